"""Scale: a group of 100 members (10 processes x 10) over 1,000 partitions, and claims over 100,000 partitions.

1. **Time to stable** of a 100-member group (10 member processes hosting 10
   subscriptions each, `benchmarks/groups_member.py`) over a 1,000-partition
   topic: after a member joins (an 11th process, one member, started before
   and told to go), after it leaves (SIGTERM: it leaves cleanly) and after
   SIGKILL of one of the ten processes (its 10 members vanish without a word:
   the session timeout has to find them). "Stable" is the group in state
   `stable` at a new generation with the expected member count and every
   assigned partition leased by its assignee (the groups benchmark's check).
   Baseline: what the timings allow at best (rebalance delay + heartbeat
   interval; for the kill, + the session timeout).
2. **What heartbeats cost the database**: transactions per second of an idle
   group (no messages: heartbeats, lease renewals and whatever else members
   do while idle), counted in `pg_stat_database.xact_commit` of a database
   made for the run, so nothing else on the server counts. Every bus
   statement outside an explicit transaction is one transaction, so this is
   statements per second (an upper bound on them). Measured for 1 process x
   1 member, 1 x 10, 5 x 10 and 10 x 10: it must grow with processes (one
   HeartbeatMonitor per process beats for all its members in one statement),
   not with members.
3. **Claims at 100,000 partitions**: `benchmarks/claims.py`'s claim + ack loop
   on a dynamic topic with 100,000 pending partitions next to 100 (target:
   at most 2x the cost per claim).

The chart goes to `benchmarks/results/<date>-scale.png`. Knobs (environment):
BUS_BENCH_SCALE_CLAIMS_PARTITIONS (default 100,000; --quick 10,000),
BUS_BENCH_SCALE_WINDOW (seconds per idle measurement, default 10; --quick 4).
Everything runs against the given DSN (the embedded server on 127.0.0.1),
processes are stopped at the end, and every wait has a timeout.

Run it alone with `bus bench scale` (or `python -m benchmarks.scale`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
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

SCENARIO = "scale"
TOPIC = "bench.scale"
PARTITIONS = 1_000
PROCESSES = 10
MEMBERS_PER_PROCESS = 10
GROUP = "scale"
IDLE_TOPIC = "bench.idle"
IDLE_PARTITIONS = 100
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Timings for a hundred members on two shared cores: quick enough to measure,
# slow enough that a busy machine does not expire healthy sessions.
TIMINGS: dict[str, Any] = {
    "heartbeat_interval": 3.0,
    "session_timeout": 30.0,
    "rebalance_delay": 0.5,
    "lease_time": 30.0,
    "cleaner_interval": 0,
}
SETTLE_TIMEOUT = 180.0

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


def _with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return default if not raw else float(raw)


async def _settle(
    mon: asyncpg.Pool, group: str, partitions: int, after: int, members: int
) -> tuple[float, int]:
    """Seconds until `group` is stable past generation `after` with `members` members; and that generation."""
    started = time.perf_counter()

    async def settled() -> int | None:
        row = await mon.fetchrow(SETTLED, group, after, members, partitions)
        return int(row["generation"]) if row is not None and row["settled"] else None

    try:
        generation = await _until(settled, SETTLE_TIMEOUT, f"{group}: {members} members stable")
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


async def _group_runs(dsn: str, quick: bool) -> tuple[list[Result], dict[str, Any]]:
    """Idle cost by processes and members (group "idle"), then join/leave/kill on the 100-member group."""
    window = _env_number("BUS_BENCH_SCALE_WINDOW", 4.0 if quick else 10.0)
    schema = "bench_scale"
    config = json.dumps(TIMINGS)
    b = await bus.connect(dsn, schema=schema, cleaner_interval=0)
    mon = await create_pool(dsn, schema, min_size=1, max_size=2)
    started_all: list[MemberProcess] = []
    rates: dict[str, float] = {}
    data: dict[str, Any] = {}
    try:
        await b.create_topic(TOPIC, partitions=PARTITIONS)
        await b.create_topic(IDLE_TOPIC, partitions=IDLE_PARTITIONS)
        await b.close()

        async def start(group: str, topic: str, members: int) -> MemberProcess:
            proc = await MemberProcess.start(
                "subscribe", dsn, schema, group, topic, "--members", str(members), "--config", config
            )
            started_all.append(proc)  # whatever happens, stopped at the end
            return proc

        async def go(group: str, partitions: int, new: list[MemberProcess], members: int) -> float:
            after = await _generation(mon, group)
            for p in new:
                p.send("go")
            seconds, _ = await _settle(mon, group, partitions, after, members)
            return seconds

        # 1. Idle cost on a small topic (so no process holds many partitions):
        # 1 process x 1 member, then 1 x 10, 5 x 10, 10 x 10.
        idle = ("idle", IDLE_PARTITIONS)
        [single] = await _start_all([start("idle", IDLE_TOPIC, 1)])
        await go(*idle, [single], 1)
        rates["1 process x 1 member"] = await _idle_rate(mon, window)
        await single.stop()
        first = await _start_all([start("idle", IDLE_TOPIC, MEMBERS_PER_PROCESS)])
        await go(*idle, first, MEMBERS_PER_PROCESS)
        rates["1 process x 10 members"] = await _idle_rate(mon, window)
        more = await _start_all([start("idle", IDLE_TOPIC, MEMBERS_PER_PROCESS) for _ in range(4)])
        await go(*idle, more, 5 * MEMBERS_PER_PROCESS)
        rates["5 processes x 10 members"] = await _idle_rate(mon, window)
        rest = await _start_all(
            [start("idle", IDLE_TOPIC, MEMBERS_PER_PROCESS) for _ in range(PROCESSES - 5)]
        )
        await go(*idle, rest, PROCESSES * MEMBERS_PER_PROCESS)
        rates["10 processes x 10 members"] = await _idle_rate(mon, window)
        await _stop_all(started_all)  # they leave cleanly
        started_all.clear()

        # 2. The 100-member group over 1,000 partitions: start, join, leave, SIGKILL.
        # A step that does not settle within SETTLE_TIMEOUT is recorded as such
        # (with the group's state) and the steps after it are not measured.
        full = PROCESSES * MEMBERS_PER_PROCESS
        procs = await _start_all([start(GROUP, TOPIC, MEMBERS_PER_PROCESS) for _ in range(PROCESSES)])
        [joiner] = await _start_all([start(GROUP, TOPIC, 1)])
        victim = procs[-1]
        steps: list[tuple[str, Any, int]] = [
            ("start_s", lambda: [p.send("go") for p in procs], full),
            ("join_s", lambda: joiner.send("go"), full + 1),
            ("leave_s", lambda: joiner.proc.send_signal(signal.SIGTERM), full),
            ("kill_s", victim.kill, full - MEMBERS_PER_PROCESS),
        ]
        for key, action, members in steps:
            after = await _generation(mon, GROUP)
            started = time.perf_counter()
            action()
            try:
                await _settle(mon, GROUP, PARTITIONS, after, members)
            except TimeoutError as exc:
                data["unsettled"] = f"{key.removesuffix('_s')}: {exc}"
                break
            data[key] = time.perf_counter() - started
        data["fences"] = sum(p.stderr_tail(1 << 30).count("member_fenced") for p in [*procs, joiner])
    finally:
        await _stop_all(started_all, graceful=False)
        await mon.close()
    data["idle_xacts_per_s"] = rates
    return _group_rows(data), data


def _group_rows(data: dict[str, Any]) -> list[Result]:
    t = TIMINGS
    best = t["rebalance_delay"] + t["heartbeat_interval"]
    rates = data["idle_xacts_per_s"]
    members_growth = rates["1 process x 10 members"] / max(rates["1 process x 1 member"], 1e-9)
    process_growth = rates["10 processes x 10 members"] / max(rates["1 process x 10 members"], 1e-9)
    where = f"{PROCESSES * MEMBERS_PER_PROCESS} members ({PROCESSES} processes x {MEMBERS_PER_PROCESS}), {PARTITIONS:,} partitions"
    steps = [
        ("start_s", "stable from cold (10 processes told to go together)", None, None),
        ("join_s", "stable after a join (101st member)", best, "rebalance delay + heartbeat interval"),
        ("leave_s", "stable after that member leaves", best, "rebalance delay + heartbeat interval"),
        (
            "kill_s",
            "stable after SIGKILL of 1 process (10 members)",
            best + t["session_timeout"],
            "session timeout + rebalance delay + heartbeat interval",
        ),
    ]
    rows: list[Result] = []
    for key, what, baseline, baseline_name in steps:
        extra: dict[str, Any] = {**t, "fences": data.get("fences")} if key == "start_s" else {}
        if key in data:
            rows.append(
                Result(
                    SCENARIO,
                    f"{what}, {where}",
                    data[key],
                    "s",
                    baseline,
                    baseline_name,
                    higher_is_better=False,
                    extra=extra,
                )
            )
        else:
            # Not settled within SETTLE_TIMEOUT (or an earlier step did not): the row says so.
            extra["unsettled"] = data.get("unsettled")
            rows.append(
                Result(
                    SCENARIO,
                    f"{what}, {where}: NOT stable within {SETTLE_TIMEOUT:.0f} s",
                    SETTLE_TIMEOUT,
                    "s",
                    baseline,
                    baseline_name,
                    higher_is_better=False,
                    target=f"< {SETTLE_TIMEOUT:.0f}",
                    extra=extra,
                )
            )
    for name, rate in rates.items():
        rows.append(
            Result(
                SCENARIO,
                f"idle statements/s (transactions), {name}",
                rate,
                "stmt/s",
                rates["1 process x 1 member"],
                "1 process x 1 member",
                higher_is_better=False,
            )
        )
    rows.append(
        Result(
            SCENARIO,
            "idle statements/s growth, 1 -> 10 members in one process",
            members_growth,
            "x",
            higher_is_better=False,
            target="<= 2",
            extra={"process_growth_1_to_10": round(process_growth, 2)},
        )
    )
    return rows


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
    """Three panels: time to stable, idle statements/s by processes x members, claim cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    keys = ["start_s", "join_s", "leave_s", "kill_s"]
    names = ["cold start", "join", "leave", "SIGKILL\n(10 members)"]
    values = [data.get(k, SETTLE_TIMEOUT) for k in keys]
    colors = ["#2b6cb0" if k in data else "#e53e3e" for k in keys]
    ax.bar(names, values, color=colors)
    ax.axhline(TIMINGS["session_timeout"], color="grey", linestyle="--", label="session timeout")
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        ax.annotate(f"{v:.1f} s" if k in data else "not stable", (i, v), ha="center", va="bottom")
    ax.set_ylabel("seconds to stable")
    ax.set_title(f"100 members over {PARTITIONS:,} partitions")
    ax.legend()
    ax = axes[1]
    rates = data["idle_xacts_per_s"]
    labels = list(rates)
    ax.bar([label.replace(" x ", "\nx ") for label in labels], list(rates.values()), color="#2f855a")
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
    """The group at 100 members, the idle cost, the claims at 100,000 partitions; writes the chart."""
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
    claim_rows, claim_data = await _claims_rows(dsn, quick)
    data.update(claim_data)
    stem = date.today().isoformat() + ("-quick" if quick else "") + "-scale"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = chart(data, RESULTS_DIR / f"{stem}.png")
    rows[0].extra["chart"] = path.name
    return rows + claim_rows


if __name__ == "__main__":
    from bus.server.embedded import ensure_server

    target = os.environ.get("BUS_DSN") or ensure_server().dsn
    for r in asyncio.run(run(target, quick="--quick" in sys.argv)):
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        print(f"{r.name:90s} {r.value:10.3f} {r.unit:7s} baseline {r.baseline or 0:10.3f} ratio {ratio}")
