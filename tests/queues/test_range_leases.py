"""Fresh queue jobs are leased by range: a take moves a frontier and writes one lease row, not each job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest

import bus
from bus.testing import Clock
from storage import db
from storage import queues as queue_sql
from tests.helpers import bus_on_schema_before

# The range leases that still hold a job: a lease stays in its slot once its jobs are acked or
# detached (migration 033), holding nothing.
HOLDING = """SELECT count(*) FROM queue_leases l WHERE EXISTS (
    SELECT 1 FROM queue_jobs j WHERE j.partition_id = l.partition_id AND NOT j.detached
      AND j."offset" BETWEEN l.first_offset AND l.last_offset)"""


async def _jobs(b: bus.Bus) -> list[asyncpg.Record]:
    return await b.pool.fetch(
        'SELECT "offset", detached, attempts, lease_epoch, leased_by FROM queue_jobs ORDER BY "offset"'
    )


async def test_a_take_of_fresh_jobs_writes_one_lease_row_and_no_job_row(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing({"n": i}) for i in range(50)])
    before = await b.pool.fetch('SELECT "offset", xmin::text FROM queue_jobs ORDER BY "offset"')
    async with b.queue_consumer("jobs") as q:
        got = await q.take(max_messages=30, timeout=0)
        assert [m.offset for m in got] == list(range(30)) and {m.attempt for m in got} == {1}
        # No job row was rewritten (same row versions), all still fresh-looking; one range lease.
        assert await b.pool.fetch('SELECT "offset", xmin::text FROM queue_jobs ORDER BY "offset"') == before
        assert {(r["detached"], r["attempts"], r["leased_by"]) for r in await _jobs(b)} == {(False, 0, None)}
        leases = await b.pool.fetch("SELECT first_offset, last_offset, leased_by FROM queue_leases")
        assert [(r["first_offset"], r["last_offset"], r["leased_by"]) for r in leases] == [
            (0, 29, q.consumer_id)
        ]
        assert await b.pool.fetchval("SELECT f.frontier FROM queue_frontiers f WHERE f.topic = 'jobs'") == 30
        # The next take continues at the frontier.
        rest = await q.take(max_messages=100, timeout=0)
        assert [m.offset for m in rest] == list(range(30, 50))
        await q.ack_many(got)
        await q.ack_many(rest)
    # Acked: no job left, and no lease holds one.
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0
    assert await b.pool.fetchval(HOLDING) == 0


async def test_a_lease_outlives_a_partial_ack_and_goes_with_the_last_job(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs") as q:
        a, c, d = await q.take(max_messages=3, timeout=0)
        await q.ack_many([a, d])
        assert await b.pool.fetchval(HOLDING) == 1
        await q.ack(c)
        assert await b.pool.fetchval(HOLDING) == 0


async def test_a_nacked_job_of_a_range_lease_comes_back_alone_with_its_history(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs", max_attempts=3) as q:
        a, bad, c = await q.take(max_messages=3, timeout=0)
        await q.nack(bad, error="boom")
        (again,) = await q.take(max_messages=10, timeout=0)
        assert (again.offset, again.attempt) == (bad.offset, 2)
        await q.ack_many([a, c])  # the other jobs of the lease are still held
        await q.nack(again, error="boom again")
        (third,) = await q.take(max_messages=10, timeout=0)
        assert third.attempt == 3
        await q.nack(third, error="last")
    (dead,) = await b.read("jobs.dlq", partition="0")
    errors = json.loads(dead.headers["dead_letter.errors"])
    assert [(e["attempt"], e["error"]) for e in errors] == [(1, "boom"), (2, "boom again"), (3, "last")]
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE topic = 'jobs'") == 0
    assert await b.pool.fetchval(HOLDING) == 0


async def test_a_range_lease_that_ran_out_is_reclaimed_by_the_next_take_and_fences_the_old_holder(
    b: bus.Bus,
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c", b"d"])
    async with (
        b.queue_consumer("jobs", visibility_timeout=30) as slow,
        b.queue_consumer("jobs") as other,
    ):
        first = await slow.take(max_messages=4, timeout=0)
        await slow.ack(first[0])
        assert await other.take(timeout=0) == []
        Clock(b).advance(31)  # the range lease runs out
        # One take, no waiting: the run-out lease is reclaimed and its three jobs taken at once.
        again = await other.take(max_messages=10, timeout=0)
        assert [m.offset for m in again] == [1, 2, 3]
        assert {m.attempt for m in again} == {2}
        with pytest.raises(bus.LeaseLostError):
            await slow.ack(first[1])
        await other.ack_many(again)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0
    assert await b.pool.fetchval(HOLDING) == 0


async def test_a_run_out_range_lease_nobody_took_yet_still_accepts_the_ack(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    async with b.queue_consumer("jobs", visibility_timeout=30) as q:
        got = await q.take(max_messages=2, timeout=0)
        Clock(b).advance(31)  # run out, and no take reclaimed it
        await q.ack_many(got)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_closing_gives_range_leased_jobs_back_without_counting_the_attempt(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    async with b.queue_consumer("jobs") as q:
        assert len(await q.take(max_messages=2, timeout=0)) == 2
    async with b.queue_consumer("jobs") as q:
        again = await q.take(max_messages=10, timeout=0)
        assert [(m.offset, m.attempt) for m in again] == [(0, 1), (1, 1)]
        await q.ack_many(again)


async def test_a_take_that_waited_for_a_moved_frontier_fills_up_from_other_partitions(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing(b"x", key=f"k{i}") for i in range(40)])
    counts = dict(
        await b.pool.fetch(
            "SELECT p.name, count(*) FROM queue_jobs j JOIN partitions p ON p.id = j.partition_id GROUP BY 1"
        )
    )
    assert min(counts.values()) >= 5, counts
    holder = await db.connect(dsn, schema)
    taker = await db.connect(dsn, schema)
    try:
        # Another process's take holds every frontier, and empties one partition, until it commits.
        tx = holder.transaction()
        await tx.start()
        pid_of = dict(await holder.fetch("SELECT name, id FROM partitions WHERE topic = 'jobs'"))
        smaller = min(counts, key=lambda name: counts[name])
        taken = await holder.fetch(
            queue_sql.TAKE,
            "jobs",
            [counts[smaller]],
            60.0,
            ["holder"],
            counts[smaller],
            # the turn that tries the smaller partition first
            1 if pid_of[smaller] == min(pid_of.values()) else 0,
            None,  # now: the server's clock
            None,  # the expiry scan: a full one
        )
        assert {r["partition_id"] for r in taken if r["request"] > 0} == {pid_of[smaller]}
        # Our take starts while it is held: it waits for that frontier, finds it moved past every
        # job there, and must still get its 5 jobs from the other partition.
        ours = asyncio.create_task(queue_sql.take(taker, "jobs", 5, 60.0, "taker", ordered=False))
        await asyncio.sleep(0.2)
        await tx.commit()
        got = await asyncio.wait_for(ours, 10)
        assert len(got) == 5
        assert {j["partition_id"] for j in got} != {pid_of[smaller]}
    finally:
        await holder.close()
        await taker.close()


async def test_competing_consumers_of_two_buses_get_every_job_once_with_mixed_take_sizes(
    connect: Any,
) -> None:
    b1 = await connect()
    b2 = await connect()
    await b1.create_topic("jobs", partitions=3, semantics="queue")
    await b1.publish_many("jobs", [bus.Outgoing({"n": i}, key=f"k{i % 7}") for i in range(1500)])
    seen: list[int] = []

    async def drain(b: bus.Bus, size: int) -> None:
        async with b.queue_consumer("jobs") as q:
            while batch := await q.take(max_messages=size, timeout=0.2):
                seen.extend(m.value()["n"] for m in batch)
                await q.ack_many(batch)

    await asyncio.gather(drain(b1, 100), drain(b1, 7), drain(b2, 33), drain(b2, 1))
    assert sorted(seen) == list(range(1500))
    assert await b1.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_ordered_consumers_take_fresh_jobs_in_key_order_beside_range_leases(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [bus.Outgoing(b"1", key="a"), bus.Outgoing(b"2", key="b")])
    async with b.queue_consumer("jobs") as plain, b.queue_consumer("jobs", ordered_by_key=True) as ordered:
        (first,) = await plain.take(max_messages=1, timeout=0)  # a range lease holds key a's job
        await b.publish_many("jobs", [bus.Outgoing(b"3", key="a"), bus.Outgoing(b"4", key="b")])
        got = await ordered.take(max_messages=10, timeout=0)
        # Key a's next job waits behind the one the plain consumer holds; key b's first goes out.
        assert [(m.key, m.payload) for m in got] == [("b", b"2")]
        await plain.ack(first)
        (a_next,) = await ordered.take(max_messages=10, timeout=1.0)
        assert (a_next.key, a_next.payload) == ("a", b"3")
        await ordered.ack_many([*got, a_next])
        (b_next,) = await ordered.take(max_messages=10, timeout=1.0)
        assert (b_next.key, b_next.payload) == ("b", b"4")
        await ordered.ack(b_next)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE topic = 'jobs'") == 0


async def test_the_dashboard_counts_range_leased_jobs_as_in_flight(b: bus.Bus) -> None:
    from storage import dashboard

    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b", b"c"])
    async with b.queue_consumer("jobs") as q:
        await q.take(max_messages=2, timeout=0)
        (counts,) = [c for c in await dashboard.queue_counts(b.pool) if c.topic == "jobs"]
        assert (counts.ready, counts.in_flight, counts.delayed) == (1, 2, 0)


_PUBLISH_BEFORE_HEADS = """
WITH p AS (
    UPDATE partitions SET next_offset = next_offset + cardinality($1::bytea[]) WHERE topic = 'jobs'
    RETURNING id, next_offset - cardinality($1::bytea[]) AS base
), m AS (
    INSERT INTO messages (partition_id, "offset", payload)
    SELECT p.id, p.base + u.i - 1, u.x FROM p CROSS JOIN unnest($1::bytea[]) WITH ORDINALITY AS u(x, i)
    RETURNING partition_id, "offset"
)
INSERT INTO queue_jobs (partition_id, "offset", topic) SELECT partition_id, "offset", 'jobs' FROM m
"""


@pytest.mark.fresh_schema  # made by the migrations before 013
async def test_jobs_of_a_schema_made_before_range_leases_keep_their_state(
    dsn: str, schema: str, drop_schema: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with bus_on_schema_before(dsn, schema, 13, monkeypatch) as old:
        await old.create_topic("jobs", partitions=1, semantics="queue")
        # Written the way a release of that schema wrote them: the counter moved in the statement.
        await old.pool.execute(_PUBLISH_BEFORE_HEADS, [b"free", b"held", b"free too"])
        # A job leased the way takes leased before: its own row, leased for a while yet.
        await old.pool.execute(
            "UPDATE queue_jobs SET attempts = 1, lease_epoch = 1, leased_by = 'someone',"
            " visible_at = clock_timestamp() + interval '1 hour' WHERE \"offset\" = 1"
        )
    new = await bus.connect(dsn, schema=schema)
    try:
        await new.publish("jobs", b"after")
        async with new.queue_consumer("jobs") as q:
            got = await q.take(max_messages=10, timeout=0)
            assert sorted(m.payload for m in got if m.payload) == [b"after", b"free", b"free too"]
            assert {m.attempt for m in got} == {1}
            await q.ack_many(got)
        assert [r["offset"] for r in await _jobs(new)] == [1]
    finally:
        await new.close()
