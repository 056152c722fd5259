"""Stateful property tests of the assignors against a simple model of a group.

The machine keeps members (each reading some topics, or all of them),
partitions, and the last assignment; every rebalance feeds the previous owners
back in as `previous`, the way the Rebalancer does. After every rebalance:

- every partition that some member reads is assigned exactly once, and only
  to a member that reads its topic; nothing else is assigned;
- range: per topic, each member's partitions are a contiguous run in partition
  order, and the readers' counts differ by at most one;
- sticky: every partition whose previous owner is still a member (and still
  reads it) stays, unless that owner was over its quota; when every member
  reads every topic, counts differ by at most one.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actors.assignors import ASSIGNORS, Member, Partition, assign

TOPICS = ("a", "b", "c")


class AssignorMachine(RuleBasedStateMachine):
    """A group whose membership and partitions change between rebalances."""

    def __init__(self) -> None:
        super().__init__()
        self.assignor = "range"
        self.members: dict[str, tuple[str, ...]] = {}
        self.partitions: list[Partition] = []
        self.next_member = 0
        self.next_pid = 1
        self.counts: Counter[str] = Counter()
        self.owner: dict[int, str] = {}  # the last assignment, as the next rebalance's `previous`
        self.last: dict[str, list[int]] | None = None

    @initialize(name=st.sampled_from(ASSIGNORS))
    def choose(self, name: str) -> None:
        self.assignor = name

    @rule(
        topics=st.one_of(st.just(()), st.lists(st.sampled_from(TOPICS), min_size=1, max_size=3, unique=True))
    )
    def add_member(self, topics: list[str] | tuple[()]) -> None:
        self.next_member += 1
        self.members[f"m{self.next_member:03d}"] = tuple(sorted(topics))

    @precondition(lambda self: self.members)
    @rule(data=st.data())
    def remove_member(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from(sorted(self.members)))
        del self.members[victim]

    @rule(topic=st.sampled_from(TOPICS), named=st.booleans())
    def add_partition(self, topic: str, named: bool) -> None:
        # Fixed partitions are "0".."n-1" per topic; dynamic ones carry publisher names.
        index = self.counts[topic]
        self.counts[topic] += 1
        name = f"cust-{index}" if named else str(index)
        self.partitions.append(Partition.of(self.next_pid, topic, name))
        self.next_pid += 1

    @rule()
    def rebalance(self) -> None:
        members = [
            Member(mid, topics, frozenset(p for p, o in self.owner.items() if o == mid))
            for mid, topics in self.members.items()
        ]
        out = assign(self.assignor, members, self.partitions)
        self._check(members, out)
        self.owner = {pid: mid for mid, pids in out.items() for pid in pids}
        self.last = out

    # -- the model's verdict ------------------------------------------------------------

    def _reads(self, mid: str, topic: str) -> bool:
        topics = self.members[mid]
        return not topics or topic in topics

    def _check(self, members: list[Member], out: dict[str, list[int]]) -> None:
        assert set(out) == {m.member_id for m in members}
        by_id = {p.id: p for p in self.partitions}
        handed = Counter(pid for pids in out.values() for pid in pids)
        assert all(n == 1 for n in handed.values()), f"assigned twice: {handed}"
        readable = {p.id for p in self.partitions if any(self._reads(m.member_id, p.topic) for m in members)}
        assert set(handed) == readable, f"missing {readable - set(handed)}, extra {set(handed) - readable}"
        for mid, pids in out.items():
            assert all(self._reads(mid, by_id[p].topic) for p in pids), f"{mid} got a topic it does not read"
        if self.assignor == "range":
            self._check_range(out, by_id)
        elif self.assignor == "sticky":
            self._check_sticky(members, out, by_id)

    def _check_range(self, out: dict[str, list[int]], by_id: dict[int, Partition]) -> None:
        for topic in TOPICS:
            ordered = sorted(p for p in self.partitions if p.topic == topic)
            position = {p.id: i for i, p in enumerate(ordered)}
            readers = [mid for mid in out if self._reads(mid, topic)]
            sizes = []
            for mid in readers:
                mine = sorted(position[p] for p in out[mid] if by_id[p].topic == topic)
                sizes.append(len(mine))
                assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True, (
                    f"range gave {mid} a non-contiguous run of {topic}: {mine}"
                )
            if readers and ordered:
                assert max(sizes) - min(sizes) <= 1, f"range sizes for {topic}: {sizes}"

    def _check_sticky(
        self, members: list[Member], out: dict[str, list[int]], by_id: dict[int, Partition]
    ) -> None:
        n, k = len(self.partitions), len(members)
        if k == 0:
            return
        quota_max = n // k + (1 if n % k else 0)
        for m in members:
            kept = [p for p in m.previous if p in by_id and self._reads(m.member_id, by_id[p].topic)]
            # An owner keeps all it had when it is within the smallest quota; above it, it keeps
            # at least the smallest quota (it gives back only the surplus).
            must_keep = min(len(kept), n // k)
            still = [p for p in kept if p in out[m.member_id]]
            assert len(still) >= must_keep, (
                f"sticky moved {m.member_id}'s partitions: had {sorted(kept)}, kept {sorted(still)}, "
                f"quota {n // k}..{quota_max}"
            )
        if all(not topics for topics in self.members.values()):
            sizes = [len(out[m.member_id]) for m in members]
            assert max(sizes) - min(sizes) <= 1, f"sticky unbalanced: {sizes}"

    @invariant()
    def assignment_only_names_known_members(self) -> None:
        if self.last is not None:
            assert set(self.owner.values()) <= set(self.last)


AssignorMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_assignors_against_the_model = AssignorMachine.TestCase
