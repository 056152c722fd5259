"""Scale: groups of 100 and 300 members measured as their users see them, idle cost, claims at 100,000 partitions.

1. **Groups as users see them.** For each size (100 members: 10 processes x
   10 subscriptions over 1,000 partitions; 300 members: 30 x 10 over 3,000;
   each process one Bus, `benchmarks/groups_member.py`) and each timing
   (heartbeat 3 s / session 30 s, and heartbeat 0.5 s / session 5 s;
   rebalance delay 0.5 s in both; the sticky assignor), four steps:

   * cold start: every process told to go together;
   * join: one more process with one member;
   * leave: that member stops cleanly (SIGTERM);
   * SIGKILL of one of the ten-member processes (its session has to run out).

   Each step reports the time until the group is stable, at a newer
   generation, with the expected members and every assigned partition leased
   by its assignee; the generations it used; the load average
   (`os.getloadavg`) when it ended, so a slow step on a busy machine reads as
   such. From the join on, a steady trickle goes to every partition (one
   message per partition every BUS_BENCH_SCALE_TRICKLE seconds, default: 250
   messages a second in all, spread evenly) and each handler writes the wall
   time it saw each message: a partition that KEPT its owner through the step
   has as its pause the longest any of its messages published during the
   step waited for its handler (a partition that stops for d seconds makes
   the message published as it stopped wait about d, whatever the trickle's
   period; a systemic stall shows on many partitions at once). Its baseline
   is the same in a window as long right after the step, when nothing
   happens (what the machine's load alone does to deliveries). Targets: cold
   start <= 10 s (300 members: <= 15 s); join and leave <= rebalance delay +
   2 heartbeats; SIGKILL <= session timeout + 5 s; a kept partition's pause
   <= 1 heartbeat. Right after the cold start, before the trickle, the
   group's idle statements/s are counted (as below), next to what its
   partitions' fallback polls alone send (a fetch and a lease check per
   partition per max_poll_interval).

   Before starting, the run checks that its processes fit the server's
   connection limit: each process plans `pool_max_size + 7` connections
   (docs/operations.md, "Sizing groups"); the members run with the bus's
   default pool_max_size (20) where that fits, else the largest that does.
   The most connections seen on the run's database is reported beside the
   plan.
2. **What heartbeats cost the database**: transactions per second of an idle
   group (no messages: heartbeats, lease renewals and whatever else members
   do while idle), counted in `pg_stat_database.xact_commit` of a database
   made for the run, so nothing else on the server counts. Every bus
   statement outside an explicit transaction is one transaction, so this is
   statements per second (an upper bound on them). Measured for 1 process x
   1 member, 1 x 10, 5 x 10 and 10 x 10 (heartbeat 3 s): it must grow with
   processes (one HeartbeatMonitor per process beats for all its members in
   one statement), not with members.
3. **Claims at 100,000 partitions**: `benchmarks/claims.py`'s claim + ack loop
   on a dynamic topic with 100,000 pending partitions next to 100 (target:
   at most 2x the cost per claim).

Knobs (environment): BUS_BENCH_SCALE_MEMBERS (group sizes, multiples of 10,
default "100,300"; --quick "20"), BUS_BENCH_SCALE_TIMINGS (heartbeat
intervals of the timings to run, default "3,0.5"), BUS_BENCH_SCALE_TRICKLE
(seconds between two messages of one partition, default partitions / 250),
BUS_BENCH_SCALE_CLAIMS_PARTITIONS (default 100,000; --quick 10,000),
BUS_BENCH_SCALE_WINDOW (seconds per idle measurement, default 10; --quick 4),
BUS_BENCH_SCALE_ASSIGNOR (default sticky), BUS_BENCH_SCALE_MAX_POLL_INTERVAL
(the members' max_poll_interval, default the bus's); BUS_BENCH_SCALE_IDLE_GROWTH=0
skips part 2 and BUS_BENCH_SCALE_CLAIMS=0 part 3.
The chart goes to `benchmarks/results/<date>-scale.png`. Everything runs
against the given DSN (the embedded server on 127.0.0.1), processes are
stopped at the end, and every wait has a timeout.

Run it alone with `bus bench scale` (or `python -m benchmarks.scale`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

import bus
from benchmarks import claims
from benchmarks.groups import SETTLED, MemberProcess, _start_all, _stop_all, _until
from benchmarks.rawpeers import create_pool
from benchmarks.result import Result
from bus.config import Config
from bus.errors import ValidationError

SCENARIO = "scale"
MEMBERS_PER_PROCESS = 10
PARTITIONS_PER_MEMBER = 10
IDLE_TOPIC = "bench.idle"
IDLE_PARTITIONS = 100
IDLE_PROCESSES = 10
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The two timings users run with: the default heartbeat with a long session, and a fast one.
# The rebalance delay is the default's; the lease outlives any step.
TIMINGS: dict[float, dict[str, Any]] = {
    3.0: {"heartbeat_interval": 3.0, "session_timeout": 30.0, "rebalance_delay": 0.5, "lease_time": 30.0},
    0.5: {"heartbeat_interval": 0.5, "session_timeout": 5.0, "rebalance_delay": 0.5, "lease_time": 30.0},
}
# Members: no retention cleaner, no scheduler (a group benchmark). Their pool: the bus's default
# maximum when the processes fit the server's connection limit with it, else the largest that
# fits (30 processes in the embedded server's 400 connections: 6; docs/operations.md, "Sizing groups").
MEMBER_POOL_MAX_SIZE = 20
MIN_MEMBER_POOL = 4
MEMBER_CONFIG: dict[str, Any] = {"cleaner_interval": 0, "scheduler_interval": 0, "pool_min_size": 1}
MAX_POLL_INTERVAL = Config().max_poll_interval  # the members' default: how often an idle partition polls
# Connections a Bus opens beside its pool (operations.md): LISTEN, the Announcer, the heartbeat's own,
# up to 4 for the Producer's flushes (one member process never publishes, but the plan is the general one).
CONNECTIONS_BESIDE_POOL = 7
PUBLISHER_POOL_MAX_SIZE = 4  # the run's own Bus, which publishes the trickle
MONITOR_CONNECTIONS = 2
# Large groups use the sticky assignor (docs/operations.md, "Sizing groups"): a join or a leave moves
# only the partitions that balance needs; range shifts every member's run (a join to 100 members moves
# about 80% of the partitions).
ASSIGNOR = "sticky"
START_TARGET = {100: 10.0, 300: 15.0}  # seconds from cold; sizes not named: the 300-member target
SETTLE_TIMEOUT = 180.0
# How often the run looks whether the group settled: the check reads every assigned partition's lease,
# which at 3,000 partitions every 10 ms would be load of its own on the server the group runs on.
SETTLE_STEP = 0.05
QUIET_MAX = 30.0  # the longest quiet window (no step) measured for the pause baseline
TRICKLE_RATE = 250.0  # messages a second in all, by default: the machine's load must not be the trickle
TRICKLE_TICK = 0.1  # seconds between two publishes of the trickle (each to a slice of the partitions)

XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
CREATE_DATABASE = 'CREATE DATABASE "{name}"'  # a generated name, validated below
DROP_DATABASE = 'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
GENERATION = "SELECT generation FROM groups WHERE name = $1"
STATE = """
SELECT g.state, g.generation, (SELECT count(*) FROM members m WHERE m.group_name = g.name) AS members,
       (SELECT count(*) FROM offsets o WHERE o.group_name = g.name AND o.owner IS NOT NULL
        AND o.lease_expires_at > clock_timestamp()) AS leased
FROM groups g WHERE g.name = $1
"""
ASSIGNMENT = """
SELECT p.name, m.member_id
FROM members m CROSS JOIN LATERAL unnest(m.assignment) AS a(pid) JOIN partitions p ON p.id = a.pid
WHERE m.group_name = $1
"""
CONNECTION_LIMIT = """
SELECT current_setting('max_connections')::int AS max_connections,
       current_setting('superuser_reserved_connections')::int AS reserved,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS in_use
"""
DATABASE_CONNECTIONS = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"


def _with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if not raw else float(raw)


def _env_list(name: str, default: str) -> list[float]:
    return [float(x) for x in (os.environ.get(name) or default).split(",") if x.strip()]


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def _settle(
    mon: asyncpg.Pool, group: str, partitions: int, after: int, members: int
) -> tuple[float, int]:
    """Seconds until `group` is stable past generation `after` with `members` members; and that generation."""
    started = time.perf_counter()

    async def settled() -> int | None:
        row = await mon.fetchrow(SETTLED, group, after, members, partitions)
        return int(row["generation"]) if row is not None and row["settled"] else None

    try:
        generation = await _until(settled, SETTLE_TIMEOUT, f"{group}: {members} members stable", SETTLE_STEP)
    except TimeoutError as exc:
        state = await mon.fetchrow(STATE, group)
        raise TimeoutError(f"{exc}; the group: {None if state is None else dict(state)}") from exc
    return time.perf_counter() - started, int(generation)


async def _generation(mon: asyncpg.Pool, group: str) -> int:
    value = await mon.fetchval(GENERATION, group)
    return 0 if value is None else int(value)


async def _idle_rate(mon: asyncpg.Pool, window: float) -> float:
    """Transactions per second in the run's database over `window` seconds (the monitor's own two subtracted)."""
    # pg_stat_database is flushed by backends at most once a second: read it
    # after a pause so both readings are settled, and over a long window.
    await asyncio.sleep(1.2)
    first = int(await mon.fetchval(XACTS))
    started = time.perf_counter()
    await asyncio.sleep(window)
    await asyncio.sleep(1.2)
    last = int(await mon.fetchval(XACTS))
    elapsed = time.perf_counter() - started
    return max(0, last - first - 1) / elapsed


def connection_plan(processes: int, pool_max_size: int) -> int:
    """Connections `processes` Bus processes may open at most: `pool_max_size + 7` each."""
    return processes * (pool_max_size + CONNECTIONS_BESIDE_POOL)


async def check_connections(mon: asyncpg.Pool, processes: int) -> dict[str, int]:
    """The member pool size for `processes` member processes (plus this run's own) within the server's limit.

    The bus's default pool_max_size (20) when it fits, else the largest that does, in what the
    server has left for ordinary roles (max_connections less the superuser reserve and what is
    in use). Raises ValidationError, saying what to change, when not even MIN_MEMBER_POOL fits.
    """
    row = await mon.fetchrow(CONNECTION_LIMIT)
    own = PUBLISHER_POOL_MAX_SIZE + CONNECTIONS_BESIDE_POOL + MONITOR_CONNECTIONS
    free = int(row["max_connections"]) - int(row["reserved"]) - int(row["in_use"])
    pool = min(MEMBER_POOL_MAX_SIZE, (free - own) // processes - CONNECTIONS_BESIDE_POOL)
    if pool < MIN_MEMBER_POOL:
        raise ValidationError(
            f"{processes} processes need pool_max_size + {CONNECTIONS_BESIDE_POOL} connections each "
            f"(pool_max_size >= {MIN_MEMBER_POOL}) and {own} of the run's own, but the server has {free} free "
            f"of max_connections={row['max_connections']}: run fewer processes or raise the server's max_connections"
        )
    return {
        "pool_max_size": pool,
        "planned": connection_plan(processes, pool) + own,
        "per_process": pool + CONNECTIONS_BESIDE_POOL,
        "max_connections": int(row["max_connections"]),
        "free": free,
    }


class Deliveries:
    """The trickle's messages: when each was published, and when a handler saw it (its `partition offset pid time` log lines)."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self._read: dict[Path, int] = {}
        self.sent: dict[str, list[tuple[float, int]]] = {}  # partition -> (publish time, offset), in order
        self.handled: dict[tuple[str, int], float] = {}  # (partition, offset) -> first time handled

    def new_path(self) -> Path:
        fd, name = tempfile.mkstemp(prefix="bench-scale-", suffix=".log")
        os.close(fd)
        path = Path(name)
        self.paths.append(path)
        return path

    def published(self, at: float, records: list[bus.Record]) -> None:
        for r in records:
            self.sent.setdefault(r.partition, []).append((at, r.offset))

    def refresh(self) -> None:
        """Read what the logs gained since the last look (a last line cut short waits for its end)."""
        for path in self.paths:
            with path.open("rb") as f:
                f.seek(self._read.get(path, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            self._read[path] = self._read.get(path, 0) + end
            for line in chunk[:end].decode().splitlines():
                parts = line.split()
                if len(parts) == 4:
                    self.handled.setdefault((parts[0], int(parts[1])), float(parts[3]))

    def longest_wait(self, partition: str, start: float, end: float) -> float | None:
        """The longest a message of `partition` published from `start` to `end` waited for its handler.

        A partition that stops for d seconds makes the message published as it stopped wait about d:
        this is the partition's pause, whatever the trickle's period. Not handled yet: waiting still.
        None when nothing was published to it in the window.
        """
        now = time.time()
        waits = [
            self.handled.get((partition, offset), now) - at
            for at, offset in self.sent.get(partition, [])
            if start <= at <= end
        ]
        return max(waits) if waits else None

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)


async def _trickle(
    b: bus.Bus, topic: str, partitions: int, period: float, stop: asyncio.Event, deliveries: Deliveries
) -> None:
    """One message to every partition every `period` seconds, a slice of them every TRICKLE_TICK."""
    names = [str(i) for i in range(partitions)]
    count = max(1, round(period / TRICKLE_TICK))
    slices = [names[i::count] for i in range(count)]
    tick = period / count
    next_at = time.monotonic()
    i = 0
    while not stop.is_set():
        at = time.time()
        records = await b.publish_many(topic, [bus.Outgoing(b"t", partition=n) for n in slices[i % count]])
        deliveries.published(at, records)
        i += 1
        next_at += tick
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


@dataclass
class Step:
    """One step's numbers."""

    name: str
    seconds: float | None = None
    generations: int | None = None
    loadavg: list[float] = field(default_factory=list)
    kept: int = 0
    sampled: int = 0  # kept partitions that had a message published during the step
    longest_wait: float | None = None  # the longest a kept partition's message waited for its handler
    quiet_wait: float | None = None  # the same in a window as long right after the step (no step)
    over_heartbeat: int = 0  # kept partitions that paused longer than a heartbeat
    unsettled: str | None = None


@dataclass
class GroupRun:
    """One group size at one timing."""

    members: int
    processes: int
    partitions: int
    timing: dict[str, Any]
    trickle: float
    assignor: str
    steps: list[Step] = field(default_factory=list)
    idle_xacts_per_s: float | None = None
    connections: dict[str, int] = field(default_factory=dict)
    fences: int = 0
    max_poll_interval: float = MAX_POLL_INTERVAL

    @property
    def label(self) -> str:
        t = self.timing
        return (
            f"{self.members} members ({self.processes} processes x {MEMBERS_PER_PROCESS}), "
            f"{self.partitions:,} partitions, {self.assignor}"
            + (
                ""
                if self.max_poll_interval == MAX_POLL_INTERVAL
                else f", max_poll_interval {self.max_poll_interval:g} s"
            )
            + f", heartbeat {t['heartbeat_interval']:g} s / session {t['session_timeout']:g} s"
        )


async def _assignment(mon: asyncpg.Pool, group: str) -> dict[str, str]:
    return {r["name"]: r["member_id"] for r in await mon.fetch(ASSIGNMENT, group)}


async def _group_run(
    dsn: str, schema: str, mon: asyncpg.Pool, members: int, heartbeat: float, trickle: float, window: float
) -> GroupRun:
    """Cold start, idle cost, join, leave, SIGKILL of one group of `members` at the timing of `heartbeat`."""
    timing = TIMINGS[heartbeat]
    processes = members // MEMBERS_PER_PROCESS
    partitions = members * PARTITIONS_PER_MEMBER
    assignor = os.environ.get("BUS_BENCH_SCALE_ASSIGNOR") or ASSIGNOR
    run = GroupRun(members, processes, partitions, timing, trickle, assignor)
    run.max_poll_interval = _env_number("BUS_BENCH_SCALE_MAX_POLL_INTERVAL", MAX_POLL_INTERVAL)
    tag = f"m{members}-hb{str(heartbeat).replace('.', '')}"
    topic, group = f"bench.scale.{tag}", f"scale-{tag}"
    run.connections = await check_connections(mon, processes + 1)
    config = json.dumps(
        {
            **timing,
            **MEMBER_CONFIG,
            "pool_max_size": run.connections["pool_max_size"],
            "max_poll_interval": run.max_poll_interval,
        }
    )
    deliveries = Deliveries()
    started_all: list[MemberProcess] = []
    stop_trickle = asyncio.Event()
    trickler: asyncio.Task[None] | None = None
    b = await bus.connect(
        dsn, schema=schema, cleaner_interval=0, scheduler_interval=0, pool_max_size=PUBLISHER_POOL_MAX_SIZE
    )
    peak = 0

    async def connections() -> None:
        nonlocal peak
        peak = max(peak, int(await mon.fetchval(DATABASE_CONNECTIONS)))

    try:
        await b.create_topic(topic, partitions=partitions)

        async def start(n: int) -> MemberProcess:
            out = deliveries.new_path()
            proc = await MemberProcess.start(
                "subscribe",
                dsn,
                schema,
                group,
                topic,
                "--members",
                str(n),
                "--config",
                config,
                "--out",
                str(out),
                "--assignor",
                assignor,
            )
            started_all.append(proc)  # whatever happens, stopped at the end
            return proc

        procs = await _start_all([start(MEMBERS_PER_PROCESS) for _ in range(processes)])
        [joiner] = await _start_all([start(1)])
        victim = procs[-1]
        steps: list[tuple[str, Callable[[], object], int]] = [
            ("cold start", lambda: [p.send("go") for p in procs], members),
            ("join", lambda: joiner.send("go"), members + 1),
            ("leave", lambda: joiner.proc.send_signal(signal.SIGTERM), members),
            ("SIGKILL", victim.kill, members - MEMBERS_PER_PROCESS),
        ]
        for name, action, expected in steps:
            step = Step(name)
            run.steps.append(step)
            after = await _generation(mon, group)
            before = await _assignment(mon, group)
            t0 = time.time()
            started = time.perf_counter()
            action()
            try:
                _, generation = await _settle(mon, group, partitions, after, expected)
            except TimeoutError as exc:
                step.unsettled = str(exc)
                step.loadavg = _loadavg()
                break
            step.seconds = time.perf_counter() - started
            t1 = time.time()
            step.loadavg = _loadavg()
            step.generations = generation - after
            await connections()
            if name == "cold start":
                run.idle_xacts_per_s = await _idle_rate(mon, window)
                trickler = asyncio.get_running_loop().create_task(
                    _trickle(b, topic, partitions, trickle, stop_trickle, deliveries)
                )
                await asyncio.sleep(2.0)  # the trickle under way before the next step
                continue
            now = await _assignment(mon, group)
            kept = [p for p, owner in now.items() if before.get(p) == owner]
            # The baseline: the same partitions' longest wait in a window as long as the step
            # right after it, when nothing happens (what the load alone does to deliveries).
            q0 = time.time()
            q1 = q0 + min(t1 - t0, QUIET_MAX)
            # Let what was published in the window be handled, then read the logs.
            await asyncio.sleep(max(0.0, q1 - time.time()) + max(2.0, trickle))
            deliveries.refresh()
            waits = [w for p in kept if (w := deliveries.longest_wait(p, t0, t1)) is not None]
            quiet = [w for p in kept if (w := deliveries.longest_wait(p, q0, q1)) is not None]
            step.kept = len(kept)
            step.sampled = len(waits)
            step.longest_wait = max(waits, default=0.0)
            step.quiet_wait = max(quiet, default=0.0)
            step.over_heartbeat = sum(1 for w in waits if w > timing["heartbeat_interval"])
        run.fences = sum(p.stderr_tail(1 << 30).count("member_fenced") for p in started_all)
        await connections()
    finally:
        stop_trickle.set()
        if trickler is not None:
            with contextlib.suppress(Exception):
                await trickler
        await _stop_all(started_all, graceful=False)
        await b.close()
        deliveries.remove()
    run.connections["peak_seen"] = peak
    return run


def _step_bound(run: GroupRun, step: str) -> tuple[float, str]:
    t = run.timing
    if step == "cold start":
        return START_TARGET.get(run.members, START_TARGET[300]), "the cold-start target"
    if step == "SIGKILL":
        return t["session_timeout"] + 5.0, "session timeout + 5 s"
    return t["rebalance_delay"] + 2 * t["heartbeat_interval"], "rebalance delay + 2 heartbeats"


def _run_rows(run: GroupRun) -> list[Result]:
    rows: list[Result] = []
    hb = run.timing["heartbeat_interval"]
    for step in run.steps:
        bound, bound_name = _step_bound(run, step.name)
        extra: dict[str, Any] = {"generations": step.generations, "loadavg": step.loadavg}
        if step.name == "cold start":
            extra.update({**run.timing, "fences": run.fences, "connections": run.connections})
        if step.seconds is None:
            extra["unsettled"] = step.unsettled
            rows.append(
                Result(
                    SCENARIO,
                    f"stable after {step.name}, {run.label}: NOT stable within {SETTLE_TIMEOUT:.0f} s",
                    SETTLE_TIMEOUT,
                    "s",
                    bound,
                    bound_name,
                    higher_is_better=False,
                    target="<= 1.0x",
                    extra=extra,
                )
            )
            break
        rows.append(
            Result(
                SCENARIO,
                f"stable after {step.name}, {run.label}",
                step.seconds,
                "s",
                bound,
                bound_name,
                higher_is_better=False,
                target="<= 1.0x",
                extra=extra,
            )
        )
        if step.longest_wait is not None and step.quiet_wait is not None:
            rows.append(
                Result(
                    SCENARIO,
                    f"longest pause of a partition that kept its owner, {step.name}, {run.label}",
                    step.longest_wait,
                    "s",
                    step.quiet_wait,
                    "same partitions, as long a window with no step",
                    higher_is_better=False,
                    target=f"<= {hb:g} (1 heartbeat)",
                    extra={
                        "trickle_period": run.trickle,
                        "kept": step.kept,
                        "sampled": step.sampled,
                        "paused_over_a_heartbeat": step.over_heartbeat,
                        "loadavg": step.loadavg,
                    },
                )
            )
    if run.idle_xacts_per_s is not None:
        polls = 2 * run.partitions / run.max_poll_interval
        rows.append(
            Result(
                SCENARIO,
                f"idle statements/s (transactions), {run.label}",
                run.idle_xacts_per_s,
                "stmt/s",
                polls,
                f"a fetch and a lease check per partition per max_poll_interval ({run.max_poll_interval:g} s)",
                higher_is_better=False,
                extra={"per_process": round(run.idle_xacts_per_s / run.processes, 2)},
            )
        )
    rows.append(
        Result(
            SCENARIO,
            f"connections, most seen on the run's database, {run.label}",
            run.connections["peak_seen"],
            "conn",
            run.connections["planned"],
            f"plan: (pool_max_size {run.connections['pool_max_size']} + {CONNECTIONS_BESIDE_POOL}) per process + the run's own",
            higher_is_better=False,
            target="<= 1.0x",
            extra=run.connections,
        )
    )
    return rows


async def _idle_growth(dsn: str, schema: str, mon: asyncpg.Pool, window: float) -> dict[str, float]:
    """Idle cost on a small topic by processes and members: 1 x 1, 1 x 10, 5 x 10, 10 x 10."""
    config = json.dumps({**TIMINGS[3.0], **MEMBER_CONFIG})  # the default pool: 11 processes fit
    group = "idle"
    started_all: list[MemberProcess] = []
    rates: dict[str, float] = {}

    async def start(members: int) -> MemberProcess:
        proc = await MemberProcess.start(
            "subscribe", dsn, schema, group, IDLE_TOPIC, "--members", str(members), "--config", config
        )
        started_all.append(proc)
        return proc

    async def go(new: list[MemberProcess], members: int) -> None:
        after = await _generation(mon, group)
        for p in new:
            p.send("go")
        await _settle(mon, group, IDLE_PARTITIONS, after, members)

    try:
        [single] = await _start_all([start(1)])
        await go([single], 1)
        rates["1 process x 1 member"] = await _idle_rate(mon, window)
        await single.stop()
        first = await _start_all([start(MEMBERS_PER_PROCESS)])
        await go(first, MEMBERS_PER_PROCESS)
        rates["1 process x 10 members"] = await _idle_rate(mon, window)
        more = await _start_all([start(MEMBERS_PER_PROCESS) for _ in range(4)])
        await go(more, 5 * MEMBERS_PER_PROCESS)
        rates["5 processes x 10 members"] = await _idle_rate(mon, window)
        rest = await _start_all([start(MEMBERS_PER_PROCESS) for _ in range(IDLE_PROCESSES - 5)])
        await go(rest, IDLE_PROCESSES * MEMBERS_PER_PROCESS)
        rates[f"{IDLE_PROCESSES} processes x 10 members"] = await _idle_rate(mon, window)
    finally:
        await _stop_all(started_all, graceful=False)
    return rates


def _idle_rows(rates: dict[str, float]) -> list[Result]:
    base = rates["1 process x 1 member"]
    rows = [
        Result(
            SCENARIO,
            f"idle statements/s (transactions), {name}, heartbeat 3 s",
            rate,
            "stmt/s",
            base,
            "1 process x 1 member",
            higher_is_better=False,
        )
        for name, rate in rates.items()
    ]
    last = rates[f"{IDLE_PROCESSES} processes x 10 members"]
    rows.append(
        Result(
            SCENARIO,
            "idle statements/s growth, 1 -> 10 members in one process",
            rates["1 process x 10 members"] / max(base, 1e-9),
            "x",
            higher_is_better=False,
            target="<= 2",
            extra={
                f"process_growth_1_to_{IDLE_PROCESSES}": round(
                    last / max(rates["1 process x 10 members"], 1e-9), 2
                )
            },
        )
    )
    return rows


async def _group_runs(dsn: str, quick: bool) -> tuple[list[Result], dict[str, Any]]:
    """The idle cost by processes and members, then every group size at every timing."""
    window = _env_number("BUS_BENCH_SCALE_WINDOW", 4.0 if quick else 10.0)
    sizes = [int(m) for m in _env_list("BUS_BENCH_SCALE_MEMBERS", "20" if quick else "100,300")]
    heartbeats = _env_list("BUS_BENCH_SCALE_TIMINGS", "3,0.5")
    for m in sizes:
        if m <= MEMBERS_PER_PROCESS or m % MEMBERS_PER_PROCESS:
            raise ValidationError(f"BUS_BENCH_SCALE_MEMBERS: {m} is not a multiple of 10 above 10")
    unknown = [h for h in heartbeats if h not in TIMINGS]
    if unknown:
        raise ValidationError(f"BUS_BENCH_SCALE_TIMINGS: {unknown} not among {sorted(TIMINGS)}")
    schema = "bench_scale"
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0, scheduler_interval=0)
    await b.create_topic(IDLE_TOPIC, partitions=IDLE_PARTITIONS)
    await b.close()
    mon = await create_pool(dsn, schema, min_size=1, max_size=MONITOR_CONNECTIONS)
    rows: list[Result] = []
    data: dict[str, Any] = {"runs": []}
    try:
        if os.environ.get("BUS_BENCH_SCALE_IDLE_GROWTH", "1") != "0":
            rates = await _idle_growth(dsn, schema, mon, window)
            data["idle_xacts_per_s"] = rates
            rows += _idle_rows(rates)
        for members in sizes:
            for heartbeat in heartbeats:
                period = _env_number(
                    "BUS_BENCH_SCALE_TRICKLE", members * PARTITIONS_PER_MEMBER / TRICKLE_RATE
                )
                run = await _group_run(dsn, schema, mon, members, heartbeat, period, window)
                data["runs"].append(run)
                rows += _run_rows(run)
    finally:
        await mon.close()
    return rows, data


async def _claims_rows(dsn: str, quick: bool) -> tuple[list[Result], dict[str, Any]]:
    partitions = int(_env_number("BUS_BENCH_SCALE_CLAIMS_PARTITIONS", 10_000 if quick else 100_000))
    count = 50 if quick else 300
    small = await claims._cost(dsn, 100, min(count, 100 - 1 - claims.WARMUP))
    large = await claims._cost(dsn, partitions, count)
    row = Result(
        SCENARIO,
        f"claim + ack, {partitions:,} partitions (baseline: 100)",
        large,
        "ms",
        small,
        "same, 100 partitions",
        higher_is_better=False,
        target="<= 2.0x the 100-partition cost",
        extra={"claims": count},
    )
    return [row], {"claims_partitions": partitions, "claim_ms": large, "claim_ms_100": small}


def chart(data: dict[str, Any], path: Path) -> Path:
    """Three panels: time to stable by run and step, idle statements/s by processes x members, claim cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    runs: list[GroupRun] = data["runs"]
    names = ["cold start", "join", "leave", "SIGKILL"]
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        by = {s.name: s for s in run.steps}
        values = [by[n].seconds if n in by and by[n].seconds is not None else 0.0 for n in names]
        label = f"{run.members} m, hb {run.timing['heartbeat_interval']:g} s"
        ax.bar([j + i * width for j in range(len(names))], values, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("seconds to stable and leased")
    ax.set_title("Groups: time to stable")
    ax.legend(fontsize=7)
    ax = axes[1]
    rates = data.get("idle_xacts_per_s", {})
    ax.bar([label.replace(" x ", "\nx ") for label in rates], list(rates.values()), color="#2f855a")
    for i, v in enumerate(rates.values()):
        ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom")
    ax.set_ylabel("transactions/s while idle")
    ax.set_title("What an idle group costs the database")
    ax = axes[2]
    if "claim_ms" in data:
        ax.bar(
            ["100 partitions", f"{data['claims_partitions']:,} partitions"],
            [data["claim_ms_100"], data["claim_ms"]],
            color=["#a0aec0", "#2b6cb0"],
        )
        ax.axhline(2 * data["claim_ms_100"], color="black", linestyle="--", label="target: 2x")
        ax.legend()
    ax.set_ylabel("ms per claim + ack")
    ax.set_title("Claims with many partitions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run(dsn: str, quick: bool) -> list[Result]:
    """The groups at 100 and 300 members, the idle cost, the claims at 100,000 partitions; writes the chart."""
    database = "bench_scale_" + uuid.uuid4().hex[:10]
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(CREATE_DATABASE.format(name=database))  # generated name
    finally:
        await admin.close()
    try:
        rows, data = await _group_runs(_with_database(dsn, database), quick)
    finally:
        admin = await asyncpg.connect(dsn)
        try:
            await admin.execute(DROP_DATABASE.format(name=database))
        finally:
            await admin.close()
    if os.environ.get("BUS_BENCH_SCALE_CLAIMS", "1") != "0":
        claim_rows, claim_data = await _claims_rows(dsn, quick)
        data.update(claim_data)
        rows += claim_rows
    stem = date.today().isoformat() + ("-quick" if quick else "") + "-scale"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = chart(data, RESULTS_DIR / f"{stem}.png")
    if rows:
        rows[0].extra["chart"] = path.name
    return rows


if __name__ == "__main__":
    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for r in asyncio.run(run(target, quick="--quick" in sys.argv)):
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        extra = {
            k: v
            for k, v in r.extra.items()
            if k
            in (
                "generations",
                "loadavg",
                "kept",
                "sampled",
                "paused_over_a_heartbeat",
                "per_process",
                "fences",
                "unsettled",
            )
        }
        print(f"{r.name:150s} {r.value:9.3f} {r.unit:7s} base {r.baseline or 0:8.3f} {ratio:7s} {extra}")
