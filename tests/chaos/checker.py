"""The chaos history checker: a pure function over what a chaos run recorded.

A run records four histories, each entry stamped with wall-clock time (all
processes run on one host, so their clocks agree):

- `Ack`: a publish the producer saw succeed (written only after `publish` returned);
- `Delivery`: one message handed to a group member (group, partition, offset,
  payload id, pid, member id, generation), in the order the process saw them;
- `Sample`: the committed offset, owner and lease epoch of every (group,
  partition) cursor, read every ~100 ms during the run;
- `Fault`: what was injected, when, and at which process (None: every process);
  and the faults the bus itself reported in a process (see OBSERVED): a member
  whose session expired (swept, fenced, joined again), a partition lease that
  ran out under its worker, an actor its supervisor restarted, a release that
  failed. Those happen without injection too (a heartbeat late by more than the
  session on two loaded cores is a real fault) and re-deliver from the last
  commit just like an injected one, so they explain duplicates on the process
  they hit; the checker also derives a `rejoin` fault wherever a process's
  member id changes between two of its deliveries (a fence it came back from).

`check(history)` verifies, and `Report.violations` lists every breach:

1. no loss: every acknowledged message reached every group at least once, with
   the payload the producer wrote at that offset;
2. order: within one member run (pid, member id, generation, partition), offsets
   go up by exactly one; a step back starts a new run (a re-read from the
   committed offset), anything else is a skip or a reorder;
3. committed offsets never move backwards;
4. a committed offset never covers a message the group had not been handed yet
   (a commit ahead of the work is a loss waiting to happen);
5. fencing: while one lease (same owner and epoch) spans two samples, a commit
   advance between them is backed by that owner's own deliveries; a zombie that
   wakes up never holds its old lease again on a partition it lost;
6. duplicates only inside the at-least-once window: a second delivery of
   (group, partition, offset) needs a fault that touched one of the processes
   that delivered it (or every process) between the first delivery (minus
   `slack`) and the repeat.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

TP = tuple[str, str]

#: Fault kinds the harness injects; every other kind was observed (reported by the bus or derived).
INJECTED = frozenset({"kill", "terminate_backends", "restart", "zombie", "slow", "slow_request"})
#: Observed fault kinds, and what each stands for.
OBSERVED = {
    "member_expired": "a member's session expired and it was swept (its leases freed)",
    "fenced": "a member learned it had been swept, and joined again",
    "rejoin": "a process delivered under a new member id (derived from the deliveries)",
    "lease_lost": "a worker found its partition lease gone (lapsed or taken)",
    "actor_restart": "a worker or coordinator restarted by its supervisor after an error",
    "release_failed": "a worker could not commit and release as it stopped (the lease runs out instead)",
    "loop_lag": "a member process's event loop stood still (CPU starved or blocked): heartbeats stopped too",
}


@dataclass(frozen=True)
class Ack:
    """A publish the producer saw succeed."""

    topic: str
    partition: str
    offset: int
    msg_id: str
    t: float


@dataclass(frozen=True)
class Delivery:
    """One message handed to one group member; `seq` orders a process's own deliveries."""

    group: str
    topic: str
    partition: str
    offset: int
    msg_id: str
    pid: int
    member: str
    generation: int
    t: float
    seq: int = 0


@dataclass(frozen=True)
class Sample:
    """A cursor as the sampler read it (`t`: when the read returned)."""

    t: float
    group: str
    topic: str
    partition: str
    committed: int
    owner: str | None
    epoch: int


@dataclass(frozen=True)
class Fault:
    """An injected fault: `kind`, the interval it lasted, the process it hit (None: all)."""

    kind: str
    start: float
    end: float
    pid: int | None = None
    detail: str = ""


@dataclass
class History:
    """Everything one chaos run recorded."""

    groups: list[str]
    acks: list[Ack]
    deliveries: list[Delivery]
    samples: list[Sample]
    faults: list[Fault]
    # How long before a fault a delivery may still be uncommitted (about one batch's handling time).
    slack: float = 3.0


@dataclass
class Report:
    """What `check` found: counts for the log, violations for the verdict."""

    messages: int = 0
    deliveries: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    unexplained_duplicates: int = 0
    # Explained duplicates by the kind of the fault that explains them (injected kinds preferred).
    explained_by: Counter[str] = field(default_factory=Counter)
    losses: int = 0
    rewinds: int = 0
    samples: int = 0
    commit_advances_checked: int = 0
    zombie_partitions_checked: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no invariant was breached."""
        return not self.violations

    def summary(self) -> str:
        """One line per count, then the first violations."""
        lines = [
            f"messages acknowledged: {self.messages}",
            f"deliveries: {self.deliveries}",
            "faults injected: "
            + (", ".join(f"{k}={v}" for k, v in sorted(self.faults.items()) if k in INJECTED) or "none"),
            "faults observed: "
            + (", ".join(f"{k}={v}" for k, v in sorted(self.faults.items()) if k not in INJECTED) or "none"),
            f"duplicates: {self.duplicates} (unexplained: {self.unexplained_duplicates}; explained by "
            + (", ".join(f"{k}={v}" for k, v in self.explained_by.most_common()) or "none")
            + ")",
            f"rewinds (re-reads from the committed offset): {self.rewinds}",
            f"losses: {self.losses}",
            f"cursor samples: {self.samples}, commit advances checked against the owner: "
            f"{self.commit_advances_checked}, zombie-lost partitions checked: {self.zombie_partitions_checked}",
            f"violations: {len(self.violations)}",
        ]
        lines += [f"  - {v}" for v in self.violations[:30]]
        return "\n".join(lines)


def check(h: History) -> Report:
    """Verify a recorded chaos history; see the module docstring for the invariants."""
    r = Report(messages=len(h.acks), deliveries=len(h.deliveries), samples=len(h.samples))
    faults = h.faults + rejoin_faults(h.deliveries)
    r.faults = Counter(f.kind for f in faults)
    by_key: dict[tuple[str, str, str, int], list[Delivery]] = defaultdict(list)
    for d in h.deliveries:
        by_key[(d.group, d.topic, d.partition, d.offset)].append(d)
    _check_payloads(h, by_key, r)
    _check_losses(h, by_key, r)
    _check_order(h, r)
    _check_duplicates(h, faults, by_key, r)
    samples = _samples_by_cursor(h)
    _check_monotonic(samples, r)
    first_seen = _first_delivery_times(h)
    _check_commits_backed(samples, first_seen, r)
    _check_fencing(h, samples, r)
    return r


def _check_payloads(h: History, by_key: dict[tuple[str, str, str, int], list[Delivery]], r: Report) -> None:
    written = {(a.topic, a.partition, a.offset): a.msg_id for a in h.acks}
    for (g, topic, part, off), ds in by_key.items():
        ids = {d.msg_id for d in ds}
        expected = written.get((topic, part, off))
        if len(ids) > 1 or (expected is not None and ids != {expected}):
            r.violations.append(
                f"corrupt: {g} got payloads {sorted(ids)} at {topic}/{part}@{off}, published {expected!r}"
            )


def _check_losses(h: History, by_key: dict[tuple[str, str, str, int], list[Delivery]], r: Report) -> None:
    for g in h.groups:
        missing = [a for a in h.acks if (g, a.topic, a.partition, a.offset) not in by_key]
        r.losses += len(missing)
        for a in missing[:5]:
            r.violations.append(f"loss: {g} never got {a.topic}/{a.partition}@{a.offset} (id {a.msg_id})")
        if len(missing) > 5:
            r.violations.append(f"loss: {g} lost {len(missing) - 5} more acknowledged messages")


def _check_order(h: History, r: Report) -> None:
    runs: dict[tuple[str, int, str, int, str, str], list[Delivery]] = defaultdict(list)
    for d in h.deliveries:
        runs[(d.group, d.pid, d.member, d.generation, d.topic, d.partition)].append(d)
    for key, ds in runs.items():
        ds.sort(key=lambda d: (d.seq, d.t))
        for prev, cur in zip(ds, ds[1:], strict=False):
            if cur.offset <= prev.offset:
                r.rewinds += 1
            elif cur.offset != prev.offset + 1:
                g, pid, member, gen, topic, part = key
                r.violations.append(
                    f"order: {g} {topic}/{part} pid {pid} member {member} generation {gen} went "
                    f"{prev.offset} -> {cur.offset} (skipped or reordered)"
                )


def _touches(f: Fault, pids: set[int]) -> bool:
    return f.pid is None or f.pid in pids


def rejoin_faults(deliveries: list[Delivery]) -> list[Fault]:
    """A `rejoin` fault wherever one process's member id changed between two of its deliveries.

    A process joins once per group; a new member id means its old one was
    fenced (swept) and it joined again, re-reading from the last commit.
    """
    by_pid: dict[tuple[int, str], list[Delivery]] = defaultdict(list)
    for d in deliveries:
        by_pid[(d.pid, d.group)].append(d)
    out: list[Fault] = []
    for (pid, _group), ds in by_pid.items():
        ds.sort(key=lambda d: (d.seq, d.t))
        for prev, cur in zip(ds, ds[1:], strict=False):
            if cur.member != prev.member:
                out.append(Fault("rejoin", prev.t, cur.t, pid, f"{prev.member} -> {cur.member}"))
    return out


def _check_duplicates(
    h: History, faults: list[Fault], by_key: dict[tuple[str, str, str, int], list[Delivery]], r: Report
) -> None:
    for (g, topic, part, off), ds in by_key.items():
        if len(ds) < 2:
            continue
        ds = sorted(ds, key=lambda d: d.t)
        pids = {d.pid for d in ds}
        for prev, cur in zip(ds, ds[1:], strict=False):
            r.duplicates += 1
            lo, hi = prev.t - h.slack, cur.t
            why = [f.kind for f in faults if _touches(f, pids) and f.start <= hi and f.end >= lo]
            if why:
                injected = [k for k in why if k in INJECTED]
                r.explained_by[(injected or why)[0]] += 1
            else:
                r.unexplained_duplicates += 1
                r.violations.append(
                    f"duplicate: {g} got {topic}/{part}@{off} at {prev.t:.3f} (pid {prev.pid}) and again at "
                    f"{cur.t:.3f} (pid {cur.pid}) with no fault touching its owner in between"
                )


def _samples_by_cursor(h: History) -> dict[tuple[str, str, str], list[Sample]]:
    out: dict[tuple[str, str, str], list[Sample]] = defaultdict(list)
    for s in h.samples:
        out[(s.group, s.topic, s.partition)].append(s)
    for ss in out.values():
        ss.sort(key=lambda s: s.t)
    return out


def _check_monotonic(samples: dict[tuple[str, str, str], list[Sample]], r: Report) -> None:
    for (g, topic, part), ss in samples.items():
        for prev, cur in zip(ss, ss[1:], strict=False):
            if cur.committed < prev.committed:
                r.violations.append(
                    f"backwards: {g} {topic}/{part} committed {prev.committed} at {prev.t:.3f} "
                    f"then {cur.committed} at {cur.t:.3f}"
                )


def _first_delivery_times(h: History) -> dict[tuple[str, str, str], dict[int, float]]:
    out: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    for d in h.deliveries:
        seen = out[(d.group, d.topic, d.partition)]
        if d.offset not in seen or d.t < seen[d.offset]:
            seen[d.offset] = d.t
    return out


def _check_commits_backed(
    samples: dict[tuple[str, str, str], list[Sample]],
    first_seen: dict[tuple[str, str, str], dict[int, float]],
    r: Report,
) -> None:
    for key, ss in samples.items():
        seen = first_seen.get(key, {})
        low = min(s.committed for s in ss)
        top = max(s.committed for s in ss)
        # ready[i]: when every offset in [low, low + i) had been delivered at least once.
        ready = [float("-inf")]
        for off in range(low, top):
            ready.append(max(ready[-1], seen.get(off, float("inf"))))
        for s in ss:
            if ready[s.committed - low] > s.t:
                g, topic, part = key
                undelivered = next(o for o in range(low, s.committed) if seen.get(o, float("inf")) > s.t)
                r.violations.append(
                    f"commit ahead of work: {g} {topic}/{part} committed {s.committed} at {s.t:.3f} but offset "
                    f"{undelivered} had not been delivered yet"
                )
                break


def _check_fencing(h: History, samples: dict[tuple[str, str, str], list[Sample]], r: Report) -> None:
    # When each member delivered each offset (earliest), to tell who could have committed.
    by_member: dict[tuple[str, str, str, str], dict[int, float]] = defaultdict(dict)
    for d in h.deliveries:
        seen = by_member[(d.group, d.topic, d.partition, d.member)]
        if d.offset not in seen or d.t < seen[d.offset]:
            seen[d.offset] = d.t
    for (g, topic, part), ss in samples.items():
        for prev, cur in zip(ss, ss[1:], strict=False):
            if cur.committed <= prev.committed or cur.owner is None:
                continue
            if prev.owner != cur.owner or prev.epoch != cur.epoch:
                continue  # the lease moved between the samples: either holder may have committed
            r.commit_advances_checked += 1
            t = by_member.get((g, topic, part, cur.owner), {}).get(cur.committed - 1)
            if t is None or t > cur.t:
                r.violations.append(
                    f"fencing: {g} {topic}/{part} committed {prev.committed} -> {cur.committed} between "
                    f"{prev.t:.3f} and {cur.t:.3f} under lease {cur.owner}#{cur.epoch}, whose holder had not "
                    f"delivered offset {cur.committed - 1}: a commit from another (fenced) member applied"
                )
    _check_zombies(h, samples, r)


def _check_zombies(h: History, samples: dict[tuple[str, str, str], list[Sample]], r: Report) -> None:
    for f in h.faults:
        if f.kind != "zombie" or f.pid is None:
            continue
        # The zombie's identities: the members its process delivered as before it froze.
        old = {(d.group, d.member) for d in h.deliveries if d.pid == f.pid and d.t <= f.start}
        for key, ss in samples.items():
            g = key[0]
            times = [s.t for s in ss]
            during = ss[bisect.bisect_left(times, f.start) : bisect.bisect_right(times, f.end)]
            lost = {s.owner for s in during if s.owner is not None and (g, s.owner) not in old}
            zombie_members = {m for gg, m in old if gg == g}
            had = any(s.owner in zombie_members for s in ss if s.t <= f.start)
            if not (lost and had):
                continue
            r.zombie_partitions_checked += 1
            after = ss[bisect.bisect_right(times, f.end) :]
            for s in after:
                if s.owner in zombie_members:
                    r.violations.append(
                        f"zombie: pid {f.pid} woke at {f.end:.3f} and held {g} {key[1]}/{key[2]} again as "
                        f"{s.owner} (its fenced identity) at {s.t:.3f}"
                    )
                    break
