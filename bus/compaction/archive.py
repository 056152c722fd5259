"""The Parquet archive: where a run's files go, and how they get there exactly once.

Spark writes a run's rows under `<root>/_staging/run-<id>/` (partitioned by
`topic=` and `date=`); the job then moves every file to
`<root>/topic=<t>/date=<d>/run-<id>-<n>.parquet`, `n` numbering the staged
files in sorted order. Names depend only on the run, so a run resumed after a
crash first deletes whatever an earlier attempt of the same run left
(`run-<id>-*`) and rewrites: an archived row never appears twice.

File operations go through Hadoop's FileSystem API, so the root may be a
local directory or any URI Spark can write (`file:`, `hdfs:`, `s3a:`, ...).

`archive_run` is the run's one Spark pass: PostgreSQL sends only the
removable rows (view `compaction_removable`), read split by partition and
offset range, about equal spans of the plan, never by heap position
(`messages` may be a partitioned table, whose ctids are per leaf).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.compaction.driver import Driver, Progress
from storage.compaction import sql

FETCH_SIZE = 10_000
# The JDBC read is split into offset spans: a few per executor core, none
# smaller than this many planned offsets (each task is one query;
# BUS_COMPACT_SPLIT_ROWS overrides it).
TASKS_PER_SLOT = 2
MIN_ROWS_PER_TASK = int(os.environ.get("BUS_COMPACT_SPLIT_ROWS") or 50_000)


def default_archive_root() -> str:
    """`$BUS_HOME/archive` (BUS_HOME defaults to ./.bus), as an absolute path."""
    return str(Path(os.environ.get("BUS_HOME", ".bus")).expanduser().resolve() / "archive")


def normalize_root(root: str) -> str:
    """A URI stays as given; a plain path becomes absolute (the job may run elsewhere than the CLI)."""
    if "://" in root or root.startswith("file:"):
        return root.rstrip("/")
    return str(Path(root).expanduser().resolve())


def staging_dir(root: str, run_id: int) -> str:
    """Where Spark writes a run's files before they are moved into place."""
    return f"{root}/_staging/run-{run_id}"


class ArchiveFiles:
    """Hadoop FileSystem operations on the archive root (through the Spark JVM)."""

    def __init__(self, spark: Any, root: str) -> None:
        self._jvm = spark._jvm
        self._conf = spark._jsc.hadoopConfiguration()
        self.root = root
        self._fs = self._path(root).getFileSystem(self._conf)

    def _path(self, path: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(path)

    def delete(self, path: str) -> None:
        """Delete a file or directory tree (missing is fine)."""
        p = self._path(path)
        if self._fs.exists(p):
            self._fs.delete(p, True)

    def remove_run_files(self, run_id: int) -> int:
        """Delete the final files an earlier attempt of run `run_id` left; returns how many."""
        statuses = self._fs.globStatus(self._path(f"{self.root}/topic=*/date=*/run-{run_id}-*.parquet"))
        count = 0
        for status in statuses or []:
            self._fs.delete(status.getPath(), False)
            count += 1
        return count

    def publish_staged(self, run_id: int) -> list[str]:
        """Move the staged Parquet files of run `run_id` into place; returns their final paths."""
        staged = staging_dir(self.root, run_id)
        base = self._path(staged)
        if not self._fs.exists(base):
            return []
        found: list[tuple[str, str]] = []  # (relative dir, full path)
        it = self._fs.listFiles(base, True)
        prefix = self._fs.makeQualified(base).toString().rstrip("/") + "/"
        while it.hasNext():
            path = it.next().getPath()
            name = path.getName()
            if not name.endswith(".parquet") or name.startswith((".", "_")):
                continue
            full = path.toString()
            rel_dir = full[len(prefix) :].rsplit("/", 1)[0] if full.startswith(prefix) else ""
            found.append((rel_dir, full))
        found.sort()
        final: list[str] = []
        for n, (rel_dir, full) in enumerate(found):
            target_dir = self._path(f"{self.root}/{rel_dir}")
            self._fs.mkdirs(target_dir)
            target = f"{self.root}/{rel_dir}/run-{run_id}-{n:05d}.parquet"
            if not self._fs.rename(self._path(full), self._path(target)):
                raise OSError(f"could not move archive file {full} to {target}")
            final.append(target)
        self.delete(staged)
        return final


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


def archive_run(driver: Driver, run_id: int, root: str) -> None:
    """Write the run's removable rows to Parquet under `root`, exactly once, and record the files."""
    files = ArchiveFiles(driver.spark, root)
    # Whatever an earlier attempt of this run left is incomplete or
    # unrecorded: start the run's archive over (nothing is deleted yet).
    removed = files.remove_run_files(run_id)
    files.delete(staging_dir(root, run_id))
    if removed:
        driver.log.info("compaction_archive_restarted", stale_files=removed)
    driver.progress(Progress("archive", "archiving removable rows (Spark)"))
    t0 = time.perf_counter()
    out = _removable_rows(driver, run_id)
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
    staged = driver.spark.read.schema(out.schema).parquet(staging_dir(root, run_id))
    counts = staged.groupBy("partition_id").count().collect()
    t2 = time.perf_counter()
    per_partition = [(run_id, int(r["partition_id"]), int(r["count"])) for r in counts]
    driver.q(driver.conn.executemany(sql.RECORD_ARCHIVED, per_partition))
    driver.q(driver.conn.execute(sql.ZERO_UNARCHIVED, run_id))
    final = files.publish_staged(run_id)
    driver.checkpoint("after_archive")
    driver.q(driver.conn.execute(sql.SET_ARCHIVE_FILES, run_id, final))
    total = sum(n for _, _, n in per_partition)
    message = f"{total} rows in {len(final)} files"
    driver.progress(Progress("archive", message, done=total, total=total, counts={"archived": total}))
    driver.log.info(
        "compaction_archived",
        rows=total,
        files=len(final),
        write_seconds=round(t1 - t0, 2),
        count_seconds=round(t2 - t1, 2),
        publish_seconds=round(time.perf_counter() - t2, 2),
    )


def _removable_rows(driver: Driver, run_id: int) -> Any:
    """The DataFrame of what the run archives: the removable rows with their topic, partition and date."""
    from pyspark.sql import functions as F

    # Run, topic and partition are the same for every row of a partition:
    # they come from the plan through a broadcast join instead of crossing
    # JDBC two million times.
    plan = driver.q(driver.conn.fetch(sql.SELECT_PLAN, run_id))
    partitions = driver.spark.createDataFrame(
        [(run_id, int(r["partition_id"]), r["topic"], r["partition"]) for r in plan],
        "run_id long, partition_id long, topic string, partition string",
    )
    rows = _read(driver, "compaction_removable", plan).select(
        "partition_id", "offset", "key", "headers", "payload", "created_at"
    )
    columns = [
        "run_id",
        "partition_id",
        "topic",
        "partition",
        "offset",
        "key",
        "headers",
        "payload",
        "created_at",
    ]
    joined = rows.join(F.broadcast(partitions), "partition_id").select(*columns)
    return joined.withColumn("date", F.to_date("created_at"))


def _read(driver: Driver, view: str, plan: Sequence[Any]) -> Any:
    """`view` over JDBC, one Spark task per span of the plan's pending ranges."""
    ranges = [(int(r["partition_id"]), int(r["lo"]), int(r["hi"])) for r in plan if r["done_at"] is None]
    total = sum(hi - lo for _, lo, hi in ranges)
    slots = int(driver.spark.sparkContext.defaultParallelism)
    tasks = max(1, min(slots * TASKS_PER_SLOT, -(-total // MIN_ROWS_PER_TASK)))
    predicates = [sql.split_predicate(pieces) for pieces in split_ranges(ranges, tasks)]
    url, props = driver.jdbc
    return driver.spark.read.jdbc(
        url, view, predicates=predicates, properties={**props, "fetchsize": str(FETCH_SIZE)}
    )
