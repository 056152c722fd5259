"""Through PgBouncer in transaction mode vs directly: publish, consume and queue drain, same run.

PgBouncer (Debian's 1.18, started by scripts/pgbouncer.sh in front of the benchmark's server)
carries no session state, so every bus statement runs in a transaction that names the schema
(`storage.db.TransactionPooledConnection`). Each row is the pooled Bus (`pooler="transaction"`,
`direct_dsn=` the server for LISTEN) against a direct Bus on the same server, alternating:

- publish: 8 callers publishing one message each, msg/s;
- consume: a subscription draining a 4-partition topic, msg/s;
- queue drain: two consumers taking 100 and acking each batch, jobs/s.

Run it alone with `bus bench pooler` (or `python -m benchmarks.pooler`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import bus
from benchmarks.rawpeers import drop_schema
from benchmarks.result import Result

SCENARIO = "pooler"
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pgbouncer.sh"


def _start_bouncer(dsn: str, work: str) -> str:
    parts = urlsplit(dsn)
    assert parts.hostname and parts.port and parts.username, "a TCP DSN with a user is needed"
    env = {**os.environ, "PGB_PASSWORD": parts.password or ""}
    args = [str(SCRIPT), "start", work, parts.hostname, str(parts.port), parts.username, "transaction"]
    port = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout.strip()
    user = f"{parts.username}:{parts.password}" if parts.password else parts.username
    return urlunsplit((parts.scheme, f"{user}@127.0.0.1:{port}", parts.path, parts.query, parts.fragment))


async def _publish(b: bus.Bus, n: int) -> float:
    await b.create_topic("bench.p", partitions=4)
    started = time.perf_counter()

    async def caller(k: int) -> None:
        for i in range(k, n, 8):
            await b.publish("bench.p", {"i": i}, key=str(i))

    await asyncio.gather(*(caller(k) for k in range(8)))
    return n / (time.perf_counter() - started)


async def _consume(b: bus.Bus, n: int) -> float:
    await b.create_topic("bench.c", partitions=4)
    for first in range(0, n, 1000):
        await b.publish_many(
            "bench.c", [bus.Outgoing({"i": i}, key=str(i)) for i in range(first, first + 1000)]
        )
    done = asyncio.Event()
    seen = 0

    async def handle(_m: bus.Message) -> None:
        nonlocal seen
        seen += 1
        if seen >= n:
            done.set()

    started = time.perf_counter()
    sub = await b.subscribe("bench", handle, topics=["bench.c"], start="earliest")
    try:
        await asyncio.wait_for(done.wait(), 300)
    finally:
        await sub.stop()
    return n / (time.perf_counter() - started)


async def _drain(b: bus.Bus, n: int) -> float:
    await b.create_topic("bench.q", partitions=4, semantics="queue")
    for first in range(0, n, 1000):
        await b.publish_many("bench.q", [{"i": i} for i in range(first, first + 1000)])
    left = n

    async def consumer() -> None:
        nonlocal left
        async with b.queue_consumer("bench.q", visibility_timeout=60) as q:
            while left > 0:
                jobs = await q.take(max_messages=100, timeout=0.5)
                if jobs:
                    left -= len(jobs)
                    await q.ack_many(jobs)

    started = time.perf_counter()
    await asyncio.gather(consumer(), consumer())
    return n / (time.perf_counter() - started)


async def _side(dsn: str, what: str, n: int, **config: Any) -> float:
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0, **config)
    try:
        run = {"publish": _publish, "consume": _consume, "drain": _drain}[what]
        return await run(b, n)
    finally:
        # Closed first: its scheduler and members release their rows before the schema goes.
        await b.close()
        await drop_schema(config.get("direct_dsn", dsn), schema)


async def run(dsn: str, quick: bool) -> list[Result]:
    """The three rows, pooled vs direct, the best of alternating rounds of each."""
    work = tempfile.mkdtemp(prefix="bench-pgbouncer-")
    os.chmod(work, 0o755)
    pooled_dsn = _start_bouncer(dsn, work)
    sizes = {"publish": 2_000 if quick else 10_000, "consume": 5_000 if quick else 50_000}
    sizes["drain"] = sizes["consume"]
    rounds = 1 if quick else 2
    try:
        best: dict[tuple[str, str], float] = {}
        for _ in range(rounds):
            for what, n in sizes.items():
                for side, target, config in (
                    ("direct", dsn, {}),
                    ("pooled", pooled_dsn, {"pooler": "transaction", "direct_dsn": dsn}),
                ):
                    rate = await _side(target, what, n, **config)
                    best[(what, side)] = max(best.get((what, side), 0.0), rate)
    finally:
        await asyncio.to_thread(subprocess.run, [str(SCRIPT), "stop", work], check=False)
    names = {
        "publish": "publish, 8 callers",
        "consume": "consume, subscription",
        "drain": "queue drain, 2 x take(100)",
    }
    return [
        Result(
            SCENARIO,
            f"{names[what]}, through PgBouncer (transaction mode)",
            best[(what, "pooled")],
            "msg/s",
            best[(what, "direct")],
            "direct",
            extra={"messages": n},
        )
        for what, n in sizes.items()
    ]


if __name__ == "__main__":
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        print(
            f"{row.name:60s} {row.value:10.1f} {row.unit} vs {row.baseline:10.1f} direct  ({row.ratio:.2f}x)"
        )
