"""Work queues: the bus next to pgqueuer and next to raw SQL, on the same PostgreSQL in the same run.

Every peer goes through its own front door:

* **bus**: `publish_many` (batches of 500) onto a 4-partition `semantics="queue"`
  topic, then K competing `queue_consumer`s each looping `take(N)` + `ack_many`
  until the queue is empty.
* **pgqueuer**: `Queries.enqueue` with lists (batches of 500), then K `PgQueuer`
  instances (one asyncpg connection each, as its docs set it up) with a no-op
  entrypoint, each running `PgQueuer.run(batch_size=N, mode=drain)`: its
  QueueManager's dequeue, its per-job dispatch and its buffered completion
  (`JobStatusLogBuffer`), until every instance has drained and flushed.
* **raw asyncpg**: one table, K connections each looping
  `DELETE ... WHERE id IN (SELECT ... LIMIT 100 FOR UPDATE SKIP LOCKED) RETURNING`
  (one statement, one transaction per 100 jobs): the floor for "take and
  finish 100 jobs", with no visibility timeout, no retries, no ordering.

The bus and raw SQL drain at 2 × 100 three times, turn about, and the medians
are compared (a drain lasts half a second; one slow moment of the host moved
the ratio by 0.08 between runs).

Wake-up latency: one consumer waits on an empty queue while a producer enqueues
one job at a time at a paced 200/s; each sample is the time from just before the
enqueue call to the job in the consumer's hands (bus: `take` returns it;
pgqueuer: its entrypoint runs).

pgqueuer gets its own database (`pgq_bench`) on the same server, installed
fresh each round; the bus and the raw table get fresh schemas, dropped afterwards.
Every peer's tables are analyzed once loaded (the steady state autovacuum keeps).

Run it alone with `bus bench queue [--quick]` (or `python -m benchmarks.queue`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import asyncpg
import msgspec

import bus
from benchmarks.result import Result
from storage.logs import get_logger

log = get_logger(__name__, scenario="queue")

SCENARIO = "queue"
TOPIC = "bench.jobs"
ENTRYPOINT = "bench"
BATCH = 500
PGQ = "pgqueuer"
RAW = "raw asyncpg"
PGQ_DATABASE = "pgq_bench"
WAKE_RATE = 200.0  # jobs/s offered in the wake-up latency rounds
WAKE_WARMUP = 20  # samples dropped at the start of a latency round
ROUNDS = 3  # drains of the bus and of raw SQL at 2 x 100, turn about (the median counts)
FEATURE_DELAY = 1.0  # s: the delay of the delayed jobs (passed before their drain starts)
UNREACHED = 1000  # a limit the load never reaches (in flight per key / per entrypoint; rate: x 1000 per s)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def _payload(i: int, t: float = 0.0) -> bytes:
    return _encoder.encode(
        {"job": i, "customer": f"cust-{i % 1000:05d}", "amount": 1234.5, "kind": "invoice", "t": t}
    )


def _dsn_for(dsn: str, database: str) -> str:
    """The same server, another database (asyncpg accepts `database=` too, but DSNs travel better)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _paced(n: int, rate: float, send: Callable[[int], Awaitable[None]]) -> None:
    """Call `send(i)` n times at `rate` per second on an absolute schedule (no drift)."""
    started = time.perf_counter()
    for i in range(n):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(i)


# --- bus --------------------------------------------------------------------------


async def _bus(dsn: str) -> tuple[bus.Bus, str]:
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0, pool_max_size=12)
    await b.create_topic(TOPIC, partitions=4, semantics="queue")
    return b, schema


async def _bus_drop(b: bus.Bus, schema: str) -> None:
    await b.close()  # first, so no system actor of it meets its dropped tables
    conn = await asyncpg.connect(b.dsn)
    try:
        await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # a generated bench schema name
    finally:
        await conn.close()


async def _bus_drain(
    dsn: str, jobs: int, consumers: int, take: int, feature: str | None = None
) -> tuple[float, float]:
    """(enqueue jobs/s, drain jobs/s): `consumers` queue consumers looping take(`take`) + ack_many.

    `feature` (see FEATURES): "delayed" publishes every job with a delay that has passed when
    the drain starts; "per_key" / "rate" drain a queue with a limit the load never reaches.
    """
    b, schema = await _bus(dsn)
    try:
        if feature == "per_key":
            await b.admin.update_topic(TOPIC, max_in_flight_per_key=UNREACHED)
        elif feature == "rate":
            await b.admin.update_topic(TOPIC, rate_limit=bus.Rate(UNREACHED * 1000, per=1.0))
        delay = FEATURE_DELAY if feature == "delayed" else None
        keyed = feature == "per_key"
        started = time.perf_counter()
        for first in range(0, jobs, BATCH):
            await b.publish_many(
                TOPIC,
                [
                    bus.Outgoing(_payload(i), key=f"cust-{i % 1000}" if keyed else None, delay=delay)
                    for i in range(first, min(first + BATCH, jobs))
                ],
            )
        enqueue = jobs / (time.perf_counter() - started)
        if delay is not None:
            await asyncio.sleep(delay)
        # The steady state: statistics of the loaded tables, as autovacuum keeps them (bench SQL).
        await b.pool.execute("ANALYZE queue_jobs, messages")
        handled = 0

        async def consume(q: bus.QueueConsumer) -> None:
            nonlocal handled
            while batch := await q.take(max_messages=take, timeout=0):
                handled += len(batch)  # the "work"
                await q.ack_many(batch)

        # Opened before the clock starts, as the raw drain connects first: opening checks the
        # topic, creates the dead-letter topic and starts listening (a few ms, once).
        queues = [b.queue_consumer(TOPIC, visibility_timeout=60) for _ in range(consumers)]
        for q in queues:
            await q.start()
        started = time.perf_counter()
        await asyncio.gather(*(consume(q) for q in queues))
        elapsed = time.perf_counter() - started
        for q in queues:
            await q.close()
        left = await b.pool.fetchval("SELECT count(*) FROM queue_jobs")  # bench check, not library SQL
        if handled != jobs or left:
            raise RuntimeError(f"bus drain handled {handled} of {jobs} jobs, {left} left")
        return enqueue, jobs / elapsed
    finally:
        await _bus_drop(b, schema)


async def _bus_wakeup(dsn: str, samples: int) -> list[float]:
    """Enqueue->take latencies (s) of one waiting consumer, jobs published one by one at WAKE_RATE/s."""
    b, schema = await _bus(dsn)
    try:
        latencies: list[float] = []
        total = samples + WAKE_WARMUP
        async with b.queue_consumer(TOPIC) as q:

            async def consume() -> None:
                while len(latencies) < total:
                    batch = await q.take(max_messages=10, timeout=1.0)
                    now = time.perf_counter()
                    latencies.extend(now - _decoder.decode(m.payload)["t"] for m in batch)
                    if batch:
                        await q.ack_many(batch)

            async def send(i: int) -> None:
                await b.publish(TOPIC, _payload(i, time.perf_counter()))

            consumer = asyncio.create_task(consume())
            await asyncio.sleep(0.2)  # the consumer is waiting
            await _paced(total, WAKE_RATE, send)
            await asyncio.wait_for(consumer, 30)
        return latencies[WAKE_WARMUP:]
    finally:
        await _bus_drop(b, schema)


# --- raw asyncpg ------------------------------------------------------------------

RAW_CREATE = (
    "CREATE TABLE raw_jobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload bytea NOT NULL)"
)
RAW_INSERT = "INSERT INTO raw_jobs (payload) SELECT unnest($1::bytea[])"
RAW_TAKE = """
DELETE FROM raw_jobs WHERE id IN (
    SELECT id FROM raw_jobs ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED
) RETURNING id, payload
"""


async def _raw_drain(dsn: str, jobs: int, consumers: int, take: int) -> float:
    """Drain jobs/s of `consumers` connections each deleting `take` jobs per statement (SKIP LOCKED)."""
    schema = "bench_raw_" + uuid.uuid4().hex[:10]
    settings = {"search_path": schema}
    admin = await asyncpg.connect(dsn)
    conns: list[asyncpg.Connection] = []
    try:
        await admin.execute(f'CREATE SCHEMA "{schema}"')  # a generated bench schema name
        await admin.execute(f'SET search_path = "{schema}"')
        await admin.execute(RAW_CREATE)
        for first in range(0, jobs, BATCH):
            await admin.execute(RAW_INSERT, [_payload(i) for i in range(first, min(first + BATCH, jobs))])
        await admin.execute("ANALYZE raw_jobs")
        conns = [await asyncpg.connect(dsn, server_settings=settings) for _ in range(consumers)]
        handled = 0

        async def consume(conn: asyncpg.Connection) -> None:
            nonlocal handled
            while rows := await conn.fetch(RAW_TAKE, take):
                handled += len(rows)

        started = time.perf_counter()
        await asyncio.gather(*(consume(c) for c in conns))
        elapsed = time.perf_counter() - started
        if handled != jobs:
            raise RuntimeError(f"raw drain handled {handled} of {jobs} jobs")
        return jobs / elapsed
    finally:
        for c in conns:
            await c.close()
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin.close()


# --- pgqueuer ---------------------------------------------------------------------


async def _pgq_pool(dsn: str) -> asyncpg.Pool:
    admin = await asyncpg.connect(dsn)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PGQ_DATABASE):
            await admin.execute(f'CREATE DATABASE "{PGQ_DATABASE}"')  # a constant name, not a value
    finally:
        await admin.close()
    pool = await asyncpg.create_pool(_dsn_for(dsn, PGQ_DATABASE), min_size=1, max_size=4)
    assert pool is not None
    return pool


async def _pgq_install(pool: asyncpg.Pool) -> Any:
    from pgqueuer import Queries

    queries = Queries.from_asyncpg_pool(pool)
    try:
        await queries.uninstall()
    except Exception:  # not installed yet
        log.debug("pgqueuer_not_installed")
    await queries.install()
    return queries


async def _pgq_drain(
    dsn: str, jobs: int, consumers: int, batch: int, feature: str | None = None
) -> tuple[float, float]:
    """(enqueue jobs/s, drain jobs/s): `consumers` PgQueuer instances in drain mode, batch_size=`batch`.

    `feature`: "delayed" enqueues with `execute_after` (passed when the drain starts); "limit"
    registers the entrypoint with a `concurrency_limit` the load never reaches (pgqueuer's
    limit, enforced in its dequeue across workers; it has no per-key or rate limit).
    """
    from pgqueuer import AsyncpgDriver, Job, PgQueuer
    from pgqueuer.types import QueueExecutionMode

    pool = await _pgq_pool(dsn)
    conns: list[asyncpg.Connection] = []
    try:
        queries = await _pgq_install(pool)
        started = time.perf_counter()
        for first in range(0, jobs, BATCH):
            n = min(BATCH, jobs - first)
            after = [timedelta(seconds=FEATURE_DELAY)] * n if feature == "delayed" else None
            await queries.enqueue(
                [ENTRYPOINT] * n, [_payload(i) for i in range(first, first + n)], [0] * n, execute_after=after
            )
        enqueue = jobs / (time.perf_counter() - started)
        if feature == "delayed":
            await asyncio.sleep(FEATURE_DELAY)
        await pool.execute("ANALYZE pgqueuer")  # the same steady state for pgqueuer's table
        handled = 0
        workers = []
        for _ in range(consumers):
            conn = await asyncpg.connect(_dsn_for(dsn, PGQ_DATABASE))
            conns.append(conn)
            pgq = PgQueuer(AsyncpgDriver(conn))

            @pgq.entrypoint(ENTRYPOINT, concurrency_limit=UNREACHED if feature == "limit" else 0)
            async def work(job: Job) -> None:
                nonlocal handled
                handled += 1  # the "work"

            workers.append(pgq)

        started = time.perf_counter()
        await asyncio.gather(*(w.run(batch_size=batch, mode=QueueExecutionMode.drain) for w in workers))
        elapsed = time.perf_counter() - started
        left = await pool.fetchval("SELECT count(*) FROM pgqueuer")  # pgqueuer's own table
        if handled != jobs or left:
            raise RuntimeError(f"pgqueuer drain handled {handled} of {jobs} jobs, {left} left")
        await queries.uninstall()
        return enqueue, jobs / elapsed
    finally:
        for c in conns:
            await c.close()
        await pool.close()


async def _pgq_wakeup(dsn: str, samples: int) -> list[float]:
    """Enqueue->entrypoint latencies (s) of one waiting PgQueuer, jobs enqueued one by one at WAKE_RATE/s."""
    from pgqueuer import AsyncpgDriver, Job, PgQueuer

    pool = await _pgq_pool(dsn)
    conn = await asyncpg.connect(_dsn_for(dsn, PGQ_DATABASE))
    try:
        queries = await _pgq_install(pool)
        pgq = PgQueuer(AsyncpgDriver(conn))
        latencies: list[float] = []
        total = samples + WAKE_WARMUP

        @pgq.entrypoint(ENTRYPOINT)
        async def work(job: Job) -> None:
            latencies.append(time.perf_counter() - _decoder.decode(job.payload or b"{}")["t"])
            if len(latencies) >= total:
                pgq.shutdown.set()

        async def send(i: int) -> None:
            await queries.enqueue(ENTRYPOINT, _payload(i, time.perf_counter()))

        runner = asyncio.create_task(pgq.run(batch_size=10))
        await asyncio.sleep(0.5)  # listening and waiting
        await _paced(total, WAKE_RATE, send)
        await asyncio.wait_for(runner, 30)
        await queries.uninstall()
        return latencies[WAKE_WARMUP:]
    finally:
        await conn.close()
        await pool.close()


# --- the scenario -----------------------------------------------------------------


async def run(dsn: str, quick: bool) -> list[Result]:
    """Drain throughput (2 x 100, 5 x 10) against raw SQL and pgqueuer, and wake-up latency against pgqueuer."""
    jobs = 3_000 if quick else 30_000
    samples = 200 if quick else 1_000
    results: list[Result] = []
    extra: dict[str, Any] = {"jobs": jobs}

    # A drain lasts half a second: each peer drains ROUNDS times, turn about, and the
    # median counts (one slow moment of the host does not decide a ratio).
    rounds = 1 if quick else ROUNDS
    bus_runs: list[tuple[float, float]] = []
    raw_runs: list[float] = []
    for _ in range(rounds):
        bus_runs.append(await _bus_drain(dsn, jobs, 2, 100))
        raw_runs.append(await _raw_drain(dsn, jobs, 2, 100))
    bus_enqueue = statistics.median(e for e, _ in bus_runs)
    bus_2x100 = statistics.median(d for _, d in bus_runs)
    raw_2x100 = statistics.median(raw_runs)
    extra["rounds"] = rounds
    pgq_enqueue, pgq_2x100 = await _pgq_drain(dsn, jobs, 2, 100)
    _, bus_5x10 = await _bus_drain(dsn, jobs, 5, 10)
    _, pgq_5x10 = await _pgq_drain(dsn, jobs, 5, 10)
    log.info(
        "queue_drain",
        bus_2x100=round(bus_2x100),
        bus_2x100_runs=[round(d) for _, d in bus_runs],
        raw=round(raw_2x100),
        raw_runs=[round(r) for r in raw_runs],
        pgq_2x100=round(pgq_2x100),
        bus_5x10=round(bus_5x10),
        pgq_5x10=round(pgq_5x10),
    )

    results.append(
        Result(SCENARIO, f"enqueue, batches of {BATCH}", bus_enqueue, "jobs/s", pgq_enqueue, PGQ, extra=extra)
    )
    name = "2 consumers, take(100) + ack_many"
    results.append(
        Result(
            SCENARIO,
            name,
            bus_2x100,
            "jobs/s",
            raw_2x100,
            f"{RAW} DELETE … SKIP LOCKED 100/tx",
            target=">= 0.4x raw",
            extra={**extra, "consumers": 2, "batch": 100},
        )
    )
    results.append(
        Result(
            SCENARIO,
            name,
            bus_2x100,
            "jobs/s",
            pgq_2x100,
            f"{PGQ} QueueManager 2 × batch 100",
            target=">= 3x pgqueuer",
            extra={**extra, "consumers": 2, "batch": 100},
        )
    )
    results.append(
        Result(
            SCENARIO,
            "5 consumers, take(10) + ack_many",
            bus_5x10,
            "jobs/s",
            pgq_5x10,
            f"{PGQ} QueueManager 5 × batch 10",
            target=">= 3x pgqueuer",
            extra={**extra, "consumers": 5, "batch": 10},
        )
    )

    bus_lat = await _bus_wakeup(dsn, samples)
    pgq_lat = await _pgq_wakeup(dsn, samples)
    wake = {"rate": WAKE_RATE, "samples": samples}
    log.info(
        "queue_wakeup",
        bus_p50_ms=round(1000 * statistics.median(bus_lat), 2),
        pgq_p50_ms=round(1000 * statistics.median(pgq_lat), 2),
    )
    for label, q, target in (("p50", 0.5, "<= 1.0x pgqueuer"), ("p99", 0.99, None)):
        results.append(
            Result(
                SCENARIO,
                f"enqueue→take wake-up {label}, paced {WAKE_RATE:.0f}/s",
                1000 * _pct(bus_lat, q),
                "ms",
                1000 * _pct(pgq_lat, q),
                PGQ,
                higher_is_better=False,
                target=target,
                extra=wake,
            )
        )
    results += await run_features(dsn, quick)
    return results


async def run_features(dsn: str, quick: bool) -> list[Result]:
    """Queue features at 2 x take(100): delayed jobs, and the cost of a limit the load never reaches.

    Every row's baseline is measured in the same run: the delayed drain beside pgqueuer's drain of
    jobs enqueued with `execute_after`; the limited drains beside the bus's own unlimited drain
    (target >= 0.8x; the medians of ROUNDS drains each, turn about), and pgqueuer's drain with a
    `concurrency_limit` beside its unlimited one (its cost of a limit, for comparison).
    """
    jobs = 3_000 if quick else 20_000
    extra: dict[str, Any] = {"jobs": jobs, "consumers": 2, "batch": 100, "rounds": ROUNDS}
    # The unlimited and the limited drains ROUNDS times, turn about: the medians count (a drain
    # lasts a fraction of a second, one slow moment of the host would decide a single ratio).
    runs: dict[str, list[float]] = {"plain": [], "per_key": [], "rate": []}
    for _ in range(ROUNDS):
        for feature in runs:
            runs[feature].append(
                (await _bus_drain(dsn, jobs, 2, 100, None if feature == "plain" else feature))[1]
            )
    plain, per_key, rate = (statistics.median(runs[f]) for f in ("plain", "per_key", "rate"))
    _, delayed = await _bus_drain(dsn, jobs, 2, 100, "delayed")
    _, pgq_plain = await _pgq_drain(dsn, jobs, 2, 100)
    _, pgq_delayed = await _pgq_drain(dsn, jobs, 2, 100, "delayed")
    _, pgq_limited = await _pgq_drain(dsn, jobs, 2, 100, "limit")
    log.info(
        "queue_features",
        runs={f: [round(d) for d in ds] for f, ds in runs.items()},
        plain=round(plain),
        delayed=round(delayed),
        per_key=round(per_key),
        rate=round(rate),
        pgq_plain=round(pgq_plain),
        pgq_delayed=round(pgq_delayed),
        pgq_limited=round(pgq_limited),
    )
    unlimited = "bus, no limit (same run)"
    return [
        Result(
            SCENARIO,
            "delayed jobs drained, 2 × take(100)",
            delayed,
            "jobs/s",
            pgq_delayed,
            f"{PGQ} QueueManager, execute_after",
            target=">= 1x pgqueuer",
            extra=extra,
        ),
        Result(
            SCENARIO,
            f"max_in_flight_per_key={UNREACHED} (never reached), 2 × take(100)",
            per_key,
            "jobs/s",
            plain,
            unlimited,
            target=">= 0.8x",
            extra=extra,
        ),
        Result(
            SCENARIO,
            f"rate_limit {UNREACHED * 1000}/s (never reached), 2 × take(100)",
            rate,
            "jobs/s",
            plain,
            unlimited,
            target=">= 0.8x",
            extra=extra,
        ),
        Result(
            SCENARIO,
            f"pgqueuer concurrency_limit={UNREACHED} (never reached), 2 × batch 100",
            pgq_limited,
            "jobs/s",
            pgq_plain,
            f"{PGQ}, no limit (same run)",
            extra=extra,
        ),
        Result(
            SCENARIO,
            "limited drain, bus per-key vs pgqueuer concurrency_limit",
            per_key,
            "jobs/s",
            pgq_limited,
            f"{PGQ} concurrency_limit={UNREACHED}",
            extra=extra,
        ),
    ]


if __name__ == "__main__":
    import os
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    scenario = run_features if "--features" in sys.argv else run
    for row in asyncio.run(scenario(target, quick="--quick" in sys.argv)):
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        print(
            f"{row.name:45s} {row.value:10.1f} {row.unit}  vs {row.baseline_name} {row.baseline or 0:10.1f}  {ratio}"
        )
