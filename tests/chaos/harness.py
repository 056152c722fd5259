"""The chaos run: a dedicated PostgreSQL, producers, the loops users write, random faults.

`run_chaos(seconds, seed)` starts an embedded server of its own (so restarting
it disturbs no other test), a pubsub topic `orders`, a queue topic `jobs` and
an event store, one producer process for each, and member processes (ROLES):
each process runs one member of several groups, each group a usage pattern of
README.md / API.md (see tests/chaos/member.py): handler subscriptions (one
with retries and a dead-letter topic), poll + commit, commit_async,
auto-commit, `c.transaction()`, `commit(connection=)` + `rewind()`, claims,
queue consumers and event-store claims with guards. It samples every cursor
every 100 ms and injects faults chosen by a seeded random generator:

- `kill`: SIGKILL a member process, start a replacement;
- `terminate_backends`: `pg_terminate_backend` every bus connection;
- `restart`: restart PostgreSQL (same port);
- `outage`: stop PostgreSQL (`-m fast`), leave it stopped for 20-90 s (never
  longer than the run's fault time, so the bounded run's is 20-25 s), and
  start it again on the same port: every process rides it out with its Bus
  open (the members' sessions run out meanwhile: they are fenced and join
  again); it waits for every member to have joined first, so no process is
  starting (connecting) while the server is away;
- `zombie`: SIGSTOP a member process past its session, then SIGCONT;
- `slow`: make the slow process's handler block it past its lease;
- `rebalance`: start one more process of a role (its members join every group
  of the role), let it work a few seconds, stop it gracefully (they leave):
  two rebalances while the other members' transactions are open;
- `long_transaction`: another session (a report, a `pg_dump`) holds a
  REPEATABLE READ snapshot for several seconds while the other faults go on:
  no row version written meanwhile can be vacuumed. It excuses nothing: a
  duplicate or a stall during it is a finding.
- `failover` (only with `ha=True`): crash the primary and promote its
  synchronous standby (scripts/pgha.sh); every process reconnects through the
  multi-host DSN. There is one standby, so a run has at most one failover.

`run_chaos(..., pooler="tx")` drives that one pattern with every member and
producer process going through PgBouncer in transaction mode
(scripts/pgbouncer.sh; `pooler="transaction"`, LISTEN on `direct_dsn`).

`run_chaos(..., ha=True)` runs against a PostgreSQL 15 primary and synchronous
standby (scripts/pgha.sh) instead of the embedded server; `restart` and
`outage` are left out there (the fault for that server is `failover`), and
runs of one pattern (`pooler`, `patterns`) leave `outage` out too: it stops
everything for longer than such a short run lasts.

Then it stops the producers, lets every group drain, stops the members
gracefully, collects the user's table, the dead-letter topics and the event
store's log, and returns the recorded `History` with what went wrong outside
the checker's reach (processes that died on their own, a drain that never
finished). The faults the bus itself, or a member's loop, reported (its "V"
lines) join the injected ones in the history (see the checker's OBSERVED).

With CHAOS_KEEP=1 the recordings stay, injected faults and the collected
tables included; `python -m tests.chaos.harness OUTDIR` checks them again
(without the cursor samples, which are not kept).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import msgspec

import bus
from bus.consumer import Consumer
from bus.server.embedded import ensure_server, restart_server, stop_server
from tests.chaos.checker import (
    Ack,
    DeadLetter,
    Delivery,
    Fault,
    History,
    JobTake,
    QueueLimits,
    Row,
    Sample,
    StoreItem,
    Tally,
    UserAck,
)
from tests.chaos.member import (
    CREATE_USER_TABLE,
    LQUEUE,
    LQUEUE_PER_KEY,
    LQUEUE_RATE,
    LQUEUE_VISIBILITY,
    QUEUE,
    SCHEDULE,
    SCHEDULE_CRON,
    SCHEDULE_EVERY,
    STORE,
    TOPIC,
    USER_TABLE,
    Item,
    poison,
)
from tests.chaos.member import Tally as TallyEvent

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "chaos"
PARTITIONS = 6
# (what, prefix, messages per second): the pubsub topic every group but two reads, the queue, the store.
PRODUCERS: list[tuple[str, str, float]] = [
    (TOPIC, "p", 100.0),
    (QUEUE, "q", 30.0),
    (f"es:{STORE}", "e", 15.0),
    (f"lq:{LQUEUE}", "l", 10.0),
]

# Sessions long enough to ride out a PostgreSQL restart, short enough that a zombie is swept quickly.
MEMBER_CONFIG: dict[str, float] = dict(
    heartbeat_interval=0.3,
    session_timeout=3.0,
    rebalance_delay=0.2,
    max_poll_interval=0.5,
    lease_time=4.0,
    claim_ttl=3.0,
)
# The slow member: a short lease, and a stall longer than it (but shorter than its session).
SLOW_CONFIG: dict[str, float] = {**MEMBER_CONFIG, "lease_time": 1.0, "slow_seconds": 2.0}
ZOMBIE_PAUSE = MEMBER_CONFIG["session_timeout"] + 2.0
# How long a `long_transaction` fault holds its snapshot (seconds, drawn uniformly).
LONG_TRANSACTION = (5.0, 15.0)
# Events a member records ("V" lines) that re-deliver from the last commit: observed fault kinds.
EVENT_FAULTS = {
    "member_fenced": "fenced",
    "lease_lost": "lease_lost",
    "release_failed": "release_failed",
    "actor.restarting": "actor_restart",
    "loop_lag": "loop_lag",
    "rolled_back": "rolled_back",
    "nacked": "nacked",
    "abandoned": "abandoned",
    "guard_conflict": "guard_conflict",
    "slow_work": "slow_work",
    "claim_failed": "ack_failed",
    "queue_failed": "ack_failed",
    "es_failed": "ack_failed",
    "commit_failed": "ack_failed",
}

# role -> (processes, index of the slow one or -1, [(group, pattern, assignor)]): one process runs
# one member of each of its role's groups.
ROLES: dict[str, tuple[int, int, list[tuple[str, str, str]]]] = {
    "H": (2, 0, [("g-range", "handler", "range"), ("g-dlq", "handler-dlq", "sticky")]),
    "P": (
        2,
        -1,
        [("g-poll", "poll", "roundrobin"), ("g-async", "commit-async", "range"), ("g-auto", "auto", "range")],
    ),
    "T": (2, -1, [("g-tx", "tx", "range"), ("g-txlow", "txlow", "range"), ("g-txh", "txh", "range")]),
    "L": (2, -1, [("g-claims", "claims", "-"), ("q-jobs", "queue", "-"), ("es-g", "es", "-")]),
    "Q": (2, 0, [("q-limited", "lqueue", "-")]),
}
# Patterns a run drives only when asked for (CHAOS_PATTERNS, or run_chaos(patterns=...)).
OPT_IN_PATTERNS = frozenset({"lqueue"})
# Groups whose processes a `rebalance` fault grows and shrinks.
REBALANCED_ROLES = ("T", "T", "P")
# CHAOS_KINDS=restart,kill narrows a run to some faults; CHAOS_PATTERNS=tx,txlow to some patterns.
KINDS = tuple(
    k
    for k in os.environ.get(
        "CHAOS_KINDS", "kill,terminate_backends,restart,outage,zombie,slow,rebalance,long_transaction"
    ).split(",")
    if k
)
#: The faults that run in the background, recorded when they end.
BACKGROUND_KINDS = frozenset({"rebalance", "long_transaction"})
#: The name a fault kind is recorded under, where it differs (a `slow` request's interval comes later).
RECORDED_AS = {"slow": "slow_request"}
#: The faults of a run against the HA pair: `restart` and `outage` are the embedded server's; `failover` comes first.
HA_KINDS = ("failover",) + tuple(k for k in KINDS if k not in ("restart", "outage"))
#: How long an `outage` fault keeps the server stopped (seconds, drawn uniformly; capped at the run's length).
OUTAGE = (20.0, 90.0)
PGHA = ROOT / "scripts" / "pgha.sh"
PGBOUNCER = ROOT / "scripts" / "pgbouncer.sh"
ONLY_PATTERNS = frozenset(p for p in os.environ.get("CHAOS_PATTERNS", "").split(",") if p)

SAMPLE = """
SELECT o.group_name, p.topic, p.name, o.committed, o.owner, o.lease_epoch, inet_server_port()
FROM offsets o JOIN partitions p ON p.id = o.partition_id
"""
LAGGING = """
SELECT count(*) FILTER (WHERE o.committed < p.log_end) AS lagging, count(*) AS cursors
FROM offsets o JOIN partitions p ON p.id = o.partition_id WHERE p.topic = $1
"""
PENDING_JOBS = "SELECT count(*) FROM queue_jobs WHERE topic = $1"
TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = 'bus' AND pid <> pg_backend_pid()
"""
USER_ROWS = "SELECT grp, topic, part, off, msg_id FROM user_rows"
OPEN_TRANSACTIONS = """
SELECT pid, application_name, state, now() - xact_start AS open_for, left(query, 120) AS query
FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' OR (state = 'active' AND now() - xact_start > '5 s')
"""
HELD_CURSORS = """
SELECT o.group_name, p.name, o.committed, p.log_end, o.owner, o.lease_epoch, o.lease_expires_at
FROM offsets o JOIN partitions p ON p.id = o.partition_id WHERE p.topic = $1 AND o.committed < p.log_end
"""
ES_CURSORS = """
SELECT group_name, vals, position, next_position, claimed_by, claimed_at, attempts, retry_at
FROM es_offsets WHERE store = $1
"""


def patterns_in_use(only: frozenset[str] = ONLY_PATTERNS) -> dict[str, list[tuple[str, str, str]]]:
    """Each role's groups this run drives (CHAOS_PATTERNS narrows; `tx` needs Consumer.transaction)."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for role, (_, _, members) in ROLES.items():
        chosen = (
            [m for m in members if m[1] in only]
            if only
            else [m for m in members if m[1] not in OPT_IN_PATTERNS]
        )
        if not hasattr(Consumer, "transaction"):
            chosen = [m for m in chosen if m[1] != "tx"]
        if chosen:
            out[role] = chosen
    return out


@dataclass
class Slot:
    """A member process position; a killed process's replacement takes the same slot."""

    name: str
    role: str
    slow: bool
    proc: subprocess.Popen[bytes] | None = None
    started: int = 0

    @property
    def log(self) -> str:
        return f"{self.name}-{self.started}.log"


@dataclass
class Outcome:
    """What a chaos run produced besides the history."""

    seed: int
    history: History
    problems: list[str] = field(default_factory=list)
    member_errors: Counter[str] = field(default_factory=Counter)
    publish_failures: int = 0
    drained_in: float | None = None
    skipped: list[str] = field(default_factory=list)


class ChaosRun:
    """One chaos run; see the module docstring."""

    def __init__(
        self,
        seconds: float,
        seed: int,
        *,
        ha: bool = False,
        pooler: str | None = None,
        patterns: frozenset[str] = frozenset(),
        every_kind: bool = False,
    ) -> None:
        self.seconds = seconds
        # `every_kind`: the faults go on past `seconds` until each kind of the run has fired once.
        self.every_kind = every_kind
        self.ha = ha
        # `pooler`: the one pattern this run drives, its processes through PgBouncer in transaction mode.
        self.pooler = pooler
        self.child_env: dict[str, str] = {}
        self.kinds = HA_KINDS if ha else KINDS
        if pooler or patterns:
            self.kinds = tuple(k for k in self.kinds if k != "outage")
        self.failed_over = False
        self.seed = seed
        self.rng = random.Random(seed)
        self.home = Path(tempfile.mkdtemp(prefix="bus-chaos-"))
        self.out = self.home / "out"
        self.out.mkdir()
        self.dsn = ""
        only = frozenset({pooler}) if pooler else patterns
        self.roles = patterns_in_use(only) if only else patterns_in_use()
        self.slots: list[Slot] = []
        self.extra = 0
        self.extras: list[Slot] = []  # the rebalance fault's short-lived processes
        self.background: list[asyncio.Task[None]] = []
        self.producers: list[subprocess.Popen[bytes]] = []
        self.faults: list[Fault] = []
        self.fault_file = self.out / "faults.tsv"
        self.samples: list[Sample] = []
        self.problems: list[str] = []
        self.expected_exit: set[int] = set()
        self._sampling = True

    @property
    def groups(self) -> list[tuple[str, str, str]]:
        return [m for members in self.roles.values() for m in members]

    # -- processes -------------------------------------------------------------------

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.out / log_name, "ab")  # noqa: SIM115 (the child owns it for its life)
        try:
            # The DSN (with its password) reaches the child through its environment, not its command line.
            return subprocess.Popen(
                [sys.executable, "-m", *args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "BUS_DSN": self.dsn, **self.child_env},
            )
        finally:
            log.close()

    def _start_member(self, slot: Slot) -> None:
        slot.started += 1
        tag = f"{slot.name}-{slot.started}"
        config = SLOW_CONFIG if slot.slow else MEMBER_CONFIG
        spec = ",".join(":".join(m) for m in self.roles[slot.role])
        slot.proc = self._spawn(
            [
                "tests.chaos.member",
                "-",  # the DSN: $BUS_DSN
                SCHEMA,
                str(self.out / f"{tag}.tsv"),
                "1" if slot.slow else "0",
                spec,
                *(f"{k}={v}" for k, v in config.items()),
            ],
            slot.log,
        )

    def _check_alive(self) -> None:
        """A member that died without being killed is a bug: record it with its log, replace it."""
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and proc.poll() is not None and proc.pid not in self.expected_exit:
                tail = (self.out / slot.log).read_text(errors="replace")[-2000:]
                self.problems.append(
                    f"member {slot.name} (pid {proc.pid}) exited by itself with code {proc.returncode}:\n{tail}"
                )
                self._start_member(slot)
        for i, producer in enumerate(self.producers):
            if producer.poll() is not None and producer.pid not in self.expected_exit:
                tail = (self.out / f"producer-{i}.log").read_text(errors="replace")[-2000:]
                self.problems.append(
                    f"producer {i} exited by itself with code {producer.returncode}:\n{tail}"
                )
                self.expected_exit.add(producer.pid)

    def _joined(self, slot: Slot) -> bool:
        return "joined" in (self.out / slot.log).read_text(errors="replace")

    # -- sampling --------------------------------------------------------------------

    async def _connect(self, name: str) -> asyncpg.Connection:
        return await asyncpg.connect(
            self.dsn, server_settings={"search_path": SCHEMA, "application_name": name}
        )

    async def _sampler(self) -> None:
        conn: asyncpg.Connection | None = None
        while self._sampling:
            try:
                if conn is None or conn.is_closed():
                    conn = await self._connect("chaos-sampler")
                rows = await conn.fetch(SAMPLE)
                t = time.time()
                self.samples.extend(Sample(t, r[0], r[1], r[2], r[3], r[4], r[5], r[6] or 0) for r in rows)
            except Exception:  # the observer must outlive any fault: drop the connection, reconnect
                if conn is not None:
                    conn.terminate()
                conn = None
            await asyncio.sleep(0.1)
        if conn is not None and not conn.is_closed():
            await conn.close()

    # -- faults ----------------------------------------------------------------------

    def _pick_member(self, *, slow: bool | None = None, joined: bool = False) -> Slot | None:
        """A running member (of the slow slots or the others); with `joined`, one that has said so."""
        live = [
            s
            for s in self.slots
            if s.proc is not None
            and s.proc.poll() is None
            and (slow is None or s.slow == slow)
            and (not joined or self._has_joined(s))
        ]
        return self.rng.choice(live) if live else None

    async def _wait_joined(self, within: float) -> None:
        """Until every member process (the rebalance fault's too) has joined, for at most `within` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            running = [s for s in self.slots + self.extras if s.proc is not None and s.proc.poll() is None]
            if all(self._has_joined(s) for s in running):
                return
            await asyncio.sleep(0.2)

    def _has_joined(self, slot: Slot) -> bool:
        """Whether the slot's current process printed "joined" (its SIGUSR1 handler is in place by then)."""
        log = self.out / slot.log
        return log.exists() and b"joined" in log.read_bytes()

    async def _inject(self, kind: str) -> None:
        t0 = time.time()
        if kind == "kill":
            slot = self._pick_member()
            if slot is None or slot.proc is None:
                return
            pid = slot.proc.pid
            self.expected_exit.add(pid)
            slot.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(slot.proc.wait)
            self._record(Fault("kill", t0, t0, pid, slot.name))
            self._start_member(slot)
        elif kind == "terminate_backends":
            conn = await self._connect("chaos-admin")
            try:
                n = await conn.fetchval(TERMINATE)
            finally:
                await conn.close()
            self._record(Fault("terminate_backends", t0, time.time(), None, f"{n} connections"))
        elif kind == "restart":
            await asyncio.to_thread(restart_server, self.home)
            self._record(Fault("restart", t0, time.time(), None))
        elif kind == "outage":
            # Not while a process starts or stops: it would meet the server away while connecting or leaving.
            await asyncio.gather(*(t for t in self.background if t.get_name() == "rebalance"))
            await self._wait_joined(within=30.0)
            down = self.rng.uniform(OUTAGE[0], max(OUTAGE[0], min(OUTAGE[1], self.seconds)))
            t0 = time.time()
            await asyncio.to_thread(restart_server, self.home, down=down)
            self._record(Fault("outage", t0, time.time(), None, f"server stopped {down:.1f} s"))
        elif kind == "failover":
            if self.failed_over:  # one standby: a second failover has nothing to promote
                return
            self.failed_over = True
            await asyncio.to_thread(self._pgha, "stop-primary")
            await asyncio.to_thread(self._pgha, "promote")
            self._record(Fault("failover", t0, time.time(), None, "standby promoted"))
        elif kind == "zombie":
            slot = self._pick_member(slow=False)
            if slot is None or slot.proc is None:
                return
            pid = slot.proc.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(ZOMBIE_PAUSE)
            finally:
                os.kill(pid, signal.SIGCONT)
            self._record(Fault("zombie", t0, time.time(), pid, slot.name))
        elif kind == "slow":
            # Not a process that has just been started (after a kill): until its handler is in place,
            # SIGUSR1 would end it.
            slot = self._pick_member(slow=True, joined=True)
            if slot is None or slot.proc is None:
                return
            slot.proc.send_signal(signal.SIGUSR1)
            # The interval comes from the member's own "S start/end" lines; this marks the request.
            self._record(Fault("slow_request", t0, t0, slot.proc.pid, slot.name))
        elif kind == "rebalance":
            # In the background: joining takes seconds (a process starting), other faults go on meanwhile.
            self.background.append(asyncio.create_task(self._rebalance(t0), name="rebalance"))
        elif kind == "long_transaction":
            # In the background too: the snapshot stays while the next faults come.
            self.background.append(asyncio.create_task(self._long_transaction(t0)))

    async def _long_transaction(self, t0: float) -> None:
        """Another session holds a REPEATABLE READ snapshot (the xmin horizon) for a while, then ends it."""
        hold = self.rng.uniform(*LONG_TRANSACTION)
        detail = f"REPEATABLE READ snapshot held {hold:.1f} s"
        try:
            conn = await self._connect("chaos-long-transaction")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # a restart in progress
            self._record(Fault("long_transaction", t0, time.time(), None, f"not started: {exc!r}"))
            return
        try:
            await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await conn.fetchval("SELECT count(*) FROM offsets")  # the snapshot is taken here
            await asyncio.sleep(hold)
            await conn.execute("ROLLBACK")
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError) as exc:
            # a restart or a terminated backend ended it early (asyncpg may answer that with either error)
            detail += f", ended early: {exc!r}"
        finally:
            await conn.close()
        self._record(Fault("long_transaction", t0, time.time(), None, detail))

    async def _rebalance(self, t0: float) -> None:
        """One more process of a role joins every group of it, works a little, and leaves."""
        candidates = [r for r in REBALANCED_ROLES if r in self.roles]
        if not candidates:
            return
        role = self.rng.choice(candidates)
        self.extra += 1
        slot = Slot(f"X{role}{self.extra}", role, slow=False)
        self.extras.append(slot)
        self._start_member(slot)
        assert slot.proc is not None
        proc = slot.proc
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and proc.poll() is None and not self._joined(slot):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await asyncio.sleep(self.rng.uniform(1.0, 3.0))
        await self._stop(proc, f"member {slot.name}")
        groups = frozenset(g for g, _, _ in self.roles[role])
        self._record(Fault("rebalance", t0, time.time(), None, f"{slot.name} joined and left", groups))

    def _bouncer(self, command: str) -> str:
        """Start (the pooled DSN) or stop PgBouncer in transaction mode in front of the run's server."""
        work = self.home / "pgbouncer"
        if command == "stop":
            subprocess.run([str(PGBOUNCER), "stop", str(work)], check=False)
            return ""
        work.mkdir(exist_ok=True)
        os.chmod(self.home, 0o755)
        parts = urlsplit(self.dsn)
        assert parts.hostname and parts.port and parts.username
        args = [str(PGBOUNCER), "start", str(work), parts.hostname, str(parts.port), parts.username]
        env = {**os.environ, "PGB_PASSWORD": parts.password or ""}
        port = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout.strip()
        user = f"{parts.username}:{parts.password}" if parts.password else parts.username
        return urlunsplit((parts.scheme, f"{user}@127.0.0.1:{port}", parts.path, parts.query, parts.fragment))

    def _pgha(self, *args: str) -> str:
        env = dict(os.environ, BUS_HOME=str(self.home))
        out = subprocess.run(["sh", str(PGHA), *args], env=env, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def _record(self, fault: Fault) -> None:
        self.faults.append(fault)
        with open(self.fault_file, "a") as fh:
            fh.write(
                f"{fault.kind}\t{fault.start:.6f}\t{fault.end:.6f}\t{fault.pid or ''}\t{fault.detail}\t"
                f"{','.join(sorted(fault.groups))}\n"
            )

    async def _faults(self, until: float) -> None:
        plan = list(self.kinds)
        self.rng.shuffle(plan)
        if self.ha:  # the failover first, while every pattern is busy
            plan.remove("failover")
            plan.insert(0, "failover")
        while True:
            await asyncio.sleep(self.rng.uniform(2.0, 4.0))
            self._check_alive()
            if time.monotonic() >= until and not (self.every_kind and plan):
                await asyncio.gather(*self.background)
                return
            kind = plan.pop(0) if plan else self.rng.choice(self.kinds)
            print(f"chaos: t={time.time():.3f} fault {kind}", flush=True)
            recorded = len(self.faults)
            await self._inject(kind)
            if self.every_kind and kind not in BACKGROUND_KINDS and len(self.faults) == recorded:
                plan.append(kind)  # no member to hit this time: it fires again later

    # -- the run ---------------------------------------------------------------------

    async def _warm_up(self, within: float) -> None:
        """Faults start once every member has joined and every producer has published."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within:
            joined = all(self._joined(s) for s in self.slots)
            acks = [self.out / f"acks-{i}.tsv" for i in range(len(self.producers))]
            if joined and all(a.exists() and a.stat().st_size > 0 for a in acks):
                return
            self._check_alive()
            await asyncio.sleep(0.2)
        self.problems.append(f"the members did not all join (or producers publish) within {within:.0f} s")

    async def _lagging(self, conn: asyncpg.Connection, store: Any) -> list[str]:
        """What has not drained yet (empty: everything has)."""
        behind = []
        on_topic = [g for g, p, _ in self.groups if p not in ("queue", "lqueue", "es")]
        if on_topic:
            row = await conn.fetchrow(LAGGING, TOPIC)
            if row["lagging"] or row["cursors"] != len(on_topic) * PARTITIONS:
                behind.append(f"{TOPIC}: {row['lagging']} cursors lagging of {row['cursors']}")
        for pattern, queue in (("queue", QUEUE), ("lqueue", LQUEUE)):
            if any(p == pattern for _, p, _ in self.groups):
                jobs = await conn.fetchval(PENDING_JOBS, queue)
                if jobs:
                    behind.append(f"{queue}: {jobs} jobs pending")
        for g, p, _ in self.groups:
            if p != "es":
                continue
            last: dict[str, int] = {}
            for a in read_acks(self.out):
                if a.topic == STORE:
                    last[a.partition] = max(last.get(a.partition, 0), a.offset)
            at = {c.partition_value.get("account"): c.position for c in await store.partitions(g)}
            late = [acc for acc, pos in last.items() if at.get(acc, 0) < pos]
            if late:
                behind.append(f"{g}: accounts {sorted(late)} behind")
        return behind

    async def _drain(self, within: float) -> float | None:
        conn = await self._connect("chaos-drain")
        t0 = time.monotonic()
        behind: list[str] = []
        try:
            async with bus.connect(self.dsn, schema=SCHEMA) as b:
                store = b.event_store(STORE)
                while time.monotonic() - t0 < within:
                    self._check_alive()
                    behind = await self._lagging(conn, store)
                    if not behind:
                        return time.monotonic() - t0
                    await asyncio.sleep(0.3)
            self.problems.append(f"not drained: {'; '.join(behind)}")
            self.problems += [f"at the end: {line}" for line in await self._stuck(conn)]
        finally:
            await conn.close()
        return None

    async def _stuck(self, conn: asyncpg.Connection) -> list[str]:
        """What may hold a group back: open transactions, held cursors and event-store claims."""
        lines = [f"open transaction: {dict(r)}" for r in await conn.fetch(OPEN_TRANSACTIONS)]
        lines += [f"cursor: {dict(r)}" for r in await conn.fetch(HELD_CURSORS, TOPIC)]
        lines += [f"event-store cursor: {dict(r)}" for r in await conn.fetch(ES_CURSORS, STORE)]
        return lines

    async def _stop(self, proc: subprocess.Popen[bytes], what: str) -> None:
        if proc.poll() is not None:
            return
        self.expected_exit.add(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            self.problems.append(f"{what} (pid {proc.pid}) did not stop within 30 s of SIGTERM; killed")
            proc.kill()
            await asyncio.to_thread(proc.wait)
        else:
            if proc.returncode == -signal.SIGTERM and what.startswith("member"):
                return  # stopped while still starting up (before its SIGTERM handler existed): nothing to leave
            if proc.returncode != 0:
                self.problems.append(f"{what} (pid {proc.pid}) stopped with code {proc.returncode}")

    async def _setup(self) -> None:
        async with bus.connect(self.dsn, schema=SCHEMA) as b:
            await b.create_topic(TOPIC, partitions=PARTITIONS)
            await b.create_topic(QUEUE, partitions=PARTITIONS, semantics="queue")
            await b.pool.execute(CREATE_USER_TABLE.format(schema=SCHEMA))
            if self.limited:
                await b.create_topic(
                    LQUEUE,
                    partitions=PARTITIONS,
                    semantics="queue",
                    max_in_flight_per_key=LQUEUE_PER_KEY,
                    rate_limit=LQUEUE_RATE,
                )
                await b.schedule(
                    SCHEDULE, cron=SCHEDULE_CRON, topic=LQUEUE, payload={"id": "tick-0"}, catch_up="all"
                )

    @property
    def limited(self) -> bool:
        """Whether this run drives the limited queue (and its schedule)."""
        return any(p == "lqueue" for _, p, _ in self.groups)

    async def _unschedule(self) -> None:
        """The schedule stops with the producers, so the queue can drain."""
        async with bus.connect(self.dsn, schema=SCHEMA) as b:
            await b.unschedule(SCHEDULE)

    async def _collect(self) -> None:
        """The user's table, the dead-letter topics and the store's log, written to the out dir."""
        async with bus.connect(self.dsn, schema=SCHEMA) as b:
            with open(self.out / USER_TABLE, "w") as fh:  # noqa: ASYNC230 (once, at the end)
                for r in await b.pool.fetch(USER_ROWS):
                    fh.write("\t".join(str(v) for v in r) + "\n")
            with open(self.out / "dead_letters.tsv", "w") as fh:  # noqa: ASYNC230
                for g, p, _ in self.groups:
                    if p not in ("handler-dlq", "queue", "txh"):
                        continue
                    dlq = f"{QUEUE}.dlq" if p == "queue" else f"{g}.dlq"
                    prefix = "dead_letter." if p == "queue" else "bus.source."
                    try:
                        stats = await b.admin.topic_stats(dlq)
                    except bus.errors.TopicNotFoundError:
                        continue
                    for ps in stats:
                        offset = ps.log_start
                        while offset < ps.end_offset:
                            got = await b.read(dlq, partition=ps.partition, offset=offset, max_messages=1000)
                            if not got:
                                break
                            for m in got:
                                h = m.headers
                                fh.write(
                                    f"{g}\t{h[prefix + 'topic']}\t{h[prefix + 'partition']}\t"
                                    f"{h[prefix + 'offset']}\t{msgspec.json.decode(m.payload)['id']}\t"
                                    f"{m.created_at.timestamp():.6f}\n"
                                )
                            offset = got[-1].offset + 1
            with open(self.out / "ticks.tsv", "w") as fh:  # noqa: ASYNC230
                for ps in await b.admin.topic_stats(LQUEUE) if self.limited else []:
                    offset = ps.log_start
                    while offset < ps.end_offset:
                        got = await b.read(LQUEUE, partition=ps.partition, offset=offset, max_messages=1000)
                        if not got:
                            break
                        fh.writelines(
                            f"{m.headers['schedule']}\t{m.headers['tick']}\n"
                            for m in got
                            if "schedule" in m.headers
                        )
                        offset = got[-1].offset + 1
            with open(self.out / "store.tsv", "w") as fh:  # noqa: ASYNC230
                for pe in await b.event_store(STORE).read():
                    e, t = pe.message, pe.created_at.timestamp()
                    if isinstance(e, Item):
                        fh.write(f"I\t{e.account}\t{pe.position}\n")
                    elif isinstance(e, TallyEvent):
                        fh.write(
                            f"T\t{e.account}\t{e.first}\t{e.last}\t{e.guard_position}\t{pe.position}\t"
                            f"{e.worker}\t{t:.6f}\n"
                        )

    async def run(self) -> Outcome:
        """Run the scenario and return the recorded history."""
        if self.ha:
            self.dsn = await asyncio.to_thread(self._pgha, "start")
        else:
            self.dsn = (await asyncio.to_thread(ensure_server, self.home)).dsn
        if self.pooler:
            bouncer = await asyncio.to_thread(self._bouncer, "start")
            # The processes publish and consume through the pooler; LISTEN goes straight to the server.
            self.child_env = {"BUS_DSN": bouncer, "BUS_POOLER": "transaction", "BUS_DIRECT_DSN": self.dsn}
        sampler: asyncio.Task[None] | None = None
        drained: float | None = None
        try:
            await self._setup()
            reads = {_produced_for(p) for _, p, _ in self.groups}
            for i, (what, prefix, rate) in enumerate(p for p in PRODUCERS if p[0] in reads):
                self.producers.append(
                    self._spawn(
                        [
                            "tests.chaos.producer",
                            "-",  # the DSN: $BUS_DSN
                            SCHEMA,
                            what,
                            str(PARTITIONS),
                            str(self.out / f"acks-{i}.tsv"),
                            str(rate),
                            prefix,
                        ],
                        f"producer-{i}.log",
                    )
                )
            for role in self.roles:
                n, slow_index, _ = ROLES[role]
                for i in range(n):
                    slot = Slot(f"{role}-{i}", role, slow=i == slow_index)
                    self.slots.append(slot)
                    self._start_member(slot)
            sampler = asyncio.create_task(self._sampler())
            await self._warm_up(within=60.0)
            await self._faults(time.monotonic() + self.seconds)
            await asyncio.gather(*(self._stop(p, f"producer {i}") for i, p in enumerate(self.producers)))
            if self.limited:
                await self._unschedule()
            drained = await self._drain(within=90.0)
            await asyncio.gather(*(self._stop(s.proc, f"member {s.name}") for s in self.slots if s.proc))
            await self._collect()
        finally:
            self._sampling = False
            if sampler is not None:
                await sampler
            for s in self.slots + self.extras:
                if s.proc is not None and s.proc.poll() is None:
                    s.proc.kill()
            for p in self.producers:
                if p.poll() is None:
                    p.kill()
            if self.pooler:
                await asyncio.to_thread(self._bouncer, "stop")
            await asyncio.to_thread(self._pgha, "stop") if self.ha else await asyncio.to_thread(
                stop_server, self.home
            )
        with open(self.out / "groups.tsv", "w") as fh:  # noqa: ASYNC230
            fh.writelines(f"{g}\t{p}\n" for g, p, _ in self.groups)
        outcome = Outcome(
            self.seed, read_history(self.out, self.faults, self.samples), self.problems, drained_in=drained
        )
        if not hasattr(Consumer, "transaction"):
            outcome.skipped.append("tx (bus.Consumer has no transaction() yet)")
        self._count_errors(outcome)
        if os.environ.get("CHAOS_KEEP"):
            print(f"chaos: recordings kept in {self.out}", flush=True)
        else:
            shutil.rmtree(self.home, ignore_errors=True)
        return outcome

    def _count_errors(self, outcome: Outcome) -> None:
        for path in self.out.glob("*.tsv"):
            for line in path.read_text().splitlines():
                f = line.split("\t")
                if f[0] == "E" and len(f) >= 4:
                    outcome.member_errors[f"{f[2]}: {f[3].split('(')[0]}"] += 1
                elif f[0] == "F":
                    outcome.publish_failures += 1


def _produced_for(pattern: str) -> str:
    """What the producer a pattern reads from publishes to (PRODUCERS' first field)."""
    return {"queue": QUEUE, "es": f"es:{STORE}", "lqueue": f"lq:{LQUEUE}"}.get(pattern, TOPIC)


# -- reading back --------------------------------------------------------------------


def _config_of(member_file: Path) -> dict[str, float]:
    """The config a member recording ran with (its slot name is the file name without "-N.tsv")."""
    slot = member_file.stem.rsplit("-", 1)[0]
    slow = {f"{role}-{i}" for role, (_, i, _) in ROLES.items() if i >= 0}
    return SLOW_CONFIG if slot in slow else MEMBER_CONFIG


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)


def _lines(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in (path.read_text().splitlines() if path.exists() else [])]


def read_acks(out: Path) -> list[Ack]:
    """Every publish / append the producers saw succeed."""
    acks = []
    for path in sorted(out.glob("acks-*.tsv")):
        for f in _lines(path):
            if f[0] == "A" and len(f) == 6:
                acks.append(Ack(f[1], f[2], int(f[3]), f[4], float(f[5])))
    return acks


def read_history(out: Path, injected: list[Fault], samples: list[Sample]) -> History:
    """The history recorded in `out`: acks, deliveries, stalls, the members' own fault events, the tables."""
    groups = {f[0]: f[1] for f in _lines(out / "groups.tsv") if len(f) == 2}
    acks = read_acks(out)
    deliveries: list[Delivery] = []
    user_acks: list[UserAck] = []
    counters: Counter[tuple[str, str]] = Counter()
    breaches: list[str] = []
    faults = list(injected)
    pid_of_member: dict[str, int] = {}
    expired: list[tuple[float, str]] = []  # (when, member id): swept by whichever process saw it
    takes: dict[tuple[str, str, str, int, float], JobTake] = {}  # by (group, topic, partition, offset, got)
    acked_from: dict[tuple[str, str, str, int], list[float]] = {}
    for path in sorted(out.glob("*.tsv")):
        if path.name.startswith(("acks-", "faults", "groups", "dead_letters", "store")):
            continue
        config = _config_of(path)
        slow_start: float | None = None
        pid = 0
        events: list[tuple[float, str, dict[str, str]]] = []
        for seq, f in enumerate(_lines(path)):
            if f[0] == "D" and len(f) == 10:
                pid = int(f[6])
                deliveries.append(
                    Delivery(f[1], f[2], f[3], int(f[4]), f[5], pid, f[7], int(f[8]), float(f[9]), seq)
                )
            elif f[0] == "K" and len(f) == 9:
                user_acks.append(
                    UserAck(f[1], f[2], f[3], int(f[4]), f[5], int(f[6]), int(f[7]), float(f[8]))
                )
            elif f[0] == "N" and len(f) == 3:
                counters[(f[1], f[2])] += 1
            elif f[0] == "B" and len(f) == 3:
                breaches.append(f"{path.stem}: {f[2]}")
            elif f[0] == "S" and len(f) == 3:
                if f[1] == "start":
                    slow_start = float(f[2])
                elif slow_start is not None:
                    faults.append(Fault("slow", slow_start, float(f[2]), pid or None))
                    slow_start = None
            elif f[0] == "V" and len(f) == 4:
                events.append((float(f[1]), f[2], _fields(f[3])))
            elif f[0] == "J" and len(f) == 9:
                key = None if f[6] == "-" else f[6]
                take = JobTake(f[1], f[2], f[3], int(f[4]), f[5], key, float(f[7]), float(f[8]))
                takes[(f[1], f[2], f[3], int(f[4]), take.got)] = take
            elif f[0] == "Y" and len(f) == 6:
                acked_from.setdefault((f[1], f[2], f[3], int(f[4])), []).append(float(f[5]))
        if slow_start is not None:  # killed mid-stall: the stall lasted until the kill
            faults.append(Fault("slow", slow_start, slow_start + SLOW_CONFIG["slow_seconds"], pid or None))
        if not pid:
            continue  # delivered nothing: no duplicate can involve it
        for t, name, fields in events:
            if name == "member_joined" and "member" in fields:
                pid_of_member[fields["member"]] = pid
            elif name == "member_expired" and "member" in fields:
                expired.append((t, fields["member"]))
            elif name == "actor.restarting" and not fields.get("actor", "").startswith(
                ("worker-", "coordinator")
            ):
                continue  # the notifier, heartbeat or a rebalancer: their restarts re-deliver nothing
            elif name in EVENT_FAULTS:
                # A lease lapses up to lease_time before its worker notices; a fence comes up to a
                # session after the member fell silent: the fault spans that time, not just the notice.
                kind = EVENT_FAULTS[name]
                before = {"lease_lost": config["lease_time"], "fenced": config["session_timeout"]}
                if kind == "loop_lag":  # the loop stood still for that long before it noticed
                    before[kind] = float(fields.get("seconds", "0"))
                if "since" in fields:  # a rolled-back transaction, a failed or lapsed ack: out since then
                    before[kind] = t - float(fields["since"])
                group = fields.get("group")
                scope = frozenset({group}) if group in groups else frozenset()
                detail = " ".join(f"{k}={v}" for k, v in fields.items())
                faults.append(Fault(kind, t - before.get(kind, 0.0), t, pid, detail, scope))
    for t, member in expired:
        if member in pid_of_member:
            faults.append(
                Fault(
                    "member_expired", t - MEMBER_CONFIG["session_timeout"], t, pid_of_member[member], member
                )
            )
    rows: dict[str, list[Row]] = {g: [] for g, p in groups.items() if p in ("tx", "txlow", "txh")}
    for f in _lines(out / USER_TABLE):
        rows.setdefault(f[0], []).append(Row(f[0], f[1], f[2], int(f[3]), f[4]))
    dead: dict[str, list[DeadLetter]] = {
        g: [] for g, p in groups.items() if p in ("handler-dlq", "queue", "txh")
    }
    for f in _lines(out / "dead_letters.tsv"):
        dead.setdefault(f[0], []).append(DeadLetter(f[0], f[1], f[2], int(f[3]), f[4], float(f[5])))
    for dls in dead.values():
        dls.sort(key=lambda x: x.t)
    tallies: dict[str, list[Tally]] = {g: [] for g, p in groups.items() if p == "es"}
    items: list[StoreItem] = []
    for f in _lines(out / "store.tsv"):
        if f[0] == "I":
            items.append(StoreItem(f[1], int(f[2])))
        elif f[0] == "T":
            worker_pid = int(f[6].removeprefix("es"))
            for g in tallies:
                tallies[g].append(
                    Tally(g, f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), worker_pid, float(f[7]))
                )
    reads = {g: _produced_for(p).removeprefix("es:").removeprefix("lq:") for g, p in groups.items()}
    # A job's ack that returned belongs to the latest take of it before the ack was called.
    job_takes = sorted(takes.values(), key=lambda j: j.got)
    for key, ends in acked_from.items():
        for end in ends:
            mine = [j for j in job_takes if (j.group, j.topic, j.partition, j.offset) == key and j.got <= end]
            if mine:
                i = job_takes.index(mine[-1])
                job_takes[i] = replace(mine[-1], acked_from=end)
    not_before = {}
    for path in sorted(out.glob("acks-*.tsv")):
        not_before.update({f[1]: float(f[2]) for f in _lines(path) if f[0] == "W" and len(f) == 3})
    ticks = [(f[0], f[1]) for f in _lines(out / "ticks.tsv") if len(f) == 2]
    limits = QueueLimits(LQUEUE_PER_KEY, LQUEUE_RATE.limit, LQUEUE_RATE.per, LQUEUE_VISIBILITY)
    return History(
        list(groups),
        acks,
        deliveries,
        samples,
        faults,
        patterns=groups,
        reads=reads,
        rows=rows,
        dead_letters=dead,
        poison=frozenset(a.msg_id for a in acks if poison(a.msg_id)),
        user_acks=user_acks,
        tallies=tallies,
        store_items=items,
        breaches=breaches,
        counters=counters,
        queue_limits={g: limits for g, p in groups.items() if p == "lqueue"},
        job_takes=job_takes,
        not_before=not_before,
        ticks=ticks,
        tick_every=SCHEDULE_EVERY if ticks else None,
    )


def read_faults(out: Path) -> list[Fault]:
    """The injected faults a kept run recorded in faults.tsv."""
    faults = []
    for f in _lines(out / "faults.tsv"):
        kind, start, end, pid, detail, groups = (f + [""] * 6)[:6]
        faults.append(
            Fault(
                kind,
                float(start),
                float(end),
                int(pid) if pid else None,
                detail,
                frozenset(g for g in groups.split(",") if g),
            )
        )
    return faults


async def run_chaos(
    seconds: float,
    seed: int | None = None,
    *,
    ha: bool = False,
    pooler: str | None = None,
    patterns: frozenset[str] = frozenset(),
    every_kind: bool = False,
) -> Outcome:
    """Run the chaos scenario for about `seconds` of faults; the seed is printed so a run can be replayed.

    `ha=True`: against a PostgreSQL 15 primary and synchronous standby, with a `failover` fault.
    `patterns`: only these usage patterns (those in OPT_IN_PATTERNS run only when named).
    `every_kind=True`: the faults last at least until each kind has fired once, however short `seconds`.
    """
    if seed is None:
        seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 1 << 31))
    print(f"chaos: seed {seed} (replay with CHAOS_SEED={seed}), {seconds:.0f} s of faults", flush=True)
    return await ChaosRun(seconds, seed, ha=ha, pooler=pooler, patterns=patterns, every_kind=every_kind).run()


def describe(outcome: Outcome, report: Any) -> str:
    """The counts a chaos run prints."""
    lines = [f"chaos seed {outcome.seed}", report.summary()]
    lines.append(f"publish failures (not acknowledged, not required): {outcome.publish_failures}")
    if outcome.member_errors:
        lines.append(
            "errors members saw: " + ", ".join(f"{k} x{v}" for k, v in outcome.member_errors.most_common())
        )
    lines.append(
        f"drained in: {outcome.drained_in:.1f} s" if outcome.drained_in is not None else "drained: NO"
    )
    lines += [f"skipped pattern: {s}" for s in outcome.skipped]
    lines += [f"problem: {p}" for p in outcome.problems]
    return "\n".join(lines)


if __name__ == "__main__":
    from tests.chaos.checker import check

    kept = Path(sys.argv[1])
    print(check(read_history(kept, read_faults(kept), [])).summary())
