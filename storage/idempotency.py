"""Idempotency keys: a publish repeated within its topic's dedupe window writes nothing.

A publish with a key runs, in one transaction: claim the key (insert its row,
or take over a row whose window has passed), append the messages whose keys
were claimed, fill in where they landed, and look up the original of every key
that was already there. The claim comes first and takes the keys in a fixed
order, so a concurrent publish with the same key waits on the primary key
until the first one commits (then finds its record) or rolls back (then
claims the key itself), and two batches never deadlock on each other's keys.
A flush's partition locks come after all of its key claims, so key and
partition locks never wait on each other in a cycle either.

Expired keys are deleted by the retention cleaner (`delete_expired`), a
bounded batch per pass.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from storage.db import Conn
from storage.errors import ValidationError
from storage.names import utf8_text

# $1 topics, $2 keys, $3 windows (seconds, NULL: for ever); distinct (topic, key) pairs; $4 now
# (NULL: the server's clock). A conflicting row still inside its window at $4 is locked and left
# alone (not returned).
CLAIM = """
INSERT INTO idempotency_keys (topic, key, expires_at)
SELECT u.t, u.k, COALESCE($4::timestamptz, clock_timestamp()) + make_interval(secs => u.w)
FROM unnest($1::text[], $2::text[], $3::float8[]) AS u(t, k, w)
ORDER BY u.t, u.k
ON CONFLICT (topic, key) DO UPDATE
SET expires_at = EXCLUDED.expires_at, partition_id = NULL, "offset" = NULL, created_at = NULL
WHERE idempotency_keys.expires_at IS NOT NULL
  AND idempotency_keys.expires_at <= COALESCE($4::timestamptz, clock_timestamp())
RETURNING topic, key
"""

FILL = """
UPDATE idempotency_keys k
SET partition_id = u.pid, "offset" = u.off, created_at = u.c
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::timestamptz[]) AS u(t, key, pid, off, c)
WHERE k.topic = u.t AND k.key = u.key
"""

LOOKUP = """
SELECT k.topic, k.key, k.partition_id, p.name AS partition, k."offset", k.created_at
FROM unnest($1::text[], $2::text[]) AS u(t, key)
JOIN idempotency_keys k ON k.topic = u.t AND k.key = u.key
JOIN partitions p ON p.id = k.partition_id
"""

DELETE_EXPIRED = """
DELETE FROM idempotency_keys
WHERE (topic, key) IN (
    SELECT topic, key FROM idempotency_keys
    WHERE expires_at <= clock_timestamp()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED)
"""

RELEASE = """
DELETE FROM idempotency_keys k USING unnest($1::text[], $2::text[]) AS u(t, key)
WHERE k.topic = u.t AND k.key = u.key
"""

DELETE_TOPIC_KEYS = "DELETE FROM idempotency_keys WHERE topic = $1"

COUNT_KEYS = "SELECT count(*) FROM idempotency_keys WHERE topic = $1"

#: The longest accepted idempotency key, in characters (a UUID is 36; a hash in hex 64).
MAX_KEY_LENGTH = 256

#: Where a keyed message landed: (partition id, partition name, offset, created_at).
Landing = tuple[int, str, int, datetime]


def validate_idempotency_key(key: object) -> str | None:
    """`key` unchanged if it can be an idempotency key (None: the publish has none)."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise ValidationError(
            f"idempotency_key must be a str or None, not {type(key).__name__}; "
            "pass a stable id of the message, e.g. str(order_id) or a UUID string"
        )
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise ValidationError(
            f"idempotency_key must be 1 to {MAX_KEY_LENGTH} characters long, got {len(key)}; "
            "pass a short stable id (hash a long one, e.g. hashlib.sha256(...).hexdigest())"
        )
    return key if key.isascii() and "\x00" not in key else utf8_text(key, "idempotency_key")


async def claim(
    conn: asyncpg.Connection | PoolConnectionProxy,
    topics: list[str],
    keys: list[str],
    windows: list[float | None],
    now: datetime | None = None,
) -> set[tuple[str, str]]:
    """Claim distinct (topic, key) pairs inside the caller's transaction; the pairs claimed (new or
    expired at `now`; None: the server's clock, which also starts the new windows)."""
    rows = await conn.fetch(CLAIM, topics, keys, windows, now)
    return {(r[0], r[1]) for r in rows}


async def fill(
    conn: asyncpg.Connection | PoolConnectionProxy,
    topics: list[str],
    keys: list[str],
    partition_ids: list[int],
    offsets: list[int],
    created: list[datetime],
) -> None:
    """Record where the claimed keys' messages landed (same transaction as the claim)."""
    await conn.execute(FILL, topics, keys, partition_ids, offsets, created)


async def lookup(
    conn: asyncpg.Connection | PoolConnectionProxy, topics: list[str], keys: list[str]
) -> dict[tuple[str, str], Landing]:
    """Where each already-written (topic, key) landed; keys missing from the answer are gone."""
    rows = await conn.fetch(LOOKUP, topics, keys)
    return {(r[0], r[1]): (int(r[2]), r[3], int(r[4]), r[5]) for r in rows}


async def release(conn: asyncpg.Connection | PoolConnectionProxy, topics: list[str], keys: list[str]) -> None:
    """Forget claimed keys whose message could not be written (same transaction as the claim)."""
    await conn.execute(RELEASE, topics, keys)


async def delete_topic_keys(conn: Conn, topic: str) -> None:
    """Forget every key of a topic (the topic is being deleted)."""
    await conn.execute(DELETE_TOPIC_KEYS, topic)


async def delete_expired(conn: Conn, batch: int = 10_000) -> int:
    """Delete up to `batch` keys whose dedupe window has passed; the number deleted."""
    status = await conn.execute(DELETE_EXPIRED, batch)
    return int(status.split()[-1])


async def count_keys(conn: Conn, topic: str) -> int:
    """How many keys the topic remembers (expired ones not yet cleaned included)."""
    return int(await conn.fetchval(COUNT_KEYS, topic))
