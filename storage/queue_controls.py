"""Queue settings shared by every process, cancels and job results (migration 014).

`queue_settings` holds one row per queue that has any: paused, the per-key
and rate limits the take statements read (storage/queues.py), how long job
results are kept. `queue_results` says what became of a job that is no longer
there: acked with a result, dead-lettered, or cancelled; each is announced on
the results channel with the payload "<partition id>:<offset>".
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

from storage.db import Conn, Connection

# $1 topic, $2 paused (NULL: keep), $3 set the limits (bool), $4 max_in_flight_per_key,
# $5 rate_limit, $6 rate_per, $7 result_ttl (NULL: keep), $8 fair (NULL: keep; migration 031).
UPSERT = """
INSERT INTO queue_settings (topic, paused, max_in_flight_per_key, rate_limit, rate_per, result_ttl, fair)
VALUES ($1, COALESCE($2, false), $4, $5, $6, COALESCE($7, 86400), COALESCE($8, false))
ON CONFLICT (topic) DO UPDATE SET
    fair = COALESCE($8, queue_settings.fair),
    paused = COALESCE($2, queue_settings.paused),
    max_in_flight_per_key = CASE WHEN $3 THEN $4 ELSE queue_settings.max_in_flight_per_key END,
    rate_limit = CASE WHEN $3 THEN $5 ELSE queue_settings.rate_limit END,
    rate_per = CASE WHEN $3 THEN $6 ELSE queue_settings.rate_per END,
    result_ttl = COALESCE($7, queue_settings.result_ttl)
RETURNING topic
"""

GET = """
SELECT paused, max_in_flight_per_key, rate_limit, rate_per, result_ttl, fair FROM queue_settings WHERE topic = $1
"""

# Wake every consumer of the topic (a resume): one NOTIFY per partition.
ANNOUNCE_TOPIC = "SELECT count(pg_notify($2, id::text)) FROM partitions WHERE topic = $1"

PARTITION_ID = "SELECT id FROM partitions WHERE topic = $1 AND name = $2"

# A cancel runs in a transaction: the partition's frontier locked first (as a
# take of fresh jobs locks it), then the job's row. A job nobody holds is
# deleted; a taken one keeps its lease (its ack still works) and is marked
# cancelled, so nothing takes it again.
LOCK_FRONTIER = "SELECT next_offset FROM queue_frontiers WHERE partition_id = $1 FOR UPDATE"

# $3: the time leases are judged by (NULL: the server's clock; a test's Clock moves it).
JOB_STATE = """
SELECT j.detached, j.leased_by, j.visible_at > COALESCE($3::timestamptz, clock_timestamp()) AS held_own, j.errors::text AS errors,
       l.leased_by AS range_by, l.visible_at AS range_until
FROM queue_jobs j
LEFT JOIN LATERAL (
    SELECT l.leased_by, l.visible_at FROM queue_leases l
    WHERE NOT j.detached AND l.partition_id = j.partition_id
      AND l.first_offset <= j."offset" AND l.last_offset >= j."offset"
      AND l.visible_at > COALESCE($3::timestamptz, clock_timestamp())
    ORDER BY l.first_offset DESC
    LIMIT 1
) AS l ON true
WHERE j.partition_id = $1 AND j."offset" = $2
FOR UPDATE OF j
"""

DELETE_JOB = 'DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2'

MARK_CANCELLED = """
UPDATE queue_jobs
SET cancelled = true, detached = true, attempts = GREATEST(attempts, 1),
    leased_by = COALESCE($3, leased_by), visible_at = COALESCE($4, visible_at)
WHERE partition_id = $1 AND "offset" = $2
"""

# $1 partition id, $2 offset, $3 topic, $4 status, $5 result (JSON text), $6 errors (JSON text),
# $7 the results channel, $8 now (NULL: the server's clock; the result_ttl runs from it). An earlier
# outcome (a cancel) is kept.
RECORD = """
WITH r AS (
    INSERT INTO queue_results (partition_id, "offset", topic, status, result, errors, expires_at)
    SELECT $1, $2, $3, $4, $5::text::jsonb, $6::text::jsonb,
           COALESCE($8::timestamptz, clock_timestamp()) + make_interval(secs => COALESCE(
               (SELECT result_ttl FROM queue_settings WHERE topic = $3), 86400))
    ON CONFLICT (partition_id, "offset") DO NOTHING
    RETURNING 1
)
SELECT pg_notify($7, $1::text || ':' || $2::text)
"""

# The ack of one job with its result, fenced like every ack; $6 now (NULL: the server's clock).
ACK_WITH_RESULT = """
WITH d AS (
    DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
    RETURNING partition_id, "offset", topic
), r AS (
    INSERT INTO queue_results (partition_id, "offset", topic, status, result, expires_at)
    SELECT d.partition_id, d."offset", d.topic, 'done', $4::text::jsonb,
           COALESCE($6::timestamptz, clock_timestamp()) + make_interval(secs => COALESCE(
               (SELECT result_ttl FROM queue_settings WHERE topic = d.topic), 86400))
    FROM d
    ON CONFLICT (partition_id, "offset") DO NOTHING
)
SELECT d."offset", pg_notify($5, d.partition_id::text || ':' || d."offset"::text) FROM d
"""

# What a job_result waits on: the outcome (if any, and not expired at $3 now, NULL: the server's
# clock) and whether the job is still there.
OUTCOME = """
SELECT r.status, r.result::text AS result, r.errors::text AS errors,
       EXISTS (SELECT 1 FROM queue_jobs j WHERE j.partition_id = $1 AND j."offset" = $2) AS pending
FROM (SELECT 1) AS one
LEFT JOIN queue_results r ON r.partition_id = $1 AND r."offset" = $2
    AND r.expires_at > COALESCE($3::timestamptz, clock_timestamp())
"""

# $1 how many at most, $2 now (NULL: the server's clock).
EXPIRE = """
DELETE FROM queue_results WHERE ctid IN (
    SELECT ctid FROM queue_results WHERE expires_at <= COALESCE($2::timestamptz, clock_timestamp()) LIMIT $1)
"""


async def upsert(
    conn: Conn,
    topic: str,
    *,
    paused: bool | None = None,
    limits: tuple[int | None, int | None, float | None] | None = None,
    result_ttl: float | None = None,
    fair: bool | None = None,
) -> None:
    """Set what is given of a queue's settings (`limits`: max_in_flight_per_key, rate_limit, rate_per)."""
    per_key, rate, per = limits if limits is not None else (None, None, None)
    await conn.fetchval(UPSERT, topic, paused, limits is not None, per_key, rate, per, result_ttl, fair)


async def get(conn: Conn, topic: str) -> asyncpg.Record | None:
    return await conn.fetchrow(GET, topic)


async def announce_topic(conn: Conn, topic: str, channel: str) -> None:
    await conn.fetchval(ANNOUNCE_TOPIC, topic, channel)


async def partition_id(conn: Conn, topic: str, partition: str) -> int | None:
    value = await conn.fetchval(PARTITION_ID, topic, partition)
    return None if value is None else int(value)


async def cancel(
    conn: Connection, topic: str, pid: int, offset: int, channel: str, now: datetime | None = None
) -> bool:
    """Cancel a job (inside the caller's transaction): False when it is no longer there.

    A job whose lease has not run out at `now` (None: the server's clock) keeps it.
    """
    await conn.fetchval(LOCK_FRONTIER, pid)
    row = await conn.fetchrow(JOB_STATE, pid, offset, now)
    if row is None:
        return False
    if row["detached"]:
        held = row["leased_by"] is not None and row["held_own"]
    else:
        held = row["range_by"] is not None
    if held:
        await conn.execute(MARK_CANCELLED, pid, offset, row["range_by"], row["range_until"])
    else:
        await conn.execute(DELETE_JOB, pid, offset)
    await conn.fetchval(RECORD, pid, offset, topic, "cancelled", None, row["errors"], channel, now)
    return True


async def record(
    conn: Conn,
    pid: int,
    offset: int,
    topic: str,
    status: str,
    result: str | None,
    errors: str | None,
    channel: str,
    now: datetime | None = None,
) -> None:
    """Keep a job's outcome for its topic's result_ttl from `now` (None: the server's clock) and announce it."""
    await conn.fetchval(RECORD, pid, offset, topic, status, result, errors, channel, now)


async def ack_with_result(
    conn: Conn, pid: int, offset: int, epoch: int, result: str, channel: str, now: datetime | None = None
) -> bool:
    """Ack the job if this lease still holds it, keeping `result` (JSON text) for the result_ttl from
    `now` (None: the server's clock); False if the lease was lost."""
    return await conn.fetchval(ACK_WITH_RESULT, pid, offset, epoch, result, channel, now) is not None


async def outcome(conn: Conn, pid: int, offset: int, now: datetime | None = None) -> Any:
    """(status, result JSON, errors JSON, pending) of a job; status None while there is no outcome
    (or it expired before `now`, None: the server's clock)."""
    return await conn.fetchrow(OUTCOME, pid, offset, now)


async def expire(conn: Conn, limit: int = 1000, now: datetime | None = None) -> None:
    """Forget results past their result_ttl at `now` (None: the server's clock)."""
    await conn.execute(EXPIRE, limit, now)
