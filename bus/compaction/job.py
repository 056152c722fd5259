"""The compaction and archive job (PySpark), and its `spark-submit` entry point.

    spark-submit bus/compaction/job.py --dsn postgresql://user@host:5432/db --schema bus \
        [--archive DIR_OR_URI] [--topics a,b] [--master local[*]]

What is history: records below their partition's low watermark (view
`partition_watermarks`) that are

- on `cleanup="delete"` topics with a retention: past the retention (the
  contiguous prefix of the partition that is; a topic without retention keeps
  everything);
- on `cleanup="compact"` topics: superseded by a newer record with the same key
  (and, if the topic has a retention, older than it), or the newest record of
  its key when that is a tombstone (null payload) older than the topic's
  tombstone retention (default 24 h, Kafka's `delete.retention.ms`). Keyless
  records of compact topics are never removed. The survivors stay in the log
  at their original offsets.

A run goes through recorded steps, each idempotent, so a run interrupted at
any point is finished by the next job exactly as it would have finished:

1. **plan** (one transaction): a `compaction_runs` row and one
   `compaction_plan` row per partition, with the range [lo, hi) and the cut-off
   times fixed now.
2. **stage** (in PostgreSQL, one statement): the newest record per key
   becomes the keep-set in the UNLOGGED `compaction_keep`, then ANALYZEd. Only
   key columns are involved, and a hash aggregate inside the database costs
   far less than shipping them to Spark over JDBC.
3. **archive** (the Spark pass): PostgreSQL sends only the removable rows
   (view `compaction_removable`, payloads as bytea), Spark writes Parquet
   partitioned by topic and date, files are moved to names fixed by the run.
4. **delete**: per partition, one transaction locks the partition row
   (`FOR UPDATE`), re-computes the watermark, deletes set-based only below it,
   moves `log_start` to the first offset still present and marks the plan row
   done. Partitions are deleted by a few connections side by side.
5. **bookkeeping**: totals on the run row, the keep-set dropped.

The steps live beside this module: `archive.py` (the Spark pass and the
files), `deletes.py` (the delete transactions), `driver.py` (what they
share). `CHECKPOINTS` names the moments where a crash leaves a run half
done; `run_compaction(checkpoint=...)` is told of each (the tests crash the
job there).

If the watermark moves back between the archive and the delete (an admin
reset, a new `earliest` group), the delete keeps those records (it never
removes at or above the re-checked watermark) although the archive already
holds them; the plan row records the lower `cut`, and the rows the run
archived at or above it are written to `compaction_archived`. A later run
deletes them without archiving them again (the view leaves them out), so
every row is archived once; an entry is dropped once its row is gone.

Progress: the open run's row in `compaction_runs` carries its stage and
counts as the job goes (at most once a second), for `bus compact --status`.
The Spark session (when the job starts one) is created in a background
thread while PostgreSQL plans and stages the run.

A retention cleaner running in bus processes (`cleaner_interval`) also
deletes history of delete topics, without archiving; rows it removed first
are simply absent from the archive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import asyncpg  # noqa: E402

from bus.compaction.archive import archive_run, default_archive_root, normalize_root  # noqa: E402
from bus.compaction.deletes import delete_run  # noqa: E402
from bus.compaction.driver import CheckpointFn, Driver, Progress, ProgressFn  # noqa: E402
from bus.compaction.spark import jdbc_target, spark_session  # noqa: E402
from storage.compaction import sql  # noqa: E402
from storage.errors import BusError  # noqa: E402
from storage.names import validate_name, validate_schema  # noqa: E402

__all__ = [
    "CHECKPOINTS",
    "CompactionBusyError",
    "CompactionReport",
    "PartitionOutcome",
    "Progress",
    "run_compaction",
]

#: The moments where a crash leaves a run half done: the archive's files are in place but not
#: recorded; one partition is deleted; every partition is deleted but the run is not finished.
CHECKPOINTS: tuple[str, ...] = ("after_archive", "mid_delete", "before_bookkeeping")
DEFAULT_TOMBSTONE_RETENTION = 24 * 3600.0


class CompactionBusyError(BusError):
    """Another compaction job holds this schema's compaction lock."""


@dataclass(frozen=True)
class PartitionOutcome:
    """What a run did to one partition."""

    topic: str
    partition: str
    cleanup: str
    lo: int
    hi: int
    cut: int | None
    scanned: int
    kept: int
    archived: int
    removed: int
    log_start_after: int | None


@dataclass(frozen=True)
class CompactionReport:
    """The result of `run_compaction` (also recorded in `compaction_runs` / `compaction_plan`)."""

    run_id: int
    resumed: bool
    attempts: int
    archive_root: str
    partitions: list[PartitionOutcome]
    rows_scanned: int
    rows_kept: int
    rows_archived: int
    rows_removed: int
    archive_files: list[str]
    seconds: float
    # Seconds per step of this attempt (session = waiting for Spark to start).
    timings: dict[str, float] = field(default_factory=dict)


def run_compaction(
    dsn: str,
    schema: str = "bus",
    *,
    spark: Any = None,
    master: str | None = None,
    archive: str | None = None,
    topics: Sequence[str] | None = None,
    progress: ProgressFn | None = None,
    default_tombstone_retention: float = DEFAULT_TOMBSTONE_RETENTION,
    jdbc_jar: str | None = None,
    checkpoint: CheckpointFn | None = None,
) -> CompactionReport:
    """Run (or resume) one compaction run; blocking: from async code call it in a thread.

    `spark`: a SparkSession to reuse (else one is started on `master`, default
    `local[*]`). `archive`: directory or URI (default `$BUS_HOME/archive`);
    a resumed run keeps the root it was planned with. `topics`: only these.
    `checkpoint(point)` is called at each of `CHECKPOINTS`; what it raises
    stops the run there, unfinished, as a crash would.
    """
    validate_schema(schema)
    if topics is not None:
        topics = [validate_name(t, "topic name") for t in topics]
    jdbc = jdbc_target(dsn, schema)
    root = normalize_root(archive or default_archive_root())
    starter: ThreadPoolExecutor | None = None
    if spark is not None:
        session: Callable[[], Any] = lambda: spark  # noqa: E731 - a ready session
    else:
        # Spark starts (JVM, session) while PostgreSQL plans and stages the
        # run: only the archive step waits for it.
        starter = ThreadPoolExecutor(1, thread_name_prefix="spark-start")
        session = starter.submit(spark_session, master, jdbc_jar_path=jdbc_jar).result
    loop = asyncio.new_event_loop()
    try:
        driver = Driver(loop, session, dsn, schema, jdbc, progress, checkpoint)
        return _run(driver, root, list(topics) if topics is not None else None, default_tombstone_retention)
    finally:
        loop.close()
        if starter is not None:
            starter.shutdown(wait=True)


def _run(driver: Driver, root: str, topics: list[str] | None, tombstone_default: float) -> CompactionReport:
    """Hold the schema's compaction lock for the run; the driver's connection closes after."""
    started = time.monotonic()
    conn = driver.connect()
    try:
        if not driver.q(conn.fetchval(sql.TRY_LOCK, sql.COMPACTION_LOCK_KEY)):
            raise CompactionBusyError(
                f"another compaction job is running on schema {driver.schema!r}; wait for it to finish"
            )
        try:
            run_id, resumed, partitions = _open_run(driver, root, topics, tombstone_default)
            _finish_run(driver, run_id, partitions)
            return _report(driver, run_id, resumed, time.monotonic() - started)
        finally:
            # A lost connection already released the session lock; do not
            # hide the original error behind a second one.
            if not conn.is_closed():
                driver.q(conn.fetchval(sql.UNLOCK, sql.COMPACTION_LOCK_KEY))
    finally:
        if not conn.is_closed():
            driver.q(conn.close())


def _open_run(
    driver: Driver, root: str, topics: list[str] | None, tombstone_default: float
) -> tuple[int, bool, int]:
    """The open run (resumed), or a new one planned now; returns (run id, resumed, partitions planned)."""
    t = time.perf_counter()
    conn = driver.conn
    run = driver.q(conn.fetchrow(sql.SELECT_OPEN_RUN))
    resumed = run is not None
    if run is None:
        run = driver.q(_plan(conn, root, topics, tombstone_default))
    else:
        driver.q(conn.execute(sql.BUMP_ATTEMPTS, run["id"]))
        if run["archive_root"] != root:
            driver.log.info("compaction_resume_keeps_archive", run=run["id"], archive=run["archive_root"])
    run_id = int(run["id"])
    driver.run_id = run_id
    driver.log = driver.log.bind(run=run_id)
    plan = driver.q(conn.fetch(sql.SELECT_PLAN, run_id))
    what = f"run {run_id}: {len(plan)} partitions" + (" (resumed)" if resumed else "")
    driver.progress(Progress("plan", what, total=len(plan)))
    driver.log.info("compaction_run", status=run["status"], partitions=len(plan), resumed=resumed)
    driver.lap("plan", t)
    return run_id, resumed, len(plan)


async def _plan(
    conn: asyncpg.Connection, root: str, topics: list[str] | None, tombstone_default: float
) -> asyncpg.Record:
    """One transaction: the run row and a plan row per partition, ranges and cut-offs fixed now."""
    async with conn.transaction():
        run = await conn.fetchrow(sql.INSERT_RUN, root, topics)
        assert run is not None  # INSERT ... RETURNING always returns the row
        await conn.execute(sql.INSERT_PLAN, run["id"], topics, tombstone_default)
        await conn.execute(sql.FORGET_GONE_ARCHIVED)
    await conn.execute(sql.ANALYZE_PLAN)
    return run


def _finish_run(driver: Driver, run_id: int, partitions: int) -> None:
    """Take the run from its recorded status through stage, archive and delete to done."""
    conn = driver.conn
    run = driver.q(conn.fetchrow(sql.SELECT_RUN, run_id))
    status, root = run["status"], run["archive_root"]
    t = time.perf_counter()
    if status == "planned":
        _stage(driver, run_id)
        driver.q(conn.execute(sql.SET_RUN_STATUS, run_id, "staged"))
        status = "staged"
        t = driver.lap("stage", t)
    if status == "staged":
        if partitions:
            archive_run(driver, run_id, root)
        else:  # nothing is history yet: no Spark work at all
            driver.q(conn.execute(sql.SET_ARCHIVE_FILES, run_id, []))
        status = "archived"
        t = driver.lap("archive", t)
    if status == "archived":
        if driver.q(conn.fetchval(sql.KEEP_MISMATCH, run_id)):
            # The UNLOGGED keep-set lost rows (server crash): rebuild it,
            # deterministically the same, before anything is deleted.
            driver.log.warning("compaction_keep_set_rebuilt")
            _stage(driver, run_id)
        delete_run(driver, run_id)
        t = driver.lap("delete", t)
        driver.checkpoint("before_bookkeeping")
        driver.q(conn.execute(sql.CLEAR_KEEP, run_id))
        driver.q(conn.fetchrow(sql.FINISH_RUN, run_id))
        driver.lap("finish", t)


def _stage(driver: Driver, run_id: int) -> None:
    """The keep-set: the newest record per key, computed inside PostgreSQL, then ANALYZEd."""
    conn = driver.conn
    driver.q(conn.execute(sql.CLEAR_KEEP, run_id))
    driver.progress(Progress("stage", "newest record per key (in PostgreSQL)"))
    status = driver.q(conn.execute(sql.STAGE_KEEP, run_id))
    driver.q(conn.execute(sql.ANALYZE_KEEP))
    pending = int(status.split()[-1])
    driver.progress(Progress("stage", "keep-set written", done=pending, total=pending))


def _report(driver: Driver, run_id: int, resumed: bool, seconds: float) -> CompactionReport:
    """The run's report from its rows; the last progress event."""
    run = driver.q(driver.conn.fetchrow(sql.SELECT_RUN, run_id))
    plan = driver.q(driver.conn.fetch(sql.SELECT_PLAN, run_id))
    parts = [
        PartitionOutcome(
            topic=r["topic"],
            partition=r["partition"],
            cleanup=r["cleanup"],
            lo=r["lo"],
            hi=r["hi"],
            cut=r["cut"],
            scanned=int(r["rows_scanned"] or 0),
            kept=int(r["keep_rows"] or 0),
            archived=int(r["archived_rows"] or 0),
            removed=int(r["removed_rows"] or 0),
            log_start_after=r["log_start_after"],
        )
        for r in plan
    ]
    report = CompactionReport(
        run_id=run_id,
        resumed=resumed,
        attempts=int(run["attempts"]),
        archive_root=run["archive_root"],
        partitions=parts,
        rows_scanned=sum(p.scanned for p in parts),
        rows_kept=sum(p.kept for p in parts),
        rows_archived=sum(p.archived for p in parts),
        rows_removed=sum(p.removed for p in parts),
        archive_files=list(run["archive_files"]),
        seconds=seconds,
        timings=dict(driver.timings),
    )
    counts = {
        "scanned": report.rows_scanned,
        "archived": report.rows_archived,
        "removed": report.rows_removed,
    }
    driver.progress(Progress("done", f"run {run_id} done", counts=counts))
    driver.log.info(
        "compaction_done",
        archived=report.rows_archived,
        removed=report.rows_removed,
        seconds=round(seconds, 2),
    )
    return report


def main(argv: Sequence[str] | None = None, checkpoint: CheckpointFn | None = None) -> int:
    """The `spark-submit` entry point; prints a one-line summary, exit code 0 on success."""
    main_at = time.time()
    parser = argparse.ArgumentParser(description="Archive and compact the bus's history (PySpark).")
    parser.add_argument(
        "--dsn", default=os.environ.get("BUS_DSN"), help="postgresql:// DSN (default $BUS_DSN)"
    )
    parser.add_argument("--schema", default=os.environ.get("BUS_SCHEMA", "bus"))
    parser.add_argument(
        "--archive", default=None, help="archive directory or URI (default $BUS_HOME/archive)"
    )
    parser.add_argument("--topics", default=None, help="comma-separated topic names (default: all)")
    parser.add_argument("--master", default=None, help="Spark master when not given by spark-submit")
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("--dsn (or BUS_DSN) is required")
    topics = [t for t in args.topics.split(",") if t] if args.topics else None
    report = run_compaction(
        args.dsn, args.schema, master=args.master, archive=args.archive, topics=topics, checkpoint=checkpoint
    )
    sys.stdout.write(
        f"run {report.run_id}: scanned {report.rows_scanned}, archived {report.rows_archived}, "
        f"removed {report.rows_removed}, {len(report.archive_files)} files, {report.seconds:.1f}s\n"
    )
    # Where the time went, for benchmarks: `main_at` (epoch seconds) is when
    # Python got control from spark-submit, the rest are seconds per step.
    sys.stdout.write("timings " + json.dumps({"main_at": main_at, **report.timings}) + "\n")
    return 0


def exit_with(run: Callable[[], int]) -> None:
    """End the spark-submit driver process with `run()`'s exit code, 1 when it raised.

    The exit code is decided here, explicitly: spark-submit reports the
    Python process's code, and a failed run must never look like success
    (interpreter shutdown with a Py4J gateway and the session's start-up
    thread around was seen to end with 0). os._exit skips that shutdown.
    """
    try:
        code = run()
    except BaseException:  # noqa: BLE001 - reported, and the exit code says so
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_with(main)
