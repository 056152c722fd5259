"""Queue topics (`semantics="queue"`): one job row per unacked message.

Publishing to a queue topic appends to the log exactly like pubsub and, in the
same statement, inserts the message's job row (so a job exists if and only if
its message does and is not acked). Fresh jobs are leased by range: a take
moves its partition's frontier (`queue_frontiers`) past the jobs it gets and
writes one `queue_leases` row per run, without touching the job rows. Jobs
that were nacked, given back, or whose range lease ran out are `detached`:
their own row says their lease (`visible_at` pushed by the visibility
timeout, taken with FOR UPDATE SKIP LOCKED), as every job's did before
migration 013. A job nobody acks comes back by itself either way. An ack
deletes the row; every ack/nack is fenced by `lease_epoch` (0 in a range lease).

The hot path is one autocommit statement per take and one per ack batch: no
explicit transaction around either, because each statement is atomic on its
own (a crash between a take and its ack is what the visibility timeout is for).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection
from typing import TypeAlias, cast

import asyncpg
import msgspec

from storage import db
from storage.db import Conn

# Where each take statement starts looking for fresh jobs (see TAKE).
_turns = itertools.count(random.randrange(1 << 20))

# One take statement serves every consumer of a Bus asking at the same time
# (the Bus coalesces them, see bus/queues.py): $4 lists the consumers, $2 how
# many jobs each wants, $5 their sum. Jobs come from two places, in this
# order: detached jobs that are free (their own visible_at has passed: nacked,
# given back, or their range lease ran out), leased one row at a time as
# before; then fresh jobs, leased by range: the statement locks the frontiers
# of as many partitions as it needs (in id order, starting from a partition
# picked by $6 so that side-by-side takes spread over partitions), moves them
# past what it takes, and inserts one `queue_leases` row per run of offsets a
# taker got from a partition, without writing the jobs' rows. (The jobs from a
# frontier up to its partition's end are all there and fresh: only a take,
# which moves the frontier first, or DETACH_FRESH, which moves it past them,
# removes or detaches one; so a take reads the next n offsets, not the backlog.)
# The jobs are dealt out in the order the consumers asked, each up to its
# share; `request` (1-based) says which of the requests a row went to,
# `lease_id` which range lease holds it (NULL: the job's own lease, fenced by
# `lease_epoch`).
#
# Range leases that ran out are reclaimed first: their jobs not yet acked are
# detached, still leased to the old taker until the lease's end, so the take
# that gets them records the expiry in their history, exactly as a job whose
# own lease ran out. A reclaimed job is free for the next statement, not this
# one (one snapshot). So is a frontier another take moved while this one
# waited for its lock: a statement that reclaimed jobs, or that got fewer
# jobs than asked while partitions it did not lock had fresh ones, ends with
# a marker row (request 0, `again`), and the unfilled requests are sent again.
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
), x AS (
    SELECT l.id, l.partition_id, l.first_offset, l.last_offset, l.leased_by, l.visible_at
    FROM queue_leases l
    WHERE l.topic = $1 AND l.visible_at <= statement_timestamp()
    ORDER BY l.visible_at
    LIMIT 16
    FOR UPDATE SKIP LOCKED
), xd AS (
    DELETE FROM queue_leases l USING x WHERE l.id = x.id
), xj AS (
    UPDATE queue_jobs j
    SET detached = true, attempts = 1, leased_by = x.leased_by, visible_at = x.visible_at
    FROM x
    WHERE j.partition_id = x.partition_id AND j."offset" BETWEEN x.first_offset AND x.last_offset
      AND NOT j.detached
    RETURNING j."offset"
), c AS (
"""

# Shared by both takes: the candidates `n` (numbered `rn`) dealt out to the
# requests, and the per-row lease of the detached ones (a job taken again
# after its lease ran out records that in its error history).
_TAKE_DEAL = """
), k AS (
    SELECT n.partition_id, n."offset", n.fresh, n.rn, r.consumer, r.request
    FROM n JOIN r ON n.rn > r.after AND n.rn <= r.upto
), u AS (
    UPDATE queue_jobs j
    SET attempts = j.attempts + 1, lease_epoch = j.lease_epoch + 1, leased_by = k.consumer,
        visible_at = clock_timestamp() + make_interval(secs => $3),
        errors = CASE WHEN j.leased_by IS NULL THEN j.errors
                      ELSE COALESCE(j.errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                          'attempt', j.attempts, 'error', 'visibility timeout expired',
                          'at', clock_timestamp())) END
    FROM k WHERE k.fresh = 0 AND j.partition_id = k.partition_id AND j."offset" = k."offset"
    RETURNING j.partition_id, j."offset", j.attempts, j.lease_epoch, k.request
)
"""

_TAKE_RESULT = """
SELECT u.request, u.partition_id, u."offset", u.attempts, u.lease_epoch, NULL::bigint AS lease_id,
       m.key, m.headers::text AS headers, m.payload, m.created_at, false AS again
FROM u
JOIN messages m ON m.partition_id = u.partition_id AND m."offset" = u."offset"
"""

# $1 topic, $2 jobs per consumer (int[]), $3 visibility timeout (s), $4 consumer ids (text[]),
# $5 sum of $2, $6 a random number (the partition fresh jobs are looked for first)
TAKE = (
    _TAKE_HEAD
    + """
    SELECT partition_id, "offset", visible_at FROM queue_jobs
    WHERE topic = $1 AND detached AND visible_at <= statement_timestamp()
    ORDER BY visible_at
    LIMIT $5
    FOR UPDATE SKIP LOCKED
), need AS (
    SELECT $5 - count(*) AS n FROM c
), f0 AS (
    SELECT s.partition_id, s.fresh, s.turn, sum(s.fresh) OVER (ORDER BY s.turn) AS upto
    FROM (SELECT f.partition_id, p.next_offset - f.next_offset AS fresh,
                 (row_number() OVER (ORDER BY f.partition_id) + $6::bigint) % count(*) OVER () AS turn
          FROM queue_frontiers f
          JOIN partitions p ON p.id = f.partition_id
          WHERE f.topic = $1 AND f.next_offset < p.next_offset) AS s
), lk AS (
    SELECT f.partition_id, f.next_offset FROM queue_frontiers f
    WHERE f.partition_id IN (SELECT f0.partition_id FROM f0, need WHERE f0.upto - f0.fresh < need.n)
    ORDER BY f.partition_id
    FOR UPDATE
), fr AS (
    SELECT lk.partition_id, j."offset", f0.turn
    FROM lk JOIN f0 ON f0.partition_id = lk.partition_id CROSS JOIN need
    CROSS JOIN LATERAL (
        SELECT j."offset" FROM queue_jobs j
        WHERE j.partition_id = lk.partition_id AND j."offset" >= lk.next_offset
          AND j."offset" < lk.next_offset + need.n AND NOT j.detached
        ORDER BY j."offset"
        LIMIT need.n
    ) j
), n AS (
    SELECT partition_id, "offset", 0 AS fresh,
           row_number() OVER (ORDER BY visible_at, partition_id, "offset") AS rn
    FROM c
    UNION ALL
    SELECT partition_id, "offset", 1,
           (SELECT count(*) FROM c)
           + row_number() OVER (ORDER BY turn, "offset")
    FROM fr
"""
    + _TAKE_DEAL
    + """, fk AS (
    -- one lease per run of consecutive offsets a request got from a partition
    SELECT k.partition_id, k.request, min(k.consumer) AS consumer,
           min(k."offset") AS first_offset, max(k."offset") AS last_offset
    FROM k WHERE k.fresh = 1
    GROUP BY k.partition_id, k.request, k."offset" - k.rn
), fu AS (
    UPDATE queue_frontiers f SET next_offset = m.last_offset + 1
    FROM (SELECT partition_id, max(last_offset) AS last_offset FROM fk GROUP BY partition_id) AS m
    WHERE f.partition_id = m.partition_id
), li AS (
    INSERT INTO queue_leases (topic, partition_id, first_offset, last_offset, leased_by, visible_at)
    SELECT $1, fk.partition_id, fk.first_offset, fk.last_offset, fk.consumer,
           clock_timestamp() + make_interval(secs => $3)
    FROM fk
    RETURNING id, partition_id, first_offset, last_offset
)
"""
    + _TAKE_RESULT
    + """UNION ALL
SELECT fk.request, m.partition_id, m."offset", 1, 0::bigint, li.id,
       m.key, m.headers::text, m.payload, m.created_at, false
FROM li
JOIN fk ON fk.partition_id = li.partition_id AND fk.first_offset = li.first_offset
JOIN messages m ON m.partition_id = li.partition_id AND m."offset" BETWEEN li.first_offset AND li.last_offset
UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true
WHERE EXISTS (SELECT 1 FROM xj)
   OR ((SELECT count(*) FROM k) < $5
       AND EXISTS (SELECT 1 FROM f0 WHERE f0.partition_id NOT IN (SELECT lk.partition_id FROM lk)))
ORDER BY 10, 2, 3
"""
)

# ordered_by_key: only a key's earliest remaining job is eligible, so a key
# never has two jobs out at once (a leased or delayed job blocks the next one)
# and each key is worked in order. Ordered takes see detached jobs only: the
# consumer detaches the topic's fresh jobs first (DETACH_FRESH); a job in
# another consumer's range lease still blocks its key's later jobs.
TAKE_ORDERED = (
    _TAKE_HEAD
    + """
    SELECT j.partition_id, j."offset", j.visible_at FROM queue_jobs j
    WHERE j.topic = $1 AND j.detached AND j.visible_at <= statement_timestamp()
      AND (j.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM queue_jobs e
            WHERE e.topic = j.topic AND e.key = j.key
              AND (e.partition_id, e."offset") < (j.partition_id, j."offset")))
    ORDER BY j.visible_at
    LIMIT $5
    FOR UPDATE SKIP LOCKED
), n AS (
    SELECT partition_id, "offset", 0 AS fresh,
           row_number() OVER (ORDER BY visible_at, partition_id, "offset") AS rn
    FROM c
"""
    + _TAKE_DEAL
    + _TAKE_RESULT
    + """UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true WHERE EXISTS (SELECT 1 FROM xj)
ORDER BY 10, 2, 3
"""
)

# Give the fresh jobs of topic $1 their own state, moving its frontiers past
# them (under their row locks, in id order, as a take locks them): for ordered
# takes, and before a dead-letter replay takes jobs out of a queue.
DETACH_FRESH = """
WITH lk AS (
    SELECT f.partition_id, f.next_offset FROM queue_frontiers f
    WHERE f.topic = $1
      AND EXISTS (SELECT 1 FROM partitions p WHERE p.id = f.partition_id AND p.next_offset > f.next_offset)
    ORDER BY f.partition_id
    FOR UPDATE
), d AS (
    UPDATE queue_jobs j SET detached = true
    FROM lk
    WHERE j.partition_id = lk.partition_id AND j."offset" >= lk.next_offset AND NOT j.detached
    RETURNING j.partition_id, j."offset"
)
UPDATE queue_frontiers f SET next_offset = GREATEST(f.next_offset, p.next_offset)
FROM lk JOIN partitions p ON p.id = lk.partition_id
WHERE f.partition_id = lk.partition_id
"""

ACK = """
DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING "offset"
"""

# The lists come as bigint[] literals (`db.int_array`). The ANY conditions make the jobs primary-key probes whatever the planner
# thinks of the table's size (joined with the list, it may hash a scan of
# every job); the epochs are checked against a hashed list (IS TRUE keeps the
# IN a subplan, which is hashed, rather than a join the planner may loop). $4: the
# range leases the jobs came from; a lease none of whose jobs is left is
# deleted here (its jobs left in the range equal to those this statement
# deletes; a lease another statement has locked is left to the take that
# reclaims it when it runs out).
ACK_MANY = """
WITH d AS (
    DELETE FROM queue_jobs j
    WHERE j.partition_id = ANY($1::text::bigint[]) AND j."offset" = ANY($2::text::bigint[])
      AND ((j.partition_id, j."offset", j.lease_epoch) IN (
              SELECT a.pid, a.off, a.epoch
              FROM unnest($1::text::bigint[], $2::text::bigint[], $3::text::bigint[]) AS a(pid, off, epoch)
          )) IS TRUE
    RETURNING j.partition_id, j."offset", j.detached
), e AS (
    DELETE FROM queue_leases l
    WHERE l.id IN (SELECT id FROM queue_leases WHERE id = ANY($4::text::bigint[]) FOR UPDATE SKIP LOCKED)
      AND (SELECT count(*) FROM queue_jobs j
           WHERE j.partition_id = l.partition_id AND j."offset" BETWEEN l.first_offset AND l.last_offset
             AND NOT j.detached)
        = (SELECT count(*) FROM d
           WHERE d.partition_id = l.partition_id AND d."offset" BETWEEN l.first_offset AND l.last_offset
             AND NOT d.detached)
)
SELECT partition_id, "offset" FROM d
"""

# A job of a range lease gets its own state here (its attempt, the first, is
# recorded in the row from now on).
NACK = """
UPDATE queue_jobs
SET visible_at = clock_timestamp() + make_interval(secs => $4), leased_by = NULL,
    detached = true, attempts = GREATEST(attempts, 1),
    errors = COALESCE(errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
        'attempt', GREATEST(attempts, 1), 'error', $5::text, 'at', clock_timestamp()))
WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING attempts
"""

# A consumer closing gives its jobs back at once, without counting the attempt.
RETURN_UNACKED = """
UPDATE queue_jobs j
SET visible_at = clock_timestamp(), leased_by = NULL, attempts = GREATEST(j.attempts - 1, 0), detached = true
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
SELECT EXTRACT(EPOCH FROM min(t) - clock_timestamp())::float8 FROM (
    SELECT min(visible_at) AS t FROM queue_jobs WHERE topic = $1 AND detached
    UNION ALL
    SELECT min(visible_at) FROM queue_leases WHERE topic = $1
    UNION ALL
    SELECT statement_timestamp() - interval '1 second' FROM queue_frontiers f
    WHERE f.topic = $1
      AND EXISTS (SELECT 1 FROM queue_jobs j
                  WHERE j.partition_id = f.partition_id AND j."offset" >= f.next_offset AND NOT j.detached)
) AS s
"""


# One job a take leased, as the row the statement returns (read by position on
# the hot path: a struct per job would be a noticeable part of a job's cost):
TakenJob: TypeAlias = asyncpg.Record
REQUEST = 0  # which request of the take it went to (from 1; 0: the marker row)
PARTITION_ID = 1
OFFSET = 2
ATTEMPTS = 3
LEASE_EPOCH = 4
LEASE_ID = 5  # the range lease holding the job (None: the job's own lease)
KEY = 6
HEADERS = 7  # the message's header object as JSON text
PAYLOAD = 8
CREATED_AT = 9


class RemovedJob(msgspec.Struct, frozen=True, gc=False):
    """A job `delete_job` removed: its error history as JSON text (None: no errors recorded)."""

    errors: str | None


async def take(
    conn: Conn, topic: str, limit: int, visibility_timeout: float, consumer: str, *, ordered: bool
) -> list[TakenJob]:
    """Lease up to `limit` free jobs of `topic` to `consumer` (autocommit on a pool)."""
    return (await take_for(conn, topic, [consumer], [limit], visibility_timeout, ordered=ordered))[0]


async def take_for(
    conn: Conn,
    topic: str,
    consumers: list[str],
    limits: list[int],
    visibility_timeout: float,
    *,
    ordered: bool,
) -> list[list[TakenJob]]:
    """Lease free jobs of `topic` to several takers at once, each up to its limit: the jobs of each.

    Ordered takes detach the topic's fresh jobs first (one more statement,
    which finds nothing to do while no fresh job arrived). A statement that
    ends with the marker row is sent again for the requests it did not fill
    (at most a few times).
    """
    if ordered:
        await detach_fresh(conn, topic)
    dealt: list[list[TakenJob]] = [[] for _ in consumers]
    left = list(limits)
    for _ in range(4):
        asking = [i for i, n in enumerate(left) if n > 0]
        if not asking:
            break
        args: list[object] = [
            topic,
            [left[i] for i in asking],
            visibility_timeout,
            [consumers[i] for i in asking],
            sum(left[i] for i in asking),
        ]
        if not ordered:
            args.append(next(_turns))
        again = False
        for row in await conn.fetch(TAKE_ORDERED if ordered else TAKE, *args):
            request = row[REQUEST]
            if request == 0:  # jobs may be free that this statement could not lease
                again = True
                continue
            i = asking[request - 1]
            dealt[i].append(row)
            left[i] -= 1
        if not again:
            break
    return dealt


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


async def ack_many(
    conn: Conn, jobs: list[tuple[int, int, int]], leases: Collection[int] = ()
) -> set[tuple[int, int]]:
    """Delete the jobs (partition_id, offset, epoch) still held by these leases; those deleted.

    `leases`: the range leases the jobs came from, deleted once no job of theirs is left.
    """
    rows = await conn.fetch(
        ACK_MANY,
        db.int_array([j[0] for j in jobs]),
        db.int_array([j[1] for j in jobs]),
        db.int_array([j[2] for j in jobs]),
        db.int_array(leases),
    )
    return {(r[0], r[1]) for r in rows}


async def detach_fresh(conn: Conn, topic: str) -> None:
    """Give every fresh job of `topic` its own state (before an ordered take or a dead-letter replay)."""
    await conn.execute(DETACH_FRESH, topic)


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
