"""Statements that run per job or per idle poll look rows up by key, whatever the planner thinks of
the table: a queue's tables hold few live rows, and a snapshot held elsewhere fills them with dead
ones that a scan reads one by one (the plan made for a table of few live rows picks such a scan).
Checked on generic plans, the kind the bus's lent connections use."""

from __future__ import annotations

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


async def test_an_ack_finds_its_jobs_and_leases_by_key(b: bus.Bus, dsn: str, schema: str) -> None:
    await b.create_topic("jobs", partitions=2, semantics="queue")
    for _ in range(5):
        await b.publish_many("jobs", [{"n": i} for i in range(2000)])
    async with b.queue_consumer("jobs") as q:
        for _ in range(100):  # range leases held
            assert await q.take(max_messages=10, timeout=1.0)
        conn = await db.connect(dsn, schema)
        try:
            # The size a held snapshot gives the lease table (here in live rows: the plan is the same).
            await conn.execute(
                "INSERT INTO queue_leases (topic, partition_id, first_offset, last_offset, leased_by, visible_at)"
                " SELECT 'jobs', p.id, -g, -g, 'other', clock_timestamp() + interval '1 hour'"
                " FROM partitions p, generate_series(1, 10000) AS g WHERE p.topic = 'jobs'"
            )
            await conn.execute("ANALYZE queue_jobs; ANALYZE queue_leases")
            plan = await _generic_plan(conn, queue_sql.ACK_MANY, "'{1,2}', '{5,6}', '{0,0}', '{7,8}'")
        finally:
            await conn.close()
    assert "Index Scan using queue_jobs_pkey on queue_jobs q" in plan
    assert "Tid Scan on queue_jobs j" in plan and "Tid Scan on queue_leases l" in plan
    assert "Seq Scan on queue_jobs" not in plan, plan


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
