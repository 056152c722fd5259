"""Queue topics: competing consumers, visibility timeout, nack, dead letters, key order."""

from __future__ import annotations

import asyncio
import json

import pytest

import bus
from bus.testing import Clock


async def _queue(b: bus.Bus, name: str = "jobs", partitions: int | None = 2) -> None:
    await b.create_topic(name, partitions=partitions, semantics="queue")


async def test_each_message_goes_to_exactly_one_of_competing_consumers(b: bus.Bus) -> None:
    await _queue(b)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(200)])
    seen: list[int] = []

    async def work() -> None:
        async with b.queue_consumer("jobs") as q:
            while batch := await q.take(max_messages=7, timeout=0.2):
                for m in batch:
                    seen.append(m.value(dict)["n"])
                    await q.ack(m)

    await asyncio.gather(*(work() for _ in range(4)))
    assert sorted(seen) == list(range(200))


async def test_taken_message_is_invisible_to_others_until_its_timeout(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs", visibility_timeout=30) as q1, b.queue_consumer("jobs") as q2:
        (m,) = await q1.take(timeout=0)
        assert await q2.take(timeout=0) == []
        clock = Clock(b)
        clock.advance(29)  # not yet
        assert await q2.take(timeout=0) == []
        clock.advance(2)  # past the visibility timeout, without sleeping for it
        again = await q2.take(timeout=0)
        assert [x.offset for x in again] == [m.offset] and again[0].attempt == 2
        with pytest.raises(bus.LeaseLostError):
            await q1.ack(m)
        await q2.ack(again[0])
        assert await q1.take(timeout=0) == []


async def test_nack_returns_the_message_after_the_delay(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs") as q:
        (m,) = await q.take(timeout=0)
        await q.nack(m, delay=30, error="db down")
        assert await q.take(timeout=0) == []
        clock = Clock(b)
        clock.advance(29)
        assert await q.take(timeout=0) == []
        clock.advance(2)  # past the delay
        (again,) = await q.take(timeout=0)
        assert again.attempt == 2
        await q.ack(again)


async def test_message_goes_to_dead_letter_after_max_attempts_with_error_history(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"poison", key="k", headers={"trace": "t1"})
    async with b.queue_consumer("jobs", max_attempts=3, dead_letter="jobs.dead") as q:
        for i in range(3):
            (m,) = await q.take(timeout=1.0)
            assert m.attempt == i + 1
            await q.nack(m, error=f"boom {i}")
        assert await q.take(timeout=0.1) == []
    (dead,) = await b.read("jobs.dead", partition="0")
    assert dead.payload == b"poison" and dead.key == "k"
    assert dead.headers["trace"] == "t1"
    assert dead.headers["dead_letter.attempts"] == "3"
    assert dead.headers["dead_letter.last_error"] == "boom 2"
    errors = json.loads(dead.headers["dead_letter.errors"])
    assert [e["error"] for e in errors] == ["boom 0", "boom 1", "boom 2"]


async def test_expired_visibility_counts_as_an_attempt_and_dead_letters(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"slow")
    async with b.queue_consumer("jobs", max_attempts=1, visibility_timeout=30) as q:
        (m,) = await q.take(timeout=0)
        Clock(b).advance(31)  # the lease runs out: the next take finds the job out of attempts
        assert await q.take(timeout=0) == []
    (dead,) = await b.read("jobs.dlq", partition="0")
    assert dead.payload == b"slow"
    assert "visibility timeout" in dead.headers["dead_letter.last_error"]


async def test_ordered_by_key_never_hands_out_two_messages_of_one_key(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish_many("jobs", [bus.Outgoing(b"%d" % i, key=f"k{i % 3}") for i in range(9)])
    async with (
        b.queue_consumer("jobs", ordered_by_key=True) as q1,
        b.queue_consumer("jobs", ordered_by_key=True) as q2,
    ):
        first = await q1.take(max_messages=10, timeout=0)
        assert sorted(m.key for m in first) == ["k0", "k1", "k2"]
        assert await q2.take(max_messages=10, timeout=0) == []
        k0 = next(m for m in first if m.key == "k0")
        await q1.ack(k0)
        (nxt,) = await q2.take(max_messages=10, timeout=0)
        assert nxt.key == "k0" and nxt.payload == b"3"


async def test_ordered_consumers_process_each_key_in_order(b: bus.Bus) -> None:
    await _queue(b, partitions=2)
    await b.publish_many("jobs", [bus.Outgoing({"i": i}, key=f"k{i % 4}") for i in range(80)])
    got: dict[str, list[int]] = {}
    active: set[str] = set()

    async def work() -> None:
        async with b.queue_consumer("jobs", ordered_by_key=True) as q:
            while batch := await q.take(max_messages=3, timeout=0.3):
                for m in batch:
                    assert m.key not in active
                    active.add(m.key or "")
                    got.setdefault(m.key or "", []).append(m.value(dict)["i"])
                    await asyncio.sleep(0)
                    active.discard(m.key or "")
                    await q.ack(m)

    await asyncio.gather(*(work() for _ in range(3)))
    for key, values in got.items():
        assert values == sorted(values), key
    assert sum(len(v) for v in got.values()) == 80


async def test_closing_a_consumer_gives_unacked_messages_back_at_once(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs", visibility_timeout=60) as q:
        assert len(await q.take(timeout=0)) == 1
    async with b.queue_consumer("jobs") as q:
        (m,) = await q.take(timeout=0)
        assert m.attempt == 1


async def test_ack_many_acks_in_one_round_trip(b: bus.Bus) -> None:
    await _queue(b)
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs") as q:
        msgs = await q.take(max_messages=10, timeout=0)
        await q.ack_many(msgs)
        assert await q.take(timeout=0) == []
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_publish_in_caller_transaction_creates_the_job_only_on_commit(b: bus.Bus) -> None:
    await _queue(b, partitions=1)
    async with b.pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await b.publish("jobs", b"x", connection=conn)
        await tx.rollback()
    async with b.queue_consumer("jobs") as q:
        assert await q.take(timeout=0) == []


async def test_queue_consumer_on_a_pubsub_topic_is_refused(b: bus.Bus) -> None:
    await b.create_topic("events", partitions=1)
    with pytest.raises(bus.ValidationError):
        async with b.queue_consumer("events"):
            pass


@pytest.mark.parametrize(
    "kwargs",
    [{"visibility_timeout": 0}, {"max_attempts": 0}, {"dead_letter": "bad name"}, {"dead_letter": "jobs"}],
)
async def test_bad_queue_consumer_arguments_raise_validation_error(b: bus.Bus, kwargs: dict) -> None:
    await _queue(b)
    with pytest.raises(bus.ValidationError):
        b.queue_consumer("jobs", **kwargs)
