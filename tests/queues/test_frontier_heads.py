"""A queue partition's frontier in head rows (migration 021), beside a held snapshot and beside the
previous release.

A take locks the frontier's row (a lock writes no new version) and moves the newest head row;
every 64 moves a new head row replaces it. So a snapshot held open elsewhere does not grow a
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
    # 64 moves filled generation 0; generation 1 took the other 6.
    assert [tuple(r) for r in await b.pool.fetch(HEADS)] == [(0, 64, 64), (1, 70, 6)]
    assert await b.pool.fetchval(FRONTIER) == 70


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
