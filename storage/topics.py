"""Topics and their partitions."""

from __future__ import annotations

import asyncpg
import msgspec
from asyncpg.pool import PoolConnectionProxy

from storage import idempotency

TOPIC_COLUMNS = (
    "name, partitions, semantics, cleanup, retention_seconds, tombstone_retention_seconds, "
    "namespace, task, max_message_bytes, created_at, dedupe_window_seconds"
)

INSERT_TOPIC = """
INSERT INTO topics (name, partitions, semantics, cleanup, retention_seconds,
                    tombstone_retention_seconds, namespace, task, max_message_bytes,
                    dedupe_window_seconds)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (name) DO NOTHING
RETURNING name
"""

INSERT_FIXED_PARTITIONS = """
INSERT INTO partitions (topic, name)
SELECT $1, g::text FROM generate_series(0, $2 - 1) AS g
ON CONFLICT (topic, name) DO NOTHING
"""

SELECT_TOPIC = """
SELECT name, partitions, semantics, cleanup, retention_seconds, tombstone_retention_seconds,
       namespace, task, max_message_bytes, created_at, dedupe_window_seconds
FROM topics WHERE name = $1
"""

SELECT_TOPICS = """
SELECT name, partitions, semantics, cleanup, retention_seconds, tombstone_retention_seconds,
       namespace, task, max_message_bytes, created_at, dedupe_window_seconds
FROM topics
WHERE ($1::text IS NULL OR namespace = $1) AND ($2::text IS NULL OR task = $2)
ORDER BY name
"""

DELETE_TOPIC_MESSAGES = """
DELETE FROM messages WHERE partition_id IN (SELECT id FROM partitions WHERE topic = $1)
"""

DELETE_TOPIC = "DELETE FROM topics WHERE name = $1 RETURNING name"

# A deletion first locks the heads of the topic's partitions, in partition id order as a
# publish moves them: a publish that moved a head finishes (its insert's key check of the
# partition row comes after its head move) before the deletion takes the partition rows, and
# a publish that had not moved one waits for the deletion and finds the topic gone. Without
# it the two could each wait on the other (a head, a partition row) until the server's
# deadlock check aborted one.
LOCK_TOPIC_HEADS = """
SELECT h.partition_id FROM log_heads h
WHERE h.partition_id IN (SELECT p.id FROM partitions p WHERE p.topic = $1)
ORDER BY h.partition_id, h.generation
FOR UPDATE OF h
"""

ENSURE_PARTITION = """
WITH ins AS (
    INSERT INTO partitions (topic, name) VALUES ($1, $2)
    ON CONFLICT (topic, name) DO NOTHING
    RETURNING id
)
SELECT id FROM ins
UNION ALL
SELECT id FROM partitions WHERE topic = $1 AND name = $2
LIMIT 1
"""

SELECT_PARTITION_ID = "SELECT id FROM partitions WHERE topic = $1 AND name = $2"

SELECT_PARTITIONS = """
SELECT p.id, p.name, p.log_start, p.log_end AS next_offset, p.created_at FROM partitions p WHERE p.topic = $1 ORDER BY p.id
"""

NOTIFY = "SELECT pg_notify($1, $2)"


class CreateTopicParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A topic's row, validated by the caller; durations in seconds, None: for ever."""

    name: str
    #: Fixed partitions "0".."n-1" made with the topic; None: dynamic named partitions, made on first use.
    partitions: int | None
    semantics: str
    cleanup: str
    retention_seconds: float | None
    tombstone_retention_seconds: float | None
    namespace: str | None
    task: str | None
    max_message_bytes: int
    dedupe_window_seconds: float | None


async def create_topic(
    conn: asyncpg.Connection | PoolConnectionProxy, params: CreateTopicParams, channel: str
) -> bool:
    """Insert the topic (and its fixed partitions); False if the name was taken."""
    p = params
    async with conn.transaction():
        created = await conn.fetchval(
            INSERT_TOPIC,
            p.name,
            p.partitions,
            p.semantics,
            p.cleanup,
            p.retention_seconds,
            p.tombstone_retention_seconds,
            p.namespace,
            p.task,
            p.max_message_bytes,
            p.dedupe_window_seconds,
        )
        if created is None:
            return False
        if p.partitions:
            await conn.execute(INSERT_FIXED_PARTITIONS, p.name, p.partitions)
        # Wildcard subscribers (namespace/task) learn of new topics from this.
        await conn.execute(NOTIFY, channel, p.name)
    return True


async def get_topic(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, name: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(SELECT_TOPIC, name)


async def list_topics(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, namespace: str | None, task: str | None
) -> list[asyncpg.Record]:
    return list(await conn.fetch(SELECT_TOPICS, namespace, task))


async def delete_topic(conn: asyncpg.Connection | PoolConnectionProxy, name: str) -> bool:
    async with conn.transaction():
        await conn.execute(LOCK_TOPIC_HEADS, name)
        await conn.execute(DELETE_TOPIC_MESSAGES, name)
        await idempotency.delete_topic_keys(conn, name)
        return await conn.fetchval(DELETE_TOPIC, name) is not None


async def ensure_partition(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, topic: str, name: str
) -> int:
    """The id of partition `name` of a dynamic topic, created on first use."""
    pid = await conn.fetchval(ENSURE_PARTITION, topic, name)
    assert pid is not None
    return int(pid)


async def partition_id(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, topic: str, name: str
) -> int | None:
    pid = await conn.fetchval(SELECT_PARTITION_ID, topic, name)
    return None if pid is None else int(pid)


async def partitions(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, topic: str
) -> list[asyncpg.Record]:
    return list(await conn.fetch(SELECT_PARTITIONS, topic))


TOPIC_STATS = """
SELECT p.name AS partition, p.log_start, p.log_end AS end_offset,
       (SELECT count(*) FROM messages m WHERE m.partition_id = p.id AND m."offset" >= p.log_start) AS size,
       (SELECT m.created_at FROM messages m WHERE m.partition_id = p.id AND m."offset" >= p.log_start
        ORDER BY m."offset" LIMIT 1) AS oldest,
       (SELECT m.created_at FROM messages m WHERE m.partition_id = p.id ORDER BY m."offset" DESC LIMIT 1) AS newest
FROM partitions p WHERE p.topic = $1 ORDER BY p.id
"""


async def topic_stats(
    conn: asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy, topic: str
) -> list[asyncpg.Record]:
    """Per partition: log start, end offset, stored message count, oldest and newest timestamps."""
    return list(await conn.fetch(TOPIC_STATS, topic))
