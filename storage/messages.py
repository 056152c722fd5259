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

# The same, without the NOTIFY: for publishes whose wake-up is sent after
# commit (actors/announcer.py explains why that is faster).
PUBLISH_ONE_QUIET = """
WITH p AS (
    UPDATE partitions SET next_offset = next_offset + 1 WHERE id = $1
    RETURNING next_offset - 1 AS off
)
INSERT INTO messages (partition_id, "offset", key, headers, payload)
SELECT $1, p.off, $2, $3::jsonb, $4 FROM p
RETURNING "offset", created_at
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

# Many partitions in one statement (atomic without an explicit transaction):
# partition rows are locked in id order (no deadlock between two such
# statements), each counter moves once, offsets follow input order within a
# partition. $1..$4 are parallel arrays (partition id, key, headers, payload).
PUBLISH_MULTI_QUIET = """
WITH input AS (
    SELECT u.pid, u.k, u.h, u.p, u.ord
    FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS u(pid, k, h, p, ord)
), counts AS (
    SELECT pid, count(*) AS n FROM input GROUP BY pid
), locked AS (
    SELECT id FROM partitions WHERE id IN (SELECT pid FROM counts) ORDER BY id FOR NO KEY UPDATE
), bumped AS (
    UPDATE partitions pt SET next_offset = pt.next_offset + c.n
    FROM counts c JOIN locked l ON l.id = c.pid
    WHERE pt.id = c.pid
    RETURNING pt.id, pt.next_offset - c.n AS base
)
INSERT INTO messages (partition_id, "offset", key, headers, payload)
SELECT i.pid, b.base + row_number() OVER (PARTITION BY i.pid ORDER BY i.ord) - 1, i.k, i.h::jsonb, i.p
FROM input i JOIN bumped b ON b.id = i.pid
RETURNING partition_id, "offset", created_at
"""

ANNOUNCE = "SELECT count(pg_notify($1, x::text)) FROM unnest($2::bigint[]) AS x"

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
    channel: str | None,
    statement: str = PUBLISH_ONE,
) -> tuple[int, datetime] | None:
    """Append one message; None if the partition no longer exists.

    `statement` is PUBLISH_ONE, or a variant with the same parameters and
    result (queue topics: storage.queues.PUBLISH_ONE also inserts the job).
    With `channel=None` it is PUBLISH_ONE_QUIET: the caller announces after commit.
    """
    if channel is None:
        row = await conn.fetchrow(PUBLISH_ONE_QUIET, partition_id, key, headers, payload)
    else:
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


async def publish_multi(
    conn: asyncpg.Connection | asyncpg.Pool,
    partition_ids: list[int],
    keys: list[str | None],
    headers: list[str | None],
    payloads: list[bytes | None],
) -> list[tuple[int, int, datetime]]:
    """Append messages to several partitions in one statement; (partition_id, offset, created_at) rows."""
    rows = await conn.fetch(PUBLISH_MULTI_QUIET, partition_ids, keys, headers, payloads)
    return [(r[0], r[1], r[2]) for r in rows]


async def announce(conn: asyncpg.Connection, channel: str, partition_ids: list[int]) -> None:
    """NOTIFY `channel` once per partition id (post-commit wake-ups)."""
    await conn.fetchval(ANNOUNCE, channel, partition_ids)


async def read(
    conn: asyncpg.Connection | asyncpg.Pool, partition_id: int, offset: int, limit: int
) -> list[asyncpg.Record]:
    return list(await conn.fetch(READ, partition_id, offset, limit))


async def bounds(conn: asyncpg.Connection | asyncpg.Pool, partition_id: int) -> tuple[int, int] | None:
    row = await conn.fetchrow(BOUNDS, partition_id)
    return None if row is None else (int(row[0]), int(row[1]))
