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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.table import Table

import bus
from bus.admin import GroupDescription
from bus.tables import fit, table
from bus.workflows.cli import workflows_app
from storage.errors import BusError

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="An asyncio, actor-based message bus on PostgreSQL."
)
server_app = typer.Typer(no_args_is_help=True, help="The embedded PostgreSQL server under $BUS_HOME.")
app.add_typer(server_app, name="server")
app.add_typer(workflows_app, name="workflows")
console = Console()
T = TypeVar("T")

_JSON = typer.Option(False, "--json", help="print JSON (for scripts) instead of a table")


#: The commands that only read and print: they start no actors, and configure structlog only when a
#: level below WARNING asks for events (the library's own plain rendering shows warnings meanwhile).
QUICK_COMMANDS = frozenset({"topics", "groups", "describe", "messages", "schedules", "server"})


def configure_logging(level: str | None = None, *, structured: bool = True) -> None:
    """Console logging for the CLI: stdlib at `level` (default $BUS_LOG_LEVEL or WARNING), structlog rendered."""
    name = (level or os.environ.get("BUS_LOG_LEVEL") or "WARNING").upper()
    logging.basicConfig(level=getattr(logging, name, logging.WARNING), format="%(message)s")
    if not structured and getattr(logging, name, logging.WARNING) >= logging.WARNING:
        return
    import structlog

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


def topics_rows(
    topics: list[bus.TopicInfo], sizes: list[int], depths: list[Any] | None = None
) -> list[list[str]]:
    """The cells of `bus topics`, one row per topic (`depths`: a queue topic's QueueDepth, else None)."""
    return [
        [
            t.name,
            "dynamic" if t.partitions is None else str(t.partitions),
            t.semantics,
            t.cleanup,
            str(t.retention) if t.retention else "-",
            t.namespace or "-",
            t.task or "-",
            _depth_cell(depth),
            str(size),
        ]
        for t, size, depth in zip(topics, sizes, depths or [None] * len(topics), strict=True)
    ]


def _depth_cell(depth: Any) -> str:
    """A queue's jobs to do as waiting/running/delayed/dead ("-" for a pubsub topic)."""
    if depth is None:
        return "-"
    dead = "-" if depth.dead_letter is None else str(depth.dead)
    return f"{depth.waiting}/{depth.running}/{depth.delayed}/{dead}"


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
        "depth",
        "messages",
        numeric=("partitions", "depth", "messages"),
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
    now = datetime.now(UTC)
    members = [
        [
            mem.member_id,
            mem.instance_id or "-",
            mem.host,
            str(mem.pid),
            "yes" if mem.live else "no",
            f"{max(0.0, (now - mem.last_heartbeat).total_seconds()):.1f}",
            ", ".join(f"{tp.topic}/{tp.partition}" for tp in mem.partitions) or "-",
        ]
        for mem in d.members
    ]
    yield fit(
        table(
            "MEMBER-ID",
            "INSTANCE-ID",
            "HOST",
            "PID",
            "LIVE",
            "HEARTBEAT-AGE",
            "PARTITIONS",
            numeric=("PID", "HEARTBEAT-AGE"),
        ),
        members,
        names=(0, 1, 2),
    )


_no_start = False


@app.callback()
def _root(
    ctx: typer.Context,
    log_level: str = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING (default), ERROR"),
    no_start: bool = typer.Option(
        False,
        "--no-start",
        envvar="BUS_NO_START",
        help="never start an embedded server: fail when none runs under $BUS_HOME (without BUS_DSN)",
    ),
) -> None:
    global _no_start
    _no_start = no_start
    configure_logging(log_level, structured=ctx.invoked_subcommand not in QUICK_COMMANDS)


def _embedded_notice() -> None:
    """Without BUS_DSN a command uses the embedded server under $BUS_HOME: say so when that starts one.

    A typo in BUS_HOME (or a command run from another directory) would otherwise create a new,
    empty server silently and show empty tables. --no-start (BUS_NO_START=1) refuses instead.
    """
    if os.environ.get("BUS_DSN"):
        return
    from bus.server.embedded import default_home, server_status

    home = default_home()
    if server_status(home).running:
        return
    fresh = not (home / "pgdata").is_dir()
    what = "a new, empty embedded server" if fresh else "the embedded server"
    if _no_start:
        raise BusError(
            f"no embedded server runs under {home} and --no-start (BUS_NO_START) forbids starting "
            f"{what}: set BUS_HOME to the right directory, or BUS_DSN, or run `bus server start`"
        )
    err = Console(stderr=True)
    err.print(
        f"starting {what} under {home}"
        + (" (BUS_HOME; nothing is there yet, so its tables are empty)" if fresh else "")
        + "; --no-start or BUS_NO_START=1 refuses",
        soft_wrap=True,
    )


@asynccontextmanager
async def _bus() -> AsyncIterator[bus.Bus]:
    """The Bus of a read-only command: announced when it starts a server, without actors."""
    from bus.client import connect_admin

    _embedded_notice()
    async with connect_admin() as b:
        yield b


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
    namespace: str | None = typer.Option(None),
    task: str | None = typer.Option(None),
    as_json: bool = _JSON,
) -> None:
    """List topics with their partitions and sizes; a queue's depth: jobs waiting/running/delayed/dead."""

    async def go() -> None:
        async with _bus() as b:
            found = await b.list_topics(namespace=namespace, task=task)
            sizes = [sum(s.size for s in await b.admin.topic_stats(t.name)) for t in found]
            depths = [await b.admin.queue_depth(t.name) if t.semantics == "queue" else None for t in found]
        if as_json:
            print_json(
                [
                    {**msgspec.structs.asdict(t), "messages": size, "depth": depth}
                    for t, size, depth in zip(found, sizes, depths, strict=True)
                ]
            )
        else:
            console.print(topics_table(topics_rows(found, sizes, depths)))

    run(go)


@app.command()
def groups(as_json: bool = _JSON) -> None:
    """List consumer groups: state, status, members, total lag."""

    async def go() -> None:
        async with _bus() as b:
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
        async with _bus() as b:
            d = await b.admin.describe_group(group)
        if as_json:
            now = datetime.now(UTC)
            data = msgspec.to_builtins({**msgspec.structs.asdict(d), "total_lag": d.total_lag})
            for member, raw in zip(d.members, data["members"], strict=True):
                raw["heartbeat_age"] = round(max(0.0, (now - member.last_heartbeat).total_seconds()), 3)
            print_json(data)
        else:
            for renderable in describe_table(d):
                console.print(renderable)

    run(go)


def _preview(payload: bytes | None, width: int) -> str:
    if payload is None:
        return "(tombstone)"
    text = payload.decode("utf-8", errors="replace")
    return text if len(text) <= width else text[:width] + f"… ({len(payload)} bytes)"


def messages_table(found: list[bus.Message], width: int) -> Table:
    """`bus messages` as a table: where each message is, when, its key, headers and payload."""
    rows = [
        [
            m.partition,
            str(m.offset),
            f"{m.created_at:%Y-%m-%d %H:%M:%S}",
            m.key or "-",
            "\n".join(f"{k}={v}" for k, v in m.headers.items()) or "-",
            _preview(m.payload, width),
        ]
        for m in found
    ]
    t = table("partition", "offset", "created", "key", "headers", "payload", numeric=("offset",))
    return fit(t, rows, names=(0,))


def _message_json(m: bus.Message) -> dict[str, Any]:
    payload = m.payload.decode("utf-8", errors="replace") if m.payload is not None else None
    return {
        "topic": m.topic,
        "partition": m.partition,
        "offset": m.offset,
        "created_at": m.created_at,
        "key": m.key,
        "headers": m.headers,
        "payload": payload,
    }


async def _first_messages(
    b: bus.Bus, topic: str, partition: str | None, offset: int | None, limit: int
) -> tuple[list[bus.Message], dict[str, int]]:
    """Up to `limit` messages of each partition (from `offset`, else the last ones); where each ended."""
    stats = await b.admin.topic_stats(topic)
    parts = [s for s in stats if partition is None or s.partition == partition]
    if partition is not None and not parts:
        raise bus.ValidationError(
            f"topic {topic!r} has no partition {partition!r} (it has: "
            f"{', '.join(s.partition for s in stats) or 'none yet'})"
        )
    nexts: dict[str, int] = {}
    found: list[bus.Message] = []
    for s in parts:
        start = max(s.log_start, offset if offset is not None else s.end_offset - limit)
        got = await b.read(topic, partition=s.partition, offset=start, max_messages=limit)
        found += got
        nexts[s.partition] = got[-1].offset + 1 if got else start
    found.sort(key=lambda m: (m.created_at, m.partition, m.offset))
    return found, nexts


async def _new_messages(
    b: bus.Bus, topic: str, partition: str | None, nexts: dict[str, int]
) -> list[bus.Message]:
    """The messages written since `nexts` (moved on past them), oldest first."""
    fresh: list[bus.Message] = []
    for s in await b.admin.topic_stats(topic):
        if partition is not None and s.partition != partition:
            continue
        at = max(nexts.get(s.partition, s.log_start), s.log_start)
        if s.end_offset > at:
            got = await b.read(topic, partition=s.partition, offset=at, max_messages=500)
            fresh += got
            if got:
                nexts[s.partition] = got[-1].offset + 1
    fresh.sort(key=lambda m: (m.created_at, m.partition, m.offset))
    return fresh


@app.command()
def messages(
    topic: str,
    partition: str = typer.Option(None, "--partition", help="one partition (default: every partition)"),
    offset: int = typer.Option(
        None, "--offset", help="the first offset to show (default: the last --limit messages)"
    ),
    limit: int = typer.Option(20, "--limit", help="messages per partition at most"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new messages until Ctrl-C"),
    width: int = typer.Option(200, "--width", help="payload characters shown (the rest is summarized)"),
    as_json: bool = _JSON,
) -> None:
    """Show a topic's messages with their headers (a dead-letter topic's errors are in them)."""
    if limit < 1:
        console.print("[red]error:[/red] --limit must be at least 1")
        raise typer.Exit(2)

    async def show(b: bus.Bus, found: list[bus.Message]) -> None:
        if as_json:
            for m in found:
                sys.stdout.write(msgspec.json.encode(_message_json(m)).decode() + "\n")
            sys.stdout.flush()
        elif found:
            console.print(messages_table(found, width))

    async def go() -> None:
        async with _bus() as b:
            found, nexts = await _first_messages(b, topic, partition, offset, limit)
            await show(b, found)
            if not found and not as_json and not follow:
                console.print(f"no messages in {topic}" + (f"/{partition}" if partition else ""))
            while follow:
                await asyncio.sleep(0.5)
                await show(b, await _new_messages(b, topic, partition, nexts))

    try:
        run(go)
    except KeyboardInterrupt:
        pass


@app.command()
def schedules(as_json: bool = _JSON) -> None:
    """List the periodic publishes (`b.schedule`): cron, time zone, topic, last and next tick."""

    async def go() -> None:
        async with _bus() as b:
            found = await b.schedules()
        if as_json:
            print_json(
                [
                    {
                        **msgspec.structs.asdict(s),
                        "payload": None if s.payload is None else s.payload.decode(),
                    }
                    for s in found
                ]
            )
            return
        if not found:
            console.print("no schedules")
            return
        rows = [
            [s.name, f"{s.cron} ({s.timezone})", s.topic, f"{s.next_tick.astimezone(UTC):%Y-%m-%d %H:%M:%S}"]
            for s in found
        ]
        t = table("schedule", "cron", "topic", "next tick (UTC)")
        console.print(fit(t, rows, names=(0, 2)))

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
        async with _bus() as b:
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
    from bus.compaction.command import compact_command, sidecar_command

    if every and not status:
        code = sidecar_command(console, master, archive, topics_ or None, every)
    else:
        code = compact_command(console, master=master, archive=archive, topics=topics_ or None, status=status)
    if code:
        raise typer.Exit(code)


@app.command()
def bench(
    scenario: str = typer.Argument(
        None,
        help="publish | groups | queue | worker | claims | eventstore | compact | xmin | deadtuples | pooler | stockpg | workflows | ... (benchmarks/harness.py SCENARIOS; default: all)",
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

    try:
        _embedded_notice()
    except BusError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
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


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"", "0", "false", "f", "no", "n", "off"})


def _quick(args: list[str]) -> Callable[[], None] | None:
    """The read-only commands in their plain forms, run without typer's parsing (None: any other).

    Typer's parameter handling imports pydantic, a tenth of a second or more of a command that
    only prints a table; a person waits for it. Anything else (options, help, a mistake) goes
    through typer as usual, which gives the same result more slowly.
    """
    no_start = os.environ.get("BUS_NO_START", "").strip().lower()
    if no_start not in _TRUE | _FALSE:
        return None
    rest = list(args)
    as_json = "--json" in rest
    if as_json:
        rest.remove("--json")
    match rest:
        case ["topics"]:
            call: Callable[[], None] = lambda: topics(namespace=None, task=None, as_json=as_json)  # noqa: E731
        case ["groups"]:
            call = lambda: groups(as_json=as_json)  # noqa: E731
        case ["schedules"]:
            call = lambda: schedules(as_json=as_json)  # noqa: E731
        case ["describe", group] if not group.startswith("-"):
            call = lambda: describe(group, as_json=as_json)  # noqa: E731
        case ["server", "status"]:
            call = lambda: server_status_command(as_json=as_json)  # noqa: E731
        case _:
            return None

    def run_quick() -> None:
        global _no_start
        _no_start = no_start in _TRUE
        configure_logging(None, structured=False)
        try:
            call()
        except typer.Exit as exc:
            sys.exit(exc.exit_code)

    return run_quick


def main(argv: list[str] | None = None) -> Any:
    """The `bus` console script."""
    quick = _quick(sys.argv[1:] if argv is None else argv)
    if quick is not None:
        return quick()
    return app(args=argv)
