"""What a queue's take(1) + ack leaves behind while another session holds a snapshot.

A REPEATABLE READ transaction that stays open (a report, a `pg_dump`, a
forgotten `BEGIN`) holds the database's xmin horizon: every row version
deleted or replaced from then on stays on disk until it ends, and each one is
work for the next VACUUM (and, until then, for every scan that passes it).
How many such versions a job costs is a property of the queue's design: a
job table that is inserted, updated to "running" and deleted leaves two per
job; one whose take deletes the row leaves one.

The load, in each round: a snapshot is taken (a REPEATABLE READ transaction
that read something) and held while `producers` tasks publish `jobs` jobs one
call each and `workers` tasks take them one at a time (`take(max_messages=1)`)
and ack each, until every job is acked. Side by side in the same round, on
the same server, the same jobs through two one-table queues in raw SQL:

* **raw delete-on-take**: `DELETE ... WHERE id = (SELECT ... FOR UPDATE SKIP
  LOCKED LIMIT 1) RETURNING`, the least a job can leave (one deleted row), at
  the price of at-most-once delivery (no lease, no visibility timeout);
* **raw lease-then-delete**: the take sets the job's visibility (`UPDATE ...
  SET visible_at = now() + timeout ... RETURNING`) and the ack deletes it: the
  at-least-once queue most job tables are (two row versions per job);
* **raw rotated lease log**: the take inserts its lease into the current of
  two log tables (that insert also moves the frontier), the ack deletes the
  job, and every ROTATE_EVERY seconds the older log's leases still holding a
  job move to the current one and the older log is truncated (PgQue's way):
  what a lease costs when nothing deletes it. Its publishes commit in id
  order (an advisory lock held to commit), as a frontier needs. It has no
  reclaim of leases that ran out (in the bench every job is acked), only
  their writes.

Per system: jobs/s and, per table, the dead tuples the hold kept
(`pg_stat_user_tables.n_dead_tup` after the round against before it; the
round's connections are closed first, which flushes their statistics). Rounds
alternate the systems; the rows report the round with the fewest dead tuples
per job for each. Target: the bus leaves no more dead tuples per job than the
raw lease-then-delete queue (the one-table peers' shape).

Knobs (environment): BUS_BENCH_DEAD_JOBS (jobs per round, default 5000;
--quick 400), BUS_BENCH_DEAD_WORKERS (default 8; --quick 4),
BUS_BENCH_DEAD_PRODUCERS (default 2), BUS_BENCH_DEAD_ROUNDS (default 2;
--quick 1). Only the given DSN is contacted; each system runs in a schema of
its own, dropped at the end.

Run it alone with `bus bench deadtuples` (or `python -m benchmarks.deadtuples`).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

import bus
from benchmarks.rawpeers import create_pool, drop_schema
from benchmarks.result import Result
from benchmarks.xmin import print_table

SCENARIO = "deadtuples"
QUEUE = "bench.dead.jobs"
PARTITIONS = 4
PAYLOAD = b'{"order": 12345, "amount": 1234.5, "kind": "invoice"}'
VISIBILITY = 30.0
IDLE = 0.002  # a raw worker that found no job looks again this much later

SYSTEMS = ("bus", "raw delete-on-take", "raw lease-then-delete", "raw rotated lease log")
ROTATE_EVERY = 0.25  # seconds between the rotations of the raw lease log

TABLE_STATS = """
SELECT relname, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_del
FROM pg_stat_user_tables WHERE schemaname = $1
"""

CREATE_RAW_JOBS = """
CREATE TABLE raw_jobs (
    id          bigserial PRIMARY KEY,
    payload     bytea NOT NULL,
    visible_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer NOT NULL DEFAULT 0
);
CREATE INDEX raw_jobs_ready ON raw_jobs (visible_at, id);
"""
RAW_PUBLISH = "INSERT INTO raw_jobs (payload) VALUES ($1)"
RAW_TAKE_DELETE = """
DELETE FROM raw_jobs WHERE id = (
    SELECT id FROM raw_jobs ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED
) RETURNING id, payload
"""
RAW_TAKE_LEASE = """
UPDATE raw_jobs SET visible_at = now() + make_interval(secs => $1), attempts = attempts + 1
WHERE id = (
    SELECT id FROM raw_jobs WHERE visible_at <= now() ORDER BY visible_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
) RETURNING id, payload, attempts
"""
RAW_ACK = "DELETE FROM raw_jobs WHERE id = $1 AND attempts = $2"

# The rotated lease log (PgQue's way, as a raw peer): a take inserts its lease into the current
# of two log tables, and that insert is also its frontier move (the frontier is the newest lease,
# or the base a rotation folded in); the ack deletes the job and nothing else. A rotation, under
# the frontier row's lock, moves the leases of the older log whose job is still there into the
# current one, folds the older log's newest lease into the base, truncates it and makes it
# current: a lease is inserted once (and moved while it holds a job), never deleted.
CREATE_RAW_ROTATED = """
CREATE TABLE raw_jobs (id bigserial PRIMARY KEY, payload bytea NOT NULL);
CREATE TABLE raw_lease_log_0 (job_id bigint NOT NULL, visible_at timestamptz NOT NULL);
CREATE TABLE raw_lease_log_1 (job_id bigint NOT NULL, visible_at timestamptz NOT NULL);
CREATE INDEX raw_lease_log_0_job ON raw_lease_log_0 (job_id);
CREATE INDEX raw_lease_log_1_job ON raw_lease_log_1 (job_id);
CREATE TABLE raw_lease_frontier (base bigint NOT NULL, slot integer NOT NULL);
INSERT INTO raw_lease_frontier VALUES (0, 0);

CREATE FUNCTION raw_take(timeout float8) RETURNS TABLE (id bigint, payload bytea)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    f raw_lease_frontier;
    job raw_jobs;
BEGIN
    SELECT * INTO f FROM raw_lease_frontier FOR UPDATE;
    SELECT j.* INTO job FROM raw_jobs j
    WHERE j.id > GREATEST(f.base, (SELECT max(l.job_id) FROM raw_lease_log_0 l),
                          (SELECT max(l.job_id) FROM raw_lease_log_1 l))
    ORDER BY j.id LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF f.slot = 0 THEN
        INSERT INTO raw_lease_log_0 VALUES (job.id, now() + make_interval(secs => timeout));
    ELSE
        INSERT INTO raw_lease_log_1 VALUES (job.id, now() + make_interval(secs => timeout));
    END IF;
    RETURN QUERY SELECT job.id, job.payload;
END
$$;

CREATE FUNCTION raw_rotate() RETURNS integer
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    f raw_lease_frontier;
    moved integer;
BEGIN
    SELECT * INTO f FROM raw_lease_frontier FOR UPDATE;
    IF f.slot = 0 THEN
        INSERT INTO raw_lease_log_0
        SELECT l.* FROM raw_lease_log_1 l WHERE EXISTS (SELECT 1 FROM raw_jobs j WHERE j.id = l.job_id);
        GET DIAGNOSTICS moved = ROW_COUNT;
        UPDATE raw_lease_frontier SET base = GREATEST(base, (SELECT max(job_id) FROM raw_lease_log_1)), slot = 1;
        TRUNCATE raw_lease_log_1;
    ELSE
        INSERT INTO raw_lease_log_1
        SELECT l.* FROM raw_lease_log_0 l WHERE EXISTS (SELECT 1 FROM raw_jobs j WHERE j.id = l.job_id);
        GET DIAGNOSTICS moved = ROW_COUNT;
        UPDATE raw_lease_frontier SET base = GREATEST(base, (SELECT max(job_id) FROM raw_lease_log_0)), slot = 0;
        TRUNCATE raw_lease_log_0;
    END IF;
    RETURN moved;
END
$$;
"""
# A frontier needs the ids visible in order (a job committed below a lease taken past it would
# never be taken): the publishes of the rotated log commit one at a time, under a transaction
# lock taken before the id is drawn (a lock writes no row version).
RAW_ROTATED_PUBLISH = """
WITH l AS (SELECT pg_advisory_xact_lock(7242) AS locked)
INSERT INTO raw_jobs (payload) SELECT $1 FROM l
"""
RAW_ROTATED_TAKE = "SELECT id, payload FROM raw_take($1)"
RAW_ROTATED_ACK = "DELETE FROM raw_jobs WHERE id = $1"
RAW_ROTATE = "SELECT raw_rotate()"
RAW_ROTATE_WAIT = "SET LOCAL lock_timeout = '100ms'"


@dataclass
class Round:
    """One system's run of the jobs under a held snapshot."""

    system: str
    jobs: int
    seconds: float = 0.0
    dead: dict[str, int] = field(default_factory=dict)  # per table, kept by the hold
    written: dict[str, int] = field(default_factory=dict)  # per table, rows updated or deleted

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else 0.0

    @property
    def total_dead(self) -> int:
        return sum(self.dead.values())

    @property
    def dead_per_job(self) -> float:
        return self.total_dead / self.jobs if self.jobs else 0.0

    @property
    def written_per_job(self) -> float:
        """Rows updated or deleted per job (under the hold, each one a version kept)."""
        return sum(self.written.values()) / self.jobs if self.jobs else 0.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if not raw else int(raw)


async def _stats(conn: asyncpg.Connection, schema: str) -> dict[str, tuple[int, int]]:
    """Per table of `schema`: (dead tuples, rows updated or deleted so far)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = await conn.fetch(TABLE_STATS, schema)
    return {r["relname"]: (int(r["n_dead_tup"]), int(r["n_tup_upd"]) + int(r["n_tup_del"])) for r in rows}


async def _settled_stats(conn: asyncpg.Connection, schema: str) -> dict[str, tuple[int, int]]:
    """The statistics once the closed connections' last reports arrived (two equal reads in a row)."""
    last = await _stats(conn, schema)
    for _ in range(20):
        await asyncio.sleep(0.25)
        now = await _stats(conn, schema)
        if now == last:
            return now
        last = now
    return last


async def _held(
    dsn: str,
    schema: str,
    system: str,
    jobs: int,
    run: Callable[[], Awaitable[None]],
    close: Callable[[], Awaitable[None]],
) -> Round:
    """Run `run` while a snapshot is held; `close` closes the system's connections before the count."""
    stats = await asyncpg.connect(dsn)
    holder = await asyncpg.connect(dsn)
    try:
        before = await _settled_stats(stats, schema)
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM pg_class")  # takes the snapshot
        started = time.perf_counter()
        try:
            # A system that loses a job never finishes: the round fails instead of hanging the run.
            await asyncio.wait_for(run(), 60 + jobs / 10)
            seconds = time.perf_counter() - started
        finally:
            await close()
        after = await _settled_stats(stats, schema)
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
        await stats.close()
    out = Round(system, jobs, seconds)
    for table, (dead, written) in after.items():
        was_dead, was_written = before.get(table, (0, 0))
        if dead - was_dead > 0 or written - was_written > 0:
            out.dead[table] = max(0, dead - was_dead)
            out.written[table] = written - was_written
    return out


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def bus_round(dsn: str, jobs: int, workers: int, producers: int) -> Round:
    """The bus: `producers` publishing one job per call, `workers` queue consumers taking one and acking it."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    try:
        # Warm-up on a Bus of its own (closed before the count): the schema, prepared statements.
        b = await bus.connect(dsn, schema=schema)
        try:
            await b.create_topic(QUEUE, partitions=PARTITIONS, semantics="queue")
            async with b.queue_consumer(QUEUE, visibility_timeout=VISIBILITY) as q:
                for _ in range(20):
                    await b.publish(QUEUE, PAYLOAD)
                    for job in await q.take(max_messages=1, timeout=1.0):
                        await q.ack(job)
        finally:
            await b.close()
        b = await bus.connect(dsn, schema=schema)
        acked = [0]
        done = asyncio.Event()

        async def produce(n: int) -> None:
            for _ in range(n):
                await b.publish(QUEUE, PAYLOAD)

        async def work() -> None:
            async with b.queue_consumer(QUEUE, visibility_timeout=VISIBILITY) as q:
                while not done.is_set():
                    for job in await q.take(max_messages=1, timeout=0.2):
                        await q.ack(job)
                        acked[0] += 1
                        if acked[0] >= jobs:
                            done.set()

        async def run() -> None:
            tasks = [asyncio.create_task(work()) for _ in range(workers)]
            await asyncio.gather(*(produce(n) for n in _split(jobs, producers)))
            await done.wait()
            await asyncio.gather(*tasks)

        return await _held(dsn, schema, "bus", jobs, run, b.close)
    finally:
        await drop_schema(dsn, schema)


async def raw_round(dsn: str, jobs: int, workers: int, producers: int, *, system: str) -> Round:
    """A raw SQL queue (`system`, one of SYSTEMS[1:]) through the same load."""
    schema = "bench_" + uuid.uuid4().hex[:10]
    setup = await asyncpg.connect(dsn)
    try:
        await setup.execute(f'CREATE SCHEMA "{schema}"')  # a generated name
    finally:
        await setup.close()
    try:
        pool = await create_pool(dsn, schema, min_size=2, max_size=workers + producers + 1)
        rotated = system == SYSTEMS[3]
        await pool.execute(CREATE_RAW_ROTATED if rotated else CREATE_RAW_JOBS)
        acked = [0]

        publish = RAW_ROTATED_PUBLISH if rotated else RAW_PUBLISH

        async def produce(n: int) -> None:
            for _ in range(n):
                await pool.execute(publish, PAYLOAD)

        async def take() -> asyncpg.Record | None:
            if system == SYSTEMS[1]:
                return await pool.fetchrow(RAW_TAKE_DELETE)
            if system == SYSTEMS[2]:
                row = await pool.fetchrow(RAW_TAKE_LEASE, VISIBILITY)
                if row is not None:
                    await pool.execute(RAW_ACK, row["id"], row["attempts"])
                return row
            row = await pool.fetchrow(RAW_ROTATED_TAKE, VISIBILITY)
            if row is not None:
                await pool.execute(RAW_ROTATED_ACK, row["id"])
            return row

        async def work() -> None:
            while acked[0] < jobs:
                if await take() is None:
                    await asyncio.sleep(IDLE)
                else:
                    acked[0] += 1

        async def rotate() -> None:
            async with pool.acquire() as conn:
                while acked[0] < jobs:
                    await asyncio.sleep(ROTATE_EVERY)
                    try:
                        async with conn.transaction():
                            await conn.execute(RAW_ROTATE_WAIT)
                            await conn.fetchval(RAW_ROTATE)
                    except asyncpg.LockNotAvailableError:
                        pass  # a reader held the older log: the next rotation

        async def run() -> None:
            await asyncio.gather(
                *(produce(n) for n in _split(jobs, producers)),
                *(work() for _ in range(workers)),
                *([rotate()] if rotated else []),
            )

        return await _held(dsn, schema, system, jobs, run, pool.close)
    finally:
        await drop_schema(dsn, schema)


async def measure(dsn: str, jobs: int, workers: int, producers: int, rounds: int) -> list[Round]:
    """Every system once per round, in alternating order."""
    out: list[Round] = []
    for i in range(rounds):
        for system in SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]:
            if system == SYSTEMS[0]:
                out.append(await bus_round(dsn, jobs, workers, producers))
            else:
                out.append(await raw_round(dsn, jobs, workers, producers, system=system))
    return out


def best(rounds: list[Round], system: str) -> Round:
    """The system's round with the fewest dead tuples per job."""
    return min((r for r in rounds if r.system == system), key=lambda r: r.dead_per_job)


def table(rounds: list[Round]) -> list[list[str]]:
    """Per round: the system, jobs/s, dead tuples and rows written per job, the dead tuples of each table."""
    tables = sorted({t for r in rounds for t in r.dead})
    out = [["round", "system", "jobs/s", "dead/job", "written/job", "dead", *tables]]
    per_system: dict[str, int] = {}
    for r in rounds:
        per_system[r.system] = per_system.get(r.system, 0) + 1
        out.append(
            [
                str(per_system[r.system]),
                r.system,
                f"{r.rate:,.0f}",
                f"{r.dead_per_job:.2f}",
                f"{r.written_per_job:.2f}",
                f"{r.total_dead:,}",
                *[f"{r.dead[t]:,}" if t in r.dead else "" for t in tables],
            ]
        )
    return out


async def run(dsn: str, quick: bool) -> list[Result]:
    """Dead tuples per job and jobs/s of the bus under a held snapshot, against the raw one-table queues."""
    jobs = _env_int("BUS_BENCH_DEAD_JOBS", 400 if quick else 5000)
    workers = _env_int("BUS_BENCH_DEAD_WORKERS", 4 if quick else 8)
    producers = _env_int("BUS_BENCH_DEAD_PRODUCERS", 2)
    rounds = _env_int("BUS_BENCH_DEAD_ROUNDS", 1 if quick else 2)
    measured = await measure(dsn, jobs, workers, producers, rounds)
    ours = best(measured, SYSTEMS[0])
    extra: dict[str, Any] = {
        "jobs": jobs,
        "workers": workers,
        "producers": producers,
        "rounds": rounds,
        "table": table(measured),
        "bus_dead_per_table": dict(ours.dead),
    }
    shape = f"take(1) + ack, {workers} workers, {jobs} jobs, snapshot held"
    rate = max(r.rate for r in measured if r.system == SYSTEMS[0])
    rows: list[Result] = []
    for peer in (SYSTEMS[2], SYSTEMS[1], SYSTEMS[3]):
        rows.append(
            Result(
                SCENARIO,
                f"dead tuples per job, {shape} (baseline: {peer})",
                ours.dead_per_job,
                "rows/job",
                best(measured, peer).dead_per_job,
                peer,
                higher_is_better=False,
                target="<= 1.0x raw lease-then-delete" if peer == SYSTEMS[2] else None,
                extra=extra if peer == SYSTEMS[2] else {},
            )
        )
    for peer in (SYSTEMS[2], SYSTEMS[1], SYSTEMS[3]):
        rows.append(
            Result(
                SCENARIO,
                f"jobs/s, {shape} (baseline: {peer})",
                rate,
                "jobs/s",
                max(r.rate for r in measured if r.system == peer),
                peer,
            )
        )
    return rows


if __name__ == "__main__":
    import sys

    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    result = asyncio.run(run(target, quick="--quick" in sys.argv))
    print_table(result, labels=2)
