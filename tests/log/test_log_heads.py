"""A partition's head (migration 020): publishing beside a held snapshot, and the previous release's counter.

A publish moves the newest row of the partition's head, whose row lock orders the partition's
publishers, and writes no version of the partition's row; every 64 publishes a new head row
replaces it (a publisher that waited for the closing one moves the new one). So however long
another transaction holds its snapshot, a publish walks at most one head row's versions. The
previous release moves `partitions.next_offset` itself: those moves allocate from the same head,
and while that release may run on the schema a publish moves the counter as well.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

import bus
from storage import db, versions
from storage import messages as log_sql

ROW = "SELECT ctid::text, xmin::text, next_offset FROM partitions WHERE topic = $1"
HEADS = "SELECT generation, next_offset, appends FROM log_heads WHERE partition_id = $1 ORDER BY generation"
END = "SELECT p.log_end FROM partitions p WHERE p.id = $1"
PID = "SELECT id FROM partitions WHERE topic = $1"

# A publish the way the previous release (and the SQL `publish` function) writes one: the
# counter moved in the statement, the message at the offset it returned.
COUNTER_PUBLISH = """
WITH p AS (
    UPDATE partitions SET next_offset = next_offset + 1 WHERE id = $1 RETURNING id, next_offset - 1 AS base
)
INSERT INTO messages (partition_id, "offset", payload) SELECT p.id, p.base, $2::bytea FROM p
RETURNING "offset"
"""


async def test_publishing_beside_a_held_snapshot_writes_no_version_of_the_partition_row(
    b: bus.Bus, snapshot: asyncpg.Connection
) -> None:
    await b.create_topic("t", partitions=1)
    pid = await b.pool.fetchval(PID, "t")
    before = await b.pool.fetchrow(ROW, "t")
    offsets = [(await b.publish("t", b"x")).offset for _ in range(200)]
    assert offsets == list(range(200))
    # The partition's row was never rewritten: no version chain for a publish to walk.
    assert tuple(await b.pool.fetchrow(ROW, "t")) == tuple(before)
    # Head rows took 64 publishes each: generations 0-2 filled, 3 took the last 8; only the
    # newest two are left (a rotation deletes the ones before the generation it closes).
    assert [tuple(r) for r in await b.pool.fetch(HEADS, pid)] == [(2, 192, 64), (3, 200, 8)]
    assert await b.pool.fetchval(END, pid) == 200
    assert [m.offset for m in await b.read("t", partition=0, offset=190)] == list(range(190, 200))


async def test_a_multi_partition_publish_moves_each_head_once_in_partition_order(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=3)
    recs = await b.publish_many("t", [bus.Outgoing(b"x", partition=str(i % 3)) for i in range(9)])
    assert sorted((r.partition, r.offset) for r in recs) == [(str(p), o) for p in range(3) for o in range(3)]
    for r in await b.pool.fetch("SELECT p.id, p.log_end FROM partitions p WHERE p.topic = 't'"):
        assert [tuple(h) for h in await b.pool.fetch(HEADS, r["id"])] == [(0, 3, 1)]
        assert r["log_end"] == 3


async def test_while_the_previous_release_may_run_every_publish_moves_its_counter(b: bus.Bus) -> None:
    await b.pool.execute(versions.WRITE_RELEASE, "0.1.0", "0.1.0")  # a schema that release made
    await b.create_topic("t", partitions=2)
    await b.publish_many("t", [bus.Outgoing(b"x", partition=str(i % 2)) for i in range(7)])
    await b.publish("t", b"y", partition="1")
    rows = await b.pool.fetch(
        "SELECT p.next_offset, p.log_end FROM partitions p WHERE p.topic = 't' ORDER BY p.id"
    )
    assert [tuple(r) for r in rows] == [(4, 4), (4, 4)]


async def test_a_finalized_schema_leaves_the_counter_alone(b: bus.Bus) -> None:
    # A schema this release created: nothing older ever ran on it.
    assert (await b.pool.fetchrow(versions.READ_RELEASE))["min_release"] == versions.LIBRARY_RELEASE
    await b.create_topic("t", partitions=1)
    await b.publish_many("t", [b"x"] * 3)
    assert tuple(await b.pool.fetchrow("SELECT p.next_offset, p.log_end FROM partitions p")) == (0, 3)


async def test_counter_moves_and_head_publishes_share_one_dense_sequence(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=1)
    pid = await b.pool.fetchval(PID, "t")
    old = [await db.connect(dsn, schema) for _ in range(2)]
    try:

        async def previous_release(conn: asyncpg.Connection) -> list[int]:
            return [await conn.fetchval(COUNTER_PUBLISH, pid, b"old") for _ in range(40)]

        async def this_release() -> list[int]:
            return [(await b.publish("t", b"new")).offset for _ in range(80)]

        *olds, new = await asyncio.gather(*(previous_release(c) for c in old), this_release())
    finally:
        for conn in old:
            await conn.close()
    got = sorted(olds[0] + olds[1] + new)
    assert got == list(range(160))  # unique and dense across both ways of publishing
    stored = await b.pool.fetch(
        'SELECT "offset", payload FROM messages WHERE partition_id = $1 ORDER BY 1', pid
    )
    assert [r["offset"] for r in stored] == list(range(160))
    assert sorted(r["offset"] for r in stored if r["payload"] == b"old") == sorted(olds[0] + olds[1])
    assert await b.pool.fetchval(END, pid) == 160
    # The counter never runs ahead of the head, so the previous release never hands out an offset
    # this one already gave.
    assert await b.pool.fetchval("SELECT next_offset FROM partitions WHERE id = $1", pid) <= 160


async def test_an_outbox_publish_on_a_snapshot_older_than_the_head_fails_and_writes_nothing(
    b: bus.Bus, dsn: str
) -> None:
    await b.create_topic("t", partitions=1)
    await b.publish("t", b"first")
    conn = await asyncpg.connect(dsn)
    try:
        tx = conn.transaction(isolation="repeatable_read")
        await tx.start()
        await conn.fetchval("SELECT 1")  # the caller's snapshot
        await b.publish("t", b"second")  # the head moves after it
        with pytest.raises(asyncpg.SerializationError):
            await b.publish("t", b"outbox", connection=conn)
        await tx.rollback()
    finally:
        await conn.close()
    assert [m.payload for m in await b.read("t", partition=0)] == [b"first", b"second"]
    assert (await b.publish("t", b"third")).offset == 2


async def test_a_publisher_that_waited_for_a_rotation_takes_the_next_generation(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=1)
    pid = await b.pool.fetchval(PID, "t")
    for _ in range(63):  # generation 0 then takes one more publish before it closes
        await b.publish("t", b"x")
    rotating, waiting = await db.connect(dsn, schema), await db.connect(dsn, schema)
    try:
        tx = rotating.transaction()
        await tx.start()
        # The 64th publish closes generation 0 and inserts generation 1, uncommitted for now.
        assert await rotating.fetchval(log_sql.APPEND_SINGLE, pid, None, None, b"64th", None) == 63
        behind = asyncio.create_task(waiting.fetchval(log_sql.APPEND_SINGLE, pid, None, None, b"65th", None))
        await asyncio.sleep(0.2)
        assert not behind.done()  # it waits on the head row the rotation holds
        await tx.commit()
        # The row it waited for is closed: it reads the newest generation again, no offset twice.
        assert await asyncio.wait_for(behind, 5) == 64
    finally:
        await rotating.close()
        await waiting.close()
    assert [tuple(r) for r in await b.pool.fetch(HEADS, pid)] == [(0, 64, 64), (1, 65, 1)]
    stored = await b.pool.fetch('SELECT "offset" FROM messages WHERE partition_id = $1 ORDER BY 1', pid)
    assert [r["offset"] for r in stored] == list(range(65))


# In one snapshot: the partition's end and how many of its offsets below it are stored.
END_AND_BELOW = """
SELECT p.log_end, (SELECT count(*) FROM messages m WHERE m.partition_id = p.id AND m."offset" < p.log_end)
FROM partitions p WHERE p.id = $1
"""


async def test_concurrent_publishers_across_rotations_get_dense_offsets_visible_in_order(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=2)
    pids = [r["id"] for r in await b.pool.fetch("SELECT id FROM partitions WHERE topic = 't' ORDER BY id")]
    conns = [await db.connect(dsn, schema) for _ in range(6)]
    done = False
    seen: list[tuple[int, int]] = []

    async def publisher(conn: asyncpg.Connection, n: int) -> None:
        for i in range(50):
            # Single, one-partition and two-partition statements, as the Producer's flushes are.
            if i % 3 == 0:
                await conn.fetchval(log_sql.APPEND_SINGLE, pids[0], None, None, b"x", None)
            else:
                batch = log_sql.Batch.of(
                    [pids[0], pids[1], pids[1]], ["0", "1", "1"], [None] * 3, [None] * 3, [b"y"] * 3
                )
                await log_sql.append(conn, batch)

    async def reader() -> None:
        while not done:
            row = await b.pool.fetchrow(END_AND_BELOW, pids[0])
            seen.append((row[0], row[1]))
            await asyncio.sleep(0)

    watching = asyncio.create_task(reader())
    try:
        await asyncio.gather(*(publisher(c, n) for n, c in enumerate(conns)))
    finally:
        done = True
        await watching
        for conn in conns:
            await conn.close()
    # Every end a reader saw had every offset below it stored and visible: committed in order.
    assert seen and all(end == below for end, below in seen)
    for pid, total in ((pids[0], 6 * 50), (pids[1], 6 * 2 * 33)):
        stored = await b.pool.fetch('SELECT "offset" FROM messages WHERE partition_id = $1 ORDER BY 1', pid)
        assert [r["offset"] for r in stored] == list(range(total))
        assert await b.pool.fetchval(END, pid) == total
        # Rotated many times; only the newest two generations are left.
        assert len(await b.pool.fetch(HEADS, pid)) <= 2
