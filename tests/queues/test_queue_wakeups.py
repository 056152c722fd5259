"""Queue consumers wait on NOTIFY (the Bus's one LISTEN connection), with the poll as fallback; acks coalesce.

Most tests set `max_poll_interval` far above the take's timeout, so only a
notification (or the consumer's own knowledge of when a delayed job becomes
visible) can hand the job over before the take gives up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import bus
from actors.messages import Unsubscribe
from storage import queues as queue_sql

NO_POLL = 60.0  # a fallback poll this slow never fires within a test


class Statements(list[int]):
    """Statements sent (how many jobs each carried), and an event set at every one."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()

    def record(self, jobs: int) -> None:
        self.append(jobs)
        self.sent.set()


@pytest.fixture
def takes(monkeypatch: pytest.MonkeyPatch) -> Statements:
    """Every take statement sent (the number of jobs it asked for), in order."""
    sent = Statements()
    real = queue_sql.take_for

    async def counting(
        conn: Any, topic: str, consumers: list[str], limits: list[int], *args: Any, **kwargs: Any
    ) -> Any:
        sent.record(sum(limits))
        return await real(conn, topic, consumers, limits, *args, **kwargs)

    monkeypatch.setattr(queue_sql, "take_for", counting)
    return sent


@pytest.fixture
def ack_statements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ack statement sent (the number of jobs in it), in order."""
    sent: list[int] = []
    real = queue_sql.ack_many

    async def counting(conn: Any, jobs: list[tuple[int, int, int]], leases: Any = ()) -> Any:
        sent.append(len(jobs))
        return await real(conn, jobs, leases)

    monkeypatch.setattr(queue_sql, "ack_many", counting)
    return sent


async def test_an_idle_take_sleeps_until_a_publish_notifies_it(connect: Any, takes: Statements) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=3, semantics="queue")
    async with b.queue_consumer("jobs") as q:
        waiting = asyncio.create_task(q.take(max_messages=10, timeout=20))
        await asyncio.wait_for(takes.sent.wait(), 10)
        await asyncio.sleep(0.5)
        assert len(takes) == 1, "an idle take must wait for a notification, not poll"
        assert not waiting.done()
        await b.publish("jobs", b"wake up", key="k")
        got = await asyncio.wait_for(waiting, 15)
        assert [m.payload for m in got] == [b"wake up"]
        assert len(takes) == 2
        await q.ack_many(got)


async def test_a_lost_notification_is_picked_up_by_the_poll_fallback(connect: Any) -> None:
    b = await connect(max_poll_interval=0.2)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    async with b.queue_consumer("jobs") as q:
        # The Notifier forgets this consumer: every NOTIFY for it is lost from now on.
        system = await b._group_system()
        await system.notifier.ask(Unsubscribe(q._waker))
        await b.publish("jobs", b"x")
        got = await q.take(timeout=20)
        assert [m.payload for m in got] == [b"x"]
        assert q._doorbell.rings == 0, "the job must have come through the fallback poll"
        await q.ack_many(got)


async def test_a_nacked_job_is_taken_when_its_delay_ends_without_any_notification(connect: Any) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs") as q:
        (m,) = await q.take(timeout=0)
        await q.nack(m, delay=0.3, error="later")
        (again,) = await q.take(timeout=20)
        assert again.offset == m.offset and again.attempt == 2
        await q.ack(again)


async def test_an_expired_lease_is_taken_by_a_waiting_consumer(connect: Any) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs", visibility_timeout=0.3) as q1, b.queue_consumer("jobs") as q2:
        (m,) = await q1.take(timeout=0)
        (again,) = await q2.take(timeout=20)
        assert again.offset == m.offset and again.attempt == 2
        await q2.ack(again)


async def test_jobs_given_back_on_close_wake_a_waiting_consumer(connect: Any) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs") as q2:
        q1 = b.queue_consumer("jobs", visibility_timeout=600)
        await q1.start()
        assert len(await q1.take(timeout=0)) == 1
        waiting = asyncio.create_task(q2.take(timeout=20))
        await asyncio.sleep(0.2)
        await q1.close()
        (got,) = await asyncio.wait_for(waiting, 15)
        assert got.payload == b"x" and got.attempt == 1


async def test_an_ordered_ack_wakes_the_consumer_waiting_for_that_key(connect: Any) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing(b"first", key="k"), bus.Outgoing(b"second", key="k")])
    async with (
        b.queue_consumer("jobs", ordered_by_key=True) as q1,
        b.queue_consumer("jobs", ordered_by_key=True) as q2,
    ):
        (first,) = await q1.take(max_messages=10, timeout=0)
        waiting = asyncio.create_task(q2.take(max_messages=10, timeout=20))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await q1.ack(first)
        (second,) = await asyncio.wait_for(waiting, 15)
        assert second.payload == b"second"


async def test_a_dynamic_topic_wakes_on_a_partition_created_after_the_consumer_started(connect: Any) -> None:
    b = await connect(max_poll_interval=NO_POLL)
    await b.create_topic("jobs", partitions=None, semantics="queue")
    async with b.queue_consumer("jobs") as q:
        waiting = asyncio.create_task(q.take(timeout=20))
        await asyncio.sleep(0.2)
        await b.publish("jobs", b"x", partition="brand-new")
        (got,) = await asyncio.wait_for(waiting, 15)
        assert got.partition == "brand-new"
        await q.ack(got)


async def test_concurrent_acks_of_one_consumer_go_in_one_statement(
    b: bus.Bus, ack_statements: list[int]
) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(50)])
    async with b.queue_consumer("jobs") as q:
        msgs = await q.take(max_messages=50, timeout=0)
        assert len(msgs) == 50
        await asyncio.gather(*(q.ack(m) for m in msgs[:40]), q.ack_many(msgs[40:]))
        assert ack_statements == [50]
        assert await q.take(timeout=0) == []
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_a_lost_lease_fails_only_its_own_ack_in_a_coalesced_batch(
    b: bus.Bus, ack_statements: list[int]
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs") as q:
        a, lost, c = await q.take(max_messages=3, timeout=0)
        # Another consumer took `lost` after its lease ran out.
        await b.pool.execute(
            'UPDATE queue_jobs SET lease_epoch = lease_epoch + 1 WHERE "offset" = $1', lost.offset
        )
        results = await asyncio.gather(q.ack(a), q.ack(lost), q.ack(c), return_exceptions=True)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], bus.LeaseLostError)
        assert ack_statements == [3]
        await q.ack_many([lost])  # no longer held by this consumer: a no-op
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 1


async def test_acking_the_same_job_twice_at_once_is_one_ack(b: bus.Bus, ack_statements: list[int]) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"x")
    async with b.queue_consumer("jobs") as q:
        (m,) = await q.take(timeout=0)
        await asyncio.gather(q.ack(m), q.ack(m), q.ack_many([m]))
        assert ack_statements == [1]
        await q.ack(m)  # acked before: a no-op
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_a_failed_ack_statement_fails_every_caller_and_keeps_the_leases(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    real = queue_sql.ack_many
    calls = 0

    async def failing_once(conn: Any, jobs: list[tuple[int, int, int]], leases: Any = ()) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("connection reset")
        return await real(conn, jobs, leases)

    monkeypatch.setattr(queue_sql, "ack_many", failing_once)
    async with b.queue_consumer("jobs") as q:
        a, c = await q.take(max_messages=2, timeout=0)
        results = await asyncio.gather(q.ack(a), q.ack(c), return_exceptions=True)
        assert all(isinstance(r, bus.BusError) for r in results), results
        await q.ack_many([a, c])  # still held: the retry acks them
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_consumers_of_one_bus_share_take_and_ack_statements(
    b: bus.Bus, takes: Statements, ack_statements: list[int]
) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(30)])
    async with b.queue_consumer("jobs") as q1, b.queue_consumer("jobs") as q2, b.queue_consumer("jobs") as q3:
        got = await asyncio.gather(
            q1.take(max_messages=10, timeout=0),
            q2.take(max_messages=5, timeout=0),
            q3.take(max_messages=20, timeout=0),
        )
        assert takes == [35], "three consumers asking at once: one take statement"
        assert [len(g) for g in got] == [10, 5, 15]
        offsets = [(m.partition, m.offset) for g in got for m in g]
        assert len(set(offsets)) == 30
        # Each consumer holds its own leases: acking another's message is not a silent success.
        await asyncio.gather(q1.ack_many(got[0]), q2.ack_many(got[1]), *(q3.ack(m) for m in got[2]))
        assert ack_statements == [30]
        with pytest.raises(bus.ValidationError):
            await q1.nack(got[1][0])
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_big_takes_of_one_moment_go_side_by_side(b: bus.Bus, takes: Statements) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(250)])
    async with b.queue_consumer("jobs") as q1, b.queue_consumer("jobs") as q2:
        got = await asyncio.gather(q1.take(max_messages=100, timeout=0), q2.take(max_messages=100, timeout=0))
        # A hundred rows outweigh a statement's fixed cost: two statements in the two write slots.
        assert sorted(takes) == [100, 100]
        assert [len(g) for g in got] == [100, 100]
        assert not {(m.partition, m.offset) for m in got[0]} & {(m.partition, m.offset) for m in got[1]}
        await asyncio.gather(q1.ack_many(got[0]), q2.ack_many(got[1]))


async def test_a_consumer_taking_twice_at_once_gets_distinct_jobs(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(6)])
    async with b.queue_consumer("jobs") as q:
        first, second = await asyncio.gather(
            q.take(max_messages=4, timeout=0), q.take(max_messages=4, timeout=0)
        )
        assert len(first) + len(second) == 6
        assert not {m.offset for m in first} & {m.offset for m in second}
        await q.ack_many(first + second)


async def test_a_take_cancelled_while_its_statement_runs_gives_the_jobs_back(
    b: bus.Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("jobs", b"x")
    real = queue_sql.take_for
    started = asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> Any:
        started.set()
        rows = await real(*args, **kwargs)
        await asyncio.sleep(0.3)  # the caller gives up before the answer arrives
        return rows

    monkeypatch.setattr(queue_sql, "take_for", slow)
    async with b.queue_consumer("jobs", visibility_timeout=600) as q1:
        taking = asyncio.create_task(q1.take(timeout=0))
        await asyncio.wait_for(started.wait(), 10)
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        monkeypatch.setattr(queue_sql, "take_for", real)
        async with b.queue_consumer("jobs") as q2:
            (m,) = await q2.take(timeout=10)
            assert m.payload == b"x" and m.attempt == 1
            await q2.ack(m)
