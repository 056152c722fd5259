"""A Producer's flush moves its heads in its own statement (APPEND_ONE_PLANNED, APPEND_SINGLE_PLANNED, APPEND_PLANNED).

The newest head is read in the statement's snapshot and moved by its key. A head that does not move
(a rotation committed while the statement waited for it) leaves nothing written and the flush goes
through the head functions; a head someone else moved since the snapshot, or a claimed partition,
wakes the partition's caught-up claim cursors. Offsets stay dense and visible in order (invariant 1).
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

import bus
from storage import db
from storage import messages as log_sql
from tests.helpers import bus_on_schema_before

HEADS = "SELECT generation, next_offset, appends FROM log_heads WHERE partition_id = $1 ORDER BY generation"
PID = "SELECT id FROM partitions WHERE topic = $1 ORDER BY id"
STORED = 'SELECT "offset" FROM messages WHERE partition_id = $1 ORDER BY 1'
PENDING = "SELECT pending_since IS NOT NULL FROM offsets WHERE partition_id = $1 AND group_name = $2"


async def planned_connection(dsn: str, schema: str) -> asyncpg.Connection:
    return await db.connect(dsn, schema, settings=log_sql.PLANNED_SETTINGS)


def flush(pid: int, payloads: list[bytes]) -> log_sql.Batch:
    n = len(payloads)
    return log_sql.Batch.of([pid] * n, ["0"] * n, [None] * n, [None] * n, payloads)


async def caught_up_claimed_partition(b: bus.Bus) -> int:
    """A one-partition topic whose group "billing" claimed and acked all there is: its cursor not pending."""
    await b.create_topic("t", partitions=1)
    (pid,) = [r["id"] for r in await b.pool.fetch(PID, "t")]
    await b.publish("t", b"0")
    claim = await b.claim("billing", topic="t", worker_id="w1")
    assert claim is not None
    await claim.ack()
    assert await b.pool.fetchval(PENDING, pid, "billing") is False
    return int(pid)


@pytest.mark.parametrize("size", [1, 3])
async def test_a_planned_flush_of_one_partition_that_waited_for_a_rotation_lands_at_the_next_offsets(
    dsn: str, schema: str, b: bus.Bus, size: int
) -> None:
    await b.create_topic("t", partitions=1)
    (pid,) = [r["id"] for r in await b.pool.fetch(PID, "t")]
    for _ in range(63):
        await b.publish("t", b"x")
    rotating, waiting = await db.connect(dsn, schema), await planned_connection(dsn, schema)
    try:
        tx = rotating.transaction()
        await tx.start()
        # The 64th publish closes generation 0 and inserts generation 1, uncommitted for now.
        assert await rotating.fetchval(log_sql.APPEND_SINGLE, pid, None, None, b"64th", None) == 63
        behind = asyncio.create_task(log_sql.append(waiting, flush(pid, [b"next"] * size), planned=True))
        await asyncio.sleep(0.2)
        assert not behind.done()  # it waits on the head row the rotation holds
        await tx.commit()
        placed = await asyncio.wait_for(behind, 5)
        assert [p[:2] for p in placed if p is not None] == [(pid, 64 + i) for i in range(size)]
    finally:
        await rotating.close()
        await waiting.close()
    assert [tuple(r) for r in await b.pool.fetch(HEADS, pid)] == [(0, 64, 64), (1, 64 + size, 1)]
    assert [r["offset"] for r in await b.pool.fetch(STORED, pid)] == list(range(64 + size))


@pytest.mark.parametrize("size", [1, 3])
async def test_a_planned_flush_of_one_partition_rotates_the_head_it_closes(
    dsn: str, schema: str, b: bus.Bus, size: int
) -> None:
    await b.create_topic("t", partitions=1)
    (pid,) = [r["id"] for r in await b.pool.fetch(PID, "t")]
    conn = await planned_connection(dsn, schema)
    try:
        for _ in range(130):  # two rotations
            assert None not in await log_sql.append(conn, flush(pid, [b"x"] * size), planned=True)
    finally:
        await conn.close()
    assert [tuple(r) for r in await b.pool.fetch(HEADS, pid)] == [(1, 128 * size, 64), (2, 130 * size, 2)]
    assert [r["offset"] for r in await b.pool.fetch(STORED, pid)] == list(range(130 * size))


@pytest.mark.parametrize(
    ("planned", "partitions"),
    [(True, 1), (False, 1), (True, 2)],
    ids=["planned", "head-function", "planned-two-partitions"],
)
async def test_a_publish_that_waited_for_a_claims_first_cursors_wakes_them(
    dsn: str, schema: str, b: bus.Bus, planned: bool, partitions: int
) -> None:
    pid = await caught_up_claimed_partition(b)
    await b.create_topic("u", partitions=1)
    (other,) = [r["id"] for r in await b.pool.fetch(PID, "u")]
    batch = flush(pid, [b"1"])
    if partitions == 2:  # a flush of two partitions (APPEND_PLANNED)
        batch = log_sql.Batch.of([pid, other], ["0", "0"], [None] * 2, [None] * 2, [b"1", b"u"])
    # As before the group's first claim: the partition (and its head) not claimed, its cursor caught up.
    await b.pool.execute("UPDATE partitions SET claimed = false WHERE id = $1", pid)
    await b.pool.execute("UPDATE log_heads SET claimed = false WHERE partition_id = $1", pid)
    claiming = await db.connect(dsn, schema)
    publisher = await (planned_connection(dsn, schema) if planned else db.connect(dsn, schema))
    try:
        tx = claiming.transaction()
        await tx.start()
        # The creation of the first cursors: the head held (moved by no offset), the partition claimed.
        await claiming.execute("SELECT log_head_hold($1)", pid)
        await claiming.execute("UPDATE partitions SET claimed = true WHERE id = $1", pid)
        # The publish's snapshot shows the partition not claimed; it waits for the head.
        behind = asyncio.create_task(log_sql.append(publisher, batch, planned=planned))
        await asyncio.sleep(0.2)
        assert not behind.done()
        await tx.commit()
        placed = await asyncio.wait_for(behind, 5)
        assert [p[:2] for p in placed if p is not None] == [(pid, 1), (other, 0)][:partitions]
    finally:
        await claiming.close()
        await publisher.close()
    # It saw the head moved since its snapshot and read the claim again: the cursor is woken.
    assert await b.pool.fetchval(PENDING, pid, "billing") is True


async def test_a_planned_single_publish_wakes_the_caught_up_cursor_of_a_claimed_partition(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    pid = await caught_up_claimed_partition(b)
    conn = await planned_connection(dsn, schema)
    try:
        await log_sql.append(conn, flush(pid, [b"1"]), planned=True)
    finally:
        await conn.close()
    assert await b.pool.fetchval(PENDING, pid, "billing") is True


async def test_the_heads_of_a_claimed_partition_carry_its_claim_across_rotations(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    pid = await caught_up_claimed_partition(b)
    assert await b.pool.fetchval("SELECT bool_and(claimed) FROM log_heads WHERE partition_id = $1", pid)
    conn = await planned_connection(dsn, schema)
    try:
        for i in range(130):  # two rotations: generations 1 and 2 are inserted by the flushes
            await log_sql.append(conn, flush(pid, [b"%d" % i]), planned=True)
        heads = await b.pool.fetch("SELECT generation, claimed FROM log_heads WHERE partition_id = $1", pid)
        assert max(h["generation"] for h in heads) == 2 and all(h["claimed"] for h in heads)
        # The cursor caught up again: the next planned publish, on the newest generation, wakes it.
        await b.pool.execute(
            "UPDATE offsets SET committed = 131, pending_since = NULL WHERE partition_id = $1", pid
        )
        await log_sql.append(conn, flush(pid, [b"last"]), planned=True)
    finally:
        await conn.close()
    assert await b.pool.fetchval(PENDING, pid, "billing") is True


@pytest.mark.fresh_schema  # made by the migrations before 037
async def test_a_partition_claimed_before_the_heads_carried_the_claim_has_it_on_its_head(
    dsn: str, schema: str, drop_schema: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with bus_on_schema_before(dsn, schema, 37, monkeypatch) as old:
        await old.create_topic("t", partitions=2)
        claimed, unclaimed = [r["id"] for r in await old.pool.fetch(PID, "t")]
        # As a group's first claim cursors left it on that schema: the partition's row marked.
        await old.pool.execute("UPDATE partitions SET claimed = true WHERE id = $1", claimed)
    new = await bus.connect(dsn, schema=schema)
    try:
        flags = await new.pool.fetch("SELECT partition_id, claimed FROM log_heads")
        assert {r["partition_id"]: r["claimed"] for r in flags} == {claimed: True, unclaimed: False}
    finally:
        await new.close()


@pytest.mark.parametrize("statement", ["APPEND_SINGLE_PLANNED", "APPEND_ONE_PLANNED"])
async def test_the_planned_one_partition_statements_move_the_head_by_key_on_a_small_analyzed_heads_table(
    dsn: str, schema: str, b: bus.Bus, statement: str
) -> None:
    await b.create_topic("t", partitions=4)
    await b.publish_many("t", [bus.Outgoing(b"x", partition=str(i % 4)) for i in range(8)])
    await b.pool.execute("ANALYZE log_heads")  # one page: a planner left alone scans it whole
    (pid, *_) = [r["id"] for r in await b.pool.fetch(PID, "t")]
    args: list[object] = [pid, None, None, b"x", None]
    if statement == "APPEND_ONE_PLANNED":
        args = [pid, None, None, [b"x", b"y"], None]
    conn = await planned_connection(dsn, schema)
    try:
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + getattr(log_sql, statement), *args))
    finally:
        await conn.close()
    assert "Seq Scan on log_heads" not in plan, plan
    assert "Index Scan using log_heads_pkey on log_heads h" in plan, plan
    assert "log_heads_pkey on log_heads x" in plan, plan


async def test_a_planned_queue_flush_that_waited_for_a_rotation_writes_its_jobs_at_the_next_offsets(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("q", partitions=1, semantics="queue")
    await b.create_topic("t", partitions=1)
    (pid,) = [r["id"] for r in await b.pool.fetch(PID, "q")]
    (other,) = [r["id"] for r in await b.pool.fetch(PID, "t")]
    for _ in range(63):
        await b.publish("q", b"x")
    rotating, waiting = await db.connect(dsn, schema), await planned_connection(dsn, schema)
    # Two jobs and a message of a pubsub topic: only the queue's messages get job rows.
    batch = log_sql.Batch.of(
        [pid, other, pid], ["0", "0", "0"], ["k1", None, "k2"], [None] * 3, [b"j1", b"m", b"j2"], queue=True
    )
    try:
        tx = rotating.transaction()
        await tx.start()
        assert await rotating.fetchval(log_sql.APPEND_SINGLE, pid, None, None, b"64th", None) == 63
        behind = asyncio.create_task(log_sql.append(waiting, batch, planned=True))
        await asyncio.sleep(0.2)
        assert not behind.done()
        await tx.commit()
        placed = await asyncio.wait_for(behind, 5)
        assert [p[:2] for p in placed if p is not None] == [(pid, 64), (other, 0), (pid, 65)]
    finally:
        await rotating.close()
        await waiting.close()
    # (the 64th message was written without its job, by the statement for topics that are not queues)
    jobs = 'SELECT "offset", key FROM queue_jobs WHERE partition_id = $1 AND "offset" >= 63 ORDER BY 1'
    assert [tuple(r) for r in await b.pool.fetch(jobs, pid)] == [(64, "k1"), (65, "k2")]
    assert await b.pool.fetchval("SELECT count(*) FROM queue_jobs WHERE partition_id = $1", other) == 0
    async with b.queue_consumer("q") as q:
        got = await q.take(max_messages=100, timeout=0)
    assert len(got) == 65 and [m.payload for m in got[-2:]] == [b"j1", b"j2"]


async def test_the_planned_queue_statement_moves_the_heads_by_key_on_a_small_analyzed_heads_table(
    dsn: str, schema: str, b: bus.Bus
) -> None:
    await b.create_topic("q", partitions=4, semantics="queue")
    await b.publish_many("q", [bus.Outgoing(b"x", partition=str(i % 4)) for i in range(8)])
    await b.pool.execute("ANALYZE log_heads")
    first, second, *_ = [r["id"] for r in await b.pool.fetch(PID, "q")]
    args = [f"{{{first},{second}}}", None, None, [b"x", b"y"], "{0,0}", [first, second], [1, 1], None]
    conn = await planned_connection(dsn, schema)
    try:
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + log_sql.APPEND_QUEUE_PLANNED, *args))
    finally:
        await conn.close()
    assert "Seq Scan on log_heads" not in plan, plan
    assert "Index Scan using log_heads_pkey on log_heads h" in plan, plan
