"""The `bus` command line (also `python -m bus`).

Database and schema come from `BUS_DSN` / `BUS_SCHEMA` like every command
(neither set: the embedded server under `$BUS_HOME`). This is the one place
that configures logging, and the only module that builds rich tables for the
admin commands (with `bus.tables`), so that `import bus` loads neither rich nor typer.

Tables fold long cells onto more lines instead of cutting them: a topic or
group name is what people copy, and a cut number is a wrong number. `--json`
prints the same data for scripts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import msgspec
import structlog
import typer
from rich.console import Console
from rich.table import Table

import bus
from bus.admin import GroupDescription
from bus.tables import fit, table
from storage.errors import BusError

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="An asyncio, actor-based message bus on PostgreSQL."
)
server_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server under $BUS_HOME.")
app.add_typer(server_app, name="server")
console = Console()
T = TypeVar("T")

_JSON = typer.Option(False, "--json", help="print JSON (for scripts) instead of a table")


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
    """Run a command's coroutine; a BusError becomes its message and exit code 2."""
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def print_json(data: object) -> None:
    """`data` as indented JSON on stdout (datetimes ISO 8601, durations in seconds)."""

    def enc_hook(obj: object) -> float:
        from datetime import timedelta

        if isinstance(obj, timedelta):
            return obj.total_seconds()
        raise NotImplementedError(type(obj))

    sys.stdout.write(
        msgspec.json.format(msgspec.json.encode(data, enc_hook=enc_hook), indent=2).decode() + "\n"
    )


def topics_rows(topics: list[bus.TopicInfo], sizes: list[int]) -> list[list[str]]:
    """The cells of `bus topics`, one row per topic."""
    return [
        [
            t.name,
            "dynamic" if t.partitions is None else str(t.partitions),
            t.semantics,
            t.cleanup,
            str(t.retention) if t.retention else "-",
            t.namespace or "-",
            t.task or "-",
            str(size),
        ]
        for t, size in zip(topics, sizes, strict=True)
    ]


def topics_table(rows: list[list[str]]) -> Table:
    """`bus topics` as a table."""
    t = table(
        "topic",
        "partitions",
        "semantics",
        "cleanup",
        "retention",
        "namespace",
        "task",
        "messages",
        numeric=("partitions", "messages"),
    )
    return fit(t, rows)


def groups_table(groups: list[bus.GroupSummary]) -> Table:
    """`bus groups` as a table."""
    rows = [[g.name, g.state, g.status, str(g.members), str(g.total_lag)] for g in groups]
    t = table("group", "state", "status", "members", "lag", numeric=("members", "lag"))
    return fit(t, rows)


def describe_table(d: GroupDescription) -> Iterator[Any]:
    """Rich renderables for `bus describe`, shaped like `kafka-consumer-groups --describe`."""
    yield (
        f"GROUP {d.name}  generation={d.generation}  state={d.state}  status={d.status}  "
        f"leader={d.leader or '-'}  assignor={d.assignor}  start={d.subscription.start} "
        f"(recorded {d.subscription.recorded_at:%Y-%m-%d %H:%M:%S})"
    )
    rows = [
        [
            p.topic,
            p.partition,
            "-" if p.committed is None else str(p.committed),
            str(p.end_offset),
            str(p.log_start),
            str(p.lag),
            "-" if p.lag_seconds is None else f"{p.lag_seconds:.1f}",
            p.owner or "-",
        ]
        for p in d.partitions
    ]
    t = table(
        "TOPIC",
        "PARTITION",
        "CURRENT-OFFSET",
        "LOG-END-OFFSET",
        "LOG-START",
        "LAG",
        "LAG-SECONDS",
        "CONSUMER-ID",
        numeric=("CURRENT-OFFSET", "LOG-END-OFFSET", "LOG-START", "LAG", "LAG-SECONDS"),
    )
    yield fit(t, rows, names=(0, 1, 7))
    members = [
        [
            mem.member_id,
            mem.instance_id or "-",
            mem.host,
            str(mem.pid),
            "yes" if mem.live else "no",
            ", ".join(f"{tp.topic}/{tp.partition}" for tp in mem.partitions) or "-",
        ]
        for mem in d.members
    ]
    yield fit(
        table("MEMBER-ID", "INSTANCE-ID", "HOST", "PID", "LIVE", "PARTITIONS", numeric=("PID",)),
        members,
        names=(0, 1, 2),
    )


@app.callback()
def _root(
    log_level: str = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING (default), ERROR"),
) -> None:
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
def topics(
    namespace: str = typer.Option(None), task: str = typer.Option(None), as_json: bool = _JSON
) -> None:
    """List topics with their partitions and sizes."""

    async def go() -> None:
        async with bus.connect() as b:
            found = await b.list_topics(namespace=namespace, task=task)
            sizes = [sum(s.size for s in await b.admin.topic_stats(t.name)) for t in found]
        if as_json:
            print_json(
                [
                    {**msgspec.structs.asdict(t), "messages": size}
                    for t, size in zip(found, sizes, strict=True)
                ]
            )
        else:
            console.print(topics_table(topics_rows(found, sizes)))

    run(go)


@app.command()
def groups(as_json: bool = _JSON) -> None:
    """List consumer groups: state, status, members, total lag."""

    async def go() -> None:
        async with bus.connect() as b:
            found = await b.admin.list_groups()
        if as_json:
            print_json(found)
        else:
            console.print(groups_table(found))

    run(go)


@app.command()
def describe(group: str, as_json: bool = _JSON) -> None:
    """Describe a group like `kafka-consumer-groups --describe`."""

    async def go() -> None:
        async with bus.connect() as b:
            d = await b.admin.describe_group(group)
        if as_json:
            print_json({**msgspec.structs.asdict(d), "total_lag": d.total_lag})
        else:
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
            plan = await b.admin.reset_offsets(
                group, to=parse_reset_target(to), topic=topic, dry_run=not execute
            )
            rows = [[row.topic, row.partition, str(row.current), str(row.new)] for row in plan]
            t = table("topic", "partition", "current", "new", numeric=("current", "new"))
            console.print(fit(t, rows, names=(0, 1)))
            console.print("applied" if execute else "dry run: nothing changed (add --execute to apply)")

    run(go)


@app.command()
def migrate(
    status: bool = typer.Option(
        False, "--status", help="list applied and pending migrations; change nothing"
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the SQL of the pending migrations; change nothing"
    ),
    finalize: bool = typer.Option(
        False,
        "--finalize",
        help="end a rolling deploy: the schema's minimum release becomes this library's "
        "(run it once every process runs this release)",
    ),
) -> None:
    """Apply the pending migrations of the schema (connect does it too), or list them, or print their SQL."""
    from bus.migrate import migrate_command

    run(lambda: migrate_command(console, status=status, dry_run=dry_run, finalize=finalize))


@app.command()
def compact(
    master: str = typer.Option(None, "--master", help="local[*] (default), local[2], spark://host:7077"),
    archive: str = typer.Option(None, "--archive", help="archive URI/dir (default $BUS_HOME/archive)"),
    topics_: list[str] = typer.Option(None, "--topics", help="only these topics"),  # noqa: B008 - typer's idiom
    status: bool = typer.Option(False, "--status", help="show recorded runs instead of running"),
    every: str = typer.Option(
        None, "--every", help="keep running: compact every 10m (90s, 1h...) in one Spark session"
    ),
) -> None:
    """Run the Spark compaction and archive job with a progress display."""
    from bus.compact import compact_command, sidecar_command

    if every and not status:
        code = sidecar_command(console, master, archive, topics_ or None, every)
    else:
        code = compact_command(console, master=master, archive=archive, topics=topics_ or None, status=status)
    if code:
        raise typer.Exit(code)


@app.command()
def bench(
    scenario: str = typer.Argument(
        None, help="publish | groups | queue | fanout | claims | eventstore | compact | xmin (default: all)"
    ),
    quick: bool = typer.Option(False, help="smaller sizes, for a smoke run"),
    against: str = typer.Option(
        None,
        "--against",
        help="publish: compare with release REV (a virtualenv built from `git archive REV`)",
    ),
    server: str = typer.Option(
        None, "--server", help="pg15: run on Debian's PostgreSQL 15 with its defaults (scripts/pg15.sh)"
    ),
) -> None:
    """Run the benchmark harness from a checkout; writes benchmarks/results/<date>.json and .md there."""
    import os
    import subprocess
    from pathlib import Path

    # benchmarks/ is not part of the wheel and not a dependency of bus/: it runs as its own
    # program (`python -m benchmarks`) from the checkout in the working directory.
    if not (Path.cwd() / "benchmarks" / "harness.py").is_file():
        console.print(
            "bus bench runs from a checkout of the project: cd into it (benchmarks/ is not installed)"
        )
        raise typer.Exit(2)
    if against and scenario != "publish":
        console.print("--against compares the publish path: run `bus bench publish --against REV`")
        raise typer.Exit(2)
    args = [scenario] if scenario else []
    env = dict(os.environ)
    if against:
        env["BUS_BENCH_AGAINST"] = against
    if server:
        env["BUS_BENCH_SERVER"] = server
    code = subprocess.call(
        [sys.executable, "-m", "benchmarks", *args, *(["--quick"] if quick else [])], env=env
    )
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

    code = command(
        console, host=host, port=port, admin=admin, token=token, audit_log=audit_log, refresh=refresh
    )
    if code:
        raise typer.Exit(code)


@server_app.command("start")
def server_start() -> None:
    """Start (or find) the embedded server and keep it running until `bus server stop`."""
    from bus.server.embedded import ensure_server, server_status

    server = ensure_server(keep=True)
    status = server_status()
    console.print(server.masked_dsn, soft_wrap=True)
    console.print(status.describe(), soft_wrap=True)
    if server.password is not None:
        console.print(f"the password is in {status.password_file} (mode 0600)", soft_wrap=True)


@server_app.command("dsn")
def server_dsn() -> None:
    """Print the embedded server's full DSN, password included, for other tools (psql, spark-submit).

    Starts the server if it is not running. The only command that prints the password:
    hand it on through the environment (`PGPASSWORD`, `BUS_DSN`), not on a command line.
    """
    from bus.server.embedded import ensure_server

    server = ensure_server(keep=True)
    print(server.dsn)


@server_app.command("stop")
def server_stop() -> None:
    """Stop the embedded server (also when processes still use it)."""
    from bus.server.embedded import stop_server

    console.print("stopped" if stop_server() else "not running")


@server_app.command("status")
def server_status_command(as_json: bool = _JSON) -> None:
    """Whether the embedded server runs, how it stops, and how many processes use it."""
    from bus.server.embedded import server_status

    status = server_status()
    if as_json:
        print_json(
            {
                "home": str(status.home),
                "running": status.running,
                "dsn": status.server.masked_dsn if status.server else None,
                "keep": status.keep,
                "legacy": status.legacy,
                "users": status.users,
                "password_file": str(status.password_file),
            }
        )
        return
    console.print(status.describe(), soft_wrap=True)
    if status.server is not None:
        console.print(status.server.masked_dsn, soft_wrap=True)


def main(argv: list[str] | None = None) -> Any:
    """The `bus` console script."""
    return app(args=argv)
