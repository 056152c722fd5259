"""Fan-out: total deliveries/s with 1, 5 and 10 groups on one pubsub topic, and storage growth.

M messages on a pubsub topic of 8 partitions; each of G groups drains the
whole topic with claims (max 500 messages per claim, ack each claim), the
groups running concurrently. Total deliveries/s = G x M / elapsed; the
baseline is the 1-group run. Storage: `pg_total_relation_size` of `offsets`
(the only per-group cost: one cursor per partition) next to `messages`,
after the 1-group and 10-group runs.

Run it alone with `bus bench fanout` (or `python -m benchmarks.fanout`).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import bus
from benchmarks.result import Result

SCENARIO = "fanout"
TOPIC = "bench.fanout"
PARTITIONS = 8
MIB = 1024 * 1024


async def _round(dsn: str, messages: int, groups: int) -> tuple[float, int, int]:
    """(deliveries/s, offsets bytes, messages bytes)."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        await b.create_topic(TOPIC, partitions=PARTITIONS)
        for first in range(0, messages, 1000):
            await b.publish_many(
                TOPIC, [{"i": i, "kind": "order.created"} for i in range(first, min(first + 1000, messages))]
            )

        async def drain(group: str) -> int:
            got = 0
            while (c := await b.claim(group, topic=TOPIC, worker_id="w", max_messages=500)) is not None:
                got += len(c.messages)
                await c.ack()
            return got

        started = time.perf_counter()
        counts = await asyncio.gather(*(drain(f"g{i}") for i in range(groups)))
        elapsed = time.perf_counter() - started
        assert counts == [messages] * groups, counts
        sizes = await b.pool.fetchrow(
            "SELECT pg_total_relation_size('offsets') AS o,"
            " (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree('messages')) AS m"
        )
        return sum(counts) / elapsed, int(sizes["o"]), int(sizes["m"])
    finally:
        async with b.pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # generated bench schema name
        await b.close()


async def run(dsn: str, quick: bool) -> list[Result]:
    """Deliveries/s for 1, 5, 10 groups; storage of cursors vs messages."""
    messages = 5_000 if quick else 50_000
    rates: dict[int, tuple[float, int, int]] = {}
    for groups in (1, 5, 10):
        rates[groups] = await _round(dsn, messages, groups)
    base = rates[1][0]
    results = [
        Result(
            SCENARIO,
            f"deliveries/s, {g} group(s)",
            rates[g][0],
            "msg/s",
            base,
            "1 group",
            extra={"messages": messages},
        )
        for g in (1, 5, 10)
    ]
    results.append(
        Result(
            SCENARIO,
            "offsets table size, 10 groups (baseline: 1 group)",
            rates[10][1] / MIB,
            "MiB",
            rates[1][1] / MIB,
            "1 group",
            higher_is_better=False,
            extra={"messages_mib": round(rates[10][2] / MIB, 2)},
        )
    )
    return results


if __name__ == "__main__":
    import os
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        print(f"{row.name:50s} {row.value:10.2f} {row.unit} vs {row.baseline:10.2f} {row.extra}")
