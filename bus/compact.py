"""`bus compact`: run the Spark compaction and archive job with a progress display, or show past runs.

The job itself lives in `storage/compaction/` (also runnable with
`spark-submit storage/compaction/job.py`). Database and schema come from
`BUS_DSN` / `BUS_SCHEMA` like every command; without `BUS_DSN` the embedded
server under `$BUS_HOME` is used (it listens on TCP, which JDBC needs).
"""

from __future__ import annotations

import asyncio
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
from storage.errors import BusError

_STAGES = (
    ("plan", "plan"),
    ("stage", "keep-set (keys)"),
    ("archive", "archive (Parquet)"),
    ("delete", "delete"),
)


async def _target() -> tuple[str, str]:
    """(dsn, schema), with the migrations applied (connect does that)."""
    async with bus.connect(cleaner_interval=0) as b:
        return b.dsn, b.config.schema


async def _runs(dsn: str, schema: str, limit: int = 20) -> list[Any]:
    conn = await db.connect(dsn, schema)
    try:
        return list(await conn.fetch(compaction_sql.SELECT_RUNS, limit))
    finally:
        await conn.close()


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
    from storage.compaction import run_compaction

    try:
        dsn, schema = asyncio.run(_target())
        if status:
            console.print(status_table(asyncio.run(_runs(dsn, schema))))
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
