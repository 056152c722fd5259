"""The `bus` command line (also `python -m bus`).

Database and schema come from `BUS_DSN` / `BUS_SCHEMA` like every command
(neither set: the embedded server under `$BUS_HOME`). This is the one place
that configures logging.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
import typer
from rich.console import Console
from rich.table import Table

import bus
from storage.errors import BusError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="An asyncio, actor-based message bus on PostgreSQL.")
server_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server under $BUS_HOME.")
app.add_typer(server_app, name="server")
console = Console()
T = TypeVar("T")


def configure_logging(level: str | None = None) -> None:
    """Console logging for the CLI: stdlib at `level` (default $BUS_LOG_LEVEL or WARNING), structlog rendered."""
    name = (level or os.environ.get("BUS_LOG_LEVEL") or "WARNING").upper()
    logging.basicConfig(level=getattr(logging, name, logging.WARNING), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            # Plain tracebacks: rich ones (with locals) take seconds of CPU on the event
            # loop, long enough for an actor restart to cost a member its session.
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )


def run(fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


@app.callback()
def _root(log_level: str = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING (default), ERROR")) -> None:
    configure_logging(log_level)


@app.command()
def demo(
    messages: int = typer.Option(6000, help="messages to publish"),
    fast: bool = typer.Option(False, help="shorter timeouts (used by the tests)"),
) -> None:
    """The main job: topics, producers, a three-member group, a member killed, lag shown live."""
    from bus.demo import run_demo

    ok = run(lambda: run_demo(console, messages=messages, fast=fast))
    if not ok:
        raise typer.Exit(1)


@app.command()
def topics(namespace: str = typer.Option(None), task: str = typer.Option(None)) -> None:
    """List topics with their partitions and sizes."""

    async def go() -> None:
        async with bus.connect() as b:
            table = Table("topic", "partitions", "semantics", "cleanup", "retention", "namespace", "task", "messages")
            for t in await b.list_topics(namespace=namespace, task=task):
                stats = await b.admin.topic_stats(t.name)
                table.add_row(
                    t.name,
                    "dynamic" if t.partitions is None else str(t.partitions),
                    t.semantics,
                    t.cleanup,
                    str(t.retention) if t.retention else "-",
                    t.namespace or "-",
                    t.task or "-",
                    str(sum(s.size for s in stats)),
                )
            console.print(table)

    run(go)


@app.command()
def groups() -> None:
    """List consumer groups: state, status, members, total lag."""

    async def go() -> None:
        async with bus.connect() as b:
            table = Table("group", "state", "status", "members", "lag")
            for g in await b.admin.list_groups():
                table.add_row(g.name, g.state, g.status, str(g.members), str(g.total_lag))
            console.print(table)

    run(go)


@app.command()
def describe(group: str) -> None:
    """Describe a group like `kafka-consumer-groups --describe`."""
    from bus.admin import describe_table

    async def go() -> None:
        async with bus.connect() as b:
            d = await b.admin.describe_group(group)
            for renderable in describe_table(d):
                console.print(renderable)

    run(go)


@app.command("reset-offsets")
def reset_offsets(
    group: str,
    to: str = typer.Option(..., "--to", help="earliest | latest | an ISO datetime | an offset"),
    topic: str = typer.Option(None, "--topic"),
    execute: bool = typer.Option(False, "--execute", help="apply; without it, only show the plan"),
) -> None:
    """Move a group's committed offsets (dry run unless --execute; refused while members are live)."""
    from bus.admin import parse_reset_target

    async def go() -> None:
        async with bus.connect() as b:
            plan = await b.admin.reset_offsets(group, to=parse_reset_target(to), topic=topic, dry_run=not execute)
            table = Table("topic", "partition", "current", "new")
            for row in plan:
                table.add_row(row.topic, row.partition, str(row.current), str(row.new))
            console.print(table)
            console.print("applied" if execute else "dry run: nothing changed (add --execute to apply)")

    run(go)


@app.command()
def compact(
    master: str = typer.Option(None, "--master", help="local[*] (default), local[2], spark://host:7077"),
    archive: str = typer.Option(None, "--archive", help="archive URI/dir (default $BUS_HOME/archive)"),
    topics_: list[str] = typer.Option(None, "--topics", help="only these topics"),  # noqa: B008 - typer's idiom
    status: bool = typer.Option(False, "--status", help="show recorded runs instead of running"),
    every: str = typer.Option(None, "--every", help="keep running: compact every 10m (90s, 1h...) in one Spark session"),
) -> None:
    """Run the Spark compaction and archive job with a progress display."""
    from bus.compact import compact_command, sidecar_command

    if every and not status:
        code = sidecar_command(console, master, archive, topics_ or None, every)
    else:
        code = compact_command(console, master=master, archive=archive, topics=topics_ or None, status=status)
    if code:
        raise typer.Exit(code)


def _benchmarks_main() -> Any:
    """The harness of the checkout in the working directory (benchmarks/ is not part of the wheel)."""
    import importlib
    import sys
    from pathlib import Path

    if not (Path.cwd() / "benchmarks" / "harness.py").is_file():
        console.print("bus bench runs from a checkout of the project: cd into it (benchmarks/ is not installed)")
        raise typer.Exit(2)
    sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module("benchmarks.harness").main


@app.command()
def bench(
    scenario: str = typer.Argument(None, help="publish | groups | queue | fanout | claims | eventstore | compact (default: all)"),
    quick: bool = typer.Option(False, help="smaller sizes, for a smoke run"),
) -> None:
    """Run the benchmark harness from a checkout; writes benchmarks/results/<date>.json and .md there."""
    bench_main = _benchmarks_main()

    code = bench_main(scenario, quick=quick, console=console)
    if code:
        raise typer.Exit(code)


@app.command()
def dashboard(
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (default: loopback only)"),
    port: int = typer.Option(8765, "--port"),
    admin: bool = typer.Option(False, "--admin", help="allow actions (replay, reset, stop/start)"),
    token: str = typer.Option(None, "--token", envvar="BUS_DASHBOARD_TOKEN", help="admin token, 8+ chars"),
    audit_log: str = typer.Option(None, "--audit-log", help="default $BUS_HOME/dashboard-audit.log"),
    refresh: float = typer.Option(1.0, "--refresh", help="seconds between live updates"),
) -> None:
    """Web dashboard: topics, groups and lag, queues and dead letters, claims, event-store groups, compaction."""
    from bus.dashboard import command

    code = command(console, host=host, port=port, admin=admin, token=token, audit_log=audit_log, refresh=refresh)
    if code:
        raise typer.Exit(code)


@server_app.command("start")
def server_start() -> None:
    """Start (or find) the embedded server and print its DSN."""
    from storage.embedded import ensure_server

    console.print(ensure_server().dsn)


@server_app.command("stop")
def server_stop() -> None:
    """Stop the embedded server."""
    from storage.embedded import stop_server

    console.print("stopped" if stop_server() else "not running")


def main(argv: list[str] | None = None) -> Any:
    return app(args=argv)
