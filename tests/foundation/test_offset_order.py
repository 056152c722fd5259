"""Invariant 1: offsets are dense per partition and become visible in offset order."""

from __future__ import annotations

import asyncio
import random

import bus

WRITERS = 8
TRANSACTIONS_PER_WRITER = 25


async def test_offsets_stay_dense_and_in_order_under_slow_concurrent_transactions(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=1)
    rng = random.Random(7)
    committed: list[int] = []
    done = asyncio.Event()

    async def writer(w: int) -> None:
        for i in range(TRANSACTIONS_PER_WRITER):
            async with b.pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                try:
                    await asyncio.sleep(rng.random() * 0.004)  # others publish meanwhile
                    count = rng.choice((1, 1, 2))
                    recs = [await b.publish("t", f"{w}:{i}:{n}", connection=conn) for n in range(count)]
                    await asyncio.sleep(rng.random() * 0.002)  # holds the partition while others wait
                finally:
                    if rng.random() < 0.2:
                        await tx.rollback()
                    else:
                        await tx.commit()
                        committed.extend(r.offset for r in recs)

    async def reader() -> int:
        seen: list[bytes | None] = []  # payloads by offset, as first observed
        polls = 0
        while True:
            finished = done.is_set()
            msgs = await b.read("t", offset=0, max_messages=100_000)
            polls += 1
            offsets = [m.offset for m in msgs]
            # Never a gap: what is visible is always a dense prefix 0..n-1 ...
            assert offsets == list(range(len(offsets))), f"gap in {offsets}"
            # ... that only grows: nothing new appears below an offset already passed.
            assert len(msgs) >= len(seen)
            assert [m.payload for m in msgs[: len(seen)]] == seen
            seen = [m.payload for m in msgs]
            if finished:
                return polls
            await asyncio.sleep(0)

    reading = asyncio.create_task(reader())
    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    done.set()
    polls = await reading
    assert polls > 10  # the reader really raced the writers
    final = await b.read("t", offset=0, max_messages=100_000)
    assert sorted(committed) == list(range(len(committed))) == [m.offset for m in final]


async def test_concurrent_publish_many_batches_interleave_without_gaps(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=2)

    async def batch(n: int) -> list[bus.Record]:
        return await b.publish_many("t", [bus.Outgoing(f"{n}-{i}", partition=str(i % 2)) for i in range(10)])

    results = await asyncio.gather(*(batch(n) for n in range(12)))
    for partition in ("0", "1"):
        offsets = sorted(r.offset for recs in results for r in recs if r.partition == partition)
        assert offsets == list(range(60))
        assert [m.offset for m in await b.read("t", partition=partition, max_messages=1000)] == offsets
    # Each batch's messages are contiguous within a partition (one statement per partition).
    for recs in results:
        zero = [r.offset for r in recs if r.partition == "0"]
        assert zero == list(range(zero[0], zero[0] + 5))
