"""Periodic jobs: definitions, validation, exactly one publish per tick, catch_up of missed ticks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import bus
from actors.runtime import spawn
from actors.scheduler import Check, Scheduler, plan
from bus.testing import Clock, eventually
from tests.conftest import Connect

EVERY_SECOND = "* * * * * *"  # croniter: a sixth field is seconds


async def ticks(b: bus.Bus, topic: str = "jobs") -> list[datetime]:
    """The tick times of every job published to `topic` so far, in publish order."""
    return [datetime.fromisoformat(m.headers["tick"]) for m in await b.read(topic, 0, 0, 10_000)]


async def wait_ticks(b: bus.Bus, count: int, timeout: float = 10.0) -> list[datetime]:  # noqa: ASYNC109
    async def enough() -> list[datetime] | None:
        found = await ticks(b)
        return found if len(found) >= count else None

    return await eventually(enough, timeout)


async def test_each_tick_published_once_with_payload_and_headers(connect: Connect) -> None:
    b = await connect(scheduler_interval=0.2)
    await b.create_topic("jobs", partitions=1)
    assert await b.schedule("every", cron=EVERY_SECOND, topic="jobs", payload={"report": "daily"})
    found = await wait_ticks(b, 2)
    msgs = await b.read("jobs", 0, 0)
    assert msgs[0].value() == {"report": "daily"} and msgs[0].headers["schedule"] == "every"
    assert all(t.microsecond == 0 for t in found)
    assert len(set(found)) == len(found)
    assert all(
        later - earlier == timedelta(seconds=1) for earlier, later in zip(found, found[1:], strict=False)
    )


async def test_several_schedulers_publish_each_tick_once(connect: Connect) -> None:
    buses = [await connect(scheduler_interval=0.1) for _ in range(3)]
    b = buses[0]
    await b.create_topic("jobs", partitions=1)
    for each in buses:  # every process declares its schedules at start
        await each.schedule("every", cron=EVERY_SECOND, topic="jobs", payload={"n": 1})
    await wait_ticks(b, 3)
    await buses[1].close()  # the leader may be any of them: the others go on
    found = await wait_ticks(b, 5)
    assert len(set(found)) == len(found), found
    assert all(
        later - earlier == timedelta(seconds=1) for earlier, later in zip(found, found[1:], strict=False)
    )


async def test_same_definition_is_a_no_op_and_another_replaces_it(connect: Connect) -> None:
    b = await connect(scheduler_interval=0)
    await b.create_topic("jobs", partitions=1)
    await b.create_topic("other", partitions=1)
    assert await b.schedule("nightly", cron="0 3 * * *", topic="jobs", payload={"a": 1}, timezone="UTC")
    (first,) = await b.schedules()
    assert not await b.schedule("nightly", cron="0 3 * * *", topic="jobs", payload={"a": 1}, timezone="UTC")
    assert await b.schedules() == [first]
    assert await b.schedule(
        "nightly", cron="30 4 * * *", topic="other", payload={"a": 2}, timezone="Europe/Paris", catch_up="all"
    )
    (info,) = await b.schedules()
    assert (info.cron, info.topic, info.payload, info.timezone, info.catch_up) == (
        "30 4 * * *",
        "other",
        b'{"a":2}',
        "Europe/Paris",
        "all",
    )
    assert info.next_tick.astimezone(UTC).hour in (2, 3) and info.next_tick.minute == 30
    assert info.last_tick >= first.last_tick
    assert await b.unschedule("nightly")
    assert not await b.unschedule("nightly")
    assert await b.schedules() == []


async def test_replaced_definition_publishes_to_its_new_topic(connect: Connect) -> None:
    b = await connect(scheduler_interval=0.1)
    await b.create_topic("jobs", partitions=1)
    await b.create_topic("other", partitions=1)
    await b.schedule("every", cron="0 0 1 1 *", topic="jobs", payload=1)
    await b.schedule("every", cron=EVERY_SECOND, topic="other", payload=2)
    await eventually(lambda: b.read("other", 0, 0), timeout=5)
    assert await b.read("jobs", 0, 0) == []


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "every day"}, "cron"),
        ({"cron": 5}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"timezone": ""}, "timezone"),
        ({"catch_up": "some"}, "catch_up"),
        ({"name": "bad name;"}, "schedule name"),
        ({"payload": {1, 2}}, "payload"),
    ],
)
async def test_bad_input_raises_and_writes_nothing(
    connect: Connect, kwargs: dict[str, Any], says: str
) -> None:
    b = await connect(scheduler_interval=0)
    await b.create_topic("jobs", partitions=1)
    call: dict[str, Any] = {"name": "nightly", "cron": "0 3 * * *", "topic": "jobs", "payload": {"a": 1}}
    call.update(kwargs)
    name = call.pop("name")
    with pytest.raises(bus.ValidationError, match=says):
        await b.schedule(name, **call)
    assert await b.schedules() == []


async def test_unknown_topic_raises_and_writes_nothing(connect: Connect) -> None:
    b = await connect(scheduler_interval=0)
    with pytest.raises(bus.TopicNotFoundError):
        await b.schedule("nightly", cron="0 3 * * *", topic="missing", payload={})
    assert await b.schedules() == []


@pytest.mark.parametrize(("catch_up", "published"), [("all", 10), ("one", 1), ("none", 0)])
async def test_ticks_missed_while_no_scheduler_ran_follow_catch_up(
    connect: Connect, catch_up: str, published: int
) -> None:
    b = await connect(scheduler_interval=0)  # declares, but fires nothing
    await b.create_topic("jobs", partitions=1)
    await b.schedule("minutely", cron="* * * * *", topic="jobs", payload={}, catch_up=catch_up)
    (info,) = await b.schedules()
    # A scheduler whose clock says ten minutes (ten ticks) went by with no scheduler running: half a
    # minute past the tenth tick, so that none is within its grace (2 s here, twice its lease) and
    # each one is a missed tick, whatever second of the minute the schedule was declared at.
    now = (info.last_tick + timedelta(minutes=10)).replace(second=30, microsecond=0)
    ref = spawn(lambda: Scheduler(b.pool, b.publish, 0.1, 1.0, wall=lambda: now), "scheduler")
    try:
        await ref.ask(Check())
        await ref.ask(Check())  # a second pass at the same time finds nothing more to do
    finally:
        await ref.stop()
    expected = [t for t in plan("* * * * *", "UTC", info.last_tick, now, "all", 0)[0]]
    assert len(expected) == 10
    assert await ticks(b) == expected[len(expected) - published :]
    (after,) = await b.schedules()
    assert after.last_tick == expected[-1]  # done with every missed tick, published or not


async def test_a_yearly_job_fires_once_the_bus_clock_is_moved_past_its_tick(connect: Connect) -> None:
    b = await connect(scheduler_interval=60.0)  # a pass a minute of the Bus's clock: the advance brings one
    await b.create_topic("jobs", partitions=1)
    await b.schedule("new-year", cron="0 0 1 1 *", topic="jobs", payload={})
    (info,) = await b.schedules()
    clock = Clock(b)
    clock.advance(timedelta(days=366))  # the scheduler's pass and the time it judges ticks by move on
    moved = clock.now()
    assert moved is not None
    found = await wait_ticks(b, 1)
    expected = plan("0 0 1 1 *", "UTC", info.last_tick, moved, "all", 0)[0]
    assert len(expected) == 1 and found == expected


def test_plan_of_missed_ticks() -> None:
    last = datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC)
    now = last + timedelta(seconds=10)
    every = [datetime(2026, 1, 1, 0, 0, i, tzinfo=UTC) for i in range(1, 11)]
    following = datetime(2026, 1, 1, 0, 0, 11, tzinfo=UTC)
    assert plan(EVERY_SECOND, "UTC", last, now, "all", 2.5) == (every, every[-1], following)
    assert plan(EVERY_SECOND, "UTC", last, now, "none", 2.5)[0] == every[-3:]
    assert plan(EVERY_SECOND, "UTC", last, now, "one", 2.5)[0] == every[-4:]
    assert plan(EVERY_SECOND, "UTC", last, now, "one", 0.1)[0] == every[-1:]
    assert plan(EVERY_SECOND, "UTC", last, now, "none", 0.1)[0] == []
    assert plan("0 3 * * *", "Europe/Paris", last, now, "all", 1) == (
        [],
        last,
        datetime(2026, 1, 1, 2, tzinfo=UTC),
    )
