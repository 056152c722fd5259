"""Partition assignors: pure functions from (members, partitions, previous owners) to an assignment.

`range` is Kafka's (and the seed's): per topic, partitions in order, members
in order, each member a contiguous run; the first `n % m` members get one
extra (10 partitions, 3 members → 4/3/3). `roundrobin` deals all partitions
across members in turn. `sticky` keeps every partition with its previous
owner while that keeps the counts balanced, and moves only the surplus.

Members subscribe to topics; an empty topic list means "every topic of the
group" (wildcard subscriptions). A partition only goes to members that read
its topic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

ASSIGNORS = ("range", "roundrobin", "sticky")


@dataclass(frozen=True)
class Member:
    """A live member as the assignor sees it."""

    member_id: str
    topics: tuple[str, ...] = ()
    previous: frozenset[int] = field(default_factory=frozenset)

    def reads(self, topic: str) -> bool:
        return not self.topics or topic in self.topics


@dataclass(frozen=True, order=True)
class Partition:
    """A partition as the assignor sees it."""

    topic: str
    sort_key: tuple[int, str]
    id: int

    @staticmethod
    def of(pid: int, topic: str, name: str) -> Partition:
        # Fixed partitions are "0".."n-1": order them numerically, not as text.
        key = (int(name), "") if name.isdigit() else (1 << 62, name)
        return Partition(topic, key, pid)


Assignment = dict[str, list[int]]


def _by_topic(partitions: Sequence[Partition]) -> dict[str, list[Partition]]:
    topics: dict[str, list[Partition]] = {}
    for p in sorted(partitions):
        topics.setdefault(p.topic, []).append(p)
    return topics


def assign_range(members: Sequence[Member], partitions: Sequence[Partition]) -> Assignment:
    """Per topic, contiguous runs: the first (n % m) members take one more."""
    out: Assignment = {m.member_id: [] for m in members}
    for topic, parts in _by_topic(partitions).items():
        readers = sorted((m for m in members if m.reads(topic)), key=lambda m: m.member_id)
        if not readers:
            continue
        base, extra = divmod(len(parts), len(readers))
        start = 0
        for i, m in enumerate(readers):
            count = base + (1 if i < extra else 0)
            out[m.member_id].extend(p.id for p in parts[start : start + count])
            start += count
    return out


def assign_roundrobin(members: Sequence[Member], partitions: Sequence[Partition]) -> Assignment:
    """All partitions in (topic, partition) order, dealt to the members that read them in turn."""
    out: Assignment = {m.member_id: [] for m in members}
    ordered = sorted(members, key=lambda m: m.member_id)
    turn = 0
    for p in sorted(partitions):
        for _ in range(len(ordered)):
            m = ordered[turn % len(ordered)]
            turn += 1
            if m.reads(p.topic):
                out[m.member_id].append(p.id)
                break
    return out


def assign_sticky(members: Sequence[Member], partitions: Sequence[Partition]) -> Assignment:
    """Balanced like round-robin, but every partition stays with its previous owner when it can."""
    out: Assignment = {m.member_id: [] for m in members}
    if not members:
        return out
    ordered = sorted(members, key=lambda m: m.member_id)
    by_id = {p.id: p for p in partitions}
    owner_of: dict[int, str] = {}
    for m in ordered:
        for pid in sorted(m.previous):
            if pid in by_id and m.reads(by_id[pid].topic) and pid not in owner_of:
                owner_of[pid] = m.member_id
    # Target counts: n // m each, the first n % m one more. Members that
    # already hold more than their share give back their highest partitions.
    n, k = len(partitions), len(ordered)
    quota = {
        m.member_id: n // k + (1 if i < n % k else 0)
        for i, m in enumerate(
            sorted(ordered, key=lambda m: (-len([p for p in m.previous if p in by_id]), m.member_id))
        )
    }
    for m in ordered:
        kept = sorted(pid for pid, o in owner_of.items() if o == m.member_id)
        out[m.member_id] = kept[: quota[m.member_id]]
    taken = {pid for parts in out.values() for pid in parts}
    free = [p for p in sorted(partitions) if p.id not in taken]
    for p in free:
        candidates = [m for m in ordered if m.reads(p.topic)]
        if not candidates:
            continue
        # The least loaded reader relative to its quota, then by name: deterministic.
        best = min(candidates, key=lambda m: (len(out[m.member_id]) - quota[m.member_id], m.member_id))
        out[best.member_id].append(p.id)
    return out


_ASSIGNORS: Mapping[str, Callable[[Sequence[Member], Sequence[Partition]], Assignment]] = {
    "range": assign_range,
    "roundrobin": assign_roundrobin,
    "sticky": assign_sticky,
}


def assign(name: str, members: Sequence[Member], partitions: Sequence[Partition]) -> Assignment:
    """Run the assignor `name`; every partition read by some member is assigned exactly once."""
    try:
        fn = _ASSIGNORS[name]
    except KeyError:
        raise ValueError(f"unknown assignor {name!r}; use one of {ASSIGNORS}") from None
    return fn(members, partitions)
