"""The chaos history checker: a pure function over what a chaos run recorded.

A run records these histories, each entry stamped with wall-clock time (all
processes run on one host, so their clocks agree):

- `Ack`: a publish (or event-store append) the producer saw succeed;
- `Delivery`: one message handled by a group's member (group, topic, partition,
  offset, payload id, pid, member id, generation: the lease epoch for claims,
  the attempt for queue jobs), in the order the process saw them;
- `UserAck`: a claim / queue / event-store ack that returned to the user;
- `Row`: a row of the user's own table (the effectively-once patterns write
  one per message inside the transaction that commits the offsets);
- `DeadLetter`: a message found in a dead-letter topic at the end;
- `Tally`: an event the event-store workers appended with a guard, covering
  the Items of one claim; `StoreItem`: every Item in the store's final log;
- `Sample`: the committed offset, owner and lease epoch of every (group,
  partition) cursor, read every ~100 ms during the run;
- `Fault`: what was injected, when, and at which process (None: every process)
  and group(s) (empty: every group); and the faults the bus or the user's loop
  reported in a process (see OBSERVED): a member whose session expired, a
  lease that ran out, an actor restarted, a transaction rolled back, a job
  nacked or abandoned, a claim released, a guard conflict. They re-deliver
  from the last commit (some by design) just like an injected fault, so they
  explain duplicates on the process they hit; the checker also derives a
  `rejoin` fault wherever a process's member id changes between two of its
  deliveries (a fence it came back from).

`History.patterns` names each group's usage pattern (see tests/chaos/member.py);
`History.reads` the topic (or store) it reads (default: every ack).

`check(history)` verifies, and `Report.violations` lists every breach:

1. no loss: every acknowledged message reached every group at least once, with
   the payload the producer wrote at that offset; in a group with a dead-letter
   topic a poison message must be dead-lettered instead (and nothing else);
2. order: within one member run (pid, member id, generation, partition), offsets
   go up by exactly one (skipping only dead-lettered poison, or offsets another
   member handled meanwhile: the partition left and came back; event-store
   positions only go up; queue jobs have no order); a step back starts a new run
   (a re-read from the committed offset), anything else is a skip or a reorder;
3. committed offsets never move backwards;
4. a committed offset never covers a message the group had not been handed yet
   (nor dead-lettered): a commit ahead of the work is a loss waiting to happen;
5. fencing: while one lease (same owner and epoch) spans two samples, a commit
   advance between them is backed by that owner's own deliveries; a zombie that
   wakes up never holds its old group identity again on a partition it lost;
6. duplicates only inside the at-least-once window: a second delivery of
   (group, partition, offset) needs a fault that touched one of the processes
   that delivered it (or every process) and that group between the first
   delivery (minus `slack`) and the repeat;
7. exactly once in the user's table (groups in `History.rows`): every
   acknowledged message has exactly one row, with its payload id; a second row
   is a violation whatever the faults; in a group that also dead-letters
   (`txh`), a poison message has no row at all (its savepoint rolled back);
8. acked stays acked: a claim or queue job whose ack returned is never handed
   out again under a later lease epoch / attempt;
9. guards hold: no guarded Tally was appended while an Item of its account had
   been appended after the guard's position; every acknowledged Item is covered
   by a Tally, twice only when a fault hit the first Tally's worker;
10. the contract breaches the members saw themselves (`History.breaches`);
11. queue limits hold (groups in `History.queue_limits`, from the consumers' own
    timestamps, each job's `JobTake`): per key, never more jobs in flight than
    `max_in_flight_per_key`, a job counting from its take's return to the start of
    its ack that returned, cut at the take's start plus the visibility timeout (a
    span inside the one the database held it); never more than the rate limit's
    jobs handed out whose takes (from the call to its return) all fit in one
    window of `per` seconds;
12. no delayed job handed out before its time: a take that returned before the
    publish's start plus its delay (`History.not_before`);
13. a schedule's tick published once (`History.ticks`, what the queue's log
    holds at the end), and no tick left out between its first and last one
    (`History.tick_every`).

`Report.patterns` holds the counts per group and pattern, printed by `summary()`.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

TP = tuple[str, str]

#: Fault kinds the harness injects; every other kind was observed (reported by the bus or derived).
INJECTED = frozenset(
    {
        "kill",
        "terminate_backends",
        "restart",
        "outage",
        "zombie",
        "slow",
        "slow_request",
        "rebalance",
        "long_transaction",
        "failover",
    }
)
#: Injected kinds the bus must ride out without a trace: they explain no duplicate, gap or stall.
EXCUSES_NOTHING = frozenset({"long_transaction"})
#: Observed fault kinds, and what each stands for.
OBSERVED = {
    "member_expired": "a member's session expired and it was swept (its leases freed)",
    "fenced": "a member learned it had been swept, and joined again",
    "rejoin": "a process delivered under a new member id (derived from the deliveries)",
    "lease_lost": "a worker found its partition lease gone (lapsed or taken)",
    "actor_restart": "a worker or coordinator restarted by its supervisor after an error",
    "release_failed": "a worker could not commit and release as it stopped (the lease runs out instead)",
    "loop_lag": "a member process's event loop stood still (CPU starved or blocked): heartbeats stopped too",
    "rolled_back": "the user's transaction rolled back (its batch comes again, by design)",
    "nacked": "a queue job nacked (it comes back, by design)",
    "abandoned": "a queue job left unacked (its visibility timeout brings it back, by design)",
    "guard_conflict": "an event-store append refused by its guard; the claim released (by design)",
    "slow_work": "a claim worked on past its lease, then extended (another worker may take it: by design)",
    "ack_failed": "a claim, job or event-store ack, or an async commit, that failed (the messages may come again)",
}
#: Patterns whose deliveries have no order (competing consumers) / sparse positions (event store).
UNORDERED = frozenset({"queue", "lqueue"})
SPARSE = frozenset({"es"})
#: Patterns that keep one identity per process (a worker id), so a woken zombie may claim again under it.
STABLE_IDENTITY = frozenset({"claims", "queue", "lqueue", "es"})
#: Patterns whose user acks are fenced by the generation recorded (epoch / attempt): check 8.
FENCED_ACKS = frozenset({"claims", "queue", "lqueue"})


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
class UserAck:
    """A claim, queue or event-store ack that returned: `generation` as in the delivery it acks."""

    group: str
    topic: str
    partition: str
    offset: int
    msg_id: str
    pid: int
    generation: int
    t: float


@dataclass(frozen=True)
class Row:
    """A row of the user's own table, written in the transaction that committed the offsets."""

    group: str
    topic: str
    partition: str
    offset: int
    msg_id: str


@dataclass(frozen=True)
class DeadLetter:
    """A message found in a group's dead-letter topic (`t`: when it was written there)."""

    group: str
    topic: str
    partition: str
    offset: int
    msg_id: str
    t: float


@dataclass(frozen=True)
class Tally:
    """A guarded event-store append covering Items `first`..`last` of one account."""

    group: str
    account: str
    first: int
    last: int
    guard_position: int
    position: int
    pid: int
    t: float


@dataclass(frozen=True)
class StoreItem:
    """An Item in the event store's final log."""

    account: str
    position: int


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
    server: int = 0  # the port of the server that answered (a failover changes it)


@dataclass(frozen=True)
class Fault:
    """A fault: `kind`, the interval it lasted, the process it hit (None: all), the groups (empty: all)."""

    kind: str
    start: float
    end: float
    pid: int | None = None
    detail: str = ""
    groups: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JobTake:
    """A limited queue's job as its consumer saw it: the take's call and return, its ack's start.

    `acked_from`: when the ack that returned was called (None: not acked by this take).
    """

    group: str
    topic: str
    partition: str
    offset: int
    msg_id: str
    key: str | None
    asked: float
    got: float
    acked_from: float | None = None


@dataclass(frozen=True)
class QueueLimits:
    """A limited queue's settings: per-key limit, rate limit (jobs per `per` s), visibility timeout."""

    per_key: int | None
    rate: int | None
    per: float
    visibility: float


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
    patterns: dict[str, str] = field(default_factory=dict)
    reads: dict[str, str] = field(default_factory=dict)
    rows: dict[str, list[Row]] = field(default_factory=dict)
    dead_letters: dict[str, list[DeadLetter]] = field(default_factory=dict)
    poison: frozenset[str] = frozenset()
    user_acks: list[UserAck] = field(default_factory=list)
    tallies: dict[str, list[Tally]] = field(default_factory=dict)
    store_items: list[StoreItem] = field(default_factory=list)
    breaches: list[str] = field(default_factory=list)
    # (group, kind) -> how often the members' loops did it (released, nacked, committed, ...).
    counters: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Limited queues: each group's limits and the jobs its consumers took (check 11).
    queue_limits: dict[str, QueueLimits] = field(default_factory=dict)
    job_takes: list[JobTake] = field(default_factory=list)
    # Delayed publishes: message id -> the earliest time its job may be handed out (check 12).
    not_before: dict[str, float] = field(default_factory=dict)
    # A schedule's published ticks (schedule, tick as ISO 8601) and its period in seconds (check 13).
    ticks: list[tuple[str, str]] = field(default_factory=list)
    tick_every: float | None = None


@dataclass
class PatternCounts:
    """The counts of one group (one usage pattern)."""

    pattern: str
    acked: int = 0
    delivered: int = 0
    deliveries: int = 0
    duplicates: int = 0
    unexplained: int = 0
    explained_by: Counter[str] = field(default_factory=Counter)
    losses: int = 0
    rows: int | None = None
    row_duplicates: int = 0
    row_losses: int = 0
    dead_lettered: int | None = None
    dead_letter_duplicates: int = 0
    tallies: int | None = None
    tally_duplicates: int = 0
    violations: int = 0
    events: Counter[str] = field(default_factory=Counter)

    def line(self, group: str) -> str:
        """One row of the per-pattern table."""
        explained = self.duplicates - self.unexplained
        cells = [
            f"{self.pattern:<12}",
            f"{group:<10}",
            f"{self.acked:>6}",
            f"{self.delivered:>9}",
            f"{self.deliveries:>10}",
            f"{explained:>8}",
            f"{self.unexplained:>11}",
            f"{self.losses:>6}",
        ]
        extra = []
        if self.rows is not None:
            extra.append(f"table rows={self.rows} dup={self.row_duplicates} lost={self.row_losses}")
        if self.dead_lettered is not None:
            extra.append(f"dead-lettered={self.dead_lettered} (dup {self.dead_letter_duplicates})")
        if self.tallies is not None:
            extra.append(f"tallies={self.tallies} (dup {self.tally_duplicates})")
        if self.events:
            extra.append(" ".join(f"{k}={v}" for k, v in sorted(self.events.items())))
        if self.explained_by:
            extra.append("dups by " + ",".join(f"{k}={v}" for k, v in self.explained_by.most_common(3)))
        return " ".join(cells) + f" {self.violations:>4}  " + "; ".join(extra)


HEADER = (
    f"{'pattern':<12} {'group':<10} {'acked':>6} {'delivered':>9} {'deliveries':>10} {'dup expl':>8} "
    f"{'dup unexpl.':>11} {'losses':>6} {'viol':>4}  details"
)


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
    patterns: dict[str, PatternCounts] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no invariant was breached."""
        return not self.violations

    def pattern(self, group: str) -> PatternCounts:
        """The counts of `group` (created on first use)."""
        return self.patterns.setdefault(group, PatternCounts(""))

    def violate(self, group: str | None, text: str) -> None:
        """Record a breach (and count it against its group)."""
        self.violations.append(text)
        if group is not None:
            self.pattern(group).violations += 1

    def table(self) -> str:
        """The per-pattern counts, one line per group."""
        lines = [HEADER] + [
            pc.line(g) for g, pc in sorted(self.patterns.items(), key=lambda kv: kv[1].pattern)
        ]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line per count, the per-pattern table, then the first violations."""
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
            "per pattern:",
            self.table(),
            f"violations: {len(self.violations)}",
        ]
        lines += [f"  - {v}" for v in self.violations[:30]]
        return "\n".join(lines)


def check(h: History) -> Report:
    """Verify a recorded chaos history; see the module docstring for the invariants."""
    r = Report(messages=len(h.acks), deliveries=len(h.deliveries), samples=len(h.samples))
    faults = h.faults + rejoin_faults(h.deliveries)
    r.faults = Counter(f.kind for f in faults)
    for g in h.groups:
        pc = r.pattern(g)
        pc.pattern = h.patterns.get(g, "")
        pc.acked = len(_acks_of(h, g))
        pc.events = Counter({k: v for (gg, k), v in h.counters.items() if gg == g})
    by_key: dict[tuple[str, str, str, int], list[Delivery]] = defaultdict(list)
    for d in h.deliveries:
        by_key[(d.group, d.topic, d.partition, d.offset)].append(d)
        r.pattern(d.group).deliveries += 1
    for (g, *_), _ds in by_key.items():
        r.pattern(g).delivered += 1
    _check_payloads(h, by_key, r)
    _check_losses(h, by_key, faults, r)
    _check_order(h, r)
    _check_duplicates(h, faults, by_key, r)
    _check_rows(h, r)
    _check_acked_stays_acked(h, r)
    _check_tallies(h, faults, r)
    _check_queue_limits(h, r)
    _check_delays(h, r)
    _check_ticks(h, r)
    for text in h.breaches:
        r.violate(None, f"breach: {text}")
    samples = _samples_by_cursor(h)
    _check_monotonic(samples, r)
    first_seen = _first_delivery_times(h)
    _check_commits_backed(samples, first_seen, r)
    _check_fencing(h, samples, r)
    return r


def _acks_of(h: History, group: str) -> list[Ack]:
    topic = h.reads.get(group)
    return [a for a in h.acks if topic is None or a.topic == topic]


def _check_payloads(h: History, by_key: dict[tuple[str, str, str, int], list[Delivery]], r: Report) -> None:
    written = {(a.topic, a.partition, a.offset): a.msg_id for a in h.acks}
    for (g, topic, part, off), ds in by_key.items():
        ids = {d.msg_id for d in ds}
        expected = written.get((topic, part, off))
        if len(ids) > 1 or (expected is not None and ids != {expected}):
            r.violate(
                g, f"corrupt: {g} got payloads {sorted(ids)} at {topic}/{part}@{off}, published {expected!r}"
            )


def _touches(f: Fault, pids: set[int], group: str | None = None) -> bool:
    if f.kind in EXCUSES_NOTHING:
        return False
    return (f.pid is None or f.pid in pids) and (not f.groups or group is None or group in f.groups)


def _check_losses(
    h: History, by_key: dict[tuple[str, str, str, int], list[Delivery]], faults: list[Fault], r: Report
) -> None:
    for g in h.groups:
        dlq = h.dead_letters.get(g)
        lettered: dict[tuple[str, str, int], list[DeadLetter]] = defaultdict(list)
        for dl in dlq or []:
            lettered[(dl.topic, dl.partition, dl.offset)].append(dl)
        missing = []
        for a in _acks_of(h, g):
            key = (a.topic, a.partition, a.offset)
            if dlq is not None and a.msg_id in h.poison:
                if key not in lettered:
                    missing.append(a)
            elif (g, *key) not in by_key:
                missing.append(a)
        r.losses += len(missing)
        r.pattern(g).losses += len(missing)
        for a in missing[:5]:
            what = "dead-lettered" if dlq is not None and a.msg_id in h.poison else "got"
            r.violate(g, f"loss: {g} never {what} {a.topic}/{a.partition}@{a.offset} (id {a.msg_id})")
        if len(missing) > 5:
            r.violate(g, f"loss: {g} lost {len(missing) - 5} more acknowledged messages")
        if dlq is None:
            continue
        pc = r.pattern(g)
        pc.dead_lettered = len(lettered)
        for key, dls in lettered.items():
            ds = by_key.get((g, *key), [])
            pids = {d.pid for d in ds}
            if dls[0].msg_id not in h.poison:
                lo, hi = (min(d.t for d in ds) - h.slack if ds else 0.0), dls[0].t
                if not ds or not any(_touches(f, pids, g) and f.start <= hi and f.end >= lo for f in faults):
                    r.violate(
                        g,
                        f"dead letter: {g} dead-lettered {key[0]}/{key[1]}@{key[2]} ({dls[0].msg_id}), "
                        "which is not poison, with no fault on the processes that had it",
                    )
            for prev, cur in zip(dls, dls[1:], strict=False):
                pc.dead_letter_duplicates += 1
                if not any(
                    (not f.groups or g in f.groups) and f.start <= cur.t and f.end >= prev.t - h.slack
                    for f in faults
                ):
                    r.violate(
                        g,
                        f"dead letter: {g} dead-lettered {key[0]}/{key[1]}@{key[2]} twice "
                        f"({prev.t:.3f}, {cur.t:.3f}) with no fault in between",
                    )


def _check_order(h: History, r: Report) -> None:
    runs: dict[tuple[str, int, str, int, str, str], list[Delivery]] = defaultdict(list)
    for d in h.deliveries:
        runs[(d.group, d.pid, d.member, d.generation, d.topic, d.partition)].append(d)
    poison_at = {(a.topic, a.partition, a.offset) for a in h.acks if a.msg_id in h.poison}
    # When each offset was handled by anyone of the group: a partition may leave a member
    # (its lease lost) and come back within one generation, its offsets handled elsewhere.
    handled: dict[tuple[str, str, str, int], list[float]] = defaultdict(list)
    for d in h.deliveries:
        handled[(d.group, d.topic, d.partition, d.offset)].append(d.t)
    for key, ds in runs.items():
        g, pid, member, gen, topic, part = key
        pattern = h.patterns.get(g, "")
        if pattern in UNORDERED:
            continue
        skippable = poison_at if g in h.dead_letters else set()
        ds.sort(key=lambda d: (d.seq, d.t))
        for prev, cur in zip(ds, ds[1:], strict=False):
            if cur.offset <= prev.offset:
                r.rewinds += 1
            elif cur.offset != prev.offset + 1 and pattern not in SPARSE:
                if all(
                    (topic, part, o) in skippable
                    or any(prev.t <= t <= cur.t for t in handled[(g, topic, part, o)])
                    for o in range(prev.offset + 1, cur.offset)
                ):
                    continue  # dead-lettered poison, or handled by another member meanwhile
                r.violate(
                    g,
                    f"order: {g} {topic}/{part} pid {pid} member {member} generation {gen} went "
                    f"{prev.offset} -> {cur.offset} (skipped or reordered)",
                )


def rejoin_faults(deliveries: list[Delivery]) -> list[Fault]:
    """A `rejoin` fault wherever one process's member id changed between two of its deliveries.

    A process joins once per group; a new member id means its old one was
    fenced (swept) and it joined again, re-reading from the last commit.
    """
    by_pid: dict[tuple[int, str], list[Delivery]] = defaultdict(list)
    for d in deliveries:
        by_pid[(d.pid, d.group)].append(d)
    out: list[Fault] = []
    for (pid, group), ds in by_pid.items():
        ds.sort(key=lambda d: (d.seq, d.t))
        for prev, cur in zip(ds, ds[1:], strict=False):
            if cur.member != prev.member:
                out.append(
                    Fault("rejoin", prev.t, cur.t, pid, f"{prev.member} -> {cur.member}", frozenset({group}))
                )
    return out


def _check_duplicates(
    h: History, faults: list[Fault], by_key: dict[tuple[str, str, str, int], list[Delivery]], r: Report
) -> None:
    for (g, topic, part, off), ds in by_key.items():
        if len(ds) < 2:
            continue
        pc = r.pattern(g)
        ds = sorted(ds, key=lambda d: d.t)
        pids = {d.pid for d in ds}
        for prev, cur in zip(ds, ds[1:], strict=False):
            r.duplicates += 1
            pc.duplicates += 1
            lo, hi = prev.t - h.slack, cur.t
            why = [f.kind for f in faults if _touches(f, pids, g) and f.start <= hi and f.end >= lo]
            if why:
                injected = [k for k in why if k in INJECTED]
                r.explained_by[(injected or why)[0]] += 1
                pc.explained_by[(injected or why)[0]] += 1
            else:
                r.unexplained_duplicates += 1
                pc.unexplained += 1
                r.violate(
                    g,
                    f"duplicate: {g} got {topic}/{part}@{off} at {prev.t:.3f} (pid {prev.pid}) and again at "
                    f"{cur.t:.3f} (pid {cur.pid}) with no fault touching its owner in between",
                )


def _check_rows(h: History, r: Report) -> None:
    """Exactly once in the user's table: one row per acknowledged message, never two."""
    for g, rows in h.rows.items():
        pc = r.pattern(g)
        pc.rows = len(rows)
        count: Counter[tuple[str, str, int]] = Counter()
        ids: dict[tuple[str, str, int], set[str]] = defaultdict(set)
        for row in rows:
            count[(row.topic, row.partition, row.offset)] += 1
            ids[(row.topic, row.partition, row.offset)].add(row.msg_id)
        dups = sorted(k for k, n in count.items() if n > 1)
        pc.row_duplicates = sum(count[k] - 1 for k in dups)
        for k in dups[:5]:
            r.violate(g, f"exactly-once: {g}'s table has {count[k]} rows for {k[0]}/{k[1]}@{k[2]}")
        if len(dups) > 5:
            r.violate(g, f"exactly-once: {g}'s table has {len(dups) - 5} more offsets written twice")
        dead_letters = g in h.dead_letters
        for a in _acks_of(h, g):
            if dead_letters and a.msg_id in h.poison and count[(a.topic, a.partition, a.offset)]:
                r.violate(
                    g,
                    f"exactly-once: {g}'s table has a row for poison {a.topic}/{a.partition}@{a.offset} "
                    f"(id {a.msg_id}): its failed attempts' writes did not roll back",
                )
        lost = [
            a
            for a in _acks_of(h, g)
            if (a.topic, a.partition, a.offset) not in count and not (dead_letters and a.msg_id in h.poison)
        ]
        pc.row_losses = len(lost)
        for a in lost[:5]:
            r.violate(
                g,
                f"exactly-once: {g}'s table has no row for {a.topic}/{a.partition}@{a.offset} (id {a.msg_id})",
            )
        if len(lost) > 5:
            r.violate(g, f"exactly-once: {g}'s table misses {len(lost) - 5} more acknowledged messages")
        for a in _acks_of(h, g):
            got = ids.get((a.topic, a.partition, a.offset))
            if got is not None and got != {a.msg_id}:
                r.violate(
                    g,
                    f"exactly-once: {g}'s table has {sorted(got)} at {a.topic}/{a.partition}@{a.offset}, "
                    f"published {a.msg_id!r}",
                )


def _check_acked_stays_acked(h: History, r: Report) -> None:
    """A claim or queue job whose ack returned never comes back under a later epoch / attempt."""
    acked: dict[tuple[str, str, str, int], UserAck] = {}
    for a in h.user_acks:
        if h.patterns.get(a.group, "") not in FENCED_ACKS:
            continue
        key = (a.group, a.topic, a.partition, a.offset)
        if key not in acked or a.generation < acked[key].generation:
            acked[key] = a
    flagged: set[tuple[str, str, str, int]] = set()
    for d in h.deliveries:
        key = (d.group, d.topic, d.partition, d.offset)
        a = acked.get(key)
        if a is not None and d.generation > a.generation and key not in flagged:
            flagged.add(key)
            r.violate(
                d.group,
                f"acked again: {d.group} {d.topic}/{d.partition}@{d.offset} was acked at {a.t:.3f} "
                f"(pid {a.pid}, generation {a.generation}) and handed out again at {d.t:.3f} "
                f"(pid {d.pid}, generation {d.generation})",
            )


def _check_queue_limits(h: History, r: Report) -> None:
    """Per key, never more jobs in flight than the limit; never more taken within a window than the rate."""
    for g, limits in h.queue_limits.items():
        takes = [j for j in h.job_takes if j.group == g]
        # The most seen at once, printed with the counts: how close the run came to each limit.
        peaks = r.pattern(g).events
        if limits.per_key is not None:
            # (time, +1 start / -1 end); at equal times an end goes first (half-open spans).
            edges: dict[str, list[tuple[float, int, JobTake]]] = defaultdict(list)
            for j in takes:
                if j.key is None or j.acked_from is None:
                    continue
                end = min(j.acked_from, j.asked + limits.visibility)
                if end > j.got:
                    edges[j.key] += [(j.got, 1, j), (end, -1, j)]
            for key, points in sorted(edges.items()):
                out: set[JobTake] = set()
                for t, step, j in sorted(points, key=lambda p: (p[0], p[1])):
                    if step < 0:
                        out.discard(j)
                        continue
                    out.add(j)
                    peaks["peak_per_key"] = max(peaks["peak_per_key"], len(out))
                    if len(out) > limits.per_key:
                        jobs = ", ".join(
                            f"{o.partition}@{o.offset}" for o in sorted(out, key=lambda o: o.got)
                        )
                        r.violate(
                            g,
                            f"per-key limit: {g} had {len(out)} jobs of key {key!r} in flight at {t:.3f} "
                            f"(limit {limits.per_key}): {jobs}",
                        )
                        break
        if limits.rate is not None:
            # Jobs whose takes all lie in [start, start + per) were handed out within one window.
            ordered = sorted(takes, key=lambda j: j.asked)
            for i, first in enumerate(ordered):
                end = first.asked + limits.per
                inside = []
                for j in ordered[i:]:
                    if j.asked >= end:
                        break
                    if j.got < end:
                        inside.append(j)
                peaks["peak_per_window"] = max(peaks["peak_per_window"], len(inside))
                if len(inside) > limits.rate:
                    r.violate(
                        g,
                        f"rate limit: {g} was handed {len(inside)} jobs within {limits.per:g} s from "
                        f"{first.asked:.3f} (limit {limits.rate})",
                    )
                    break


def _check_delays(h: History, r: Report) -> None:
    """No delayed job was handed out (its take returned) before its publish's start plus its delay."""
    for j in h.job_takes:
        due = h.not_before.get(j.msg_id)
        if due is not None and j.got < due:
            r.violate(
                j.group,
                f"early: {j.group} was handed {j.topic}/{j.partition}@{j.offset} ({j.msg_id}) at "
                f"{j.got:.3f}, {due - j.got:.3f} s before its time",
            )


def _check_ticks(h: History, r: Report) -> None:
    """Each tick of a schedule published once, none left out between the first and the last."""
    from datetime import datetime

    by_schedule: dict[str, Counter[str]] = defaultdict(Counter)
    for name, tick in h.ticks:
        by_schedule[name][tick] += 1
    for name, ticks in sorted(by_schedule.items()):
        for tick, n in sorted(ticks.items()):
            if n > 1:
                r.violate(None, f"tick twice: schedule {name!r} published its tick {tick} {n} times")
        if h.tick_every is None:
            continue
        times = sorted(datetime.fromisoformat(t).timestamp() for t in ticks)
        for a, b in zip(times, times[1:], strict=False):
            if b - a > h.tick_every * 1.5:
                r.violate(
                    None, f"tick missed: schedule {name!r} published nothing between {a:.0f} and {b:.0f}"
                )


def _check_tallies(h: History, faults: list[Fault], r: Report) -> None:
    """Guards hold, and the guarded Tallies cover every acknowledged Item (twice only after a fault)."""
    items: dict[str, list[int]] = defaultdict(list)
    for it in h.store_items:
        items[it.account].append(it.position)
    for positions in items.values():
        positions.sort()
    for g, tallies in h.tallies.items():
        pc = r.pattern(g)
        pc.tallies = len(tallies)
        for t in tallies:
            ps = items.get(t.account, [])
            i = bisect.bisect_right(ps, t.guard_position)
            if i < len(ps) and ps[i] < t.position:
                r.violate(
                    g,
                    f"guard: {g} appended a Tally at {t.position} with guard position {t.guard_position} "
                    f"although Item {t.account}@{ps[i]} came in between",
                )
        covering: dict[tuple[str, int], list[Tally]] = defaultdict(list)
        by_account: dict[str, list[Tally]] = defaultdict(list)
        for t in tallies:
            by_account[t.account].append(t)
        for a in _acks_of(h, g):
            covering[(a.partition, a.offset)] = sorted(
                (t for t in by_account.get(a.partition, []) if t.first <= a.offset <= t.last),
                key=lambda t: t.t,
            )
        lost = [a for a in _acks_of(h, g) if not covering[(a.partition, a.offset)]]
        for a in lost[:5]:
            r.violate(g, f"tally: {g} has no Tally covering Item {a.partition}@{a.offset} (id {a.msg_id})")
        pc.losses += len(lost)
        r.losses += len(lost)
        for (account, pos), ts in covering.items():
            for prev, cur in zip(ts, ts[1:], strict=False):
                pc.tally_duplicates += 1
                if not any(
                    _touches(f, {prev.pid}, g) and f.start <= cur.t and f.end >= prev.t - h.slack
                    for f in faults
                ):
                    r.violate(
                        g,
                        f"tally: {g} Item {account}@{pos} covered by Tallies at {prev.position} (pid "
                        f"{prev.pid}) and {cur.position} (pid {cur.pid}) with no fault on the first worker",
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
            # Across a failover the old primary may have shown a commit whose wait for the standby
            # the shutdown cut short: committed there, never acknowledged to the member, not on the
            # promoted standby. Its messages come again (duplicates the failover explains).
            if cur.committed < prev.committed and cur.server == prev.server:
                r.violate(
                    g,
                    f"backwards: {g} {topic}/{part} committed {prev.committed} at {prev.t:.3f} "
                    f"then {cur.committed} at {cur.t:.3f}",
                )


def _first_delivery_times(h: History) -> dict[tuple[str, str, str], dict[int, float]]:
    """When each (group, partition) offset was first handled (or dead-lettered: handled too)."""
    out: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    handled = [(d.group, d.topic, d.partition, d.offset, d.t) for d in h.deliveries]
    handled += [(x.group, x.topic, x.partition, x.offset, x.t) for xs in h.dead_letters.values() for x in xs]
    for g, topic, part, off, t in handled:
        seen = out[(g, topic, part)]
        if off not in seen or t < seen[off]:
            seen[off] = t
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
                r.violate(
                    g,
                    f"commit ahead of work: {g} {topic}/{part} committed {s.committed} at {s.t:.3f} but offset "
                    f"{undelivered} had not been delivered yet",
                )
                break


def _check_fencing(h: History, samples: dict[tuple[str, str, str], list[Sample]], r: Report) -> None:
    # When each member delivered each offset (earliest), to tell who could have committed.
    by_member: dict[tuple[str, str, str, str], dict[int, float]] = defaultdict(dict)
    for d in h.deliveries:
        seen = by_member[(d.group, d.topic, d.partition, d.member)]
        if d.offset not in seen or d.t < seen[d.offset]:
            seen[d.offset] = d.t
    poison_at = {(a.topic, a.partition, a.offset) for a in h.acks if a.msg_id in h.poison}
    for (g, topic, part), ss in samples.items():
        for prev, cur in zip(ss, ss[1:], strict=False):
            if cur.committed <= prev.committed or cur.owner is None:
                continue
            if prev.owner != cur.owner or prev.epoch != cur.epoch:
                continue  # the lease moved between the samples: either holder may have committed
            last = cur.committed - 1
            while g in h.dead_letters and (topic, part, last) in poison_at and last >= prev.committed:
                last -= 1  # dead-lettered, never handled: the owner's last handled offset backs the commit
            if last < prev.committed:
                continue
            r.commit_advances_checked += 1
            t = by_member.get((g, topic, part, cur.owner), {}).get(last)
            if t is None or t > cur.t:
                r.violate(
                    g,
                    f"fencing: {g} {topic}/{part} committed {prev.committed} -> {cur.committed} between "
                    f"{prev.t:.3f} and {cur.t:.3f} under lease {cur.owner}#{cur.epoch}, whose holder had not "
                    f"delivered offset {last}: a commit from another (fenced) member applied",
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
            if h.patterns.get(g, "") in STABLE_IDENTITY:
                continue  # one worker id per process: claiming again after waking is not a fenced identity
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
                    r.violate(
                        g,
                        f"zombie: pid {f.pid} woke at {f.end:.3f} and held {g} {key[1]}/{key[2]} again as "
                        f"{s.owner} (its fenced identity) at {s.t:.3f}",
                    )
                    break
