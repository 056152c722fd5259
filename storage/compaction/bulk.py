"""Fast synthetic history for the compaction tests and benchmark.

Rows are generated inside PostgreSQL (`INSERT ... SELECT generate_series`),
appended at offsets taken from the partition's head under its row lock, so the log stays
dense and ordered exactly as if producers had published them.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from storage import db

# $1 partition id, $2 rows, $3 distinct keys, $4 payload bytes, $5 every n-th row is a
# tombstone (0: none), $6 created_at of the first row, $7 seconds between rows.
BULK_APPEND = """
WITH p AS (SELECT $1::bigint AS id, t.base FROM log_take_offsets($1, $2) AS t)
INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
SELECT p.id, p.base + g,
       'k' || ((g::bigint * 7919) % $3),
       '{"src": "bulk"}'::jsonb,
       CASE WHEN $5 > 0 AND g % $5 = $5 - 1 THEN NULL
            ELSE convert_to(substr(repeat(md5(g::text || ':' || p.id), 1 + $4 / 32), 1, $4), 'UTF8') END,
       $6::timestamptz + make_interval(secs => g * $7)
FROM p, generate_series(0, $2 - 1) AS g
"""

END_OFFSET = "SELECT p.log_end FROM partitions p WHERE p.id = $1"


class BulkAppendParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """How much synthetic history to append to which partition, and its shape."""

    partition_id: int
    rows: int
    #: Distinct keys the rows cycle through.
    keys: int
    payload_bytes: int = 150
    #: Every n-th row is a tombstone (0: none).
    tombstone_every: int = 0
    #: created_at of the first row; each next row is `step_seconds` later.
    start: datetime
    step_seconds: float = 0.001


async def bulk_append(conn: db.Connection, params: BulkAppendParams) -> int:
    """Append the generated records to the partition in one transaction; returns the new next_offset."""
    p = params
    async with conn.transaction():
        await conn.execute(
            BULK_APPEND,
            p.partition_id,
            p.rows,
            p.keys,
            p.payload_bytes,
            p.tombstone_every,
            p.start,
            p.step_seconds,
        )
        return int(await conn.fetchval(END_OFFSET, p.partition_id))


# The pure-SQL baseline the benchmark compares the job with: the same
# compaction (newest record per key survives) done inside PostgreSQL, without
# archive, then VACUUM so the space is reusable like after the job.
SQL_BASELINE_COMPACT = """
DELETE FROM messages m
USING (SELECT partition_id, key, max("offset") AS newest FROM messages GROUP BY partition_id, key) n
WHERE m.partition_id = n.partition_id AND m.key = n.key AND m."offset" < n.newest
"""
SQL_BASELINE_VACUUM = "VACUUM messages"
ANALYZE_MESSAGES = "ANALYZE messages"
