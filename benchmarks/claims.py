"""Claim cost with many partitions: 100 vs 10,000 dynamic partitions (target: at most 2x).

Each run: a dynamic topic with P partitions, each holding a few pending
messages (published in batches); one group; then a timed loop of
claim + ack, one worker, K claims. The cost per claim should not grow with
P (the candidate comes from an index over pending cursors, not a scan). The
baseline row is the same loop on 100 partitions, in the same run.

Run it alone with `bus bench claims` (or `python -m benchmarks.claims`).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import bus
from benchmarks.result import Result

SCENARIO = "claims"
TOPIC = "bench.claims"
PER_PARTITION = 3
TARGET = 2.0
WARMUP = 20  # claims before timing (each takes one partition's messages)


async def _cost(dsn: str, partitions: int, claims: int) -> float:
    """Mean milliseconds per claim + ack with `partitions` pending partitions."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        await b.create_topic(TOPIC, partitions=None)
        names = [f"dev-{i:06d}" for i in range(partitions)]
        batch: list[bus.Outgoing] = []
        for n in names:
            batch.extend(bus.Outgoing(b"reading", partition=n) for _ in range(PER_PARTITION))
            if len(batch) >= 3000:
                await b.publish_many(TOPIC, batch)
                batch = []
        if batch:
            await b.publish_many(TOPIC, batch)
        # the group's first claim materializes its cursors: not part of the steady-state cost
        first = await b.claim("bench", topic=TOPIC, worker_id="w", max_messages=PER_PARTITION)
        assert first is not None
        await first.ack()
        # Steady state, as autovacuum would have it a moment later: planner
        # statistics for the freshly loaded tables, and a short warm-up.
        async with b.pool.acquire() as conn:
            await conn.execute("ANALYZE partitions, offsets, messages")
        for _ in range(WARMUP):
            c = await b.claim("bench", topic=TOPIC, worker_id="w", max_messages=PER_PARTITION)
            assert c is not None
            await c.ack()
        started = time.perf_counter()
        for _ in range(claims):
            c = await b.claim("bench", topic=TOPIC, worker_id="w", max_messages=PER_PARTITION)
            assert c is not None
            await c.ack()
        return (time.perf_counter() - started) * 1000 / claims
    finally:
        async with b.pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # generated bench schema name
        await b.close()


async def run(dsn: str, quick: bool) -> list[Result]:
    """Claim + ack cost at 100 and 10,000 partitions."""
    claims = 50 if quick else 500
    small = await _cost(dsn, 100, min(claims, 100 - 1 - WARMUP))
    large = await _cost(dsn, 10_000, claims)
    return [
        Result(
            SCENARIO,
            "claim + ack, 10,000 partitions (baseline: 100)",
            large,
            "ms",
            small,
            "same, 100 partitions",
            higher_is_better=False,
            target=f"<= {TARGET}x the 100-partition cost",
            extra={"claims": claims},
        )
    ]


if __name__ == "__main__":
    import os
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        print(f"{row.name}: {row.value:.3f} {row.unit} vs {row.baseline:.3f} ({row.ratio:.2f}x)")
