"""The chaos run: a dedicated PostgreSQL, a producer, members of three groups, random faults.

`run_chaos(seconds, seed)` starts an embedded server of its own (so restarting
it disturbs no other test), a topic, one producer process and seven member
processes in three groups (range and sticky handler subscriptions, and a
round-robin poll + commit consumer), samples every cursor every 100 ms, and
injects faults chosen by a seeded random generator:

- `kill`: SIGKILL a member, start a replacement;
- `terminate_backends`: `pg_terminate_backend` every bus connection;
- `restart`: restart PostgreSQL (same port);
- `zombie`: SIGSTOP a member past its session, then SIGCONT;
- `slow`: make the slow member's handler block its process past its lease.

Then it stops the producer, lets the groups drain, stops the members
gracefully, and returns the recorded `History` with what went wrong outside
the checker's reach (processes that died on their own, a drain that never
finished). The faults the bus itself reported in a member (its "V" lines:
session expired, fenced, lease lost, actor restarted, release failed) join the
injected ones in the history (see the checker's OBSERVED).

With CHAOS_KEEP=1 the recordings stay, injected faults included (faults.tsv);
`python -m tests.chaos.harness OUTDIR` checks them again (without the cursor
samples, which are not kept).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

import bus
from storage.embedded import ensure_server, restart_server, stop_server
from tests.chaos.checker import Ack, Delivery, Fault, History, Sample

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "chaos"
TOPIC = "orders"
PARTITIONS = 6
RATE = 150.0

# Sessions long enough to ride out a PostgreSQL restart, short enough that a zombie is swept quickly.
MEMBER_CONFIG: dict[str, float] = dict(
    heartbeat_interval=0.3, session_timeout=3.0, rebalance_delay=0.2, max_poll_interval=0.5, lease_time=4.0,
)
# The slow member: a short lease, and a stall longer than it (but shorter than its session).
SLOW_CONFIG: dict[str, float] = {**MEMBER_CONFIG, "lease_time": 1.0, "slow_seconds": 2.0}
ZOMBIE_PAUSE = MEMBER_CONFIG["session_timeout"] + 2.0
# Events a member records ("V" lines) that re-deliver from the last commit: observed fault kinds.
EVENT_FAULTS = {
    "member_fenced": "fenced",
    "lease_lost": "lease_lost",
    "release_failed": "release_failed",
    "actor.restarting": "actor_restart",
    "loop_lag": "loop_lag",
}

# (group, mode, assignor, members, index of the slow member or -1)
GROUPS: list[tuple[str, str, str, int, int]] = [
    ("g-range", "handler", "range", 3, 0),
    ("g-sticky", "handler", "sticky", 2, -1),
    ("g-poll", "poll", "roundrobin", 2, -1),
]
# CHAOS_KINDS=restart,kill narrows a run to some faults (to chase one bug).
KINDS = tuple(
    k for k in os.environ.get("CHAOS_KINDS", "kill,terminate_backends,restart,zombie,slow").split(",") if k
)

SAMPLE = """
SELECT o.group_name, p.topic, p.name, o.committed, o.owner, o.lease_epoch
FROM offsets o JOIN partitions p ON p.id = o.partition_id
"""
LAGGING = """
SELECT count(*) FILTER (WHERE o.committed < p.next_offset) AS lagging, count(*) AS cursors
FROM offsets o JOIN partitions p ON p.id = o.partition_id
"""
TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = 'bus' AND pid <> pg_backend_pid()
"""


@dataclass
class Slot:
    """A member position in a group; a killed member's replacement takes the same slot."""

    name: str
    group: str
    mode: str
    assignor: str
    slow: bool
    proc: subprocess.Popen[bytes] | None = None
    started: int = 0


@dataclass
class Outcome:
    """What a chaos run produced besides the history."""

    seed: int
    history: History
    problems: list[str] = field(default_factory=list)
    member_errors: Counter[str] = field(default_factory=Counter)
    publish_failures: int = 0
    drained_in: float | None = None


class ChaosRun:
    """One chaos run; see the module docstring."""

    def __init__(self, seconds: float, seed: int) -> None:
        self.seconds = seconds
        self.seed = seed
        self.rng = random.Random(seed)
        self.home = Path(tempfile.mkdtemp(prefix="bus-chaos-"))
        self.out = self.home / "out"
        self.out.mkdir()
        self.dsn = ""
        self.slots: list[Slot] = []
        self.producer: subprocess.Popen[bytes] | None = None
        self.faults: list[Fault] = []
        self.fault_file = self.out / "faults.tsv"
        self.samples: list[Sample] = []
        self.problems: list[str] = []
        self.expected_exit: set[int] = set()
        self._sampling = True

    # -- processes -------------------------------------------------------------------

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.out / log_name, "ab")  # noqa: SIM115 (the child owns it for its life)
        try:
            return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _start_member(self, slot: Slot) -> None:
        slot.started += 1
        tag = f"{slot.name}-{slot.started}"
        config = SLOW_CONFIG if slot.slow else MEMBER_CONFIG
        args = [f"{k}={v}" for k, v in config.items()] + [f"assignor={slot.assignor}"]
        slot.proc = self._spawn(
            ["tests.chaos.member", self.dsn, SCHEMA, slot.group, TOPIC, str(self.out / f"{tag}.tsv"),
             slot.mode, "1" if slot.slow else "0", *args],
            f"{tag}.log",
        )

    def _check_alive(self) -> None:
        """A member that died without being killed is a bug: record it with its log, replace it."""
        for slot in self.slots:
            proc = slot.proc
            if proc is not None and proc.poll() is not None and proc.pid not in self.expected_exit:
                tail = (self.out / f"{slot.name}-{slot.started}.log").read_text(errors="replace")[-2000:]
                self.problems.append(
                    f"member {slot.name} (pid {proc.pid}) exited by itself with code {proc.returncode}:\n{tail}"
                )
                self._start_member(slot)
        if self.producer is not None and self.producer.poll() is not None and self.producer.pid not in self.expected_exit:
            tail = (self.out / "producer.log").read_text(errors="replace")[-2000:]
            self.problems.append(f"the producer exited by itself with code {self.producer.returncode}:\n{tail}")
            self.expected_exit.add(self.producer.pid)

    # -- sampling --------------------------------------------------------------------

    async def _connect(self, name: str) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn, server_settings={"search_path": SCHEMA, "application_name": name})

    async def _sampler(self) -> None:
        conn: asyncpg.Connection | None = None
        while self._sampling:
            try:
                if conn is None or conn.is_closed():
                    conn = await self._connect("chaos-sampler")
                rows = await conn.fetch(SAMPLE)
                t = time.time()
                self.samples.extend(Sample(t, r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows)
            except Exception:  # the observer must outlive any fault: drop the connection, reconnect
                if conn is not None:
                    conn.terminate()
                conn = None
            await asyncio.sleep(0.1)
        if conn is not None and not conn.is_closed():
            await conn.close()

    # -- faults ----------------------------------------------------------------------

    def _pick_member(self, *, slow: bool | None = None) -> Slot:
        live = [s for s in self.slots if s.proc is not None and s.proc.poll() is None and (slow is None or s.slow == slow)]
        return self.rng.choice(live)

    async def _inject(self, kind: str) -> None:
        t0 = time.time()
        if kind == "kill":
            slot = self._pick_member()
            assert slot.proc is not None
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
        elif kind == "zombie":
            slot = self._pick_member(slow=False)
            assert slot.proc is not None
            pid = slot.proc.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(ZOMBIE_PAUSE)
            finally:
                os.kill(pid, signal.SIGCONT)
            self._record(Fault("zombie", t0, time.time(), pid, slot.name))
        elif kind == "slow":
            slot = self._pick_member(slow=True)
            assert slot.proc is not None
            slot.proc.send_signal(signal.SIGUSR1)
            # The interval comes from the member's own "S start/end" lines; this marks the request.
            self._record(Fault("slow_request", t0, t0, slot.proc.pid, slot.name))

    def _record(self, fault: Fault) -> None:
        self.faults.append(fault)
        with open(self.fault_file, "a") as fh:
            fh.write(f"{fault.kind}\t{fault.start:.6f}\t{fault.end:.6f}\t{fault.pid or ''}\t{fault.detail}\n")

    async def _faults(self, until: float) -> None:
        plan = list(KINDS)
        self.rng.shuffle(plan)
        while True:
            await asyncio.sleep(self.rng.uniform(2.0, 4.0))
            self._check_alive()
            if time.monotonic() >= until:
                return
            kind = plan.pop(0) if plan else self.rng.choice(KINDS)
            print(f"chaos: t={time.time():.3f} fault {kind}", flush=True)
            await self._inject(kind)

    # -- the run ---------------------------------------------------------------------

    async def _warm_up(self, within: float) -> None:
        """Faults start once every member has joined and the producer has published."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within:
            joined = all(
                "joined" in (self.out / f"{s.name}-{s.started}.log").read_text(errors="replace") for s in self.slots
            )
            acks = self.out / "acks.tsv"
            if joined and acks.exists() and acks.stat().st_size > 0:
                return
            self._check_alive()
            if self.producer is not None and self.producer.poll() is not None:
                return  # recorded as a problem; the run goes on so its history is still checked
            await asyncio.sleep(0.2)
        self.problems.append(f"the members did not all join within {within:.0f} s")

    async def _drain(self, within: float) -> float | None:
        conn = await self._connect("chaos-drain")
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < within:
                self._check_alive()
                row = await conn.fetchrow(LAGGING)
                if row["lagging"] == 0 and row["cursors"] == len(GROUPS) * PARTITIONS:
                    return time.monotonic() - t0
                await asyncio.sleep(0.2)
        finally:
            await conn.close()
        return None

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

    async def run(self) -> Outcome:
        """Run the scenario and return the recorded history."""
        server = await asyncio.to_thread(ensure_server, self.home)
        self.dsn = server.dsn
        sampler: asyncio.Task[None] | None = None
        drained: float | None = None
        try:
            async with bus.connect(self.dsn, schema=SCHEMA) as b:
                await b.create_topic(TOPIC, partitions=PARTITIONS)
            self.producer = self._spawn(
                ["tests.chaos.producer", self.dsn, SCHEMA, TOPIC, str(PARTITIONS), str(self.out / "acks.tsv"), str(RATE)],
                "producer.log",
            )
            for group, mode, assignor, n, slow_index in GROUPS:
                for i in range(n):
                    slot = Slot(f"{group}-{i}", group, mode, assignor, slow=i == slow_index)
                    self.slots.append(slot)
                    self._start_member(slot)
            sampler = asyncio.create_task(self._sampler())
            await self._warm_up(within=60.0)
            await self._faults(time.monotonic() + self.seconds)
            await self._stop(self.producer, "the producer")
            drained = await self._drain(within=90.0)
            if drained is None:
                self.problems.append("the groups did not drain within 90 s after the producer stopped")
            await asyncio.gather(*(self._stop(s.proc, f"member {s.name}") for s in self.slots if s.proc))
        finally:
            self._sampling = False
            if sampler is not None:
                await sampler
            for s in self.slots:
                if s.proc is not None and s.proc.poll() is None:
                    s.proc.kill()
            if self.producer is not None and self.producer.poll() is None:
                self.producer.kill()
            await asyncio.to_thread(stop_server, self.home)
        outcome = Outcome(self.seed, self._history(), self.problems, drained_in=drained)
        self._count_errors(outcome)
        if os.environ.get("CHAOS_KEEP"):
            print(f"chaos: recordings kept in {self.out}", flush=True)
        else:
            shutil.rmtree(self.home, ignore_errors=True)
        return outcome

    # -- reading back ----------------------------------------------------------------

    def _history(self) -> History:
        return read_history(self.out, self.faults, self.samples)

    def _count_errors(self, outcome: Outcome) -> None:
        for path in self.out.glob("*.tsv"):
            for line in path.read_text().splitlines():
                f = line.split("\t")
                if f[0] == "E" and len(f) >= 4:
                    outcome.member_errors[f"{f[2]}: {f[3].split('(')[0]}"] += 1
                elif f[0] == "F":
                    outcome.publish_failures += 1


def _config_of(member_file: Path) -> dict[str, float]:
    """The config a member recording ran with (its slot name is the file name without "-N.tsv")."""
    slot = member_file.stem.rsplit("-", 1)[0]
    slow = {f"{g}-{i}" for g, _, _, _, i in GROUPS if i >= 0}
    return SLOW_CONFIG if slot in slow else MEMBER_CONFIG


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)


def read_history(out: Path, injected: list[Fault], samples: list[Sample]) -> History:
    """The history recorded in `out`: acks, deliveries, stalls and the members' own fault events."""
    acks: list[Ack] = []
    ack_file = out / "acks.tsv"
    for line in (ack_file.read_text() if ack_file.exists() else "").splitlines():
        f = line.split("\t")
        if f[0] == "A" and len(f) == 6:
            acks.append(Ack(f[1], f[2], int(f[3]), f[4], float(f[5])))
    deliveries: list[Delivery] = []
    faults = list(injected)
    pid_of_member: dict[str, int] = {}
    expired: list[tuple[float, str]] = []  # (when, member id): swept by whichever process saw it
    for path in sorted(out.glob("*.tsv")):
        if path.name in ("acks.tsv", "faults.tsv"):
            continue
        config = _config_of(path)
        slow_start: float | None = None
        pid = 0
        events: list[tuple[float, str, dict[str, str]]] = []
        for seq, line in enumerate(path.read_text().splitlines()):
            f = line.split("\t")
            if f[0] == "D" and len(f) == 10:
                pid = int(f[6])
                deliveries.append(Delivery(f[1], f[2], f[3], int(f[4]), f[5], pid, f[7], int(f[8]), float(f[9]), seq))
            elif f[0] == "S" and len(f) == 3:
                if f[1] == "start":
                    slow_start = float(f[2])
                elif slow_start is not None:
                    faults.append(Fault("slow", slow_start, float(f[2]), pid or None))
                    slow_start = None
            elif f[0] == "V" and len(f) == 4:
                events.append((float(f[1]), f[2], _fields(f[3])))
        if slow_start is not None:  # killed mid-stall: the stall lasted until the kill
            faults.append(Fault("slow", slow_start, slow_start + SLOW_CONFIG["slow_seconds"], pid or None))
        if not pid:
            continue  # delivered nothing: no duplicate can involve it
        for t, name, fields in events:
            if name == "member_joined" and "member" in fields:
                pid_of_member[fields["member"]] = pid
            elif name == "member_expired" and "member" in fields:
                expired.append((t, fields["member"]))
            elif name == "actor.restarting" and not fields.get("actor", "").startswith(("worker-", "coordinator")):
                continue  # the notifier, heartbeat or a rebalancer: their restarts re-deliver nothing
            elif name in EVENT_FAULTS:
                # A lease lapses up to lease_time before its worker notices; a fence comes up to a
                # session after the member fell silent: the fault spans that time, not just the notice.
                kind = EVENT_FAULTS[name]
                before = {"lease_lost": config["lease_time"], "fenced": config["session_timeout"]}
                if kind == "loop_lag":  # the loop stood still for that long before it noticed
                    before[kind] = float(fields.get("seconds", "0"))
                faults.append(Fault(kind, t - before.get(kind, 0.0), t, pid, " ".join(f"{k}={v}" for k, v in fields.items())))
    for t, member in expired:
        if member in pid_of_member:
            faults.append(Fault("member_expired", t - MEMBER_CONFIG["session_timeout"], t, pid_of_member[member], member))
    return History([g for g, *_ in GROUPS], acks, deliveries, samples, faults)


def read_faults(out: Path) -> list[Fault]:
    """The injected faults a kept run recorded in faults.tsv."""
    path = out / "faults.tsv"
    faults = []
    for line in (path.read_text() if path.exists() else "").splitlines():
        kind, start, end, pid, detail = line.split("\t", 4)
        faults.append(Fault(kind, float(start), float(end), int(pid) if pid else None, detail))
    return faults


async def run_chaos(seconds: float, seed: int | None = None) -> Outcome:
    """Run the chaos scenario for about `seconds` of faults; the seed is printed so a run can be replayed."""
    if seed is None:
        seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 1 << 31))
    print(f"chaos: seed {seed} (replay with CHAOS_SEED={seed}), {seconds:.0f} s of faults", flush=True)
    return await ChaosRun(seconds, seed).run()


def describe(outcome: Outcome, report: Any) -> str:
    """The counts a chaos run prints."""
    lines = [f"chaos seed {outcome.seed}", report.summary()]
    lines.append(f"publish failures (not acknowledged, not required): {outcome.publish_failures}")
    if outcome.member_errors:
        lines.append("errors members saw: " + ", ".join(f"{k} x{v}" for k, v in outcome.member_errors.most_common()))
    lines.append(f"drained in: {outcome.drained_in:.1f} s" if outcome.drained_in is not None else "drained: NO")
    lines += [f"problem: {p}" for p in outcome.problems]
    return "\n".join(lines)


if __name__ == "__main__":
    from tests.chaos.checker import check

    kept = Path(sys.argv[1])
    print(check(read_history(kept, read_faults(kept), [])).summary())
