"""Statements that run per job or per idle poll look rows up by key, whatever the planner thinks of
the table: a queue's tables hold few live rows, and a snapshot held elsewhere fills them with dead
ones that a scan reads one by one (the plan made for a table of few live rows picks such a scan).
Checked on generic plans, the kind the bus's lent connections use."""

from __future__ import annotations

import json

import asyncpg

import bus
from storage import db, leases
from storage import queues as queue_sql

OLD_IDLE_MORE = (
    'EXISTS (SELECT 1 FROM messages m WHERE m.partition_id = u.pid AND m."offset" >= u.pos) AS more,'
)


async def _generic_plan(conn: asyncpg.Connection, sql: str, args: str) -> str:
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    await conn.execute("PREPARE probe AS " + sql)
    try:
        return "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE probe({args})"))
    finally:
        await conn.execute("DEALLOCATE probe")


async def test_an_ack_finds_its_jobs_by_key_and_leaves_the_leases(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    for _ in range(5):
        await b.publish_many("jobs", [{"n": i} for i in range(2000)])
    async with b.queue_consumer("jobs") as q:
        for _ in range(100):  # range leases held
            assert await q.take(max_messages=10, timeout=1.0)
        conn = await db.connect(dsn, schema)
        try:
            await conn.execute("ANALYZE queue_jobs; ANALYZE queue_leases")
            plan = await _generic_plan(conn, queue_sql.ACK_MANY, "'{1,2}', '{5,6}', '{0,0}'")
        finally:
            await conn.close()
    assert "Index Scan using queue_jobs_pkey on queue_jobs q" in plan
    assert "Tid Scan on queue_jobs j" in plan
    assert "Seq Scan on queue_jobs" not in plan, plan
    # A lease is written once: its slot of the lease table is truncated, not its rows deleted.
    assert "queue_leases" not in plan, plan


async def test_an_idle_poll_asks_the_log_for_one_message_by_key(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("t", partitions=1)
    for _ in range(5):
        await b.publish_many("t", [b"x" * 100] * 1000)
    conn = await db.connect(dsn, schema)
    try:
        await conn.execute("ANALYZE messages")
        args = "'{g}', '{m}', '{1}', '{1}', '{5}', NULL"
        plan = await _generic_plan(conn, leases.IDLE_CHECK, args)
        assert "Seq Scan on messages" not in plan, plan
        # The form it replaces: an EXISTS the planner expects to satisfy at once by a scan.
        old = leases.IDLE_CHECK.replace(
            """(SELECT m."offset" FROM messages m WHERE m.partition_id = u.pid AND m."offset" >= u.pos
            ORDER BY m."offset" LIMIT 1) IS NOT NULL AS more,""",
            OLD_IDLE_MORE,
        )
        assert old != leases.IDLE_CHECK
        assert "Seq Scan on messages" in await _generic_plan(conn, old, args)
    finally:
        await conn.close()


HEAD_SCANS = """
SELECT relname, seq_scan, idx_scan FROM pg_stat_xact_user_tables
WHERE schemaname = current_schema() AND relname IN ('log_heads', 'queue_frontier_heads')
"""


async def test_publishes_and_takes_find_their_partitions_head_rows_by_key(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    # A heads table holds a few live rows, so a plan sized by its statistics scans it; a held snapshot
    # then fills it with a dead version per publish or take, and every such scan reads them all.
    await b.create_topic("t", partitions=2)
    await b.create_topic("jobs", partitions=2, semantics="queue")
    for i in range(20):
        await b.publish("t", {"i": i})
        await b.publish("jobs", {"i": i})
    conn = await db.connect(dsn, schema)
    try:
        await conn.execute("ANALYZE log_heads")
        await conn.execute("ANALYZE queue_frontier_heads")
        assert await conn.fetchval("SELECT relpages FROM pg_class WHERE oid = 'log_heads'::regclass") <= 2
        pid = await conn.fetchval("SELECT min(id) FROM partitions WHERE topic = 't'")
        qid = await conn.fetchval("SELECT min(partition_id) FROM queue_frontiers")
        async with conn.transaction():  # pg_stat_xact_user_tables: this transaction's scans
            for _ in range(8):  # past the first plans made for the parameters: the kept generic one too
                await conn.fetchval("SELECT base FROM log_take_offsets($1, 1)", pid)
                await conn.fetchval("SELECT p.log_end FROM partitions p WHERE p.id = $1", pid)
                at = await conn.fetchval("SELECT queue_frontier_lock($1)", qid)
                await conn.fetchval("SELECT queue_frontier_move($1, $2)", qid, at + 1)
                await conn.fetchval("SELECT f.frontier FROM queue_frontiers f WHERE f.partition_id = $1", qid)
            counts = {r["relname"]: (r["seq_scan"], r["idx_scan"]) for r in await conn.fetch(HEAD_SCANS)}
    finally:
        await conn.close()
    assert counts["log_heads"][0] == 0 and counts["log_heads"][1] > 0, counts
    assert counts["queue_frontier_heads"][0] == 0 and counts["queue_frontier_heads"][1] > 0, counts


async def test_a_take_writes_no_version_of_a_lease_it_did_not_insert(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    # A lease that ran out is reclaimed by detaching its jobs; the lease itself stays, holding
    # nothing, until its slot of the lease table is truncated: no take deletes or updates one.
    await b.create_topic("jobs", partitions=2, semantics="queue")
    await b.publish_many("jobs", [{"n": i} for i in range(40)])
    async with b.queue_consumer("jobs") as q:
        for _ in range(10):
            assert await q.take(max_messages=2, timeout=1.0)
        conn = await db.connect(dsn, schema)
        try:
            await conn.execute("ANALYZE queue_leases")
            for statement in (queue_sql.TAKE, queue_sql.TAKE_WITHIN_LIMITS):
                plan = await _generic_plan(conn, statement, "'jobs', '{5}', 30, '{c}', 5, 0, NULL, NULL")
                assert "Insert on queue_leases" in plan, plan
                assert "Delete on queue_leases" not in plan and "Update on queue_leases" not in plan, plan
        finally:
            await conn.close()


async def _buffers(conn: asyncpg.Connection, sql: str, *args: object) -> int:
    """The shared buffers one run of `sql` touched, its functions' statements included."""
    plan = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) " + sql, *args)
    top = json.loads(plan)[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


async def test_a_head_is_found_from_the_end_of_its_index_in_a_table_a_held_snapshot_filled(
    b: bus.Bus, dsn: str, schema: str
) -> None:
    # Analyzed during a hold, a heads table has many pages and two live rows per partition: a bitmap
    # plan of `max(generation)` then reads every page holding a version of the partition's heads.
    await b.create_topic("t", partitions=1)
    await b.create_topic("jobs", partitions=1, semantics="queue")
    await b.publish("t", {"i": 0})
    await b.publish_many("jobs", [{"i": i} for i in range(6000)])
    hold = await db.connect(dsn, schema)
    conn = await db.connect(dsn, schema)
    try:
        pid = await conn.fetchval("SELECT id FROM partitions WHERE topic = 't'")
        qid = await conn.fetchval("SELECT partition_id FROM queue_frontiers")
        async with hold.transaction(isolation="repeatable_read"):
            await hold.fetchval("SELECT 1")  # the snapshot that keeps every version below
            # 5000 publishes' and takes' moves of the heads, each a statement of its own function call
            await conn.fetchval(
                "SELECT count(*) FROM generate_series(1, 5000) AS g CROSS JOIN LATERAL log_take_offsets($1, 1 + 0 * g)",
                pid,
            )
            await conn.fetchval(
                "SELECT count(queue_frontier_move($1, queue_frontier_lock($1) + 1 + 0 * g))"
                " FROM generate_series(1, 5000) AS g",
                qid,
            )
            await conn.execute("ANALYZE log_heads; ANALYZE queue_frontier_heads")
            pages = await conn.fetchval(
                "SELECT min(relpages) FROM pg_class WHERE oid IN ('log_heads'::regclass, 'queue_frontier_heads'::regclass)"
            )
            assert pages >= 30  # what the hold left behind
            async with conn.transaction():  # each lookup twice: the second one on the cached plan
                touched = {
                    "publish": [
                        await _buffers(conn, "SELECT base FROM log_take_offsets($1, 1)", pid)
                        for _ in range(3)
                    ],
                    "log end": [
                        await _buffers(conn, "SELECT p.log_end FROM partitions p WHERE p.id = $1", pid)
                        for _ in range(3)
                    ],
                    "frontier lock": [
                        await _buffers(conn, "SELECT queue_frontier_lock($1)", qid) for _ in range(3)
                    ],
                    "frontier": [
                        await _buffers(
                            conn, "SELECT f.frontier FROM queue_frontiers f WHERE f.partition_id = $1", qid
                        )
                        for _ in range(3)
                    ],
                }
                at = await conn.fetchval("SELECT queue_frontier_lock($1)", qid)
                touched["frontier move"] = [
                    await _buffers(conn, "SELECT queue_frontier_move($1, $2)", qid, at + k) for k in (1, 2, 3)
                ]
    finally:
        await hold.close()
        await conn.close()
    # a few index pages and the head's own (the frontier also probes the index of each of the
    # lease table's two slots, two pages each): a bitmap plan read all of the pages above
    assert all(max(runs[1:]) <= (19 if name == "frontier" else 15) for name, runs in touched.items()), (
        pages,
        touched,
    )
