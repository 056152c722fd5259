"""Work queue throughput of the bus next to pgqueuer, on the same PostgreSQL in the same run.

Both sides do the same work with the same shape:

* enqueue N jobs (~100-byte payloads) in batches of 500
  (bus: `publish_many` to a `semantics="queue"` topic; pgqueuer: `Queries.enqueue` with lists);
* then 2 (and 4) competing consumers take 10 jobs at a time and ack each job
  on its own (bus: `take` + `ack`; pgqueuer: `Queries.dequeue` + `Queries.log_jobs`
  with one job, its documented completion path), until all N are done.

pgqueuer gets its own database (`pgq_bench`) on the same server, installed
fresh each run. The bus gets a fresh schema, dropped afterwards.

Run it alone with `bus bench queue` (or `python -m benchmarks.queue`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
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
TAKE = 10
BASELINE = "pgqueuer"
TARGET = 1.5
PGQ_DATABASE = "pgq_bench"

_encoder = msgspec.json.Encoder()


def _payload(i: int) -> bytes:
    return _encoder.encode({"job": i, "customer": f"cust-{i % 1000:05d}", "amount": 1234.5, "kind": "invoice"})


def _dsn_for(dsn: str, database: str) -> str:
    """The same server, another database (asyncpg accepts `database=` too, but DSNs travel better)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def _pgq_pool(dsn: str, consumers: int) -> asyncpg.Pool:
    admin = await asyncpg.connect(dsn)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", PGQ_DATABASE):
            await admin.execute(f'CREATE DATABASE "{PGQ_DATABASE}"')  # a constant name, not a value
    finally:
        await admin.close()
    pool = await asyncpg.create_pool(_dsn_for(dsn, PGQ_DATABASE), min_size=2, max_size=consumers + 4)
    assert pool is not None
    return pool


async def _bus_round(dsn: str, jobs: int, consumers: int) -> tuple[float, float]:
    """(enqueue jobs/s, consume jobs/s) for the bus."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0, pool_max_size=consumers + 4)
    try:
        await b.create_topic(TOPIC, partitions=4, semantics="queue")
        started = time.perf_counter()
        for first in range(0, jobs, BATCH):
            await b.publish_many(TOPIC, [bus.Outgoing(_payload(i)) for i in range(first, min(first + BATCH, jobs))])
        enqueue = jobs / (time.perf_counter() - started)
        done = 0

        async def consume() -> None:
            nonlocal done
            async with b.queue_consumer(TOPIC, visibility_timeout=60) as q:
                while done < jobs:
                    batch = await q.take(max_messages=TAKE, timeout=0)
                    if not batch:
                        if done >= jobs:
                            return
                        await asyncio.sleep(0.001)
                        continue
                    for m in batch:
                        await q.ack(m)
                        done += 1

        started = time.perf_counter()
        await asyncio.gather(*(consume() for _ in range(consumers)))
        consume_rate = jobs / (time.perf_counter() - started)
        return enqueue, consume_rate
    finally:
        async with b.pool.acquire() as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')  # validated bench schema name
        await b.close()


async def _pgq_round(dsn: str, jobs: int, consumers: int) -> tuple[float, float]:
    """(enqueue jobs/s, consume jobs/s) for pgqueuer."""
    from pgqueuer.adapters.persistence.queries import Queries
    from pgqueuer.ports.repository import EntrypointExecutionParameter

    pool = await _pgq_pool(dsn, consumers)
    try:
        queries = Queries.from_asyncpg_pool(pool)
        try:
            await queries.uninstall()
        except Exception:  # not installed yet
            log.debug("pgqueuer_not_installed")
        await queries.install()
        started = time.perf_counter()
        for first in range(0, jobs, BATCH):
            n = min(BATCH, jobs - first)
            await queries.enqueue([ENTRYPOINT] * n, [_payload(i) for i in range(first, first + n)], [0] * n)
        enqueue = jobs / (time.perf_counter() - started)
        done = 0
        entrypoints: dict[Any, Any] = {ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}

        async def consume() -> None:
            nonlocal done
            manager = uuid.uuid4()
            while done < jobs:
                batch = await queries.dequeue(
                    batch_size=TAKE,
                    entrypoints=entrypoints,
                    queue_manager_id=manager,  # type: ignore[arg-type]
                    global_concurrency_limit=None,
                    heartbeat_timeout=timedelta(seconds=60),
                )
                if not batch:
                    await asyncio.sleep(0.001)
                    continue
                for job in batch:
                    await queries.log_jobs([(job, "successful", None)])
                    done += 1

        started = time.perf_counter()
        await asyncio.gather(*(consume() for _ in range(consumers)))
        consume_rate = jobs / (time.perf_counter() - started)
        await queries.uninstall()
        return enqueue, consume_rate
    finally:
        await pool.close()


async def run(dsn: str, quick: bool) -> list[Result]:
    """Enqueue and consume (2 and 4 consumers) on the bus and on pgqueuer."""
    jobs = 2_000 if quick else 20_000
    results: list[Result] = []
    for consumers in (2, 4):
        bus_enqueue, bus_rate = await _bus_round(dsn, jobs, consumers)
        pgq_enqueue, pgq_rate = await _pgq_round(dsn, jobs, consumers)
        if consumers == 2:
            results.append(
                Result(SCENARIO, f"enqueue, batches of {BATCH}", bus_enqueue, "jobs/s", pgq_enqueue, BASELINE,
                       extra={"jobs": jobs})
            )
        results.append(
            Result(
                SCENARIO,
                f"take {TAKE} + ack each, {consumers} consumers",
                bus_rate,
                "jobs/s",
                pgq_rate,
                BASELINE,
                target=f">= {TARGET}x pgqueuer",
                extra={"jobs": jobs, "consumers": consumers},
            )
        )
        log.info("queue_round", consumers=consumers, bus=round(bus_rate), pgqueuer=round(pgq_rate))
    return results


if __name__ == "__main__":
    import os
    import sys

    from storage.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        print(f"{row.name:45s} {row.value:10.0f} {row.unit}  vs {row.baseline_name} {row.baseline or 0:10.0f}  {ratio}")
