"""Compaction: the Spark job end to end vs the same compaction in pure SQL, on the same database.

Data: 4 compact topics × 8 partitions, ~10,000 keys per topic, ~150-byte
payloads, 2,000,000 rows (quick: 200,000; `BUS_BENCH_COMPACT_ROWS` overrides
both), bulk-loaded with generate_series. The Spark master is `local[2]`
(`BUS_BENCH_COMPACT_MASTER` overrides it, e.g. `local[1]` to see how the job
scales with executor threads).
Measured in this run, each on a fresh schema with identical data:

* baseline: `DELETE ... USING (newest offset per key)` then `VACUUM` (no archive);
* fresh: `spark-submit bus/compaction/job.py` in a new process (JVM start-up included);
* warm: a second run in one in-process SparkSession, on fresh data (what a
  scheduled run of the sidecar, `bus compact --every`, does).

Peak memory is the resident set of the job's process tree (Python + JVM),
sampled every 100 ms.

Not like for like: the job also archives every removed record (payload,
key, headers) to Parquet, the baseline archives nothing; the job does not
VACUUM, the baseline does. The warm row's `stages_s` splits the job's time
into its steps (plan, keep-set in SQL, Spark archive pass, deletes); the
fresh row's `steps_s` splits the process's time: `to_main` (spark-submit,
the JVM, Python and imports until the job's main() runs), `session_wait`
(waiting in the archive step for the session started beside plan and
stage), the steps, and `after_run` (shutdown).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import psutil

import bus
from benchmarks.result import Result
from bus.compaction import run_compaction
from bus.compaction.spark import spark_session, submit_command
from storage.compaction.bulk import (
    ANALYZE_MESSAGES,
    SQL_BASELINE_COMPACT,
    SQL_BASELINE_VACUUM,
    BulkAppendParams,
    bulk_append,
)
from storage.logs import get_logger

log = get_logger(__name__)

TOPICS = 4
PARTITIONS = 8
KEYS_PER_TOPIC = 10_000
PAYLOAD = 150


class PeakRss:
    """Samples the resident memory of a process and its children (a context manager)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mib(self) -> float:
        return self.peak / 2**20


async def _load(dsn: str, rows: int) -> str:
    """A fresh schema with the benchmark data; returns the schema."""
    schema = "bench_compact_" + uuid.uuid4().hex[:10]
    per_partition = rows // (TOPICS * PARTITIONS)
    start = datetime.now(UTC) - timedelta(days=2)
    async with bus.connect(dsn, schema=schema, cleaner_interval=0) as b:
        ids = []
        for t in range(TOPICS):
            info = await b.create_topic(f"state-{t}", PARTITIONS, cleanup="compact")
            for p in range(PARTITIONS):
                pid = await b.partition_id(info, str(p), create=False)
                assert pid is not None
                ids.append(pid)

        async def one(pid: int) -> None:
            async with b.pool.acquire() as conn:
                await bulk_append(
                    conn,
                    BulkAppendParams(
                        partition_id=pid,
                        rows=per_partition,
                        keys=KEYS_PER_TOPIC // PARTITIONS,
                        payload_bytes=PAYLOAD,
                        start=start,
                        step_seconds=0.01,
                    ),
                )

        await asyncio.gather(*(one(pid) for pid in ids))
        async with b.pool.acquire() as conn:
            await conn.execute(ANALYZE_MESSAGES)
    return schema


async def _drop(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # generated bench schema name
    finally:
        await conn.close()


async def _sql_baseline(dsn: str, schema: str) -> tuple[float, int]:
    from storage import db

    conn = await db.connect(dsn, schema)
    try:
        t0 = time.perf_counter()
        status = await conn.execute(SQL_BASELINE_COMPACT)
        await conn.execute(SQL_BASELINE_VACUUM)
        return time.perf_counter() - t0, int(status.split()[-1])
    finally:
        await conn.close()


class StageClock:
    """A progress callback that records how long each stage of a run took."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stage: str | None = None
        self._since = time.perf_counter()

    def __call__(self, event: Any) -> None:
        now = time.perf_counter()
        if event.stage != self._stage:
            if self._stage is not None:
                self.seconds[self._stage] = round(self.seconds.get(self._stage, 0.0) + now - self._since, 2)
            self._stage, self._since = event.stage, now


def _fresh(dsn: str, schema: str, archive: str, master: str) -> tuple[float, float, dict[str, float]]:
    """(seconds, peak MiB, where the time went) of one `spark-submit` run in a new process."""
    argv, env = submit_command(["--schema", schema, "--archive", archive], master=master)
    env["BUS_DSN"] = dsn  # the password through the environment, not the command line
    wall0 = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRss(proc.pid) as rss:
        out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"spark-submit failed ({proc.returncode}): {err[-2000:]}")
    log.info("compact_fresh", out=out.strip())
    steps: dict[str, float] = {}
    for line in out.splitlines():
        if line.startswith("timings "):
            timings = json.loads(line.removeprefix("timings "))
            # JVM start-up, the launcher, Python and its imports: until the job's main() ran.
            steps["to_main"] = round(timings.pop("main_at") - wall0, 2)
            steps.update(timings)
            steps["after_run"] = round(
                seconds - steps["to_main"] - sum(timings.values()) + timings.get("session_wait", 0.0), 2
            )
    return seconds, rss.mib, steps


async def run(dsn: str, quick: bool) -> list[Result]:
    """Baseline, fresh and warm runs on identical data; see the module docstring."""
    rows = int(os.environ.get("BUS_BENCH_COMPACT_ROWS") or (200_000 if quick else 2_000_000))
    master = os.environ.get("BUS_BENCH_COMPACT_MASTER") or "local[2]"
    tmp = Path(tempfile.mkdtemp(prefix="bus-compact-bench-"))
    schemas: list[str] = []
    try:
        schema = await _load(dsn, rows)
        schemas.append(schema)
        sql_seconds, sql_removed = await _sql_baseline(dsn, schema)

        schema = await _load(dsn, rows)
        schemas.append(schema)
        fresh_seconds, fresh_mib, fresh_steps = await asyncio.to_thread(
            _fresh, dsn, schema, str(tmp / "fresh"), master
        )

        spark = await asyncio.to_thread(spark_session, master)
        schema = await _load(dsn, rows)
        schemas.append(schema)
        with PeakRss() as first_rss:
            first = await asyncio.to_thread(
                run_compaction, dsn, schema, spark=spark, archive=str(tmp / "first")
            )
        schema = await _load(dsn, rows)
        schemas.append(schema)
        with PeakRss() as warm_rss:
            t0 = time.perf_counter()
            clock = StageClock()
            warm = await asyncio.to_thread(
                run_compaction, dsn, schema, spark=spark, archive=str(tmp / "warm"), progress=clock
            )
            warm_seconds = time.perf_counter() - t0
        await asyncio.to_thread(spark.stop)
    finally:
        for s in schemas:
            await _drop(dsn, s)
        shutil.rmtree(tmp, ignore_errors=True)

    extra: dict[str, Any] = {
        "rows": rows,
        "removed_sql": sql_removed,
        "removed_job": warm.rows_removed,
        "archived_job": warm.rows_archived,
        "first_in_session_s": round(first.seconds, 2),
        "master": master,
        "note": "the job also archives the removed rows to Parquet; the "
        "baseline archives nothing (and VACUUMs)",
    }
    return [
        Result(
            "compact",
            f"warm session, {rows:,} rows (archive + delete)",
            warm_seconds,
            "s",
            baseline=sql_seconds,
            baseline_name="pure SQL DELETE + VACUUM",
            higher_is_better=False,
            target="≤ 1.2× SQL",
            extra={
                **extra,
                "peak_rss_mib": round(max(first_rss.mib, warm_rss.mib), 1),
                "stages_s": clock.seconds,
            },
        ),
        Result(
            "compact",
            f"fresh spark-submit, {rows:,} rows (start-up included)",
            fresh_seconds,
            "s",
            baseline=sql_seconds,
            baseline_name="pure SQL DELETE + VACUUM",
            higher_is_better=False,
            target="≤ 3× SQL",
            extra={**extra, "peak_rss_mib": round(fresh_mib, 1), "steps_s": fresh_steps},
        ),
        Result(
            "compact",
            "peak memory, fresh spark-submit (Python + JVM)",
            fresh_mib,
            "MiB",
            higher_is_better=False,
            extra={"rows": rows},
        ),
    ]
