"""Queue topics (`semantics="queue"`): one job row per unacked message.

Publishing to a queue topic appends to the log exactly like pubsub and, in the
same statement, inserts the message's job row (so a job exists if and only if
its message does). Consumers take jobs with FOR UPDATE SKIP LOCKED, which
pushes `visible_at` by the visibility timeout: a job nobody acks comes back by
itself. An ack deletes the row; every ack/nack is fenced by `lease_epoch`.

The hot path is one autocommit statement per take and one per ack batch: no
explicit transaction around either, because each statement is atomic on its
own (a crash between a take and its ack is what the visibility timeout is for).
"""

from __future__ import annotations

from datetime import datetime
from typing import cast

import msgspec

from storage.db import Conn

# One take statement serves every consumer of a Bus asking at the same time
# (the Bus coalesces them, see bus/queues.py): $4 lists the consumers, $2 how
# many jobs each wants, $5 their sum. The free jobs are leased in visibility
# order and dealt out in the order the consumers asked, each up to its share;
# `request` (1-based) says which of the requests a row went to.
#
# A take commits without waiting for its WAL flush (synchronous_commit off for
# this statement's transaction only): a lease is soft state. If PostgreSQL
# crashes before the flush, the leases of the last moment are forgotten and
# those jobs are simply delivered again, as any job whose consumer vanished;
# nothing acked or published is affected (acks and publishes still wait for
# their flush). Set in `r`, which always runs before any job is leased.
_TAKE_HEAD = """
WITH r AS (
    SELECT x.ord AS request, x.consumer, sum(x.n) OVER (ORDER BY x.ord) - x.n AS after,
           sum(x.n) OVER (ORDER BY x.ord) AS upto,
           set_config('synchronous_commit', 'off', true) AS soft
    FROM unnest($4::text[], $2::int[]) WITH ORDINALITY AS x(consumer, n, ord)
), c AS (
"""

# The lease part shared by both takes: a job taken again after its lease ran
# out records that in its error history.
_TAKE_TAIL = """
), k AS (
    SELECT n.partition_id, n."offset", r.consumer, r.request
    FROM (SELECT c.partition_id, c."offset",
                 row_number() OVER (ORDER BY c.visible_at, c.partition_id, c."offset") AS rn
          FROM c) AS n
    JOIN r ON n.rn > r.after AND n.rn <= r.upto
), u AS (
    UPDATE queue_jobs j
    SET attempts = j.attempts + 1, lease_epoch = j.lease_epoch + 1, leased_by = k.consumer,
        visible_at = clock_timestamp() + make_interval(secs => $3),
        errors = CASE WHEN j.leased_by IS NULL THEN j.errors
                      ELSE COALESCE(j.errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                          'attempt', j.attempts, 'error', 'visibility timeout expired',
                          'at', clock_timestamp())) END
    FROM k WHERE j.partition_id = k.partition_id AND j."offset" = k."offset"
    RETURNING j.partition_id, j."offset", j.attempts, j.lease_epoch, k.request
)
SELECT u.request, u.partition_id, u."offset", u.attempts, u.lease_epoch,
       m.key, m.headers::text AS headers, m.payload, m.created_at
FROM u
JOIN messages m ON m.partition_id = u.partition_id AND m."offset" = u."offset"
ORDER BY m.created_at, u.partition_id, u."offset"
"""

# $1 topic, $2 jobs per consumer (int[]), $3 visibility timeout (s), $4 consumer ids (text[]), $5 sum of $2
TAKE = (
    _TAKE_HEAD
    + """
    SELECT partition_id, "offset", visible_at FROM queue_jobs
    WHERE topic = $1 AND visible_at <= statement_timestamp()
    ORDER BY visible_at
    LIMIT $5
    FOR UPDATE SKIP LOCKED
"""
    + _TAKE_TAIL
)

# ordered_by_key: only a key's earliest remaining job is eligible, so a key
# never has two jobs out at once (a leased or delayed job blocks the next one)
# and each key is worked in order.
TAKE_ORDERED = (
    _TAKE_HEAD
    + """
    SELECT j.partition_id, j."offset", j.visible_at FROM queue_jobs j
    WHERE j.topic = $1 AND j.visible_at <= statement_timestamp()
      AND (j.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM queue_jobs e
            WHERE e.topic = j.topic AND e.key = j.key
              AND (e.partition_id, e."offset") < (j.partition_id, j."offset")))
    ORDER BY j.visible_at
    LIMIT $5
    FOR UPDATE SKIP LOCKED
"""
    + _TAKE_TAIL
)

ACK = """
DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING "offset"
"""

# The ANY conditions make each job an index probe (the primary key); joined
# with the list alone the planner may hash it against a scan of every job.
ACK_MANY = """
DELETE FROM queue_jobs j
WHERE j.partition_id = ANY($1::bigint[]) AND j."offset" = ANY($2::bigint[])
  AND EXISTS (SELECT 1 FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS a(pid, off, epoch)
              WHERE j.partition_id = a.pid AND j."offset" = a.off AND j.lease_epoch = a.epoch)
RETURNING j.partition_id, j."offset"
"""

# $4 delay seconds, $5 error text
NACK = """
UPDATE queue_jobs
SET visible_at = clock_timestamp() + make_interval(secs => $4), leased_by = NULL,
    errors = COALESCE(errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
        'attempt', attempts, 'error', $5::text, 'at', clock_timestamp()))
WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING attempts
"""

# A consumer closing gives its jobs back at once, without counting the attempt.
RETURN_UNACKED = """
UPDATE queue_jobs j
SET visible_at = clock_timestamp(), leased_by = NULL, attempts = GREATEST(j.attempts - 1, 0)
FROM unnest($1::bigint[], $2::bigint[], $3::bigint[]) AS a(pid, off, epoch)
WHERE j.partition_id = a.pid AND j."offset" = a.off AND j.lease_epoch = a.epoch
"""

# Dead-lettering removes the job (fenced); the DLQ message is published in the same transaction.
DELETE_JOB = """
DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING errors::text AS errors
"""

# The partitions of a queue topic: their ids are the NOTIFY payloads a
# consumer waits for, their names label the messages it takes.
PARTITIONS = "SELECT id, name FROM partitions WHERE topic = $1"

# Seconds until the topic's next job becomes visible (a nacked job's delay or
# a lease running out; <= 0: one is visible already), NULL when there is none.
# Nobody sends a NOTIFY for those moments, so an idle consumer sleeps until then.
SECONDS_UNTIL_VISIBLE = """
SELECT EXTRACT(EPOCH FROM min(visible_at) - clock_timestamp())::float8 FROM queue_jobs WHERE topic = $1
"""


class TakenJob(msgspec.Struct, frozen=True, gc=False):
    """One job a take leased: the message, its lease and which request of the take it went to (from 1)."""

    request: int
    partition_id: int
    offset: int
    attempts: int
    lease_epoch: int
    key: str | None
    headers: str | None  # the message's header object as JSON text
    payload: bytes | None
    created_at: datetime


class RemovedJob(msgspec.Struct, frozen=True, gc=False):
    """A job `delete_job` removed: its error history as JSON text (None: no errors recorded)."""

    errors: str | None


async def take(
    conn: Conn, topic: str, limit: int, visibility_timeout: float, consumer: str, *, ordered: bool
) -> list[TakenJob]:
    """Lease up to `limit` free jobs of `topic` to `consumer` (one statement; autocommit on a pool)."""
    return await take_for(conn, topic, [consumer], [limit], visibility_timeout, ordered=ordered)


async def take_for(
    conn: Conn,
    topic: str,
    consumers: list[str],
    limits: list[int],
    visibility_timeout: float,
    *,
    ordered: bool,
) -> list[TakenJob]:
    """Lease free jobs of `topic` to several takers at once, each up to its limit; `request` numbers them from 1."""
    statement = TAKE_ORDERED if ordered else TAKE
    rows = await conn.fetch(statement, topic, limits, visibility_timeout, consumers, sum(limits))
    return [TakenJob(*row) for row in rows]


async def partitions(conn: Conn, topic: str) -> dict[int, str]:
    """partition id -> partition name of `topic`."""
    return {r[0]: r[1] for r in await conn.fetch(PARTITIONS, topic)}


async def seconds_until_visible(conn: Conn, topic: str) -> float | None:
    """Seconds until the next job of `topic` is free to take (<= 0: now); None when it has no jobs."""
    value = await conn.fetchval(SECONDS_UNTIL_VISIBLE, topic)
    return None if value is None else float(value)


async def ack(conn: Conn, partition_id: int, offset: int, epoch: int) -> bool:
    """Delete the job if this lease still holds it."""
    return await conn.fetchval(ACK, partition_id, offset, epoch) is not None


async def ack_many(conn: Conn, jobs: list[tuple[int, int, int]]) -> set[tuple[int, int]]:
    """Delete the jobs (partition_id, offset, epoch) still held by these leases; those deleted."""
    rows = await conn.fetch(ACK_MANY, [j[0] for j in jobs], [j[1] for j in jobs], [j[2] for j in jobs])
    return {(r[0], r[1]) for r in rows}


async def nack(conn: Conn, partition_id: int, offset: int, epoch: int, delay: float, error: str) -> bool:
    """Put the job back after `delay`, recording `error`; False if the lease was lost."""
    return await conn.fetchval(NACK, partition_id, offset, epoch, delay, error) is not None


async def return_unacked(conn: Conn, jobs: list[tuple[int, int, int]]) -> None:
    """Give jobs back immediately (consumer closing)."""
    await conn.execute(RETURN_UNACKED, [j[0] for j in jobs], [j[1] for j in jobs], [j[2] for j in jobs])


async def delete_job(conn: Conn, partition_id: int, offset: int, epoch: int) -> RemovedJob | None:
    """Remove the job for dead-lettering; None if the lease was lost."""
    row = await conn.fetchrow(DELETE_JOB, partition_id, offset, epoch)
    return None if row is None else RemovedJob(cast("str | None", row["errors"]))
