"""The Producer's own statement (storage/messages.py, APPEND_PLANNED): the heads moved in the flush's statement.

On the Producer's connections (session settings `PLANNED_SETTINGS`) a flush of several partitions
without idempotency keys moves its partitions' heads in its own statement. A head that does not move there (a
rotation committed while the statement waited for it) fails the statement, which wrote nothing,
and the flush runs again through log_take_offsets_many: offsets stay dense and visible in order
(invariant 1). The plans go by the heads' primary key whatever the planner makes of the table.
"""

from __future__ import annotations

import asyncio

import asyncpg

import bus
from storage import db
from storage import messages as log_sql

HEADS = "SELECT generation, next_offset, appends FROM log_heads WHERE partition_id = $1 ORDER BY generation"
END = "SELECT p.log_end FROM partitions p WHERE p.id = $1"
PID = "SELECT id FROM partitions WHERE topic = $1 ORDER BY id"
STORED = 'SELECT "offset" FROM messages WHERE partition_id = $1 ORDER BY 1'

# In one snapshot: the partition's end and how many of its offsets below it are stored.
END_AND_BELOW = """
SELECT p.log_end, (SELECT count(*) FROM messages m WHERE m.partition_id = p.id AND m."offset" < p.log_end)
FROM partitions p WHERE p.id = $1
"""


async def planned_connection(dsn: str, schema: str) -> asyncpg.Connection:
    return await db.connect(dsn, schema, settings=log_sql.PLANNED_SETTINGS)


def one(pid: int, payload: bytes) -> log_sql.Batch:
    return log_sql.Batch.of([pid], ["0"], [None], [None], [payload])


async def test_a_planned_flush_that_waited_for_a_rotation_is_written_once_at_the_next_offsets(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=2)
    first, second = [r["id"] for r in await b.pool.fetch(PID, "t")]
    for _ in range(63):  # generation 0 of the first partition then takes one more publish before it closes
        await b.publish("t", b"x", partition="0")
    rotating, waiting = await db.connect(dsn, schema), await planned_connection(dsn, schema)
    flush = log_sql.Batch.of([first, second], ["0", "1"], [None] * 2, [None] * 2, [b"65th", b"first"])
    try:
        tx = rotating.transaction()
        await tx.start()
        # The 64th publish closes generation 0 and inserts generation 1, uncommitted for now.
        assert await rotating.fetchval(log_sql.APPEND_SINGLE, first, None, None, b"64th", None) == 63
        behind = asyncio.create_task(log_sql.append(waiting, flush, planned=True))
        await asyncio.sleep(0.2)
        assert not behind.done()  # it waits on the head row the rotation holds
        await tx.commit()
        # Its statement found that head closed and wrote nothing (not even the second partition's
        # message); written again, at the next offsets.
        placed = await asyncio.wait_for(behind, 5)
        assert [p[:2] for p in placed if p is not None] == [(first, 64), (second, 0)]
    finally:
        await rotating.close()
        await waiting.close()
    assert [tuple(r) for r in await b.pool.fetch(HEADS, first)] == [(0, 64, 64), (1, 65, 1)]
    assert [tuple(r) for r in await b.pool.fetch(HEADS, second)] == [(0, 1, 1)]
    assert [r["offset"] for r in await b.pool.fetch(STORED, first)] == list(range(65))
    assert [m.payload for m in await b.read("t", partition=0, offset=63)] == [b"64th", b"65th"]
    assert [m.payload for m in await b.read("t", partition=1)] == [b"first"]


async def test_planned_and_function_publishers_across_rotations_get_dense_offsets_visible_in_order(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=2)
    pids = [r["id"] for r in await b.pool.fetch(PID, "t")]
    planned = [await planned_connection(dsn, schema) for _ in range(4)]
    plain = [await db.connect(dsn, schema) for _ in range(2)]
    done = False
    seen: list[tuple[int, int]] = []

    async def publisher(conn: asyncpg.Connection, is_planned: bool) -> None:
        for i in range(50):
            # Single, one-partition and two-partition flushes, planned or through the head functions.
            if i % 3 == 0:
                batch = one(pids[0], b"x")
            elif i % 3 == 1:
                batch = log_sql.Batch.of([pids[0]] * 2, ["0"] * 2, [None] * 2, [None] * 2, [b"y"] * 2)
            else:
                batch = log_sql.Batch.of([pids[0], pids[1]], ["0", "1"], [None] * 2, [None] * 2, [b"z"] * 2)
            placed = await log_sql.append(conn, batch, planned=is_planned)
            assert None not in placed

    async def reader() -> None:
        while not done:
            row = await b.pool.fetchrow(END_AND_BELOW, pids[0])
            seen.append((row[0], row[1]))
            await asyncio.sleep(0)

    watching = asyncio.create_task(reader())
    try:
        await asyncio.gather(*(publisher(c, True) for c in planned), *(publisher(c, False) for c in plain))
    finally:
        done = True
        await watching
        for conn in planned + plain:
            await conn.close()
    # Every end a reader saw had every offset below it stored and visible: committed in order.
    assert seen and all(end == below for end, below in seen)
    # Per publisher: 17 singles, 17 pairs and 16 two-partition flushes on the first partition.
    for pid, total in ((pids[0], 6 * (17 + 2 * 17 + 16)), (pids[1], 6 * 16)):
        assert [r["offset"] for r in await b.pool.fetch(STORED, pid)] == list(range(total))
        assert await b.pool.fetchval(END, pid) == total
        assert len(await b.pool.fetch(HEADS, pid)) <= 2  # rotated; the newest two generations left


async def test_the_planned_statement_moves_the_heads_by_key_on_a_small_analyzed_heads_table(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("t", partitions=4)
    await b.publish_many("t", [bus.Outgoing(b"x", partition=str(i % 4)) for i in range(8)])
    await b.pool.execute("ANALYZE log_heads")  # one page: a planner left alone scans it whole
    args = ["{1,2}", None, None, [b"x", b"y"], "{0,0}", [1, 2], [1, 1], None]
    conn = await planned_connection(dsn, schema)
    try:
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + log_sql.APPEND_PLANNED, *args))
        assert "Seq Scan on log_heads" not in plan, plan
        assert "Hash Join" not in plan and "Merge Join" not in plan, plan
        assert "Index Scan using log_heads_pkey on log_heads h" in plan, plan
    finally:
        await conn.close()
    # The same statement on a connection without the settings: what the settings are for.
    plan = "\n".join(r[0] for r in await b.pool.fetch("EXPLAIN " + log_sql.APPEND_PLANNED, *args))
    assert "Seq Scan on log_heads" in plan or "Hash Join" in plan


async def test_a_bus_publishes_with_dense_offsets_across_rotations_of_every_head(b: bus.Bus) -> None:
    await b.create_topic("t", partitions=3)
    for i in range(198):  # 66 a partition: every head rotates once
        await b.publish("t", {"i": i}, partition=str(i % 3))
    await b.publish_many("t", [bus.Outgoing({"j": j}, partition=str(j % 3)) for j in range(9)])
    for pid in [r["id"] for r in await b.pool.fetch(PID, "t")]:
        assert [r["offset"] for r in await b.pool.fetch(STORED, pid)] == list(range(69))
        assert [tuple(r)[:2] for r in await b.pool.fetch(HEADS, pid)] == [(0, 64), (1, 69)]
