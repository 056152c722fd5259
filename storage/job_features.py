"""Job features of queue topics (migration 031): unique jobs, progress, job status, groups of jobs.

- Unique jobs: `queue_unique` holds the newest job published under each
  (topic, unique key). A unique publish runs in one transaction that first
  takes an advisory lock of the pair (UNIQUE_LOCK), so publishes of the same
  key in every process run one at a time and each sees what the previous one
  committed: the job found (UNIQUE_FIND) is returned and nothing is added.
- Progress: kept in the job's row (`progress`) and renewing its lease in the
  same statement (PROGRESS, fenced by the lease epoch like an ack).
- Status: the job's row, its range lease and its outcome, read together (STATUS).
- Groups: `queue_groups` counts a group's jobs not yet removed; a statement
  trigger on `queue_jobs` deletes counts them down and publishes the
  callback in the transaction that removes the last one (migration 031).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.db import Conn

# One lock per (schema, topic, unique key), held until the publishing transaction ends.
UNIQUE_LOCK = """
SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.' || $1), hashtext($2))
"""

# The job that holds the unique key: still there (waiting or running), or published less than
# $4 seconds before $3 (NULL: the server's clock).
UNIQUE_FIND = """
SELECT p.name AS partition, u."offset", COALESCE(m.created_at, u.published_at) AS created_at
FROM queue_unique u
JOIN partitions p ON p.id = u.partition_id
LEFT JOIN messages m ON m.partition_id = u.partition_id AND m."offset" = u."offset"
WHERE u.topic = $1 AND u.unique_key = $2
  AND (EXISTS (SELECT 1 FROM queue_jobs j WHERE j.partition_id = u.partition_id AND j."offset" = u."offset")
       OR u.published_at > COALESCE($3::timestamptz, clock_timestamp()) - make_interval(secs => $4))
"""

# The job now holding the unique key ($3 its partition's name, $4 its offset, $5 now).
UNIQUE_RECORD = """
INSERT INTO queue_unique (topic, unique_key, partition_id, "offset", published_at)
SELECT $1, $2, p.id, $4, COALESCE($5::timestamptz, clock_timestamp())
FROM partitions p WHERE p.topic = $1 AND p.name = $3
ON CONFLICT (topic, unique_key) DO UPDATE
SET partition_id = EXCLUDED.partition_id, "offset" = EXCLUDED."offset", published_at = EXCLUDED.published_at
"""

# Progress of a taken job, fenced by its lease epoch ($3); renews its lease to $6 seconds from $7
# (NULL: the server's clock), held by consumer $5. A job of a range lease gets its own state here
# (as a nack gives it: its attempt, the first, recorded in the row), so its lease is its own.
PROGRESS = """
UPDATE queue_jobs
SET progress = $4::text::jsonb, progress_at = COALESCE($7::timestamptz, clock_timestamp()),
    detached = true, attempts = GREATEST(attempts, 1), leased_by = COALESCE(leased_by, $5),
    visible_at = COALESCE($7::timestamptz, clock_timestamp()) + make_interval(secs => $6)
WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING "offset"
"""

# What became of a job ($3 now, NULL: the server's clock): its row (state, attempts, progress,
# errors), its range lease if it is in one, and its outcome once it is gone.
STATUS = """
SELECT j."offset" IS NOT NULL AS present, j.detached, j.cancelled,
       j.visible_at > COALESCE($3::timestamptz, clock_timestamp()) AS later,
       j.leased_by IS NOT NULL AS leased, j.attempts, j.progress::text AS progress, j.progress_at,
       j.errors::text AS job_errors,
       (SELECT true FROM queue_leases l
        WHERE NOT j.detached AND l.partition_id = j.partition_id
          AND l.first_offset <= j."offset" AND l.last_offset >= j."offset"
          AND l.visible_at > COALESCE($3::timestamptz, clock_timestamp())
        LIMIT 1) AS range_leased,
       (SELECT f.frontier > j."offset" FROM queue_frontiers f WHERE f.partition_id = j.partition_id) AS passed,
       r.status, r.result::text AS result, r.errors::text AS errors
FROM (SELECT 1) AS one
LEFT JOIN queue_jobs j ON j.partition_id = $1 AND j."offset" = $2
LEFT JOIN queue_results r ON r.partition_id = $1 AND r."offset" = $2
    AND r.expires_at > COALESCE($3::timestamptz, clock_timestamp())
"""

# A group of jobs and its callback ($2 how many jobs; $3.. the callback); its id.
GROUP_CREATE = """
INSERT INTO queue_groups (topic, remaining, callback_topic, callback_payload, callback_key, callback_headers)
VALUES ($1, $2, $3, $4::text::jsonb, $5, $6::text::jsonb)
RETURNING id
"""

# The group's jobs, by their partitions' names ($2) and offsets ($3) on topic $1.
GROUP_JOBS = """
INSERT INTO queue_group_jobs (partition_id, "offset", group_id)
SELECT p.id, x.off, $4
FROM unnest($2::text[], $3::bigint[]) AS x(name, off)
JOIN partitions p ON p.topic = $1 AND p.name = x.name
"""

GROUP_STATE = "SELECT remaining, completed_at FROM queue_groups WHERE id = $1"


async def lock_unique(conn: Conn, topic: str, key: str) -> None:
    """Hold the unique key's lock until the caller's transaction ends."""
    await conn.fetchval(UNIQUE_LOCK, topic, key)


async def find_unique(
    conn: Conn, topic: str, key: str, period: float, now: datetime | None
) -> asyncpg.Record | None:
    """(partition, offset, created_at) of the job holding the unique key, or None."""
    return await conn.fetchrow(UNIQUE_FIND, topic, key, now, period)


async def record_unique(
    conn: Conn, topic: str, key: str, partition: str, offset: int, now: datetime | None
) -> None:
    """The job now holding the unique key."""
    await conn.execute(UNIQUE_RECORD, topic, key, partition, offset, now)


class ProgressParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A job's progress, reported by the consumer holding its lease at `epoch`."""

    partition_id: int
    offset: int
    epoch: int
    #: The progress as JSON text.
    data: str
    consumer: str
    #: The renewed lease runs this many seconds from `now`.
    visibility_timeout: float
    #: None: the server's clock.
    now: datetime | None = None


async def progress(conn: Conn, params: ProgressParams) -> bool:
    """Keep the job's progress and renew its lease; False if the lease was lost."""
    p = params
    row = await conn.fetchval(
        PROGRESS, p.partition_id, p.offset, p.epoch, p.data, p.consumer, p.visibility_timeout, p.now
    )
    return row is not None


async def status(conn: Conn, partition_id: int, offset: int, now: datetime | None) -> Any:
    """The row STATUS reads for one job."""
    return await conn.fetchrow(STATUS, partition_id, offset, now)


async def create_group(
    conn: Conn,
    topic: str,
    partitions: list[str],
    offsets: list[int],
    callback: tuple[str, str, str | None, str | None],
) -> int:
    """A group of the jobs (`partitions[i]`, `offsets[i]`) of `topic`, with its callback
    (topic, payload JSON, key, headers JSON); its id. In the publishing transaction."""
    group_id = int(await conn.fetchval(GROUP_CREATE, topic, len(offsets), *callback))
    await conn.execute(GROUP_JOBS, topic, partitions, offsets, group_id)
    return group_id


async def group_state(conn: Conn, group_id: int) -> asyncpg.Record | None:
    """(remaining, completed_at) of a group."""
    return await conn.fetchrow(GROUP_STATE, group_id)
