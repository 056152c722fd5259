"""`bus compact`: run the Spark compaction and archive job with a progress display, or show past runs.

The job itself is `job.py` beside it (also runnable with
`spark-submit bus/compaction/job.py`). Database and schema come from
`BUS_DSN` / `BUS_SCHEMA` like every command; without `BUS_DSN` the embedded
server under `$BUS_HOME` is used (it listens on TCP, which JDBC needs).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import bus
from storage import db
from storage.compaction import sql as compaction_sql
from storage.errors import BusError, ValidationError
from storage.logs import get_logger

log = get_logger(__name__)

_STAGES = (
    ("plan", "plan"),
    ("stage", "keep-set (keys)"),
    ("archive", "archive (Parquet)"),
    ("delete", "delete"),
)


async def _target() -> tuple[str, str]:
    """(dsn, schema) the job connects with, the migrations applied (connect does that).

    The job holds a session: an advisory lock for the whole run, Spark's JDBC connections opened on
    the schema. Through a transaction pooler it connects to `direct_dsn`, the server itself; its
    bookkeeping (runs, progress, sidecars) lands where the services behind the pooler read it.
    """
    async with bus.connect(cleaner_interval=0) as b:
        c = b.config
        if c.pooler != "transaction":
            return b.dsn, c.schema
        if not c.direct_dsn:
            raise ValidationError(
                "the compaction job holds a session (an advisory lock for the run, Spark's JDBC "
                "connections) that a transaction pooler cannot keep: set direct_dsn (BUS_DIRECT_DSN) "
                "to the PostgreSQL server itself"
            )
        return c.direct_dsn, c.schema


async def _runs(dsn: str, schema: str, limit: int = 20) -> tuple[list[Any], list[Any]]:
    """(recorded runs newest first, sidecars)."""
    conn = await db.connect(dsn, schema)
    try:
        runs = list(await conn.fetch(compaction_sql.SELECT_RUNS, limit))
        return runs, list(await conn.fetch(compaction_sql.SELECT_SIDECARS))
    finally:
        await conn.close()


def _progress_text(r: Any) -> str:
    """An open run's stage as the job last recorded it: `archive 3/8 (message)`."""
    if r["stage"] is None or r["status"] == "done":
        return "-"
    count = (
        ""
        if r["stage_done"] is None
        else f" {r['stage_done']:,}" + ("" if r["stage_total"] is None else f"/{r['stage_total']:,}")
    )
    return f"{r['stage']}{count} ({r['stage_message']}) at {r['updated_at']:%H:%M:%S}"


def sidecar_table(sidecars: list[Any]) -> Table:
    """Each `bus compact --every` process: schedule, state, next run, and its last run's outcome."""
    table = Table(
        "sidecar",
        "every",
        "master",
        "state",
        "next run",
        "ok",
        "failed",
        "last run",
        "outcome",
        "seconds",
        "archived",
        "removed",
        "error",
        "heartbeat",
        title="compaction sidecars",
    )
    for r in sidecars:
        table.add_row(
            r["name"],
            f"{r['every_seconds']:g}s",
            r["master"],
            r["state"],
            "-" if r["next_run_at"] is None else f"{r['next_run_at']:%Y-%m-%d %H:%M:%S}",
            str(r["runs_ok"]),
            str(r["runs_failed"]),
            "-" if r["last_run_id"] is None else str(r["last_run_id"]),
            r["last_outcome"] or "-",
            "-" if r["last_seconds"] is None else f"{r['last_seconds']:.1f}",
            "-" if r["last_archived"] is None else str(r["last_archived"]),
            "-" if r["last_removed"] is None else str(r["last_removed"]),
            (r["last_error"] or "-")[:80],
            f"{r['heartbeat_at']:%H:%M:%S}",
        )
    return table


def status_table(runs: list[Any]) -> Table:
    """The recorded runs, newest first."""
    table = Table(
        "run",
        "status",
        "planned",
        "finished",
        "attempts",
        "partitions",
        "scanned",
        "kept",
        "archived",
        "removed",
        "files",
        "archive",
        "progress",
        title="compaction runs",
    )
    for r in runs:
        table.add_row(
            str(r["id"]),
            r["status"],
            f"{r['planned_at']:%Y-%m-%d %H:%M:%S}",
            "-" if r["finished_at"] is None else f"{r['finished_at']:%H:%M:%S}",
            str(r["attempts"]),
            str(r["partitions"]),
            str(r["rows_scanned"]),
            str(r["rows_kept"]),
            str(r["rows_archived"]),
            str(r["rows_removed"]),
            str(r["files"]),
            r["archive_root"],
            _progress_text(r),
        )
    return table


def summary_table(report: Any) -> Table:
    """Per partition: policy, planned range, cut, rows scanned / kept / archived / removed, new log start."""
    table = Table(
        "topic",
        "partition",
        "cleanup",
        "range",
        "cut",
        "scanned",
        "kept",
        "archived",
        "removed",
        "log start",
        title=f"compaction run {report.run_id}" + (" (resumed)" if report.resumed else ""),
    )
    for p in report.partitions:
        table.add_row(
            p.topic,
            p.partition,
            p.cleanup,
            f"[{p.lo}, {p.hi})",
            "-" if p.cut is None else str(p.cut),
            str(p.scanned),
            str(p.kept),
            str(p.archived),
            str(p.removed),
            "-" if p.log_start_after is None else str(p.log_start_after),
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        "",
        "",
        str(report.rows_scanned),
        str(report.rows_kept),
        str(report.rows_archived),
        str(report.rows_removed),
        "",
    )
    return table


def compact_command(
    console: Console, master: str | None, archive: str | None, topics: list[str] | None, status: bool
) -> int:
    """Run the job (or with `status`, list recorded runs); returns the process exit code."""
    from bus.compaction import run_compaction

    try:
        dsn, schema = asyncio.run(_target())
        if status:
            runs, sidecars = asyncio.run(_runs(dsn, schema))
            console.print(status_table(runs))
            if sidecars:
                console.print(sidecar_table(sidecars))
            return 0
        columns = (
            SpinnerColumn(),
            TextColumn("{task.description:<20}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=False) as bar:
            tasks = {name: bar.add_task(label, total=None, start=False, info="") for name, label in _STAGES}
            current: list[str] = []

            def on_progress(event: Any) -> None:
                # Stages finish in order: starting one completes the previous.
                if event.stage in tasks:
                    task = tasks[event.stage]
                    if not current or current[-1] != event.stage:
                        for done in current:
                            bar.update(
                                tasks[done],
                                completed=bar.tasks[tasks[done]].total or 1,
                                total=bar.tasks[tasks[done]].total or 1,
                            )
                        current.append(event.stage)
                        bar.start_task(task)
                    counts = " ".join(f"{k} {v:,}" for k, v in event.counts.items())
                    bar.update(
                        task, total=event.total, completed=event.done, info=(counts or event.message)[:60]
                    )
                elif event.stage == "done":
                    for name in current:
                        t = bar.tasks[tasks[name]]
                        bar.update(tasks[name], total=t.total or 1, completed=t.total or 1)

            report = run_compaction(
                dsn, schema, master=master, archive=archive, topics=topics, progress=on_progress
            )
        console.print(summary_table(report))
        console.print(
            f"archive: {report.archive_root} ({len(report.archive_files)} files), {report.seconds:.1f}s"
        )
        return 0
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


# -- the sidecar: `bus compact --every 10m` -------------------------------------------------

_EVERY = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")
# While idle the sidecar's row is refreshed at least this often (seconds).
HEARTBEAT_EVERY = 30.0


def parse_every(text: str) -> float:
    """Seconds in a schedule like `10m`, `90s`, `1h30m` or `45` (seconds); raises ValidationError otherwise."""
    match = _EVERY.fullmatch(text.strip().lower())
    seconds = 0.0
    if match and any(match.groups()):
        h, m, s = (float(g) if g else 0.0 for g in match.groups())
        seconds = h * 3600 + m * 60 + s
    if seconds <= 0:
        raise ValidationError(
            f"--every takes a positive duration like 10m, 90s, 1h30m or 45 (seconds), not {text!r}"
        )
    return seconds


class _SidecarRow:
    """The sidecar's row in `compaction_sidecars`, on a connection of its own (reopened after a failure).

    Bookkeeping must never stop the schedule: a failed write is logged and
    retried with the next one.
    """

    def __init__(self, dsn: str, schema: str, name: str) -> None:
        self.dsn, self.schema, self.name = dsn, schema, name
        self.loop = asyncio.new_event_loop()
        self.conn: Any = None

    def write(self, statement: str, *args: Any) -> None:
        """Run one statement on the sidecar's row (its name is the first argument)."""
        try:
            if self.conn is None or self.conn.is_closed():
                self.conn = self.loop.run_until_complete(db.connect(self.dsn, self.schema))
            self.loop.run_until_complete(self.conn.execute(statement, self.name, *args))
        except Exception as exc:  # noqa: BLE001 - a lost database must not end the sidecar
            log.warning("compaction_sidecar_write_failed", error=str(exc))
            self.conn = None

    def close(self) -> None:
        """Close the connection and the private event loop."""
        if self.conn is not None and not self.conn.is_closed():
            self.loop.run_until_complete(self.conn.close())
        self.loop.close()


def sidecar_command(
    console: Console,
    master: str | None,
    archive: str | None,
    topics: list[str] | None,
    every: str,
    *,
    max_runs: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Keep one Spark session warm and compact every `every` (e.g. `10m`) until stopped.

    Each run's outcome (ok, failed with its error, busy when another job held
    the lock), the next run's time and the run in progress are recorded in
    the database, so `bus compact --status` shows them from anywhere. A failed
    run does not end the sidecar; SIGTERM or Ctrl-C lets the current run
    finish and stops it. `max_runs` / `stop` are for tests and scripts.
    """
    from bus.compaction import CompactionBusyError, run_compaction, spark_session

    try:
        seconds = parse_every(every)
        dsn, schema = asyncio.run(_target())
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    row = _SidecarRow(dsn, schema, f"{socket.gethostname()}:{os.getpid()}")
    row.write(compaction_sql.SIDECAR_REGISTER, seconds, master or "local[*]")
    runs = 0
    try:
        console.print(
            f"compaction sidecar {row.name}: every {every} ({seconds:g}s) on {master or 'local[*]'}"
        )
        spark = spark_session(master)  # started once, kept warm between runs
        next_at = time.time()
        while not stop.is_set() and (max_runs is None or runs < max_runs):
            row.write(compaction_sql.SIDECAR_RUN_STARTED)
            started = time.monotonic()
            try:
                report = run_compaction(dsn, schema, spark=spark, archive=archive, topics=topics)
            except CompactionBusyError as exc:
                row.write(
                    compaction_sql.SIDECAR_RUN_FINISHED,
                    "busy",
                    None,
                    time.monotonic() - started,
                    str(exc),
                    None,
                    None,
                )
                console.print(f"skipped: {exc}")
            except Exception as exc:  # noqa: BLE001 - recorded; the next run resumes the open run
                log.exception("compaction_sidecar_run_failed")
                row.write(
                    compaction_sql.SIDECAR_RUN_FINISHED,
                    "failed",
                    None,
                    time.monotonic() - started,
                    f"{type(exc).__name__}: {exc}"[:2000],
                    None,
                    None,
                )
                console.print(f"[red]run failed:[/red] {exc}")
            else:
                row.write(
                    compaction_sql.SIDECAR_RUN_FINISHED,
                    "ok",
                    report.run_id,
                    report.seconds,
                    None,
                    report.rows_archived,
                    report.rows_removed,
                )
                console.print(
                    f"run {report.run_id}: archived {report.rows_archived:,}, removed "
                    f"{report.rows_removed:,} in {report.seconds:.1f}s"
                )
            runs += 1
            if max_runs is not None and runs >= max_runs:
                break
            # A fixed schedule; a run longer than the interval is followed at once.
            next_at = max(next_at + seconds, time.time())
            while not stop.is_set():
                row.write(compaction_sql.SIDECAR_STATE, "idle", datetime.fromtimestamp(next_at, UTC))
                left = next_at - time.time()
                if left <= 0 or stop.wait(min(left, HEARTBEAT_EVERY)):
                    break
        return 0
    except KeyboardInterrupt:
        return 0
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    finally:
        row.write(compaction_sql.SIDECAR_STATE, "stopped", None)
        row.close()
