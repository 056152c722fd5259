"""Queue features: delays, priorities, per-key and rate limits, pause, cancel, job results."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

import bus
from bus import queue_features
from bus.testing import Clock
from storage import db
from storage import queues as queue_sql


async def _queue(b: bus.Bus, name: str = "jobs", partitions: int = 2, **settings: Any) -> None:
    await b.create_topic(name, partitions=partitions, semantics="queue", **settings)


async def test_a_delayed_job_is_not_taken_early_and_is_taken_within_a_second_of_its_time(b: bus.Bus) -> None:
    await _queue(b)
    await b.publish("jobs", b"now")
    rec = await b.publish("jobs", b"later", delay=0.6)
    due = time.monotonic() + 0.6
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=10, timeout=0)
        assert [m.payload for m in first] == [b"now"]
        await q.ack_many(first)
        early = await q.take(max_messages=10, timeout=0.3)
        if early:  # a loaded machine ran this take past the job's time: it must not have come sooner
            taken = time.monotonic()
            (job,) = early
        else:
            (job,) = await q.take(max_messages=10, timeout=3.0)
            taken = time.monotonic()
        assert job.offset == rec.offset and job.payload == b"later"
        assert due - 0.05 <= taken <= due + 1.0
        await q.ack(job)


async def test_deliver_at_and_outgoing_fields_delay_jobs(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    at = datetime.now(UTC) + timedelta(seconds=30)
    await b.publish_many(
        "jobs",
        [
            bus.Outgoing(b"a", deliver_at=at),
            bus.Outgoing(b"b", delay=timedelta(seconds=40)),
            bus.Outgoing(b"c"),
        ],
    )
    async with b.queue_consumer("jobs") as q:
        (now,) = await q.take(max_messages=10, timeout=0)
        assert now.payload == b"c"
        await q.ack(now)
        clock = Clock(b)
        clock.advance(31)  # past the delivery time, not the delay
        assert [m.payload for m in await q.take(max_messages=10, timeout=0)] == [b"a"]
        clock.advance(10)
        assert [m.payload for m in await q.take(max_messages=10, timeout=0)] == [b"b"]


async def test_higher_priority_is_taken_first_and_equal_priorities_keep_their_order(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"p0-a")
    await b.publish("jobs", b"low", priority=-1)
    await b.publish("jobs", b"p0-b")
    await b.publish("jobs", b"p5-a", priority=5)
    await b.publish("jobs", b"p9", priority=9)
    await b.publish("jobs", b"p5-b", priority=5)
    await b.publish("jobs", b"p0-c")
    order: list[bytes] = []
    async with b.queue_consumer("jobs") as q:
        while len(order) < 7:
            (m,) = await q.take(max_messages=1, timeout=1.0)
            order.append(m.payload or b"")
            await q.ack(m)
    assert order == [b"p9", b"p5-a", b"p5-b", b"p0-a", b"p0-b", b"p0-c", b"low"]


async def test_one_take_deals_jobs_in_priority_order(b: bus.Bus) -> None:
    await _queue(b, partitions=2)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key=str(i)) for i in range(6)])
    await b.publish_many("jobs", [bus.Outgoing({"n": 100 + i}, priority=3) for i in range(3)])
    async with b.queue_consumer("jobs") as q:
        got = await q.take(max_messages=4, timeout=0)
        assert sorted(m.value(dict)["n"] for m in got[:3]) == [100, 101, 102]
        rest = await q.take(max_messages=10, timeout=0)
        assert sorted(m.value(dict)["n"] for m in got[3:] + rest) == list(range(6))


async def test_delay_and_priority_on_a_pubsub_topic_raise_and_write_nothing(b: bus.Bus) -> None:
    await b.create_topic("events", partitions=1)
    for kwargs in ({"delay": 1.0}, {"deliver_at": datetime.now(UTC)}, {"priority": 1}):
        with pytest.raises(bus.ValidationError, match="queue topics"):
            await b.publish("events", b"x", **kwargs)
    with pytest.raises(bus.ValidationError, match="queue topics"):
        await b.publish_many("events", [bus.Outgoing(b"y"), bus.Outgoing(b"z", priority=2)])
    assert await b.read("events", "0") == []
    await _queue(b, "q")
    with pytest.raises(bus.ValidationError):
        await b.publish("q", b"x", deliver_at=datetime(2030, 1, 1))  # naive
    with pytest.raises(bus.ValidationError):
        await b.publish("q", b"x", delay=-1.0)
    with pytest.raises(bus.ValidationError):
        await b.create_topic("events2", semantics="pubsub", max_in_flight_per_key=2)


async def test_a_paused_queue_hands_out_nothing_and_taken_jobs_still_ack(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish_many("jobs", [b"1", b"2", b"3"])
    async with b.queue_consumer("jobs") as q, b.queue_consumer("jobs") as other:
        (held,) = await q.take(max_messages=1, timeout=0)
        await b.admin.pause_queue("jobs")
        assert await other.take(max_messages=10, timeout=0.3) == []
        assert await q.take(max_messages=10, timeout=0) == []
        await q.ack(held)
        waiting = asyncio.ensure_future(other.take(max_messages=10, timeout=5.0))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await b.admin.resume_queue("jobs")
        got = await waiting
        assert sorted(m.payload or b"" for m in got) == [b"2", b"3"]
    assert (await b.admin.queue_settings("jobs"))[2] is False


async def test_a_cancelled_job_is_never_handed_out(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    fresh = await b.publish("jobs", b"fresh")
    delayed = await b.publish("jobs", b"delayed", delay=30)
    kept = await b.publish("jobs", b"kept")
    assert await b.admin.cancel_job("jobs", fresh) is True
    assert await b.admin.cancel_job("jobs", delayed) is True
    assert await b.admin.cancel_job("jobs", fresh) is False
    Clock(b).advance(31)  # the delayed one would be due now
    async with b.queue_consumer("jobs") as q:
        got = await q.take(max_messages=10, timeout=0)
        assert [m.offset for m in got] == [kept.offset]
        await q.ack_many(got)
    with pytest.raises(bus.JobFailedError) as failed:
        await b.job_result("jobs", fresh, timeout=1.0)
    assert failed.value.status == "cancelled"


async def test_a_cancelled_taken_job_acks_but_is_not_retried_after_nack_or_expiry(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    a, c = await b.publish("jobs", b"a"), await b.publish("jobs", b"c")
    async with b.queue_consumer("jobs", visibility_timeout=30) as q:
        got = await q.take(max_messages=2, timeout=0)
        assert [m.offset for m in got] == [a.offset, c.offset]
        assert await b.admin.cancel_job("jobs", a) is True
        assert await b.admin.cancel_job("jobs", c) is True
        await q.ack(got[0])  # the ack of a cancelled job still works
        await q.nack(got[1], error="boom")  # not retried
        Clock(b).advance(31)  # nor after its lease would have run out
        assert await q.take(max_messages=10, timeout=0) == []
    rows = await b.pool.fetch("SELECT * FROM queue_jobs")
    assert rows == []


async def test_job_result_returns_the_acked_value_woken_by_notify(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue_features, "_RECHECK", 60.0)  # only a NOTIFY can wake it in time
    await _queue(b, partitions=1, result_ttl=60.0)
    rec = await b.publish("jobs", {"x": 1})
    waiting = asyncio.ensure_future(b.job_result("jobs", rec, timeout=5.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    async with b.queue_consumer("jobs") as q:
        (job,) = await q.take(timeout=1.0)
        await q.ack(job, result={"rows": 42})
    assert await asyncio.wait_for(waiting, 3.0) == {"rows": 42}
    assert await b.job_result("jobs", rec, timeout=0) == {"rows": 42}
    other = await b.publish("jobs", b"y")
    with pytest.raises(TimeoutError):
        await b.job_result("jobs", other, timeout=0.2)


async def test_a_result_and_a_dead_letter_outcome_are_kept_for_the_result_ttl_then_forgotten(
    b: bus.Bus,
) -> None:
    clock = Clock(b)
    await _queue(b, partitions=1, result_ttl=60.0)
    done = await b.publish("jobs", {"x": 1})
    poison = await b.publish("jobs", b"poison")
    async with b.queue_consumer("jobs", max_attempts=1) as q:
        first, second = await q.take(max_messages=2, timeout=1.0)
        await q.ack(first, result={"rows": 42})
        await q.nack(second, error="bad")
    clock.advance(59)  # within the ttl: both outcomes are there
    assert await b.job_result("jobs", done, timeout=0) == {"rows": 42}
    with pytest.raises(bus.JobFailedError):
        await b.job_result("jobs", poison, timeout=0)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_results") == 2
    clock.advance(2)  # past it: forgotten (the job is gone, so there is nothing to wait for) and deleted
    assert await b.job_result("jobs", done, timeout=0) is None
    assert await b.job_result("jobs", poison, timeout=0) is None
    assert await b.pool.fetchval("SELECT count(*) FROM queue_results") == 0


async def test_job_result_raises_job_failed_for_a_dead_lettered_job(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    rec = await b.publish("jobs", b"poison")
    async with b.queue_consumer("jobs", max_attempts=2) as q:
        for attempt in (1, 2):
            (job,) = await q.take(timeout=1.0)
            await q.nack(job, error=f"bad {attempt}")
    with pytest.raises(bus.JobFailedError) as failed:
        await b.job_result("jobs", rec, timeout=1.0)
    assert failed.value.status == "failed"
    assert [e["error"] for e in failed.value.errors] == ["bad 1", "bad 2"]


class Rows(msgspec.Struct):
    rows: int


async def test_job_result_decodes_into_the_type_asked_for_and_names_the_job_when_it_does_not(
    b: bus.Bus,
) -> None:
    await _queue(b, partitions=1)
    counted, listed, bare = [await b.publish("jobs", b"x") for _ in range(3)]
    async with b.queue_consumer("jobs") as q:
        first, second, third = sorted(await q.take(max_messages=3, timeout=1.0), key=lambda m: m.offset)
        await q.ack(first, result={"rows": 42})
        await q.ack(second, result=[1, 2])
        await q.ack(third)
    assert await b.job_result("jobs", counted, timeout=0, type=Rows) == Rows(rows=42)
    assert await b.job_result("jobs", listed, timeout=0, type=tuple[int, int]) == (1, 2)
    assert await b.job_result("jobs", bare, timeout=0, type=Rows | None) is None
    with pytest.raises(bus.MessageDecodeError) as wrong:
        await b.job_result("jobs", listed, timeout=0, type=Rows)
    assert (wrong.value.topic, wrong.value.partition, wrong.value.offset) == ("jobs", "0", listed.offset)
    assert "fix the type or the handler" in str(wrong.value)
    with pytest.raises(bus.MessageDecodeError, match="it has none"):
        await b.job_result("jobs", bare, timeout=0, type=Rows)
    with pytest.raises(bus.ValidationError, match="not a type a result decodes into"):
        await b.job_result("jobs", counted, timeout=0, type=object())  # type: ignore[call-overload]


async def test_max_in_flight_per_key_holds_and_frees_on_ack(b: bus.Bus) -> None:
    await _queue(b, partitions=2, max_in_flight_per_key=2)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key="hot") for i in range(5)])
    await b.publish("jobs", {"n": 99}, key="cold")
    async with b.queue_consumer("jobs") as q, b.queue_consumer("jobs") as q2:
        got = await q.take(max_messages=10, timeout=0)
        assert sorted(m.value(dict)["n"] for m in got) == [0, 1, 99]
        assert await q2.take(max_messages=10, timeout=0.2) == []
        await q.ack(got[0])
        more = await q2.take(max_messages=10, timeout=1.0)
        assert [m.key for m in more] == ["hot"]
        await b.admin.update_topic("jobs", max_in_flight_per_key=None)
        rest = await q2.take(max_messages=10, timeout=1.0)
        assert len(rest) == 2


async def test_rate_limit_holds_within_its_window(b: bus.Bus) -> None:
    await _queue(b, partitions=2, rate_limit=bus.Rate(3, per=0.5))
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(8)])
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=10, timeout=0)
        assert len(first) == 3
        assert await q.take(max_messages=10, timeout=0) == []
        later = await q.take(max_messages=10, timeout=2.0)
        assert 1 <= len(later) <= 3
    settings = await b.admin.queue_settings("jobs")
    assert settings[1] == bus.Rate(3, per=0.5)
    with pytest.raises(bus.ValidationError):
        await b.admin.update_topic("jobs", rate_limit=5)


async def test_a_per_key_limit_the_take_cannot_reach_leaves_fresh_jobs_in_range_leases(b: bus.Bus) -> None:
    await _queue(b, partitions=2, max_in_flight_per_key=50)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key=f"k{i % 4}") for i in range(20)])
    async with b.queue_consumer("jobs") as q:
        got = await q.take(max_messages=10, timeout=0)
        assert len(got) == 10
        # No job row was written to lease them: they are still fresh, held by range leases.
        assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE detached") == 0
        assert await b.pool.fetchval("SELECT count(*) FROM queue_leases") >= 1
        await q.ack_many(got)


async def test_jobs_in_range_leases_count_toward_the_per_key_limit(b: bus.Bus) -> None:
    await _queue(b, partitions=1, max_in_flight_per_key=3)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key="hot") for i in range(6)])
    await b.publish_many("jobs", [bus.Outgoing({"n": 10 + i}, key="cold") for i in range(2)])
    async with b.queue_consumer("jobs") as q, b.queue_consumer("jobs") as q2:
        first = await q.take(max_messages=2, timeout=0)  # within the limit: leased by range
        assert [m.key for m in first] == ["hot", "hot"]
        # Two more "hot" alone are within the limit, not beside the two already out: one goes.
        second = await q2.take(max_messages=2, timeout=0)
        assert sorted(m.value(dict)["n"] for m in second) == [2, 10]
        third = await q2.take(max_messages=10, timeout=0)
        assert [m.value(dict)["n"] for m in third] == [11]


async def test_a_limited_take_that_raced_another_counts_what_that_one_committed(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await _queue(b, partitions=2, rate_limit=bus.Rate(5, per=60.0))
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(10)])
    holder = await db.connect(dsn, schema)
    taker = await db.connect(dsn, schema)
    try:
        # Another process's limited take has leased 3 jobs and not committed yet.
        tx = holder.transaction()
        await tx.start()
        held = [
            r
            for r in await holder.fetch(
                queue_sql.TAKE_WITHIN_LIMITS, "jobs", [3], 60.0, ["h"], 3, 0, None, None
            )
            if r[0] > 0
        ]
        assert len(held) == 3
        # Ours starts meanwhile (its snapshot without those 3), waits for the settings row, and
        # must still see them once they commit: 2 more, not 5.
        ours = asyncio.create_task(queue_sql.take_limited(taker, "jobs", ["t"], [10], 60.0, ordered=False))
        await asyncio.sleep(0.3)
        assert not ours.done()
        await tx.commit()
        (got,) = await asyncio.wait_for(ours, 10)
        assert len(got) == 2
    finally:
        await holder.close()
        await taker.close()


async def test_an_ordered_consumer_of_a_rate_limited_queue_keeps_both(b: bus.Bus) -> None:
    await _queue(b, partitions=2, rate_limit=bus.Rate(4, per=60.0))
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key=f"k{i % 3}") for i in range(9)])
    async with b.queue_consumer("jobs", ordered_by_key=True) as q, b.queue_consumer("jobs") as plain:
        first = await q.take(max_messages=10, timeout=0)
        # Ordered: one job per key at a time, each key's earliest.
        assert sorted(m.value(dict)["n"] for m in first) == [0, 1, 2]
        await q.ack_many(first)
        # Ordered and unordered takes share the window: one more job in it, then none.
        assert [m.value(dict)["n"] for m in await plain.take(max_messages=10, timeout=0)] == [3]
        assert await q.take(max_messages=10, timeout=0) == []
        assert await plain.take(max_messages=10, timeout=0) == []
