"""Stateful property test of the lease / offset state machine, on the real database.

Simulated members of one group acquire, commit through, fetch under, release
and lose leases on two partitions (storage/leases.py, the statements the
PartitionWorkers run); leases are expired by moving `lease_expires_at` into
the past and members are removed the way a leave does (storage/membership.py).
A model says what each call must do; after every step the cursor rows must
match it:

- at most one owner per partition, and it is the one the model expects;
- `committed` never decreases, and moves only by an applied commit;
- a commit (or fetch, or release) carrying a stale epoch, from a non-owner,
  or on an expired lease never applies;
- acquire succeeds exactly when the lease is free, expired, or already the
  caller's, and the caller is a member.
"""

from __future__ import annotations

from typing import Any, TypeVar

import asyncpg
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import bus
from storage import groups, leases, membership, topics
from tests.properties.loop import LoopEnv

T = TypeVar("T")
GROUP = "g"
MEMBERS = ("m1", "m2", "m3")
PARTITIONS = 2
MESSAGES = 5

RESET_MEMBERS = "DELETE FROM members WHERE group_name = $1"
RESET = """
UPDATE offsets SET committed = 0, owner = NULL, owner_generation = NULL, lease_epoch = 0, lease_expires_at = NULL
WHERE group_name = $1
"""
ADD_MEMBER = """
INSERT INTO members (group_name, member_id, client_id, host, pid, session_timeout, generation, assignment)
SELECT $1, $2, 'props', 'host', 1, 1e6, 1, array_agg(partition_id) FROM offsets WHERE group_name = $1
"""
EXPIRE = """
UPDATE offsets SET lease_expires_at = clock_timestamp() - interval '1 second'
WHERE group_name = $1 AND partition_id = $2 AND owner IS NOT NULL
"""
CURSORS = "SELECT partition_id, committed, owner, lease_epoch, lease_expires_at > clock_timestamp() AS live FROM offsets WHERE group_name = $1"


class Env(LoopEnv):
    """One event loop and connection shared by every example (set up once per test)."""

    def __init__(self, dsn: str, schema: str) -> None:
        super().__init__()
        self.dsn, self.schema = dsn, schema
        self.pids: list[int] = self.run(self._setup())

    async def _setup(self) -> list[int]:
        async with bus.connect(self.dsn, schema=self.schema) as b:
            await b.create_topic("t", partitions=PARTITIONS)
            for i in range(PARTITIONS * MESSAGES):
                await b.publish("t", {"i": i}, partition=str(i % PARTITIONS))
            # Records the group (start: earliest), so its cursors start at 0.
            c = b.consumer(GROUP, topics=["t"], start="earliest")
            await c.start()
            await c.close()
        self.conn = await asyncpg.connect(self.dsn, server_settings={"search_path": self.schema})
        ids = [r[0] for r in await topics.partitions(self.conn, "t")]
        await groups.materialize_offsets(self.conn, GROUP, ids)
        return sorted(
            r[0]
            for r in await self.conn.fetch("SELECT partition_id FROM offsets WHERE group_name = $1", GROUP)
        )

    def close(self) -> None:
        self.run(self.conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.run(self.conn.close())
        self.loop.close()


class LeaseMachine(RuleBasedStateMachine):
    """Members racing for two partitions' leases, checked against a model after every step."""

    env: Env

    def __init__(self) -> None:
        super().__init__()
        env = self.env
        self.run = env.run
        self.conn = env.conn
        self.run(self.conn.execute(RESET_MEMBERS, GROUP))
        self.run(self.conn.execute(RESET, GROUP))
        self.members: set[str] = set()
        for m in MEMBERS:
            self._add(m)
        # The model: per partition (owner, epoch, live, committed).
        self.owner: dict[int, str | None] = {p: None for p in env.pids}
        self.epoch: dict[int, int] = {p: 0 for p in env.pids}
        self.live: dict[int, bool] = {p: False for p in env.pids}
        self.committed: dict[int, int] = {p: 0 for p in env.pids}
        # What each member believes: the epoch its last acquire returned (maybe stale by now).
        self.held: dict[tuple[str, int], int] = {}

    def _add(self, member: str) -> None:
        self.run(self.conn.execute(ADD_MEMBER, GROUP, member))
        self.members.add(member)

    partitions = st.integers(0, PARTITIONS - 1)
    member = st.sampled_from(MEMBERS)

    @rule(member=member, p=partitions)
    def acquire(self, member: str, p: int) -> None:
        pid = self.env.pids[p]
        got = self.run(leases.acquire(self.conn, GROUP, pid, member, 1, 60.0))
        may = member in self.members and (self.owner[pid] in (None, member) or not self.live[pid])
        assert (got is not None) == may, f"acquire by {member} of {pid}: got {got}, model says {may}"
        if got is not None:
            self.epoch[pid] += 1
            assert got == (self.epoch[pid], self.committed[pid])
            self.owner[pid], self.live[pid] = member, True
            self.held[(member, pid)] = got[0]

    @rule(member=member, p=partitions, advance=st.integers(-2, MESSAGES), stale=st.booleans())
    def commit(self, member: str, p: int, advance: int, stale: bool) -> None:
        pid = self.env.pids[p]
        epoch = self.held.get((member, pid), 0) - (1 if stale else 0)
        offset = max(0, self.committed[pid] + advance)
        applied = self.run(leases.commit(self.conn, GROUP, member, [(pid, offset, epoch)]))
        may = self.owner[pid] == member and self.live[pid] and epoch == self.epoch[pid]
        assert (pid in applied) == may, (
            f"commit {offset} by {member}@{epoch} on {pid}: applied={applied}, model {may}"
        )
        if may:
            self.committed[pid] = max(self.committed[pid], offset)

    @rule(member=member, p=partitions)
    def fetch(self, member: str, p: int) -> None:
        pid = self.env.pids[p]
        epoch = self.held.get((member, pid), 0)
        rows = self.run(leases.fetch(self.conn, GROUP, pid, member, epoch, 0, 100))
        may = self.owner[pid] == member and self.live[pid] and epoch == self.epoch[pid]
        assert (len(rows) == MESSAGES) == may and (not rows or may), (
            f"fetch by {member}@{epoch}: {len(rows)} rows"
        )

    @rule(p=partitions)
    def expire(self, p: int) -> None:
        pid = self.env.pids[p]
        self.run(self.conn.execute(EXPIRE, GROUP, pid))
        if self.owner[pid] is not None:
            self.live[pid] = False

    @rule(member=member, p=partitions)
    def release(self, member: str, p: int) -> None:
        pid = self.env.pids[p]
        epoch = self.held.get((member, pid), 0)
        done = self.run(leases.release(self.conn, GROUP, pid, member, epoch, "bus_props"))
        may = self.owner[pid] == member and epoch == self.epoch[pid]
        assert done == may, f"release by {member}@{epoch} of {pid}: {done}, model {may}"
        if may:
            self.owner[pid], self.live[pid] = None, False

    @rule(member=member)
    def remove_member(self, member: str) -> None:
        if member not in self.members:
            return
        self.run(membership.leave(self.conn, GROUP, member, 0.5, "bus_props"))
        self.members.discard(member)
        for pid, owner in self.owner.items():
            if owner == member:
                self.owner[pid], self.live[pid] = None, False

    @rule(member=member)
    def rejoin(self, member: str) -> None:
        if member not in self.members:
            self._add(member)

    @invariant()
    def cursors_match_the_model(self) -> None:
        for r in self.run(self.conn.fetch(CURSORS, GROUP)):
            pid = r["partition_id"]
            assert r["owner"] == self.owner[pid], f"{pid}: owner {r['owner']}, model {self.owner[pid]}"
            assert r["lease_epoch"] == self.epoch[pid]
            assert r["committed"] == self.committed[pid], (
                f"{pid}: committed {r['committed']}, model {self.committed[pid]}"
            )
            assert bool(r["live"]) == (self.owner[pid] is not None and self.live[pid])


@pytest.fixture
def env(dsn: str, schema: str) -> Any:
    e = Env(dsn, schema)
    yield e
    e.close()


def test_leases_and_commits_follow_the_model(env: Env) -> None:
    LeaseMachine.env = env
    run_state_machine_as_test(
        LeaseMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
