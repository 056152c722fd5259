"""A Bus's test Clock moves its group sessions, partition leases and its workers' timers: no test sleeps past one."""

from __future__ import annotations

import pytest

import bus
from actors import handler_runner
from bus.testing import Clock, eventually
from tests.helpers import drain


async def test_moving_the_clock_past_a_session_sweeps_the_silent_member(connect, fast) -> None:
    b = await connect(**fast)
    await b.create_topic("t", partitions=1)
    await b.pool.execute(
        "INSERT INTO groups (name, start_mode) VALUES ('g', 'earliest');"
        "INSERT INTO members (group_name, member_id, client_id, host, pid, session_timeout) "
        "VALUES ('g', 'silent', 'x', 'h', 1, 30.0)"
    )
    assert await b.admin.sweep() == 0  # its 30-second session has just begun
    clock = Clock(b)
    clock.advance(29)
    assert await b.admin.sweep() == 0
    clock.advance(2)  # past the session, without waiting for it
    assert await b.admin.sweep() == 1
    assert await b.pool.fetchval("SELECT count(*) FROM members WHERE group_name = 'g'") == 0
    assert (await b.admin.describe_group("g")).state == "empty"


async def test_a_lease_run_out_on_the_moved_clock_refuses_the_commit_and_the_member_reads_again(
    connect, fast
) -> None:
    # A jump past the lease is a pause of the whole process: its leases and its session run out,
    # its commit is refused, and it joins again and reads the uncommitted messages again, every
    # statement judging by the moved time (a join at real time would be swept at once, again and again).
    b = await connect(**{**fast, "lease_time": 30.0})
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [{"i": i} for i in range(3)])
    c = await b.consumer("g", topics=["t"], auto_commit=False).start()
    assert [m.offset for m in await drain([c], 3)] == [0, 1, 2]
    first = await b.pool.fetchrow("SELECT owner, lease_epoch FROM offsets WHERE group_name = 'g'")
    Clock(b).advance(31)
    with pytest.raises(bus.StaleGenerationError):
        await c.commit()
    assert await b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'g'") == 0
    again = await drain([c], 3)
    assert [m.offset for m in again] == [0, 1, 2]
    await c.commit()
    now = await b.pool.fetchrow(
        "SELECT owner, lease_epoch, committed, lease_expires_at > clock_timestamp() + interval '31 seconds' "
        "AS moved FROM offsets WHERE group_name = 'g'"
    )
    assert now["owner"] != first["owner"] and now["lease_epoch"] > first["lease_epoch"]
    assert now["committed"] == 3
    assert now["moved"]  # the new lease runs from the moved time
    await eventually(lambda: c.member_id == now["owner"])
    await c.close()


async def test_a_handlers_commit_interval_runs_out_on_the_moved_clock(connect, fast, monkeypatch) -> None:
    # A commit a minute (of the Bus's clock): what is handled in between is committed by the
    # worker's timer, which an advance runs out; an interval the advance passed is over for the next one.
    monkeypatch.setattr(handler_runner, "COMMIT_INTERVAL", 60.0)
    b = await connect(**{**fast, "heartbeat_interval": 30.0, "session_timeout": 100.0, "lease_time": 300.0})
    await b.create_topic("t", partitions=1)
    seen: list[int] = []

    async def handler(m: bus.Message) -> None:
        seen.append(m.offset)

    committed = "SELECT committed FROM offsets WHERE group_name = 'g'"
    sub = await b.subscribe("g", handler, topics=["t"], start="earliest")
    clock = Clock(b)
    await b.publish("t", b"a")
    await eventually(lambda: _equals(b.pool.fetchval(committed), 1))  # the first commit goes at once
    await b.publish("t", b"b")
    await eventually(lambda: len(seen) == 2)
    assert await b.pool.fetchval(committed) == 1  # inside the interval: the timer will commit it
    clock.advance(60)
    await eventually(lambda: _equals(b.pool.fetchval(committed), 2))
    clock.advance(60)  # a whole interval since that commit, with nothing to commit meanwhile
    await b.publish("t", b"c")  # so the next one is committed at once
    await eventually(lambda: _equals(b.pool.fetchval(committed), 3))
    await sub.stop()


async def _equals(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return await value == expected


async def test_a_handlers_retry_backoff_runs_out_on_the_moved_clock(connect, fast) -> None:
    # A session and a lease longer than the advance: the member stays, so only the worker's retry
    # timer brings the message again (a rejoin would read it again too).
    b = await connect(**{**fast, "heartbeat_interval": 30.0, "session_timeout": 3000.0, "lease_time": 3600.0})
    await b.create_topic("t", partitions=1)
    attempts: list[int] = []

    async def handler(m: bus.Message) -> None:
        attempts.append(m.offset)
        if len(attempts) == 1:
            raise ValueError("the first attempt fails")

    sub = await b.subscribe(
        "g", handler, topics=["t"], start="earliest", retry=bus.Retry(max_attempts=2, backoff=600.0)
    )
    clock = Clock(b)
    await b.publish("t", b"a")
    await eventually(lambda: attempts == [0])  # failed: the retry comes in ten minutes
    clock.advance(600)
    await eventually(lambda: attempts == [0, 0])
    await eventually(
        lambda: _equals(b.pool.fetchval("SELECT committed FROM offsets WHERE group_name = 'g'"), 1)
    )
    await sub.stop()
