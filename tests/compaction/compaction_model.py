"""A plain-Python reference model of what a compaction run must do, and test-data helpers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

import bus
from storage import groups as group_sql
from storage.compaction.bulk import BulkAppendParams, bulk_append

# Test-only statements (setup and snapshots), constant and parameterized like the bus's own.
SNAPSHOT = """
SELECT m.partition_id, m."offset", m.key, m.payload IS NULL AS tombstone, m.created_at, md5(m.payload) AS digest
FROM messages m ORDER BY m.partition_id, m."offset"
"""
PARTITIONS = """
SELECT w.partition_id, w.topic, w.partition, w.log_start, w.next_offset, w.low_watermark,
       t.cleanup, t.retention_seconds, t.tombstone_retention_seconds
FROM partition_watermarks w JOIN topics t ON t.name = w.topic ORDER BY w.partition_id
"""
SET_COMMITTED = """
UPDATE offsets SET committed = $3
WHERE group_name = $1 AND partition_id = (SELECT id FROM partitions WHERE topic = $2 AND name = $4)
"""
PRESENT = 'SELECT partition_id, "offset" FROM messages ORDER BY 1, 2'
LOG_STARTS = "SELECT id, log_start FROM partitions ORDER BY id"
LAST_RUN = "SELECT * FROM compaction_runs ORDER BY id DESC LIMIT 1"


@dataclass
class Expected:
    """The model's answer: what stays, what is archived (= removed), and each partition's log start."""

    remaining: set[tuple[int, int]]
    archived: dict[tuple[int, int], str | None]  # (partition_id, offset) -> payload md5
    log_start: dict[int, int]


def expected_after(
    rows: list[Any], parts: list[Any], now: datetime, default_tombstone: float = 86400.0
) -> Expected:
    """What one complete run planned at `now` leaves, from a snapshot taken before it."""
    by_part: dict[int, list[Any]] = {}
    for r in rows:
        by_part.setdefault(r["partition_id"], []).append(r)
    remaining: set[tuple[int, int]] = set()
    archived: dict[tuple[int, int], str | None] = {}
    log_start: dict[int, int] = {}
    for p in parts:
        pid, lo, wm, end = p["partition_id"], p["log_start"], p["low_watermark"], p["next_offset"]
        prows = by_part.get(pid, [])
        retention = p["retention_seconds"]
        cutoff = None if retention is None else now - timedelta(seconds=retention)
        remove: set[int] = set()
        if p["cleanup"] == "delete":
            if cutoff is not None:
                young = [r["offset"] for r in prows if r["created_at"] >= cutoff]
                cut = min([wm, *young])
                remove = {r["offset"] for r in prows if lo <= r["offset"] < cut}
        else:
            tomb_cutoff = now - timedelta(seconds=p["tombstone_retention_seconds"] or default_tombstone)
            newest: dict[str, Any] = {}
            for r in prows:
                if r["key"] is not None and r["offset"] < end:
                    newest[r["key"]] = r  # rows come in offset order
            for r in prows:
                if r["key"] is None or not lo <= r["offset"] < wm:
                    continue
                top = newest[r["key"]]
                if r["offset"] < top["offset"]:
                    if cutoff is None or r["created_at"] < cutoff:
                        remove.add(r["offset"])
                elif r["tombstone"] and r["created_at"] < tomb_cutoff:
                    remove.add(r["offset"])
        for r in prows:
            if r["offset"] in remove:
                archived[(pid, r["offset"])] = r["digest"]
            else:
                remaining.add((pid, r["offset"]))
        left = [o for o in (r["offset"] for r in prows) if o not in remove and o >= lo]
        log_start[pid] = max(lo, min(left) if left else end)
    return Expected(remaining, archived, log_start)


async def snapshot(conn: asyncpg.Connection) -> tuple[list[Any], list[Any]]:
    """(rows, partitions) as the model needs them."""
    return list(await conn.fetch(SNAPSHOT)), list(await conn.fetch(PARTITIONS))


async def present(conn: asyncpg.Connection) -> set[tuple[int, int]]:
    return {(r[0], r[1]) for r in await conn.fetch(PRESENT)}


async def log_starts(conn: asyncpg.Connection) -> dict[int, int]:
    return {r[0]: r[1] for r in await conn.fetch(LOG_STARTS)}


async def make_group(b: bus.Bus, name: str, topics: list[str], committed: dict[tuple[str, str], int]) -> None:
    """A live `earliest` group reading `topics`, its cursors set to `committed` (others stay at the log start)."""
    async with b.pool.acquire() as conn:
        await group_sql.record_group(
            conn, group_sql.RecordGroupParams(name=name, start_mode="earliest", lookback_seconds=0.0)
        )
        await group_sql.add_group_topics(conn, name, topics)
        ids = [r["partition_id"] for r in await group_sql.group_partitions(conn, name)]
        await group_sql.materialize_offsets(conn, name, ids)
        for (topic, partition), offset in committed.items():
            await conn.execute(SET_COMMITTED, name, topic, offset, partition)


async def load(
    b: bus.Bus,
    topic: str,
    partition: str,
    rows: int,
    *,
    keys: int,
    start: datetime,
    step: float,
    tombstone_every: int = 0,
) -> None:
    """Append generated rows to one partition (see storage/compaction/bulk.py)."""
    info = await b.topic(topic)
    pid = await b.partition_id(info, partition, create=True)
    assert pid is not None
    async with b.pool.acquire() as conn:
        await bulk_append(
            conn,
            BulkAppendParams(
                partition_id=pid,
                rows=rows,
                keys=keys,
                start=start,
                step_seconds=step,
                tombstone_every=tombstone_every,
            ),
        )


def archive_rows(spark: Any, root: str) -> list[Any]:
    """Every row in the archive: (partition_id, offset, md5 of payload)."""
    from pyspark.sql import functions as F

    df = spark.read.parquet(root)
    return df.select("partition_id", "offset", F.md5("payload").alias("digest"), "topic", "date").collect()
