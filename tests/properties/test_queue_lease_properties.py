"""Stateful property test of queue leases (range leases and per-job leases), on the real database.

Two takers take, ack, nack, give back and let their leases run out on a
two-partition queue topic while more jobs are published (storage/queues.py,
the statements the QueueConsumer runs). A model says, for every job, who holds
it under which epoch, whether that lease still runs, and how many attempts it
had; after every step:

- a take gets exactly min(asked, free jobs), only free jobs (never one whose
  lease still runs), each with one attempt more than before;
- an ack, nack or give-back applies exactly to the jobs the caller still
  holds under the epoch it names (a lease that ran out and nobody took since
  still counts), and to no other;
- the job rows are exactly the jobs not acked.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

import asyncpg
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import bus
from storage import queues
from tests.properties.loop import LoopEnv

T = TypeVar("T")
TAKERS = ("a", "b")
Job = tuple[int, int]  # (partition_id, offset)

EXPIRE_RANGES = (
    "UPDATE queue_leases SET visible_at = clock_timestamp() - interval '1 second' WHERE leased_by = $1"
)
EXPIRE_OWN = """
UPDATE queue_jobs SET visible_at = clock_timestamp() - interval '1 second'
WHERE detached AND leased_by = $1 AND visible_at > clock_timestamp()
"""
JOBS = 'SELECT partition_id, "offset" FROM queue_jobs WHERE topic = $1'


class Env(LoopEnv):
    """One event loop, Bus and connection shared by every example; each example gets its own topic."""

    def __init__(self, dsn: str, schema: str) -> None:
        super().__init__()
        self.names = itertools.count()
        self.b: bus.Bus = self.run(bus.connect(dsn, schema=schema, cleaner_interval=0))
        self.conn: asyncpg.Connection = self.run(
            asyncpg.connect(dsn, server_settings={"search_path": schema})
        )

    def close(self) -> None:
        self.run(self.conn.close())
        self.run(self.b.close())
        self.loop.close()


class QueueMachine(RuleBasedStateMachine):
    """Two takers on one queue topic, checked against a model after every step."""

    env: Env

    def __init__(self) -> None:
        super().__init__()
        env = self.env
        self.run, self.conn = env.run, env.conn
        self.topic = f"q{next(env.names)}"
        self.run(env.b.create_topic(self.topic, partitions=2, semantics="queue"))
        self.pid_of = {name: pid for pid, name in self.run(queues.partitions(self.conn, self.topic)).items()}
        self.holder: dict[Job, tuple[str, int] | None] = {}  # (taker, epoch) of the lease, None: free
        self.live: dict[Job, bool] = {}  # the holder's lease still runs
        self.attempts: dict[Job, int] = {}
        self.acked: set[Job] = set()
        self.lease_ids: dict[Job, int | None] = {}
        self.had: dict[str, dict[Job, int]] = {t: {} for t in TAKERS}  # the last epoch each taker got per job
        self.epoch: dict[Job, int] = {}  # the job's lease_epoch: the last take's
        self._publish(4)

    def _publish(self, n: int) -> None:
        records = self.run(self.env.b.publish_many(self.topic, [b"x"] * n))
        for r in records:
            job = (self.pid_of[r.partition], r.offset)
            self.holder[job], self.live[job], self.attempts[job] = None, False, 0
            self.epoch[job] = 0

    def _free(self) -> list[Job]:
        return [
            j for j in self.holder if j not in self.acked and (self.holder[j] is None or not self.live[j])
        ]

    def _epoch(self, job: Job) -> int:
        holder = self.holder[job]
        assert holder is not None
        return holder[1]

    def _held(self, taker: str) -> list[Job]:
        return sorted(
            j for j, h in self.holder.items() if j not in self.acked and h is not None and h[0] == taker
        )

    taker = st.sampled_from(TAKERS)

    @rule(n=st.integers(1, 4))
    def publish(self, n: int) -> None:
        self._publish(n)

    @rule(taker=taker, n=st.integers(1, 6))
    def take(self, taker: str, n: int) -> None:
        free = set(self._free())
        rows = self.run(queues.take(self.conn, self.topic, n, 60.0, taker, ordered=False))
        got = [(r[queues.PARTITION_ID], r[queues.OFFSET]) for r in rows]
        assert len(got) == len(set(got)) == min(n, len(free)), (
            f"take {n} by {taker}: {got}, free {sorted(free)}"
        )
        for r, job in zip(rows, got, strict=True):
            assert job in free, f"{job} taken by {taker} while {self.holder[job]} holds it"
            assert r[queues.ATTEMPTS] == self.attempts[job] + 1, f"{job}: attempt {r[queues.ATTEMPTS]}"
            previous = self.holder[job]
            assert (
                previous is None
                or r[queues.LEASE_EPOCH] > previous[1]
                or (r[queues.LEASE_EPOCH] == 0 and r[queues.LEASE_ID] is not None and self.attempts[job] == 0)
            ), f"{job}: epoch {r[queues.LEASE_EPOCH]} after {previous}"
            self.holder[job], self.live[job] = (taker, r[queues.LEASE_EPOCH]), True
            self.had[taker][job] = self.epoch[job] = r[queues.LEASE_EPOCH]
            self.attempts[job] = r[queues.ATTEMPTS]
            self.lease_ids[job] = r[queues.LEASE_ID]

    @rule(taker=taker, picks=st.lists(st.booleans(), min_size=6, max_size=6), stale=st.booleans())
    def ack(self, taker: str, picks: list[bool], stale: bool) -> None:
        tokens = [(j, self._epoch(j)) for j, pick in zip(self._held(taker), picks, strict=False) if pick]
        if stale:  # a lease the taker had once and lost (given back, nacked, or taken by another since)
            tokens += [(j, e) for j, e in self.had[taker].items() if (j, e) not in tokens][:1]
        leases = {self.lease_ids[j] for j, _ in tokens if self.lease_ids.get(j) is not None}
        done = self.run(queues.ack_many(self.conn, [(j[0], j[1], e) for j, e in tokens], leases))
        # The job's epoch changes only when a take leases it again: an ack with the epoch of the
        # last take applies (also after that lease ran out, or the job was nacked or given back,
        # as long as nobody took it since); the consumer itself never acks what it gave up.
        expected = {j for j, e in tokens if j not in self.acked and self.epoch[j] == e}
        assert done == expected, f"ack by {taker} of {tokens}: {done}, model {expected}"
        self.acked |= done

    @rule(taker=taker, index=st.integers(0, 5))
    def nack(self, taker: str, index: int) -> None:
        held = self._held(taker)
        if not held:
            return
        job = held[index % len(held)]
        epoch = self._epoch(job)
        ok = self.run(queues.nack(self.conn, job[0], job[1], epoch, 0.0, "no"))
        assert ok, f"nack by {taker} of {job}@{epoch} refused"
        self.holder[job], self.live[job] = None, False

    @rule(taker=taker, index=st.integers(0, 5), behind=st.integers(1, 2))
    def nack_with_an_old_epoch(self, taker: str, index: int, behind: int) -> None:
        held = self._held(taker)
        if not held:
            return
        job = held[index % len(held)]
        epoch = self._epoch(job) - behind
        ok = self.run(queues.nack(self.conn, job[0], job[1], epoch, 0.0, "stale"))
        assert not ok, f"nack of {job} with epoch {epoch} (lease at {self.holder[job]}) applied"

    @rule(taker=taker)
    def give_back(self, taker: str) -> None:
        held = self._held(taker)
        self.run(queues.return_unacked(self.conn, [(p, o, self._epoch((p, o))) for p, o in held]))
        for job in held:
            self.holder[job], self.live[job] = None, False
            self.attempts[job] = max(self.attempts[job] - 1, 0)

    @rule(taker=taker)
    def expire(self, taker: str) -> None:
        self.run(self.conn.execute(EXPIRE_RANGES, taker))
        self.run(self.conn.execute(EXPIRE_OWN, taker))
        for job in self._held(taker):
            self.live[job] = False

    @invariant()
    def job_rows_are_the_jobs_not_acked(self) -> None:
        rows = {(r[0], r[1]) for r in self.run(self.conn.fetch(JOBS, self.topic))}
        assert rows == set(self.holder) - self.acked

    def teardown(self) -> None:
        # Whatever is not acked can still be had by somebody: nothing was lost.
        for taker in TAKERS:
            self.expire(taker)
        rest = self.run(queues.take(self.conn, self.topic, 1000, 60.0, "drain", ordered=False))
        assert {(r[queues.PARTITION_ID], r[queues.OFFSET]) for r in rest} == set(self.holder) - self.acked


@pytest.fixture
def env(dsn: str, schema: str, drop_schema: None) -> Any:
    e = Env(dsn, schema)
    yield e
    e.close()


def test_queue_leases_follow_the_model(env: Env) -> None:
    QueueMachine.env = env
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
