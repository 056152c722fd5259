"""W jobs at once with 1 ms of work each: `b.worker(concurrency=W)` beside raw SKIP LOCKED on W connections.

The shape of the common job-queue benchmark: W workers each take one job,
work on it for 1 ms and finish it, until the queue is empty.

* **bus**: `b.worker(TOPIC, handler, concurrency=W)` on a 4-partition queue
  topic; the handler sleeps 1 ms. The worker takes once for all its free
  slots and acks after each handler returns (acks of one moment in one
  statement), with visibility timeouts, retries and dead letters as usual.
* **raw asyncpg**: one table, W connections each looping
  `DELETE ... WHERE id = (SELECT id ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING`
  then 1 ms of sleep: one autocommit statement per job, no lease, no retry (a
  job whose process dies mid-work is lost).

Both drain the same number of jobs, turn about, ROUNDS times at each W; the
medians are compared. Target: the worker at ≥ 0.8× raw at W = 16 and 64. For
reference, W `queue_consumer`s of the same Bus each looping `take(1)` (and
`take(10)`) with the same work run once each, beside the same raw median.

Run it alone with `bus bench worker [--quick]` (or `python -m benchmarks.worker`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
import uuid

import asyncpg

import bus
from benchmarks.rawpeers import create_pool, drop_schema
from benchmarks.result import Result
from storage.logs import get_logger

log = get_logger(__name__, scenario="worker")

SCENARIO = "worker"
TOPIC = "bench.jobs"
RAW = "raw SKIP LOCKED"
WORK = 0.001  # s of work per job
ROUNDS = 2
TARGET = "≥ 0.8× raw"

CREATE_RAW = "CREATE TABLE raw_jobs (id bigserial PRIMARY KEY, payload bytea NOT NULL)"
FILL_RAW = "INSERT INTO raw_jobs (payload) SELECT convert_to(g::text, 'UTF8') FROM generate_series(1, $1) g"
TAKE_RAW = """
DELETE FROM raw_jobs WHERE id = (SELECT id FROM raw_jobs ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1)
RETURNING id, payload
"""


def _sizes(quick: bool) -> list[tuple[int, int]]:
    """(W, jobs) pairs: about a second of draining each at the rates one core reaches."""
    if quick:
        return [
            (
                int(os.environ.get("BUS_BENCH_WORKER_W", "4")),
                int(os.environ.get("BUS_BENCH_WORKER_JOBS", "200")),
            )
        ]
    return [(16, 2_000), (64, 4_000)]


async def _raw(dsn: str, concurrency: int, jobs: int) -> float:
    """Jobs/s of `concurrency` connections each deleting one job at a time, then 1 ms of work."""
    schema = "bench_raw_" + uuid.uuid4().hex[:10]
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE SCHEMA "{schema}"')  # a generated bench schema name
    finally:
        await admin.close()
    pool = await create_pool(dsn, schema, min_size=concurrency, max_size=concurrency)
    try:
        await pool.execute(CREATE_RAW)
        await pool.execute(FILL_RAW, jobs)
        await pool.execute("ANALYZE raw_jobs")
        handled = 0

        async def work(conn: asyncpg.Connection) -> None:
            nonlocal handled
            while await conn.fetchrow(TAKE_RAW) is not None:
                await asyncio.sleep(WORK)
                handled += 1

        conns = [await pool.acquire() for _ in range(concurrency)]
        started = time.perf_counter()
        await asyncio.gather(*(work(c) for c in conns))
        elapsed = time.perf_counter() - started
        for c in conns:
            await pool.release(c)
        if handled != jobs:
            raise RuntimeError(f"raw drain handled {handled} of {jobs} jobs")
        return jobs / elapsed
    finally:
        await pool.close()
        await drop_schema(dsn, schema)


async def _worker(dsn: str, concurrency: int, jobs: int) -> float:
    """Jobs/s of one `b.worker(concurrency=W)` whose handler works 1 ms per job."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        await b.create_topic(TOPIC, partitions=4, semantics="queue")
        for first in range(0, jobs, 500):
            await b.publish_many(
                TOPIC, [bus.Outgoing(str(i).encode()) for i in range(first, min(first + 500, jobs))]
            )
        await b.pool.execute("ANALYZE queue_jobs, messages")  # bench SQL: the steady state autovacuum keeps
        handled = 0
        done = asyncio.Event()

        async def handle(job: bus.Message) -> None:
            nonlocal handled
            await asyncio.sleep(WORK)
            handled += 1
            if handled == jobs:
                done.set()

        started = time.perf_counter()
        w = await b.worker(TOPIC, handle, concurrency=concurrency, visibility_timeout=60)
        await asyncio.wait_for(done.wait(), 600)
        await w.stop()  # the last acks written
        elapsed = time.perf_counter() - started
        left = await b.pool.fetchval("SELECT count(*) FROM queue_jobs")  # bench check, not library SQL
        if left:
            raise RuntimeError(f"the worker left {left} of {jobs} jobs")
        return jobs / elapsed
    finally:
        await b.close()
        await drop_schema(dsn, schema)


async def _take_loops(dsn: str, concurrency: int, jobs: int, take: int) -> float:
    """Jobs/s of `concurrency` queue consumers of one Bus each looping take(`take`), 1 ms per job, ack."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    try:
        await b.create_topic(TOPIC, partitions=4, semantics="queue")
        for first in range(0, jobs, 500):
            await b.publish_many(
                TOPIC, [bus.Outgoing(str(i).encode()) for i in range(first, min(first + 500, jobs))]
            )
        await b.pool.execute("ANALYZE queue_jobs, messages")  # bench SQL, as above
        queues = [b.queue_consumer(TOPIC, visibility_timeout=60) for _ in range(concurrency)]
        for q in queues:
            await q.start()

        async def loop(q: bus.QueueConsumer) -> None:
            while got := await q.take(max_messages=take, timeout=0):
                for job in got:
                    await asyncio.sleep(WORK)
                    await q.ack(job)

        started = time.perf_counter()
        await asyncio.gather(*(loop(q) for q in queues))
        elapsed = time.perf_counter() - started
        for q in queues:
            await q.close()
        return jobs / elapsed
    finally:
        await b.close()
        await drop_schema(dsn, schema)


async def run(dsn: str, quick: bool) -> list[Result]:
    """The worker beside raw SKIP LOCKED at each W, ROUNDS drains each, turn about (medians)."""
    rows: list[Result] = []
    rounds = 1 if quick else ROUNDS
    for concurrency, jobs in _sizes(quick):
        mine: list[float] = []
        raw: list[float] = []
        for _ in range(rounds):
            raw.append(await _raw(dsn, concurrency, jobs))
            mine.append(await _worker(dsn, concurrency, jobs))
        value, baseline = statistics.median(mine), statistics.median(raw)
        log.info("worker_bench", concurrency=concurrency, worker=mine, raw=raw)
        rows.append(
            Result(
                SCENARIO,
                f"{jobs} jobs, 1 ms each, W = {concurrency}",
                value,
                "jobs/s",
                baseline=baseline,
                baseline_name=RAW,
                target=TARGET,
                extra={"worker": mine, "raw": raw, "concurrency": concurrency, "jobs": jobs},
            )
        )
        if not quick:
            # What the worker replaces: W consumers each looping take(1), and take(10), beside raw.
            for take in (1, 10):
                loops = await _take_loops(dsn, concurrency, jobs, take)
                rows.append(
                    Result(
                        SCENARIO,
                        f"{jobs} jobs, 1 ms each, {concurrency} queue_consumers looping take({take})",
                        loops,
                        "jobs/s",
                        baseline=baseline,
                        baseline_name=RAW,
                    )
                )
    return rows


if __name__ == "__main__":
    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for row in asyncio.run(run(target, quick="--quick" in sys.argv)):
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        print(
            f"{row.name:40s} {row.value:10.1f} {row.unit}  vs {row.baseline_name} {row.baseline or 0:10.1f}  {ratio}"
        )
