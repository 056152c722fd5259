"""The log: publishing and reading messages.

Offsets come from `partitions.next_offset`, incremented (and so row-locked)
in the publishing transaction: two publishers to one partition serialize on
that row, so offsets are dense and commit in offset order (invariant 1). A
`bigserial` alone would let offset 8 commit before offset 7 and a reader
that already moved past 7 would miss it for good.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

PUBLISH_ONE = """
WITH p AS (
    UPDATE partitions SET next_offset = next_offset + 1 WHERE id = $1
    RETURNING next_offset - 1 AS off
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload)
    SELECT $1, p.off, $2, $3::jsonb, $4 FROM p
    RETURNING "offset", created_at
)
SELECT m."offset", m.created_at, pg_notify($5, $1::text) FROM m
"""

PUBLISH_BATCH = """
WITH p AS (
    UPDATE partitions SET next_offset = next_offset + cardinality($4::bytea[]) WHERE id = $1
    RETURNING next_offset - cardinality($4::bytea[]) AS base
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload)
    SELECT $1, p.base + u.ord - 1, u.k, u.h::jsonb, u.p
    FROM p, unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS u(k, h, p, ord)
    RETURNING "offset", created_at
)
SELECT m."offset", m.created_at, n.ok
FROM m, (SELECT pg_notify($5, $1::text) IS NULL AS ok) AS n
ORDER BY m."offset"
"""

READ = """
SELECT "offset", key, headers::text AS headers, payload, created_at
FROM messages
WHERE partition_id = $1 AND "offset" >= $2
ORDER BY "offset"
LIMIT $3
"""

BOUNDS = "SELECT log_start, next_offset FROM partitions WHERE id = $1"


async def publish_one(
    conn: asyncpg.Connection | asyncpg.Pool,
    partition_id: int,
    key: str | None,
    headers: str | None,
    payload: bytes | None,
    channel: str,
    statement: str = PUBLISH_ONE,
) -> tuple[int, datetime] | None:
    """Append one message; None if the partition no longer exists.

    `statement` is PUBLISH_ONE, or a variant with the same parameters and
    result (queue topics: storage.queues.PUBLISH_ONE also inserts the job).
    """
    row = await conn.fetchrow(statement, partition_id, key, headers, payload, channel)
    return None if row is None else (row[0], row[1])


async def publish_batch(
    conn: asyncpg.Connection,
    partition_id: int,
    keys: list[str | None],
    headers: list[str | None],
    payloads: list[bytes | None],
    channel: str,
    statement: str = PUBLISH_BATCH,
) -> list[tuple[int, datetime]]:
    """Append messages to one partition in one statement; [] if the partition no longer exists."""
    rows = await conn.fetch(statement, partition_id, keys, headers, payloads, channel)
    return [(r[0], r[1]) for r in rows]


async def read(
    conn: asyncpg.Connection | asyncpg.Pool, partition_id: int, offset: int, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(READ, partition_id, offset, limit))


async def bounds(conn: asyncpg.Connection | asyncpg.Pool, partition_id: int) -> tuple[int, int] | None:
    row = await conn.fetchrow(BOUNDS, partition_id)
    return None if row is None else (int(row[0]), int(row[1]))
