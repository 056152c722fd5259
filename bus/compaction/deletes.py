"""The delete step of a compaction run: per partition, one transaction below the re-checked watermark.

Partitions are independent (each transaction locks only its own partition
row), so a few connections delete side by side. A partition's transaction
re-computes the low watermark under the lock and never removes at or above
it: rows the archive already holds but a moved-back watermark now protects
are recorded in `compaction_archived`, so a later run deletes them without
archiving them again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from bus.compaction.driver import Driver, Progress
from storage import db
from storage.compaction import sql
from storage.errors import BusError

# Partitions deleted side by side (each in its own transaction): PostgreSQL
# spends the delete's time in the heap, one core per backend.
DELETE_CONNECTIONS = 2


def delete_run(driver: Driver, run_id: int) -> None:
    """Delete every partition of the run not done yet (a resumed run skips the done ones)."""
    plan = driver.q(driver.conn.fetch(sql.SELECT_PLAN, run_id))
    pending = [r for r in plan if r["done_at"] is None]
    driver.q(_delete_side_by_side(driver, run_id, pending))


async def _delete_side_by_side(driver: Driver, run_id: int, pending: list[asyncpg.Record]) -> None:
    """Delete the pending partitions, each in its own transaction, on up to DELETE_CONNECTIONS connections.

    The first failure stops the others after their current partition and is raised.
    """
    todo = list(reversed(pending))
    done = removed_total = 0
    failed: list[BaseException] = []

    async def worker(conn: asyncpg.Connection) -> None:
        nonlocal done, removed_total
        while todo and not failed:
            row = todo.pop()
            try:
                removed = await _delete_partition(driver, conn, run_id, int(row["partition_id"]))
                done += 1
                removed_total += removed
                first = done == 1  # read before the await below lets the other worker count on
                counts = {"removed": removed_total}
                what = f"{row['topic']}/{row['partition']}"
                await driver.progress_async(
                    conn, Progress("delete", what, done=done, total=len(pending), counts=counts)
                )
                if first:
                    driver.checkpoint("mid_delete")
            except BaseException as exc:
                failed.append(exc)
                raise

    extra: list[asyncpg.Connection] = []
    try:
        for _ in range(min(DELETE_CONNECTIONS, len(pending)) - 1):
            extra.append(await db.connect(driver.dsn, driver.schema))
        await asyncio.gather(*(worker(c) for c in [driver.conn, *extra]), return_exceptions=True)
    finally:
        for c in extra:
            if not c.is_closed():
                await c.close()
    if failed:
        raise failed[0]


async def _delete_partition(driver: Driver, conn: asyncpg.Connection, run_id: int, partition_id: int) -> int:
    """One transaction: lock the partition, re-check the watermark, delete below it, move log_start."""
    async with conn.transaction():
        plan = await conn.fetchrow(sql.SELECT_PLAN_ROW, run_id, partition_id)
        if plan is None or plan["done_at"] is not None:
            return 0
        part = await conn.fetchrow(sql.LOCK_PARTITION, partition_id)
        if part is None:  # the topic was deleted meanwhile: nothing left to remove
            await conn.execute(sql.MARK_PARTITION_DONE, run_id, partition_id, 0, None, None)
            return 0
        watermark = int(await conn.fetchval(sql.PARTITION_WATERMARK, partition_id))
        cut = min(int(plan["hi"]), watermark)
        removed = await _delete_below(conn, run_id, partition_id, plan, watermark)
        if cut < int(plan["hi"]):
            # Archived but held back by the re-checked watermark: a later
            # run deletes these rows without archiving them again.
            await conn.execute(sql.HOLD_ARCHIVED, partition_id, cut)
        await conn.execute(sql.FORGET_ARCHIVED, partition_id)
        log_start = int(await conn.fetchval(sql.ADVANCE_LOG_START, partition_id))
        await conn.execute(sql.MARK_PARTITION_DONE, run_id, partition_id, removed, cut, log_start)
    if cut < int(plan["hi"]):
        driver.log.warning(
            "compaction_watermark_moved_back", partition_id=partition_id, planned=plan["hi"], cut=cut
        )
    return removed


async def _delete_below(
    conn: asyncpg.Connection, run_id: int, partition_id: int, plan: Any, watermark: int
) -> int:
    """Delete the partition's history below `watermark` by its cleanup policy; returns how many rows went."""
    if plan["cleanup"] == "delete":
        status = await conn.execute(sql.DELETE_RANGE, partition_id, plan["lo"], plan["hi"], watermark)
        return int(status.split()[-1])
    expected = plan["keep_rows"]
    actual = await conn.fetchval(sql.KEEP_COUNT, run_id, partition_id)
    if expected is None or int(actual) != int(expected):
        raise BusError(
            f"compaction keep-set of partition {partition_id} is incomplete ({actual} of {expected} rows); "
            "nothing was deleted, run the job again to rebuild it"
        )
    status = await conn.execute(
        sql.DELETE_COMPACTED,
        run_id,
        partition_id,
        plan["lo"],
        plan["hi"],
        watermark,
        plan["retention_cutoff"],
    )
    return int(status.split()[-1])
