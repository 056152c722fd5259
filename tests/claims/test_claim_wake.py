"""A claim cursor's wake-up is not lost to an ack that waited for a publisher (migration 023).

An ack recomputes the cursor's `pending_since` under a lock of the partition
row. A publisher holds that lock until it commits; an ack that started while
the publisher was still open waits for it, and must then see the message it
committed: else the cursor is left caught up with a message to read, and no
claim picks the partition until the next publish to it.
"""

from __future__ import annotations

import asyncio

import asyncpg

import bus
from bus.testing import eventually
from storage import db


async def _ack_waiting(conn: asyncpg.Connection) -> bool:
    """Whether an ack of this database waits for a lock (the partition row's)."""
    return bool(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%FOR SHARE%committed%'"
        )
    )


async def test_an_ack_that_waited_for_a_publisher_leaves_the_cursor_pending(
    connect: bus.Bus, dsn: str, schema: str
) -> None:
    b = await connect()
    await b.create_topic("orders", partitions=1)
    await b.publish_many("orders", [b"0", b"1"])
    claim = await b.claim("billing", topic="orders", worker_id="w1")
    assert claim is not None and [m.offset for m in claim.messages] == [0, 1]
    publisher = await db.connect(dsn, schema)
    watcher = await asyncpg.connect(dsn)
    try:
        tx = publisher.transaction()
        await tx.start()
        # The publish holds the partition row's lock until it commits.
        await publisher.fetchval("SELECT (publish('orders', '{\"n\": 2}'::jsonb)).\"offset\"")
        ack = asyncio.create_task(claim.ack(1))
        await eventually(lambda: _ack_waiting(watcher), timeout=10)
        await tx.commit()
        await ack
    finally:
        await publisher.close()
        await watcher.close()
    row = await b.pool.fetchrow("SELECT committed, pending_since FROM offsets WHERE group_name = 'billing'")
    assert row["committed"] == 2 and row["pending_since"] is not None
    again = await b.claim("billing", topic="orders", worker_id="w2")
    assert again is not None and [m.offset for m in again.messages] == [2]
