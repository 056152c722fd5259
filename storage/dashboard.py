"""Read-mostly statements for the web dashboard (`bus dashboard`).

Everything here reads the same tables the admin API reads, in one statement
per page section, so a dashboard refreshing every second costs a handful of
queries however many topics and groups there are. The only writes are the
dashboard's actions: replaying dead letters (deleting their job row in the
caller's transaction, which also publishes them again) and stopping or
starting a claims group.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
import msgspec

from storage import queues
from storage.db import Conn, Connection

# Per partition of every topic: bounds and stored size estimate (next_offset -
# log_start; compaction's holes make it an upper bound, the topic page counts exactly).
TOPIC_PARTITIONS = """
SELECT p.topic, p.name AS partition, p.log_start, p.log_end AS end_offset, p.created_at
FROM partitions p
ORDER BY p.topic, p.id
"""

# Per queue topic: jobs ready now, leased (in flight) and delayed (nacked with a delay).
# A job whose lease ran out counts as ready: the next take gets it.
QUEUE_COUNTS = """
SELECT t.name AS topic,
       count(j."offset") FILTER (WHERE j.visible_at <= clock_timestamp()) AS ready,
       count(j."offset") FILTER (WHERE j.visible_at > clock_timestamp() AND j.leased_by IS NOT NULL) AS in_flight,
       count(j."offset") FILTER (WHERE j.visible_at > clock_timestamp() AND j.leased_by IS NULL) AS delayed,
       min(j.visible_at) FILTER (WHERE j.visible_at > clock_timestamp() AND j.leased_by IS NULL) AS next_delayed
FROM topics t
LEFT JOIN queue_job_states j ON j.topic = t.name
WHERE t.semantics = 'queue'
GROUP BY t.name
ORDER BY t.name
"""

# The dead letters still waiting in a queue topic ($1 topic, $2 limit, $3 payload bytes shown), oldest
# first: jobs whose message carries the dead_letter.* headers a queue consumer adds.
DEAD_LETTERS = """
SELECT p.name AS partition, m."offset", m.key, m.headers::text AS headers,
       substring(m.payload FROM 1 FOR $3) AS payload, octet_length(m.payload) AS payload_bytes, m.created_at,
       j.leased_by IS NOT NULL AND j.visible_at > clock_timestamp() AS leased
FROM queue_job_states j
JOIN partitions p ON p.id = j.partition_id
JOIN messages m ON m.partition_id = j.partition_id AND m."offset" = j."offset"
WHERE j.topic = $1 AND m.headers ? 'dead_letter.topic'
ORDER BY m.created_at, j.partition_id, j."offset"
LIMIT $2
"""

# Take dead letters out of their queue for a replay, in the caller's transaction, after
# DETACH_FRESH (storage/queues.py) gave the queue's fresh jobs their own state:
# $1 dead-letter topic, $2 partition name (NULL: all), $3 offset (NULL: all), $4 limit.
# Jobs another consumer holds right now are skipped (SKIP LOCKED, live lease), so
# a replay never races a consumer draining the dead-letter queue.
TAKE_DEAD_LETTERS = """
WITH c AS (
    SELECT j.partition_id, j."offset"
    FROM queue_jobs j
    JOIN partitions p ON p.id = j.partition_id
    WHERE j.topic = $1
      AND ($2::text IS NULL OR p.name = $2::text)
      AND ($3::bigint IS NULL OR j."offset" = $3::bigint)
      -- queue_job_states' rule, spelled on j itself: the lock's recheck then sees a lease
      -- a take committed meanwhile (through the view it would read the statement's snapshot).
      AND CASE WHEN j.detached THEN j.leased_by IS NULL OR j.visible_at <= clock_timestamp()
               ELSE NOT EXISTS (SELECT 1 FROM queue_leases l
                                WHERE l.partition_id = j.partition_id
                                  AND j."offset" BETWEEN l.first_offset AND l.last_offset
                                  AND l.visible_at > clock_timestamp()) END
    ORDER BY j.partition_id, j."offset"
    LIMIT $4
    FOR UPDATE OF j SKIP LOCKED
), d AS (
    DELETE FROM queue_jobs j USING c
    WHERE j.partition_id = c.partition_id AND j."offset" = c."offset"
    RETURNING j.partition_id, j."offset"
)
SELECT p.name AS partition, m."offset", m.key, m.headers::text AS headers, m.payload
FROM d
JOIN messages m ON m.partition_id = d.partition_id AND m."offset" = d."offset"
JOIN partitions p ON p.id = d.partition_id
ORDER BY d.partition_id, d."offset"
"""

# Groups read with claims, with their lease and pending counts. A claims group
# never has member rows and never rebalances (generation 0); a consumer group
# whose members left keeps the generation it reached.
CLAIM_GROUPS = """
SELECT g.name, g.status, g.state, g.recorded_at, g.last_active_at,
       count(o.partition_id) AS partitions,
       count(o.partition_id) FILTER (WHERE o.lease_expires_at > clock_timestamp()) AS leased,
       count(o.partition_id) FILTER (WHERE o.pending_since IS NOT NULL) AS pending,
       min(o.pending_since) AS oldest_pending,
       COALESCE(sum(GREATEST(p.log_end - GREATEST(o.committed, p.log_start), 0)), 0)::bigint AS lag
FROM groups g
LEFT JOIN offsets o ON o.group_name = g.name
LEFT JOIN partitions p ON p.id = o.partition_id
WHERE g.generation = 0 AND NOT EXISTS (SELECT 1 FROM members m WHERE m.group_name = g.name)
GROUP BY g.name, g.status, g.state, g.recorded_at, g.last_active_at
ORDER BY g.name
"""

# One claims group's cursors with their leases ($1 group).
CLAIM_LEASES = """
SELECT p.topic, p.name AS partition, o.committed, p.log_end AS end_offset,
       GREATEST(p.log_end - GREATEST(o.committed, p.log_start), 0) AS lag,
       CASE WHEN o.lease_expires_at > clock_timestamp() THEN o.owner END AS owner,
       CASE WHEN o.lease_expires_at > clock_timestamp() THEN o.lease_expires_at END AS lease_expires_at,
       o.pending_since, o.committed_at
FROM offsets o
JOIN partitions p ON p.id = o.partition_id
WHERE o.group_name = $1
ORDER BY p.topic, p.id
"""

# Stop ($2 = 'stopped') or start ($2 = 'active') a group; dead and cancelled groups stay as they are.
SET_GROUP_STATUS = """
UPDATE groups SET status = $2, updated_at = clock_timestamp()
WHERE name = $1 AND status IN ('active', 'stopped')
RETURNING name
"""

# Every event-store group with its failure, retry and claim counts.
ES_GROUPS = """
SELECT g.store, g.name, g.status, g.error_context::text AS error_context, g.max_attempts, g.retry_backoff,
       g.updated_at,
       count(o.id) AS partitions,
       count(o.id) FILTER (WHERE o.claimed_by IS NOT NULL) AS claimed,
       count(o.id) FILTER (WHERE o.retry_at > clock_timestamp()) AS retrying,
       min(o.retry_at) FILTER (WHERE o.retry_at > clock_timestamp()) AS next_retry_at,
       COALESCE(max(o.attempts), 0) AS max_attempts_seen,
       (SELECT s.next_position - 1 FROM es_stores s WHERE s.name = g.store) AS last_position,
       COALESCE(min(o.position), 0) AS min_position
FROM es_groups g
LEFT JOIN es_offsets o ON o.store = g.store AND o.group_name = g.name
GROUP BY g.store, g.name, g.status, g.error_context, g.max_attempts, g.retry_backoff, g.updated_at
ORDER BY g.store, g.name
"""

# One event-store group's partitions that failed or wait for a retry ($1 store, $2 group, $3 limit).
ES_TROUBLED_PARTITIONS = """
SELECT partition_key, position, claimed_by, attempts, retry_at, last_error
FROM es_offsets
WHERE store = $1 AND group_name = $2 AND (attempts > 0 OR last_error IS NOT NULL OR claimed_by IS NOT NULL)
ORDER BY retry_at NULLS LAST, id
LIMIT $3
"""


class PartitionBounds(msgspec.Struct, frozen=True, gc=False):
    """A partition's log start and end offset."""

    topic: str
    partition: str
    log_start: int
    end_offset: int
    created_at: datetime


class QueueCounts(msgspec.Struct, frozen=True, gc=False):
    """A queue topic's job counts and when its next delayed job becomes visible."""

    topic: str
    ready: int
    in_flight: int
    delayed: int
    next_delayed: datetime | None


class DeadLetter(msgspec.Struct, frozen=True, gc=False):
    """A job waiting in a dead-letter topic; `payload` cut to a preview, `payload_bytes` its full size."""

    partition: str
    offset: int
    key: str | None
    headers: str | None  # JSON text
    payload: bytes | None
    payload_bytes: int | None
    created_at: datetime
    leased: bool


class TakenDeadLetter(msgspec.Struct, frozen=True, gc=False):
    """A dead letter taken out for replay: where it was and the message to publish again."""

    partition: str
    offset: int
    key: str | None
    headers: str | None  # JSON text
    payload: bytes | None


async def topic_partitions(conn: Conn) -> list[PartitionBounds]:
    """Every partition of every topic with its log start and end offset."""
    return [PartitionBounds(*r) for r in await conn.fetch(TOPIC_PARTITIONS)]


async def queue_counts(conn: Conn) -> list[QueueCounts]:
    """Per queue topic: ready, in-flight and delayed job counts."""
    return [QueueCounts(*r) for r in await conn.fetch(QUEUE_COUNTS)]


async def dead_letters(conn: Conn, topic: str, limit: int, payload_bytes: int) -> list[DeadLetter]:
    """The jobs still waiting in a dead-letter topic, payloads cut to `payload_bytes`."""
    return [DeadLetter(*r) for r in await conn.fetch(DEAD_LETTERS, topic, limit, payload_bytes)]


async def take_dead_letters(
    conn: Connection, topic: str, partition: str | None, offset: int | None, limit: int
) -> list[TakenDeadLetter]:
    """Delete dead-letter jobs (all, or the one at partition/offset) and return their messages (caller's transaction)."""
    await queues.detach_fresh(conn, topic)  # jobs a take may be reading as fresh are their own now
    return [TakenDeadLetter(*r) for r in await conn.fetch(TAKE_DEAD_LETTERS, topic, partition, offset, limit)]


async def claim_groups(conn: Conn) -> list[asyncpg.Record]:
    """Groups without members (read with claims) and their lease counts."""
    return list(await conn.fetch(CLAIM_GROUPS))


async def claim_leases(conn: Conn, group: str) -> list[asyncpg.Record]:
    """One claims group's cursors: committed, lag, live lease owner and expiry."""
    return list(await conn.fetch(CLAIM_LEASES, group))


async def set_group_status(conn: Conn, group: str, status: str) -> bool:
    """Stop or start a group; False when it does not exist or is dead/cancelled."""
    if status not in ("active", "stopped"):
        raise ValueError(f"status must be 'active' or 'stopped', got {status!r}")
    return await conn.fetchval(SET_GROUP_STATUS, group, status) is not None


async def es_groups(conn: Conn) -> list[asyncpg.Record]:
    """Every event-store group with status, error context and retry counts."""
    return list(await conn.fetch(ES_GROUPS))


async def es_troubled_partitions(conn: Conn, store: str, group: str, limit: int) -> list[asyncpg.Record]:
    """An event-store group's partitions that are claimed, failed, or waiting for a retry."""
    return list(await conn.fetch(ES_TROUBLED_PARTITIONS, store, group, limit))


# Each group's lag, once per 10-second bucket (another watcher that wrote the bucket already wins),
# for groups that still exist; $1 group names, $2 lags. Samples older than an hour go at the same time.
RECORD_LAG = """
WITH s AS (SELECT * FROM unnest($1::text[], $2::bigint[]) AS u(name, lag)),
ins AS (
    INSERT INTO lag_samples (group_name, bucket, lag)
    SELECT s.name, to_timestamp(floor(extract(epoch FROM clock_timestamp()) / 10) * 10), s.lag
    FROM s JOIN groups g ON g.name = s.name
    ON CONFLICT (group_name, bucket) DO NOTHING
    RETURNING 1
)
DELETE FROM lag_samples WHERE bucket < clock_timestamp() - interval '1 hour'
"""

# A group's lag samples of the last hour, oldest first: (unix time, lag).
LAG_HISTORY = """
SELECT extract(epoch FROM bucket)::float8 AS t, lag FROM lag_samples
WHERE group_name = $1 AND bucket >= clock_timestamp() - interval '1 hour'
ORDER BY bucket
"""


async def record_lag(conn: Conn, lags: dict[str, int]) -> None:
    """Keep each group's lag in this 10-second bucket (and forget samples older than an hour)."""
    await conn.execute(RECORD_LAG, list(lags), list(lags.values()))


async def lag_history(conn: Conn, group: str) -> list[tuple[float, int]]:
    """The group's kept lag samples of the last hour, oldest first."""
    return [(float(r["t"]), int(r["lag"])) for r in await conn.fetch(LAG_HISTORY, group)]
