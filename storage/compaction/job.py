"""The compaction and archive job (PySpark), and its `spark-submit` entry point.

    spark-submit storage/compaction/job.py --dsn postgresql://user@host:5432/db --schema bus \
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

Spark reads the removable rows split by partition and offset range, about
equal spans of the plan, never by heap position: `messages` may be a
partitioned table (segments), whose ctids are per leaf.

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
from typing import Any, Literal

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import asyncpg  # noqa: E402

from storage import db  # noqa: E402
from storage.compaction import sql  # noqa: E402
from storage.compaction.archive import (  # noqa: E402
    ArchiveFiles,
    default_archive_root,
    normalize_root,
    staging_dir,
)
from storage.compaction.spark import jdbc_target, spark_session  # noqa: E402
from storage.errors import BusError, ValidationError  # noqa: E402
from storage.logs import get_logger  # noqa: E402
from storage.names import validate_name, validate_schema  # noqa: E402

log = get_logger(__name__)

CrashPoint = Literal["after_archive", "mid_delete", "before_bookkeeping"]
CRASH_POINTS: tuple[str, ...] = ("after_archive", "mid_delete", "before_bookkeeping")
DEFAULT_TOMBSTONE_RETENTION = 24 * 3600.0
FETCH_SIZE = 10_000
# Partitions deleted side by side (each in its own transaction): PostgreSQL
# spends the delete's time in the heap, one core per backend.
DELETE_CONNECTIONS = 2


# The run's stage is written to its row at most this often (seconds).
PROGRESS_EVERY = 1.0
# The JDBC read is split into offset spans: a few per executor core, none
# smaller than this many planned offsets (each task is one query;
# BUS_COMPACT_SPLIT_ROWS overrides it).
TASKS_PER_SLOT = 2
MIN_ROWS_PER_TASK = int(os.environ.get("BUS_COMPACT_SPLIT_ROWS") or 50_000)


def split_ranges(
    ranges: Sequence[tuple[int, int, int]], tasks: int
) -> list[list[tuple[int, int | None, int | None]]]:
    """Cut the planned [lo, hi) ranges of partitions into `tasks` spans of about equal size.

    Each span is a list of (partition_id, from, below) pieces; None stands for
    "the planned bound" (the view applies the plan's own lo and hi), so a
    partition that is not cut appears whole. Every planned offset lands in
    exactly one span, whatever the storage layout of `messages`.
    """
    ranges = [r for r in ranges if r[2] > r[1]]
    if not ranges:
        return []
    tasks = max(1, tasks)
    total = sum(hi - lo for _, lo, hi in ranges)
    size = -(-total // tasks)
    spans: list[list[tuple[int, int | None, int | None]]] = [[]]
    room = size
    for pid, lo, hi in ranges:
        start = lo
        while start < hi:
            if room == 0:
                spans.append([])
                room = size
            end = min(hi, start + room)
            spans[-1].append((pid, None if start == lo else start, None if end == hi else end))
            room -= end - start
            start = end
    return spans


class CompactionCrash(BusError):
    """An injected crash (`crash_at=` or `BUS_COMPACT_CRASH_AT`): the run stops there, unfinished."""


class CompactionBusyError(BusError):
    """Another compaction job holds this schema's compaction lock."""


@dataclass(frozen=True)
class Progress:
    """A progress event: `stage` is plan|stage|archive|delete|done; counts so far in `counts`."""

    stage: str
    message: str
    done: int = 0
    total: int | None = None
    counts: dict[str, int] = field(default_factory=dict)


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


ProgressFn = Callable[[Progress], None]


def run_compaction(
    dsn: str,
    schema: str = "bus",
    *,
    spark: Any = None,
    master: str | None = None,
    archive: str | None = None,
    topics: Sequence[str] | None = None,
    crash_at: str | None = None,
    progress: ProgressFn | None = None,
    default_tombstone_retention: float = DEFAULT_TOMBSTONE_RETENTION,
    jdbc_jar: str | None = None,
) -> CompactionReport:
    """Run (or resume) one compaction run; blocking: from async code call it in a thread.

    `spark`: a SparkSession to reuse (else one is started on `master`, default
    `local[*]`). `archive`: directory or URI (default `$BUS_HOME/archive`);
    a resumed run keeps the root it was planned with. `topics`: only these.
    `crash_at`: one of `CRASH_POINTS`, raises CompactionCrash there (tests);
    `BUS_COMPACT_CRASH_AT` does the same from outside.
    """
    validate_schema(schema)
    if topics is not None:
        topics = [validate_name(t, "topic name") for t in topics]
    crash_at = crash_at or os.environ.get("BUS_COMPACT_CRASH_AT") or None
    if crash_at is not None and crash_at not in CRASH_POINTS:
        raise ValidationError(f"crash_at must be one of {CRASH_POINTS}, not {crash_at!r}")
    url, props = jdbc_target(dsn, schema)
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
        job = _Job(loop, session, dsn, schema, url, props, progress, crash_at, default_tombstone_retention)
        return job.run(root, list(topics) if topics is not None else None)
    finally:
        loop.close()
        if starter is not None:
            starter.shutdown(wait=True)


class _Job:
    """One job execution: a driver connection, the Spark session, the open run."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        spark: Callable[[], Any],
        dsn: str,
        schema: str,
        url: str,
        props: dict[str, str],
        progress: ProgressFn | None,
        crash_at: str | None,
        tombstone_default: float,
    ) -> None:
        self.loop = loop
        self._spark = spark
        self._spark_ready: Any = None
        self.run_id: int | None = None
        self.timings: dict[str, float] = {}
        self._stage_written: tuple[str, float] | None = None
        self.dsn = dsn
        self.schema = schema
        self.url = url
        self.props = props
        self.on_progress = progress or (lambda _p: None)
        self.crash_at = crash_at
        self.tombstone_default = tombstone_default
        self.conn: asyncpg.Connection | None = None
        self.log = log.bind(schema=schema)

    @property
    def spark(self) -> Any:
        """The Spark session, waiting for it to finish starting the first time."""
        if self._spark_ready is None:
            t0 = time.perf_counter()
            self._spark_ready = self._spark()
            self.timings["session_wait"] = round(time.perf_counter() - t0, 2)
        return self._spark_ready

    def _record_due(self, event: Progress) -> bool:
        """Whether to write this event to the run row: a new stage, the end, or a second since the last write."""
        if self.run_id is None:
            return False
        now = time.monotonic()
        last = self._stage_written
        if last is None or last[0] != event.stage or event.stage == "done" or now - last[1] >= PROGRESS_EVERY:
            self._stage_written = (event.stage, now)
            return True
        return False

    def _stage_args(self, event: Progress) -> tuple[Any, ...]:
        return (self.run_id, event.stage, event.done, event.total, event.message[:200])

    def progress(self, event: Progress) -> None:
        """Tell the caller, and record the run's stage in `compaction_runs` (`bus compact --status`)."""
        self.on_progress(event)
        if self._record_due(event):
            assert self.conn is not None
            self.q(self.conn.execute(sql.SET_STAGE, *self._stage_args(event)))

    async def progress_async(self, conn: asyncpg.Connection, event: Progress) -> None:
        """`progress` from inside the job's event loop, on the connection at hand."""
        self.on_progress(event)
        if self._record_due(event):
            await conn.execute(sql.SET_STAGE, *self._stage_args(event))

    def _lap(self, step: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[step] = round(self.timings.get(step, 0.0) + now - since, 2)
        return now

    def q(self, coro: Any) -> Any:
        """Run one driver-side database call on the job's private event loop."""
        with db.translate_errors():
            return self.loop.run_until_complete(coro)

    def _crash(self, point: str) -> None:
        if self.crash_at == point:
            self.log.warning("compaction_crash_injected", point=point)
            raise CompactionCrash(f"injected crash at {point}; run the job again to finish the run")

    # -- the run --------------------------------------------------------------------

    def run(self, root: str, topics: list[str] | None) -> CompactionReport:
        started = time.monotonic()
        self.conn = self.q(db.connect(self.dsn, self.schema))
        conn = self.conn
        try:
            if not self.q(conn.fetchval(sql.TRY_LOCK, sql.COMPACTION_LOCK_KEY)):
                raise CompactionBusyError(
                    f"another compaction job is running on schema {self.schema!r}; wait for it to finish"
                )
            try:
                return self._run_locked(root, topics, started)
            finally:
                # A lost connection already released the session lock; do not
                # hide the original error behind a second one.
                if not conn.is_closed():
                    self.q(conn.fetchval(sql.UNLOCK, sql.COMPACTION_LOCK_KEY))
        finally:
            if not conn.is_closed():
                self.q(conn.close())

    def _run_locked(self, root: str, topics: list[str] | None, started: float) -> CompactionReport:
        conn = self.conn
        assert conn is not None
        t = time.perf_counter()
        run = self.q(conn.fetchrow(sql.SELECT_OPEN_RUN))
        resumed = run is not None
        if run is None:
            run = self.q(self._plan(root, topics))
        else:
            self.q(conn.execute(sql.BUMP_ATTEMPTS, run["id"]))
            if run["archive_root"] != root:
                self.log.info("compaction_resume_keeps_archive", run=run["id"], archive=run["archive_root"])
        run_id = int(run["id"])
        self.run_id = run_id
        root = run["archive_root"]
        self.log = self.log.bind(run=run_id)
        status = run["status"]
        plan = self.q(conn.fetch(sql.SELECT_PLAN, run_id))
        self.progress(
            Progress(
                "plan",
                f"run {run_id}: {len(plan)} partitions" + (" (resumed)" if resumed else ""),
                total=len(plan),
            )
        )
        self.log.info("compaction_run", status=status, partitions=len(plan), resumed=resumed)
        t = self._lap("plan", t)

        if status == "planned":
            self._stage(run_id)
            self.q(conn.execute(sql.SET_RUN_STATUS, run_id, "staged"))
            status = "staged"
            t = self._lap("stage", t)
        if status == "staged":
            if plan:
                self._archive(run_id, root)
            else:  # nothing is history yet: no Spark work at all
                self.q(conn.execute(sql.SET_ARCHIVE_FILES, run_id, []))
            status = "archived"
            t = self._lap("archive", t)
        if status == "archived":
            if self.q(conn.fetchval(sql.KEEP_MISMATCH, run_id)):
                # The UNLOGGED keep-set lost rows (server crash): rebuild it,
                # deterministically the same, before anything is deleted.
                self.log.warning("compaction_keep_set_rebuilt")
                self._stage(run_id)
            self._delete(run_id)
            t = self._lap("delete", t)
            self._crash("before_bookkeeping")
            self.q(conn.execute(sql.CLEAR_KEEP, run_id))
            self.q(conn.fetchrow(sql.FINISH_RUN, run_id))
            self._lap("finish", t)
        return self._report(run_id, resumed, time.monotonic() - started)

    async def _plan(self, root: str, topics: list[str] | None) -> asyncpg.Record:
        conn = self.conn
        assert conn is not None
        async with conn.transaction():
            run = await conn.fetchrow(sql.INSERT_RUN, root, topics)
            assert run is not None  # INSERT ... RETURNING always returns the row
            await conn.execute(sql.INSERT_PLAN, run["id"], topics, self.tombstone_default)
            await conn.execute(sql.FORGET_GONE_ARCHIVED)
        await conn.execute(sql.ANALYZE_PLAN)
        return run

    # -- the keep-set, and how Spark splits its read -----------------------------------

    def _predicates(self, plan: Sequence[Any]) -> list[str]:
        """JDBC predicates splitting the run's planned ranges into about equal offset spans, one per Spark task."""
        ranges = [(int(r["partition_id"]), int(r["lo"]), int(r["hi"])) for r in plan if r["done_at"] is None]
        return [sql.split_predicate(pieces) for pieces in split_ranges(ranges, self._tasks(ranges))]

    def _tasks(self, ranges: Sequence[tuple[int, int, int]]) -> int:
        total = sum(hi - lo for _, lo, hi in ranges)
        slots = int(self.spark.sparkContext.defaultParallelism)
        return max(1, min(slots * TASKS_PER_SLOT, -(-total // MIN_ROWS_PER_TASK)))

    def _read(self, view: str, plan: Sequence[Any]) -> Any:
        props = {**self.props, "fetchsize": str(FETCH_SIZE)}
        return self.spark.read.jdbc(self.url, view, predicates=self._predicates(plan), properties=props)

    def _stage(self, run_id: int) -> None:
        conn = self.conn
        assert conn is not None
        self.q(conn.execute(sql.CLEAR_KEEP, run_id))
        self.progress(Progress("stage", "newest record per key (in PostgreSQL)"))
        status = self.q(conn.execute(sql.STAGE_KEEP, run_id))
        self.q(conn.execute(sql.ANALYZE_KEEP))
        pending = int(status.split()[-1])
        self.progress(Progress("stage", "keep-set written", done=pending, total=pending))

    # -- the archive (the one Spark pass) ---------------------------------------------

    def _archive(self, run_id: int, root: str) -> None:
        from pyspark.sql import functions as F

        conn = self.conn
        assert conn is not None
        files = ArchiveFiles(self.spark, root)
        # Whatever an earlier attempt of this run left is incomplete or
        # unrecorded: start the run's archive over (nothing is deleted yet).
        removed = files.remove_run_files(run_id)
        files.delete(staging_dir(root, run_id))
        if removed:
            self.log.info("compaction_archive_restarted", stale_files=removed)
        self.progress(Progress("archive", "archiving removable rows (Spark)"))
        # Run, topic and partition are the same for every row of a partition:
        # they come from the plan through a broadcast join instead of crossing
        # JDBC two million times.
        plan = self.q(conn.fetch(sql.SELECT_PLAN, run_id))
        partitions = self.spark.createDataFrame(
            [(run_id, int(r["partition_id"]), r["topic"], r["partition"]) for r in plan],
            "run_id long, partition_id long, topic string, partition string",
        )
        rows = self._read("compaction_removable", plan).select(
            "partition_id", "offset", "key", "headers", "payload", "created_at"
        )
        out = (
            rows.join(F.broadcast(partitions), "partition_id")
            .select(
                "run_id",
                "partition_id",
                "topic",
                "partition",
                "offset",
                "key",
                "headers",
                "payload",
                "created_at",
            )
            .withColumn("date", F.to_date("created_at"))
        )
        t0 = time.perf_counter()
        # Payloads rarely repeat: a dictionary for them is built, found useless
        # and thrown away page after page; plain encoding skips that work.
        (
            out.write.mode("overwrite")
            .partitionBy("topic", "date")
            .option("parquet.enable.dictionary#payload", "false")
            .parquet(staging_dir(root, run_id))
        )
        t1 = time.perf_counter()
        # An explicit schema: a run with nothing to archive leaves no file to infer one from.
        counts = (
            self.spark.read.schema(out.schema)
            .parquet(staging_dir(root, run_id))
            .groupBy("partition_id")
            .count()
            .collect()
        )
        t2 = time.perf_counter()
        self.q(
            conn.executemany(
                sql.RECORD_ARCHIVED, [(run_id, int(r["partition_id"]), int(r["count"])) for r in counts]
            )
        )
        self.q(conn.execute(sql.ZERO_UNARCHIVED, run_id))
        final = files.publish_staged(run_id)
        self._crash("after_archive")
        self.q(conn.execute(sql.SET_ARCHIVE_FILES, run_id, final))
        total = sum(int(r["count"]) for r in counts)
        self.progress(
            Progress(
                "archive",
                f"{total} rows in {len(final)} files",
                done=total,
                total=total,
                counts={"archived": total},
            )
        )
        self.log.info(
            "compaction_archived",
            rows=total,
            files=len(final),
            write_seconds=round(t1 - t0, 2),
            count_seconds=round(t2 - t1, 2),
            publish_seconds=round(time.perf_counter() - t2, 2),
        )

    # -- deletes ------------------------------------------------------------------------

    def _delete(self, run_id: int) -> None:
        conn = self.conn
        assert conn is not None
        plan = self.q(conn.fetch(sql.SELECT_PLAN, run_id))
        pending = [r for r in plan if r["done_at"] is None]
        self.q(self._delete_side_by_side(run_id, pending))

    async def _delete_side_by_side(self, run_id: int, pending: list[asyncpg.Record]) -> None:
        """Delete the pending partitions, each in its own transaction, on up to DELETE_CONNECTIONS connections.

        Partitions are independent (each locks only its own partition row), so
        they may go side by side; the first failure stops the others after
        their current partition and is raised.
        """
        assert self.conn is not None
        todo = list(reversed(pending))
        done = removed_total = 0
        failed: list[BaseException] = []

        async def worker(conn: asyncpg.Connection) -> None:
            nonlocal done, removed_total
            while todo and not failed:
                row = todo.pop()
                try:
                    removed = await self._delete_partition(conn, run_id, int(row["partition_id"]))
                    done += 1
                    removed_total += removed
                    first = done == 1  # read before the await below lets the other worker count on
                    await self.progress_async(
                        conn,
                        Progress(
                            "delete",
                            f"{row['topic']}/{row['partition']}",
                            done=done,
                            total=len(pending),
                            counts={"removed": removed_total},
                        ),
                    )
                    if first:
                        self._crash("mid_delete")
                except BaseException as exc:
                    failed.append(exc)
                    raise

        extra: list[asyncpg.Connection] = []
        try:
            for _ in range(min(DELETE_CONNECTIONS, len(pending)) - 1):
                extra.append(await db.connect(self.dsn, self.schema))
            await asyncio.gather(*(worker(c) for c in [self.conn, *extra]), return_exceptions=True)
        finally:
            for c in extra:
                if not c.is_closed():
                    await c.close()
        if failed:
            raise failed[0]

    async def _delete_partition(self, conn: asyncpg.Connection, run_id: int, partition_id: int) -> int:
        """One transaction: lock the partition, re-check the watermark, delete below it, move log_start."""
        async with conn.transaction():
            plan = await conn.fetchrow(sql.SELECT_PLAN_ROW, run_id, partition_id)
            if plan is None or plan["done_at"] is not None:
                return 0
            part = await conn.fetchrow(sql.LOCK_PARTITION, partition_id)
            if part is None:  # the topic was deleted meanwhile: nothing left to remove
                await conn.execute(sql.MARK_PARTITION_DONE, run_id, partition_id, 0, None, None)
                return 0
            watermark = int(await conn.fetchval(sql.PARTITION_WATERMARK, partition_id))
            cut = min(int(plan["hi"]), watermark)
            if plan["cleanup"] == "delete":
                status = await conn.execute(sql.DELETE_RANGE, partition_id, plan["lo"], plan["hi"], watermark)
            else:
                expected = plan["keep_rows"]
                actual = await conn.fetchval(sql.KEEP_COUNT, run_id, partition_id)
                if expected is None or int(actual) != int(expected):
                    raise BusError(
                        f"compaction keep-set of partition {partition_id} is incomplete ({actual} of {expected} rows); "
                        "nothing was deleted, run the job again to rebuild it"
                    )
                status = await conn.execute(
                    sql.DELETE_COMPACTED,
                    run_id,
                    partition_id,
                    plan["lo"],
                    plan["hi"],
                    watermark,
                    plan["retention_cutoff"],
                )
            removed = int(status.split()[-1])
            if cut < int(plan["hi"]):
                # Archived but held back by the re-checked watermark: a later
                # run deletes these rows without archiving them again.
                await conn.execute(sql.HOLD_ARCHIVED, partition_id, cut)
            await conn.execute(sql.FORGET_ARCHIVED, partition_id)
            log_start = int(await conn.fetchval(sql.ADVANCE_LOG_START, partition_id))
            await conn.execute(sql.MARK_PARTITION_DONE, run_id, partition_id, removed, cut, log_start)
        if cut < int(plan["hi"]):
            self.log.warning(
                "compaction_watermark_moved_back", partition_id=partition_id, planned=plan["hi"], cut=cut
            )
        return removed

    # -- report ---------------------------------------------------------------------------

    def _report(self, run_id: int, resumed: bool, seconds: float) -> CompactionReport:
        conn = self.conn
        assert conn is not None
        run = self.q(conn.fetchrow(sql.SELECT_RUN, run_id))
        plan = self.q(conn.fetch(sql.SELECT_PLAN, run_id))
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
            timings=dict(self.timings),
        )
        self.progress(
            Progress(
                "done",
                f"run {run_id} done",
                counts={
                    "scanned": report.rows_scanned,
                    "archived": report.rows_archived,
                    "removed": report.rows_removed,
                },
            )
        )
        self.log.info(
            "compaction_done",
            archived=report.rows_archived,
            removed=report.rows_removed,
            seconds=round(seconds, 2),
        )
        return report


def main(argv: Sequence[str] | None = None) -> int:
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
    parser.add_argument("--crash-at", default=None, choices=CRASH_POINTS, help="testing: stop the run there")
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("--dsn (or BUS_DSN) is required")
    topics = [t for t in args.topics.split(",") if t] if args.topics else None
    report = run_compaction(
        args.dsn, args.schema, master=args.master, archive=args.archive, topics=topics, crash_at=args.crash_at
    )
    sys.stdout.write(
        f"run {report.run_id}: scanned {report.rows_scanned}, archived {report.rows_archived}, "
        f"removed {report.rows_removed}, {len(report.archive_files)} files, {report.seconds:.1f}s\n"
    )
    # Where the time went, for benchmarks: `main_at` (epoch seconds) is when
    # Python got control from spark-submit, the rest are seconds per step.
    sys.stdout.write("timings " + json.dumps({"main_at": main_at, **report.timings}) + "\n")
    return 0


if __name__ == "__main__":
    # The exit code is decided here, explicitly: spark-submit reports the
    # Python process's code, and a failed run must never look like success
    # (interpreter shutdown with a Py4J gateway and the session's start-up
    # thread around was seen to end with 0). os._exit skips that shutdown.
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - reported, and the exit code says so
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
