"""The Parquet archive: where a run's files go, and how they get there exactly once.

Spark writes a run's rows under `<root>/_staging/run-<id>/` (partitioned by
`topic=` and `date=`); the job then moves every file to
`<root>/topic=<t>/date=<d>/run-<id>-<n>.parquet`, `n` numbering the staged
files in sorted order. Names depend only on the run, so a run resumed after a
crash first deletes whatever an earlier attempt of the same run left
(`run-<id>-*`) and rewrites: an archived row never appears twice.

File operations go through Hadoop's FileSystem API, so the root may be a
local directory or any URI Spark can write (`file:`, `hdfs:`, `s3a:`, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
