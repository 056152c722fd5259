"""Range leases are written once and emptied a slot at a time (migration 033): an ack deletes only
its jobs, and a rotation truncates the slots the clock has left, keeping the leases that still
hold a job and each partition's newest lease (its frontier), copied to the current slot."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

import bus
from bus.testing import Clock
from storage import db, versions
from storage import queues as queue_sql

SLOTS = "SELECT DISTINCT slot FROM queue_leases ORDER BY slot"
LEASES = "SELECT slot, first_offset, last_offset FROM queue_leases ORDER BY first_offset"
FRONTIER = "SELECT f.frontier FROM queue_frontiers f WHERE f.topic = 'jobs'"


async def _away_from_a_slot_switch(b: bus.Bus) -> None:
    """Wait, if the server's clock is near the end of a slot's ten seconds, for the next one to start
    (the leases a test takes then all go to one slot)."""
    left = float(await b.pool.fetchval("SELECT 10 - extract(epoch FROM clock_timestamp()) % 10"))
    if left < 4:
        await asyncio.sleep(left + 0.05)


async def _other_slot(b: bus.Bus) -> int:
    """The slot none of the leases is in: the one a rotation is told is current."""
    used = {r[0] for r in await b.pool.fetch(SLOTS)}
    (other,) = {0, 1} - used
    return other


async def test_a_rotation_keeps_the_leases_holding_a_job_and_the_frontier(b: bus.Bus) -> None:
    await _away_from_a_slot_switch(b)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [{"n": i} for i in range(6)])
    async with b.queue_consumer("jobs") as q:
        first = await q.take(max_messages=2, timeout=0)
        held = await q.take(max_messages=2, timeout=0)
        last = await q.take(max_messages=2, timeout=0)
        await q.ack_many(first + last)
        # Acked leases stay in their slot, holding nothing.
        assert [tuple(r)[1:] for r in await b.pool.fetch(LEASES)] == [(0, 1), (2, 3), (4, 5)]
        current = await _other_slot(b)
        assert await queue_sql.rotate_leases(b.pool, current) >= 1
        # The lease still holding its jobs and the newest one (the frontier) moved to the
        # current slot; the acked lease before them is gone, and with it its slot's rows.
        assert [tuple(r) for r in await b.pool.fetch(LEASES)] == [(current, 2, 3), (current, 4, 5)]
        assert await b.pool.fetchval(FRONTIER) == 6
        await q.ack_many(held)  # its lease still holds: the jobs are acked
        await b.publish("jobs", {"n": 6})
        (job,) = await q.take(max_messages=5, timeout=0)
        assert job.offset == 6  # the frontier did not go back
        await q.ack(job)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


async def test_a_lease_copied_by_a_rotation_still_runs_out_and_fences_its_holder(b: bus.Bus) -> None:
    await _away_from_a_slot_switch(b)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    async with (
        b.queue_consumer("jobs", visibility_timeout=30) as slow,
        b.queue_consumer("jobs") as other,
    ):
        got = await slow.take(max_messages=2, timeout=0)
        assert await queue_sql.rotate_leases(b.pool, await _other_slot(b)) == 1
        Clock(b).advance(31)
        again = await other.take(max_messages=10, timeout=0)
        assert sorted((m.offset, m.attempt) for m in again) == [(0, 2), (1, 2)]
        for m in got:
            try:
                await slow.ack(m)
            except bus.LeaseLostError:
                continue
            raise AssertionError("the old holder's ack was taken")
        await other.ack_many(again)
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs") == 0


# Held a moment (the lock's wait times out) and held longer (the lock is not asked for).
@pytest.mark.parametrize("held_for", [0.0, 1.2])
async def test_a_slot_a_transaction_holds_is_left_as_it_is_and_takes_go_on(
    b: bus.Bus, dsn: str, schema: str, held_for: float
) -> None:
    await _away_from_a_slot_switch(b)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [{"n": i} for i in range(4)])
    holder: asyncpg.Connection = await db.connect(dsn, schema)
    try:
        async with b.queue_consumer("jobs") as q:
            await q.ack_many(await q.take(max_messages=2, timeout=0))
            current = await _other_slot(b)
            tx = holder.transaction(isolation="repeatable_read")
            await tx.start()
            assert await holder.fetchval("SELECT count(*) FROM queue_leases") == 1  # holds every slot
            await asyncio.sleep(held_for)
            # The rotation does not wait for the holder (a moment at most), and truncates nothing.
            assert await asyncio.wait_for(queue_sql.rotate_leases(b.pool, current), 5) == 0
            assert await b.pool.fetchval("SELECT count(*) FROM queue_leases") == 1
            # Takes and acks go on beside the held slot.
            rest = await asyncio.wait_for(q.take(max_messages=5, timeout=0), 5)
            assert [m.offset for m in rest] == [2, 3]
            await q.ack_many(rest)
            await tx.rollback()
            assert await queue_sql.rotate_leases(b.pool, current) >= 1
            assert [tuple(r)[1:] for r in await b.pool.fetch(LEASES)] == [(2, 3)]
            assert await b.pool.fetchval(FRONTIER) == 4
    finally:
        await holder.close()


async def test_while_the_previous_release_may_run_no_slot_is_truncated(b: bus.Bus) -> None:
    await b.pool.execute(versions.WRITE_RELEASE, "0.1.0", "0.1.0")  # a schema that release made
    await _away_from_a_slot_switch(b)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish_many("jobs", [b"a", b"b"])
    async with b.queue_consumer("jobs") as q:
        await q.ack_many(await q.take(max_messages=1, timeout=0))
        await q.ack_many(await q.take(max_messages=1, timeout=0))
        # That release deletes leases by id and reads the frontier's row: nothing is rotated.
        assert await queue_sql.rotate_leases(b.pool, await _other_slot(b)) == 0
        assert await b.pool.fetchval("SELECT count(*) FROM queue_leases") == 2
        assert await b.pool.fetchval("SELECT next_offset FROM queue_frontiers WHERE topic = 'jobs'") == 2


async def test_a_per_key_limit_counts_the_jobs_still_held_not_the_leases_left_behind(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue", max_in_flight_per_key=2)
    await b.publish_many("jobs", [bus.Outgoing({"n": i}, key="hot") for i in range(6)])
    async with b.queue_consumer("jobs") as q:
        for round_ in range(3):
            got = await q.take(max_messages=2, timeout=0)  # within the limit: a range lease
            assert [m.value(dict)["n"] for m in got] == [2 * round_, 2 * round_ + 1]
            await q.ack_many(got)
            # The leases stay, not run out, holding nothing: the key is not at its limit.
            assert await b.pool.fetchval("SELECT count(*) FROM queue_leases") == round_ + 1
        assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE detached") == 0
