"""Idempotent publishing: `idempotency_key` on publish, publish_many (bus.Outgoing) and the outbox."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import bus
from actors.cleaner import CleanNow
from bus.testing import Clock
from storage import idempotency
from tests.conftest import Connect


async def _all(b: bus.Bus, topic: str) -> list[bus.Message]:
    info = await b.topic(topic)
    out: list[bus.Message] = []
    for p in range(info.partitions or 0):
        out += await b.read(topic, partition=str(p), max_messages=100_000)
    return out


async def _keys(b: bus.Bus, topic: str) -> int:
    return await idempotency.count_keys(b.pool, topic)


async def test_a_repeated_key_returns_the_original_record_and_writes_nothing(b: bus.Bus) -> None:
    info = await b.create_topic("orders", partitions=4)
    assert info.dedupe_window == timedelta(hours=24)
    first = await b.publish("orders", {"n": 1}, key="c1", idempotency_key="order-42")
    await asyncio.sleep(0.01)
    # A retry may differ in everything but the key: still the original, nothing written.
    again = await b.publish(
        "orders", {"n": 2}, partition=(int(first.partition) + 1) % 4, idempotency_key="order-42"
    )
    assert again == first
    other = await b.publish("orders", {"n": 3}, key="c1", idempotency_key="order-43")
    assert other.offset == first.offset + 1 and other.partition == first.partition
    msgs = await _all(b, "orders")
    assert sorted(m.value()["n"] for m in msgs) == [1, 3]  # type: ignore[index]
    # Without a key nothing is deduplicated.
    plain = [await b.publish("orders", b"x", partition="0") for _ in range(2)]
    assert plain[0] != plain[1]


async def test_keys_are_per_topic(b: bus.Bus) -> None:
    await b.create_topic("a")
    await b.create_topic("b")
    ra = await b.publish("a", b"1", idempotency_key="k")
    rb = await b.publish("b", b"1", idempotency_key="k")
    assert (ra.topic, rb.topic) == ("a", "b")
    assert len(await _all(b, "a")) == len(await _all(b, "b")) == 1


async def test_publish_many_dedupes_against_earlier_calls_and_inside_the_batch(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)
    first = await b.publish("t", b"one", partition="1", idempotency_key="k1")
    recs = await b.publish_many(
        "t",
        [
            bus.Outgoing(b"a", partition="0", idempotency_key="k0"),
            bus.Outgoing(b"dup-of-earlier", partition="0", idempotency_key="k1"),
            bus.Outgoing(b"b", partition="0"),
            bus.Outgoing(b"dup-inside", partition="0", idempotency_key="k0"),
            bus.Outgoing(b"c", partition="1", idempotency_key="k2"),
        ],
    )
    assert recs[1] == first
    assert recs[3] == recs[0]
    assert [(r.partition, r.offset) for r in (recs[0], recs[2], recs[4])] == [("0", 0), ("0", 1), ("1", 1)]
    assert sorted(m.payload or b"" for m in await _all(b, "t")) == [b"a", b"b", b"c", b"one"]
    # The whole batch again: every record is the original, nothing written.
    again = await b.publish_many(
        "t", [bus.Outgoing(b"zzz", partition="0", idempotency_key=k) for k in ("k0", "k1", "k2")]
    )
    assert again == [recs[0], first, recs[4]]
    assert len(await _all(b, "t")) == 4


async def test_queue_topics_enqueue_one_job_per_key(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    r1 = await b.publish("jobs", {"job": 1}, idempotency_key="job-1")
    r2 = await b.publish("jobs", {"job": 1}, idempotency_key="job-1")
    many = await b.publish_many("jobs", [bus.Outgoing({"job": 1}, idempotency_key="job-1"), {"job": 2}])
    assert r1 == r2 == many[0]
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE topic = 'jobs'") == 2
    async with b.queue_consumer("jobs") as q:
        taken = await q.take(10, timeout=0.5)
    assert sorted(m.value()["job"] for m in taken) == [1, 2]  # type: ignore[index]


async def test_the_outbox_path_dedupes_and_a_rolled_back_key_is_not_kept(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("t")
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            rec = await b.publish("t", b"in-tx", idempotency_key="ob-1", connection=conn)
        assert await b.publish("t", b"retry", idempotency_key="ob-1") == rec
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await b.publish("t", b"rolled-back", idempotency_key="ob-2", connection=conn)
                raise RuntimeError("the caller's transaction fails")
        kept = await b.publish_many("t", [bus.Outgoing(b"again", idempotency_key="ob-2")], connection=conn)
        assert kept[0].offset == rec.offset + 1
        assert await b.publish("t", b"x", idempotency_key="ob-2") == kept[0]
    finally:
        await conn.close()
    assert [m.payload for m in await b.read("t")] == [b"in-tx", b"again"]


async def test_concurrent_publishes_of_one_key_write_once_and_agree(connect: Connect) -> None:
    buses = [await connect(cleaner_interval=0) for _ in range(3)]
    await buses[0].create_topic("t", partitions=3)
    for round_no in range(5):
        key = f"race-{round_no}"
        recs = await asyncio.gather(
            *(buses[i % 3].publish("t", {"i": i}, key=str(i), idempotency_key=key) for i in range(12))
        )
        assert len(set(recs)) == 1, recs
    assert len(await _all(buses[0], "t")) == 5


async def test_the_window_expires_and_the_cleaner_deletes_expired_keys(connect: Connect) -> None:
    b = await connect(cleaner_interval=0.05)
    clock = Clock(b)
    info = await b.create_topic("t", dedupe_window=60)
    assert info.dedupe_window == timedelta(seconds=60)
    forever = await b.create_topic("f", dedupe_window=None)
    assert forever.dedupe_window is None
    first = await b.publish("t", b"1", idempotency_key="k")
    await b.publish("f", b"1", idempotency_key="k")
    assert await b.publish("t", b"2", idempotency_key="k") == first
    clock.advance(61)
    # Past the window: a new publish, and a new window from then on.
    second = await b.publish("t", b"3", idempotency_key="k")
    assert second.offset == first.offset + 1
    assert await b.publish("t", b"4", idempotency_key="k") == second
    assert await b.publish("f", b"2", idempotency_key="k") != second  # no window: still the first
    # The cleaner deletes keys whose window has passed on the server's clock.
    clock.reset()
    await b.create_topic("short", dedupe_window=0.2)
    await b.publish("short", b"1", idempotency_key="k")
    for _ in range(200):
        if await _keys(b, "short") == 0:
            break
        await asyncio.sleep(0.05)
    assert await _keys(b, "short") == 0
    assert await _keys(b, "t") == 1  # its window ends two minutes past the server's clock
    assert await _keys(b, "f") == 1  # no window: kept


async def test_the_cleaner_pass_deletes_expired_keys(connect: Connect) -> None:
    b = await connect()
    await b.create_topic("t", dedupe_window=timedelta(milliseconds=50))
    await b.publish_many("t", [bus.Outgoing(b"x", idempotency_key=f"k{i}") for i in range(20)])
    assert await _keys(b, "t") == 20
    await asyncio.sleep(0.1)
    assert b._cleaner is not None
    await b._cleaner.ask(CleanNow())
    assert await _keys(b, "t") == 0


async def test_deleting_a_topic_forgets_its_keys(b: bus.Bus) -> None:
    await b.create_topic("t")
    await b.publish("t", b"1", idempotency_key="k")
    await b.delete_topic("t")
    await b.create_topic("t")
    rec = await b.publish("t", b"2", idempotency_key="k")
    assert rec.offset == 0 and [m.payload for m in await b.read("t")] == [b"2"]


@pytest.mark.parametrize(
    "bad",
    [123, b"bytes", "", "x" * 257, "nul\x00", "\ud800", ["k"]],
    ids=lambda v: type(v).__name__ + str(len(str(v))),
)
async def test_a_bad_key_is_a_validation_error_and_writes_nothing(b: bus.Bus, bad: Any) -> None:
    await b.create_topic("t")
    with pytest.raises(bus.ValidationError, match="idempotency_key"):
        await b.publish("t", b"x", idempotency_key=bad)
    with pytest.raises(bus.ValidationError, match="idempotency_key"):
        await b.publish_many("t", [bus.Outgoing(b"ok"), bus.Outgoing(b"x", idempotency_key=bad)])
    assert await b.read("t") == []
    assert await _keys(b, "t") == 0


async def test_bad_dedupe_windows_are_refused(b: bus.Bus) -> None:
    for bad in (0, -1, "1d", float("nan")):
        with pytest.raises(bus.ValidationError, match="dedupe_window"):
            await b.create_topic("t", dedupe_window=bad)  # type: ignore[arg-type]
    await b.create_topic("t", dedupe_window=timedelta(hours=1))
    with pytest.raises(bus.TopicConflictError, match="dedupe_window"):
        await b.create_topic("t")


async def test_a_producer_retrying_through_terminated_backends_writes_each_message_once(
    connect: Connect, dsn: str
) -> None:
    b = await connect(cleaner_interval=0)
    await b.create_topic("t", partitions=3)
    total, retried, kills = 0, 0, 0
    records: dict[int, bus.Record] = {}
    done = asyncio.Event()

    async def producer() -> None:
        nonlocal retried, total
        # At least 200 messages, and on until the faults have hit a few publishes (a fast machine
        # may otherwise finish first).
        while (total < 200 or kills < 5 or retried < 3) and total < 20_000:
            i = total
            total += 1
            while True:
                try:
                    records[i] = await b.publish("t", {"i": i}, key=str(i % 7), idempotency_key=f"msg-{i}")
                    break
                except bus.StorageUnavailableError:
                    retried += 1
                    assert retried < 5000, "no progress"
                    await asyncio.sleep(0.001)

    async def killer() -> None:
        nonlocal kills
        admin = await asyncpg.connect(dsn)
        rng = random.Random(7)
        try:
            while not done.is_set():
                # Only this Bus's own pool connections (the database is shared with other tests).
                pids = [h._con.get_server_pid() for h in b.pool._holders if h._con is not None]  # type: ignore[attr-defined]
                pids += list(b.producer_stats.server_pids) * 4  # the Producer's own connections, mostly
                if pids:
                    kills += int(
                        bool(await admin.fetchval("SELECT pg_terminate_backend($1)", rng.choice(pids)))
                    )
                await asyncio.sleep(rng.uniform(0.03, 0.1))
        finally:
            await admin.close()

    kill_task = asyncio.create_task(killer())
    try:
        await asyncio.gather(*(producer() for _ in range(8)))
    finally:
        done.set()
        await kill_task
    assert kills >= 5 and retried >= 3, (kills, retried)
    msgs = await _all(b, "t")
    seen = sorted(m.value()["i"] for m in msgs)  # type: ignore[index]
    assert seen == list(range(total))  # every message, exactly once
    by_place = {(m.partition, m.offset): m.value()["i"] for m in msgs}  # type: ignore[index]
    assert all(by_place[(r.partition, r.offset)] == i for i, r in records.items())
    for p in range(3):  # offsets stay dense
        offsets = [m.offset for m in msgs if m.partition == str(p)]
        assert sorted(offsets) == list(range(len(offsets)))


async def test_a_bus_clock_moved_past_the_window_lets_the_key_publish_again(connect: Connect) -> None:
    # Windows are judged by the Bus's clock (bus.testing.Clock), as leases are: no sleeping them out.
    b = await connect()
    clock = Clock(b)
    await b.create_topic("t", dedupe_window=3600)
    first = await b.publish("t", b"1", idempotency_key="k")
    assert await b.publish("t", b"2", idempotency_key="k") == first
    async with b.pool.acquire() as conn, conn.transaction():
        outboxed = await b.publish("t", b"o1", idempotency_key="o", connection=conn)
    clock.advance(3599)
    assert await b.publish("t", b"3", idempotency_key="k") == first  # still inside the window
    clock.advance(2)
    second = await b.publish("t", b"4", idempotency_key="k")  # through the Producer
    assert second.offset > outboxed.offset
    assert await b.publish("t", b"5", idempotency_key="k") == second
    async with b.pool.acquire() as conn, conn.transaction():  # in the caller's transaction (outbox)
        again = await b.publish("t", b"o2", idempotency_key="o", connection=conn)
    assert again.offset == second.offset + 1
    # The new windows start at the moved time: an hour from it.
    clock.advance(3599)
    assert await b.publish("t", b"6", idempotency_key="k") == second
    assert [m.payload for m in await _all(b, "t")] == [b"1", b"o1", b"4", b"o2"]
