"""A queue partition's frontier in head rows (migration 021), beside a held snapshot and beside the
previous release.

A take locks the frontier's row (a lock writes no new version); the frontier is the end of the
partition's newest range lease, or its head row where that is further (migration 033): a take
that leases what it moves past writes only its lease, and a move past offsets it does not lease
moves the newest head row; every 64 moves a new head row replaces it. So a snapshot held open elsewhere does not grow a
version chain that every take walks. While the previous release may run on the schema, a move
also writes the row that release reads, and a move that release makes reaches the head.
"""

from __future__ import annotations

import asyncpg

import bus
from storage import versions

ROW = "SELECT ctid::text, xmin::text, next_offset FROM queue_frontiers WHERE topic = 'jobs'"
HEADS = """SELECT h.generation, h.next_offset, h.moves FROM queue_frontier_heads h
JOIN queue_frontiers f ON f.partition_id = h.partition_id WHERE f.topic = 'jobs' ORDER BY h.generation"""
FRONTIER = "SELECT f.frontier FROM queue_frontiers f WHERE f.topic = 'jobs'"


async def _take_one_by_one(b: bus.Bus, n: int) -> list[int]:
    taken: list[int] = []
    async with b.queue_consumer("jobs") as q:
        for i in range(n):
            await b.publish("jobs", {"n": i})
            (job,) = await q.take(timeout=5.0)
            taken.append(job.value(dict)["n"])
            await q.ack(job)
    return taken


async def test_takes_beside_a_held_snapshot_write_no_version_of_the_frontier_row(
    b: bus.Bus, snapshot: asyncpg.Connection
) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    before = await b.pool.fetchrow(ROW)
    assert await _take_one_by_one(b, 70) == list(range(70))
    assert tuple(await b.pool.fetchrow(ROW)) == tuple(before)  # locked 70 times, never rewritten
    # Nor the head: each take moved the frontier by its lease alone (the end of the newest lease).
    assert [tuple(r) for r in await b.pool.fetch(HEADS)] == [(0, 0, 0)]
    assert await b.pool.fetchval(FRONTIER) == 70


async def test_a_move_past_offsets_no_lease_covers_moves_the_head(b: bus.Bus) -> None:
    await b.create_topic("jobs", partitions=1, semantics="queue")
    # Two jobs detached at publish (delayed), no fresh one: the take leases nothing and moves the
    # frontier past them to the partition's end, which only the head can say.
    await b.publish_many("jobs", [bus.Outgoing({"n": 0}, delay=60), bus.Outgoing({"n": 1}, delay=60)])
    async with b.queue_consumer("jobs") as q:
        assert await q.take(max_messages=5, timeout=0) == []
        assert [tuple(r) for r in await b.pool.fetch(HEADS)] == [(0, 2, 1)]
        assert await b.pool.fetchval(FRONTIER) == 2
        # A fresh job after them is leased from there, and its lease moves the frontier alone.
        await b.publish("jobs", {"n": 2})
        (job,) = await q.take(max_messages=5, timeout=0)
        assert job.value(dict)["n"] == 2
        assert [tuple(r) for r in await b.pool.fetch(HEADS)] == [(0, 2, 1)]
        assert await b.pool.fetchval(FRONTIER) == 3
        await q.ack(job)
    assert await b.pool.fetchval(FRONTIER) == 3


async def test_while_the_previous_release_may_run_a_take_moves_its_frontier_row_too(b: bus.Bus) -> None:
    await b.pool.execute(versions.WRITE_RELEASE, "0.1.0", "0.1.0")  # a schema that release made
    await b.create_topic("jobs", partitions=1, semantics="queue")
    assert await _take_one_by_one(b, 3) == [0, 1, 2]
    assert (await b.pool.fetchrow(ROW))["next_offset"] == 3 == await b.pool.fetchval(FRONTIER)
    # That release's take moves the row itself: the head follows, so this release's takes
    # never hand out what it leased.
    await b.publish_many("jobs", [{"n": i} for i in range(3, 6)])
    await b.pool.execute("UPDATE queue_frontiers SET next_offset = 5 WHERE topic = 'jobs'")
    assert await b.pool.fetchval(FRONTIER) == 5
    async with b.queue_consumer("jobs") as q:
        assert [m.value(dict)["n"] for m in await q.take(max_messages=10, timeout=0)] == [5]
