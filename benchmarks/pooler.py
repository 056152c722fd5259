"""Through PgBouncer in transaction mode vs directly: publish, consume and queue drain, same run.

PgBouncer (Debian's 1.18, started by scripts/pgbouncer.sh in front of the benchmark's server)
carries no session state, so every bus statement runs in a transaction that names the schema
(`storage.db.TransactionPooledConnection`). Each row is the pooled Bus (`pooler="transaction"`,
`direct_dsn=` the server for LISTEN) against a direct Bus on the same server, alternating:

- publish: 8 callers publishing one message each, msg/s;
- consume: a subscription draining a 4-partition topic, msg/s;
- queue drain: two consumers taking 100 and acking each batch, jobs/s.

Beside each, raw asyncpg doing the same work through the same bouncer and directly (a pool of
the bus's size; through the bouncer without prepared statements, as PgBouncer 1.18 requires):
8 callers inserting one row each, a reader of 4 partitions that reads 100 rows and stores its
position per batch, and two consumers that lock 100 jobs (FOR UPDATE SKIP LOCKED) and delete
them. The raw rows' pooled/direct ratio is the pooler's own cost; the bus's ratio set beside
it (`vs raw`, target ≥ 0.9×) is what the bus adds to it. Each value is the best of alternating
rounds (2 quick, 3 full), the side that goes first swapped every round.

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

import asyncpg

import bus
from benchmarks.rawpeers import drop_schema
from benchmarks.result import Result
from bus.config import Config
from storage.names import validate_schema

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
    acked = 0
    done = asyncio.Event()

    async def consumer() -> None:
        nonlocal acked
        async with b.queue_consumer("bench.q", visibility_timeout=60) as q:
            while True:
                jobs = await q.take(max_messages=100, timeout=0.5)
                if jobs:
                    await q.ack_many(jobs)
                    acked += len(jobs)
                    if acked >= n:
                        done.set()

    started = time.perf_counter()
    consumers = [asyncio.create_task(consumer()) for _ in range(2)]
    try:
        # Over when the last job is acked: the other consumer may be waiting in a take for more.
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.perf_counter() - started
    finally:
        for task in consumers:
            task.cancel()
        await asyncio.gather(*consumers, return_exceptions=True)
    return n / elapsed


# The raw peers' statements; `{s}` is the run's schema (validated; a transaction pooler keeps no
# search_path, so every name is qualified).
RAW_TABLES = """
CREATE TABLE "{s}".raw_messages (id bigserial PRIMARY KEY, partition int NOT NULL, key text, payload jsonb);
CREATE INDEX ON "{s}".raw_messages (partition, id);
CREATE TABLE "{s}".raw_positions (partition int PRIMARY KEY, position bigint NOT NULL);
CREATE TABLE "{s}".raw_jobs (id bigserial PRIMARY KEY, payload jsonb, locked_until timestamptz);
"""
RAW_INSERT = 'INSERT INTO "{s}".raw_messages (partition, key, payload) VALUES ($1, $2, $3::jsonb)'
RAW_FILL = """
INSERT INTO "{s}".raw_messages (partition, key, payload)
SELECT g % 4, g::text, jsonb_build_object('i', g) FROM generate_series($1::int, $2::int - 1) AS g
"""
RAW_READ = """
SELECT id, key, payload FROM "{s}".raw_messages WHERE partition = $1 AND id > $2 ORDER BY id LIMIT 100
"""
RAW_POSITION = """
INSERT INTO "{s}".raw_positions (partition, position) VALUES ($1, $2)
ON CONFLICT (partition) DO UPDATE SET position = EXCLUDED.position
"""
RAW_JOBS = """
INSERT INTO "{s}".raw_jobs (payload) SELECT jsonb_build_object('i', g) FROM generate_series(1, $1::int) AS g
"""
RAW_TAKE = """
UPDATE "{s}".raw_jobs j SET locked_until = clock_timestamp() + interval '60 seconds'
WHERE j.id IN (SELECT id FROM "{s}".raw_jobs WHERE locked_until IS NULL OR locked_until < clock_timestamp()
               ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
RETURNING j.id, j.payload
"""
RAW_ACK = 'DELETE FROM "{s}".raw_jobs WHERE id = ANY($1::bigint[])'


async def _raw_publish(pool: asyncpg.Pool, s: str, n: int) -> float:
    sql = RAW_INSERT.format(s=s)
    started = time.perf_counter()

    async def caller(k: int) -> None:
        for i in range(k, n, 8):
            await pool.execute(sql, i % 4, str(i), f'{{"i": {i}}}')

    await asyncio.gather(*(caller(k) for k in range(8)))
    return n / (time.perf_counter() - started)


async def _raw_consume(pool: asyncpg.Pool, s: str, n: int) -> float:
    await pool.execute(RAW_FILL.format(s=s), 0, n)
    read, position = RAW_READ.format(s=s), RAW_POSITION.format(s=s)
    seen = 0
    started = time.perf_counter()

    async def reader(partition: int) -> None:
        nonlocal seen
        after = 0
        while True:
            rows = await pool.fetch(read, partition, after)
            if not rows:
                return
            seen += len(rows)
            after = rows[-1]["id"]
            await pool.execute(position, partition, after)

    await asyncio.gather(*(reader(p) for p in range(4)))
    assert seen == n, (seen, n)
    return n / (time.perf_counter() - started)


async def _raw_drain(pool: asyncpg.Pool, s: str, n: int) -> float:
    await pool.execute(RAW_JOBS.format(s=s), n)
    take, ack = RAW_TAKE.format(s=s), RAW_ACK.format(s=s)
    started = time.perf_counter()

    async def consumer() -> None:
        while True:
            jobs = await pool.fetch(take)
            if not jobs:
                return
            await pool.execute(ack, [j["id"] for j in jobs])

    await asyncio.gather(consumer(), consumer())
    return n / (time.perf_counter() - started)


async def _raw_side(dsn: str, admin_dsn: str, what: str, n: int, pooled: bool) -> float:
    """The raw asyncpg peer of one row, on `dsn` (the bouncer when `pooled`), in a schema of its own."""
    schema = validate_schema("bench_" + uuid.uuid4().hex[:10])
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE SCHEMA "{schema}"')  # validated just above
        await admin.execute(RAW_TABLES.format(s=schema))
    finally:
        await admin.close()
    size = Config().pool_max_size
    # Through a transaction pooler a prepared statement may meet another server connection.
    pool = await asyncpg.create_pool(
        dsn, min_size=size, max_size=size, statement_cache_size=0 if pooled else 100
    )
    try:
        run = {"publish": _raw_publish, "consume": _raw_consume, "drain": _raw_drain}[what]
        return await run(pool, schema, n)
    finally:
        await pool.close()
        await drop_schema(admin_dsn, schema)


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
    rounds = 2 if quick else 3
    try:
        best: dict[tuple[str, str], float] = {}
        for round_ in range(rounds):
            for what, n in sizes.items():
                sides: list[tuple[str, str, dict[str, Any]]] = [
                    ("direct", dsn, {}),
                    ("pooled", pooled_dsn, {"pooler": "transaction", "direct_dsn": dsn}),
                ]
                # Alternating which side goes first: a machine that slows down or warms up during a
                # round does not favour one side.
                for side, target, config in sides if round_ % 2 == 0 else sides[::-1]:
                    rate = await _side(target, what, n, **config)
                    best[(what, side)] = max(best.get((what, side), 0.0), rate)
                    raw = await _raw_side(target, dsn, what, n, pooled=side == "pooled")
                    best[(what, "raw " + side)] = max(best.get((what, "raw " + side), 0.0), raw)
    finally:
        await asyncio.to_thread(subprocess.run, [str(SCRIPT), "stop", work], check=False)
    names = {
        "publish": "publish, 8 callers",
        "consume": "consume, subscription",
        "drain": "queue drain, 2 x take(100)",
    }
    results: list[Result] = []
    for what, n in sizes.items():
        bus_ratio = best[(what, "pooled")] / best[(what, "direct")]
        raw_ratio = best[(what, "raw pooled")] / best[(what, "raw direct")]
        results.append(
            Result(
                SCENARIO,
                f"{names[what]}, through PgBouncer (transaction mode)",
                best[(what, "pooled")],
                "msg/s",
                best[(what, "direct")],
                "direct",
                extra={"messages": n},
            )
        )
        results.append(
            Result(
                SCENARIO,
                f"{names[what]}, raw asyncpg through PgBouncer (transaction mode)",
                best[(what, "raw pooled")],
                "msg/s",
                best[(what, "raw direct")],
                "raw direct",
                extra={"messages": n},
            )
        )
        # The bus's pooled/direct ratio against raw asyncpg's: what the bus adds to the pooler's own cost.
        results.append(
            Result(
                SCENARIO,
                f"{names[what]}, pooled/direct ratio of the bus vs raw asyncpg's",
                round(bus_ratio, 3),
                "ratio",
                round(raw_ratio, 3),
                "raw asyncpg's ratio",
                target="≥ 0.9×",
                extra={"messages": n},
            )
        )
    return results


if __name__ == "__main__":
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        print(
            f"{row.name:80s} {row.value:10.3f} {row.unit} vs {row.baseline:10.3f} {row.baseline_name}  "
            f"({row.ratio:.2f}x)"
        )
