"""Queue topics (`semantics="queue"`): one job row per unacked message.

Publishing to a queue topic appends to the log exactly like pubsub and, in the
same statement, inserts the message's job row (so a job exists if and only if
its message does and is not acked). Fresh jobs are leased by range: a take
moves its partition's frontier past the jobs it gets by writing one
`queue_leases` row per run, without touching the job rows (a frontier is the
end of its partition's newest lease, or its head row if that is further).
Leases are written once: an ack deletes only its jobs, and a lease whose jobs
are all gone or detached holds nothing and stays in its slot of the lease
table until `rotate_leases` truncates the slot (migration 033). Jobs
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
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TypeAlias, cast

import asyncpg
import msgspec

from storage import db
from storage.db import Conn
from storage.expiry import ExpiryBound

# Where each take statement starts looking for fresh jobs (see TAKE).
_turns = itertools.count(random.randrange(1 << 20))


def _bounded(text: str, param: int) -> str:
    """A take statement whose expiry scan (CTE `x`) starts at parameter `param` (NULL: a full scan)."""
    return text.replace("{bound}", f"${param}")


def _judged_at(text: str, param: int) -> str:
    """A take statement whose times all come from parameter `param`: the time its leases are judged by.

    Each `statement_timestamp()` and `clock_timestamp()` of `text` becomes
    `COALESCE($param::timestamptz, ...)`: NULL (production) keeps the server's
    clock, a time (`bus.testing.Clock`) moves when leases, delays and the rate
    window run out for this statement. Only constants are formatted in.
    """
    for server in ("statement_timestamp()", "clock_timestamp()"):
        text = text.replace(server, f"COALESCE(${param}::timestamptz, {server})")
    return text


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
# The scan for leases that ran out starts at the caller's bound (a parameter,
# NULL for a full scan): the leases below it were reclaimed already. Every
# take ends with one more marker row (SCANNED) that says how many leases the
# scan reclaimed and by what time, from which the caller moves its bound
# (ExpiryBound).
#
# A take commits without waiting for its WAL flush (synchronous_commit off for
# this statement's transaction only): a lease is soft state. If PostgreSQL
# crashes before the flush, the leases of the last moment are forgotten and
# those jobs are simply delivered again, as any job whose consumer vanished;
# nothing acked or published is affected (acks and publishes still wait for
# their flush). Set in `r`, which always runs before any job is leased.
_TAKE_START = """
WITH r AS (
    SELECT x.ord AS request, x.consumer, sum(x.n) OVER (ORDER BY x.ord) - x.n AS after,
           sum(x.n) OVER (ORDER BY x.ord) AS upto,
           set_config('synchronous_commit', 'off', true) AS soft
    FROM unnest($4::text[], $2::int[]) WITH ORDINALITY AS x(consumer, n, ord)
), g AS (
    -- the queue's settings (migration 014): paused, or limited (taken by TAKE_LIMITED only)
    SELECT COALESCE(bool_or(s.paused), false) AS paused,
           COALESCE(bool_or(s.max_in_flight_per_key IS NOT NULL OR s.rate_limit IS NOT NULL), false) AS limited
    FROM queue_settings s WHERE s.topic = $1
), cx AS (
    -- cancelled jobs whose lease ran out (or that were nacked): gone instead of taken again
    DELETE FROM queue_jobs j
    WHERE (j.partition_id, j."offset") IN (
        SELECT e.partition_id, e."offset" FROM queue_jobs e
        WHERE e.topic = $1 AND e.cancelled AND e.visible_at <= statement_timestamp()
        LIMIT 100
        FOR UPDATE SKIP LOCKED)
), x AS (
    -- from the caller's bound on (see ExpiryBound): the leases below it were reclaimed. Only
    -- the leases still holding a job: nothing deletes a lease whose jobs were acked or detached
    -- (migration 033), it stays in its slot until the slot is truncated
    SELECT l.id, l.partition_id, l.first_offset, l.last_offset, l.leased_by, l.visible_at
    FROM queue_leases l
    WHERE l.topic = $1 AND l.visible_at >= COALESCE({bound}::timestamptz, '-infinity'::timestamptz)
      AND l.visible_at <= statement_timestamp()
      AND EXISTS (SELECT 1 FROM queue_jobs e
                  WHERE e.partition_id = l.partition_id AND NOT e.detached
                    AND e."offset" BETWEEN l.first_offset AND l.last_offset)
    ORDER BY l.visible_at
    LIMIT 16  -- EXPIRY_BATCH
    FOR UPDATE SKIP LOCKED
), xd AS (
    -- how many leases the scan reclaims (read by the SCANNED row); they stay, holding no job
    SELECT count(*)::integer AS deleted FROM x
), xj AS (
    UPDATE queue_jobs j
    SET detached = true, attempts = 1, leased_by = x.leased_by, visible_at = x.visible_at
    FROM x
    WHERE j.partition_id = x.partition_id AND j."offset" BETWEEN x.first_offset AND x.last_offset
      AND NOT j.detached
    RETURNING j."offset"
"""
_TAKE_HEAD = (
    _TAKE_START
    + """), c AS (
"""
)

# Shared by both takes: the candidates `n` (numbered `rn`) dealt out to the
# requests, and the per-row lease of the detached ones (a job taken again
# after its lease ran out records that in its error history).
_TAKE_DEAL = """
), k AS (
    SELECT n.partition_id, n."offset", n.fresh, n.rn, r.consumer, r.request
    FROM n JOIN r ON n.rn > r.after AND n.rn <= r.upto{deal_if}
), u AS (
    UPDATE queue_jobs j
    SET attempts = j.attempts + 1, lease_epoch = j.lease_epoch + 1, leased_by = k.consumer,
        visible_at = clock_timestamp() + make_interval(secs => $3),
        errors = CASE WHEN j.leased_by IS NULL THEN j.errors
                      ELSE COALESCE(j.errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                          'attempt', j.attempts, 'error', 'visibility timeout expired',
                          'at', clock_timestamp())) END
    FROM k WHERE k.fresh = 0 AND j.partition_id = k.partition_id AND j."offset" = k."offset"
    RETURNING j.partition_id, j."offset", j.attempts, j.lease_epoch, k.request, j.priority
)
"""

_TAKE_RESULT = """
SELECT u.request, u.partition_id, u."offset", u.attempts, u.lease_epoch, NULL::bigint AS lease_id,
       m.key, m.headers::text AS headers, m.payload, m.created_at, false AS again, u.priority
FROM u
JOIN messages m ON m.partition_id = u.partition_id AND m."offset" = u."offset"
UNION ALL
SELECT -5, 0, 0, (SELECT xd.deleted FROM xd), 0, NULL, NULL, NULL, NULL,
       LEAST(statement_timestamp(), transaction_timestamp()), true, 0
"""

# The take of detached and fresh jobs, TAKE's text. TAKE and TAKE_WITHIN_LIMITS are it with
# constants formatted in, never a value: {limits} CTEs before the candidates, {stop} what makes
# it hand out nothing, {total} how many jobs it may hand out in all, {gate} CTEs between the
# candidates and the deal, {deal_if} the deal's condition, {move_if} the frontier moves'
# condition, {log} CTEs after the leases, {markers} the marker rows after the jobs.
_TAKE_FRESH = (
    _TAKE_START
    + """{limits}), c AS (
    SELECT partition_id, "offset", visible_at, priority, key FROM queue_jobs
    WHERE topic = $1 AND detached AND NOT cancelled AND visible_at <= statement_timestamp()
      AND NOT (SELECT {stop} FROM g)
    ORDER BY priority DESC, visible_at
    LIMIT {total}
    FOR UPDATE SKIP LOCKED
), need AS (
    -- fresh jobs have priority 0: they go after detached jobs of priority >= 0, before the others
    SELECT CASE WHEN (SELECT {stop} FROM g) THEN 0
                ELSE {total} - count(*) FILTER (WHERE priority >= 0) END AS n
    FROM c
), f0 AS (
    SELECT s.partition_id, s.fresh, s.turn, s.stop, sum(s.fresh) OVER (ORDER BY s.turn) AS upto
    -- each partition's frontier and end, read in one call (migration 038)
    FROM (SELECT e.partition_id, e.stop - e.at AS fresh, e.stop,
                 (row_number() OVER (ORDER BY e.partition_id) + $6::bigint) % count(*) OVER () AS turn
          FROM queue_bounds($1) AS e(partition_id, at, stop)
          WHERE e.at < e.stop) AS s
), lk AS (
    -- each frontier locked in id order, read as the take that held it before left it
    SELECT s.partition_id, queue_frontier_lock(s.partition_id) AS next_offset
    FROM (SELECT f0.partition_id FROM f0, need WHERE f0.upto - f0.fresh < need.n
          ORDER BY f0.partition_id) AS s
), fr AS (
    -- the next fresh jobs past each locked frontier (detached ones there, delayed or
    -- prioritized at publish, are taken through c instead)
    SELECT lk.partition_id, j."offset", j.key, f0.turn
    FROM lk JOIN f0 ON f0.partition_id = lk.partition_id CROSS JOIN need
    CROSS JOIN LATERAL (
        SELECT j."offset", j.key FROM queue_jobs j
        WHERE j.partition_id = lk.partition_id AND j."offset" >= lk.next_offset AND NOT j.detached
        ORDER BY j."offset"
        LIMIT need.n
    ) j
), n AS (
    -- higher priority first; among equals the detached jobs by visibility, then the fresh ones
    -- (each partition's in offset order, so what is dealt of a partition is a prefix of it)
    SELECT partition_id, "offset", fresh, key,
           row_number() OVER (ORDER BY prio DESC, fresh, t, turn, partition_id, "offset") AS rn
    FROM (SELECT partition_id, "offset", 0 AS fresh, key, priority AS prio, visible_at AS t, 0::bigint AS turn
          FROM c
          UNION ALL
          SELECT partition_id, "offset", 1, key, 0, NULL, turn FROM fr) AS a{gate}"""
    + _TAKE_DEAL
    + """, fk AS (
    -- one lease per run of consecutive offsets a request got from a partition
    SELECT k.partition_id, k.request, min(k.consumer) AS consumer,
           min(k."offset") AS first_offset, max(k."offset") AS last_offset
    FROM k WHERE k.fresh = 1
    GROUP BY k.partition_id, k.request, k."offset" - k.rn
), fa AS (
    -- per partition read: its first fresh job not dealt (the deal stops at rn {total}), how many
    -- fresh jobs were read, the last one
    SELECT n.partition_id, min(n."offset") FILTER (WHERE n.rn > {total}) AS undealt,
           count(*) AS got, max(n."offset") AS last
    FROM n WHERE n.fresh = 1
    GROUP BY n.partition_id
), fu AS (
    -- each locked frontier moves to its first fresh job not dealt; when all were dealt, past
    -- the last, or to the partition's end if no other fresh job is there (detached ones left
    -- behind it are taken through c). A frontier is also the end of its partition's newest
    -- lease (migration 033): a move to the end of the lease this take inserts writes nothing
    -- more, unless the previous release may run (it reads the frontier's row)
    -- (a plain SELECT: the final statement reads it, see the last branch)
    SELECT queue_frontier_move(m.partition_id, m.next_offset) AS moved
    FROM (SELECT lk.partition_id, lk.next_offset AS at,
                 COALESCE(fa.undealt,
                          CASE WHEN COALESCE(fa.got, 0) < need.n THEN f0.stop ELSE fa.last + 1 END) AS next_offset,
                 (SELECT max(fk.last_offset) + 1 FROM fk WHERE fk.partition_id = lk.partition_id) AS leased
          FROM lk JOIN f0 ON f0.partition_id = lk.partition_id CROSS JOIN need
          LEFT JOIN fa ON fa.partition_id = lk.partition_id) AS m
    WHERE m.next_offset > m.at{move_if}
      AND (m.leased IS DISTINCT FROM m.next_offset OR previous_release_may_run())
), li AS (
    INSERT INTO queue_leases (topic, partition_id, first_offset, last_offset, leased_by, visible_at)
    SELECT $1, fk.partition_id, fk.first_offset, fk.last_offset, fk.consumer,
           clock_timestamp() + make_interval(secs => $3)
    FROM fk
    RETURNING id, partition_id, first_offset, last_offset
){log}
"""
    + _TAKE_RESULT
    + """UNION ALL
SELECT fk.request, m.partition_id, m."offset", 1, 0::bigint, li.id,
       m.key, m.headers::text, m.payload, m.created_at, false, 0
FROM li
JOIN fk ON fk.partition_id = li.partition_id AND fk.first_offset = li.first_offset
JOIN messages m ON m.partition_id = li.partition_id AND m."offset" BETWEEN li.first_offset AND li.last_offset
UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE NOT (SELECT {stop} FROM g)
  AND (EXISTS (SELECT 1 FROM xj)
       OR ((SELECT count(*) FROM k) < {total}
           AND EXISTS (SELECT 1 FROM f0 WHERE f0.partition_id NOT IN (SELECT lk.partition_id FROM lk))))
UNION ALL
SELECT {markers}
UNION ALL
-- no row: what makes the frontier moves run (a CTE that writes through a function is a
-- plain SELECT, which runs only as far as it is read)
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, false, 0 FROM fu WHERE fu.moved IS NULL
ORDER BY 12 DESC, 10, 2, 3
"""
)

# $1 topic, $2 jobs per consumer (int[]), $3 visibility timeout (s), $4 consumer ids (text[]),
# $5 sum of $2, $6 a random number (the partition fresh jobs are looked for first),
# $7 the time leases are judged by (NULL: the server's clock; every take has it, see _judged_at),
# $8 where its scan for range leases that ran out starts (NULL: a full scan; see ExpiryBound).
# A queue with limits hands out nothing here and answers with the marker LIMITED.
TAKE = _judged_at(
    _TAKE_FRESH.format(
        bound="$8",
        limits="",
        stop="paused OR limited",
        total="$5",
        gate="",
        deal_if="",
        move_if="",
        log="",
        markers="""-1, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE (SELECT limited AND NOT paused FROM g)""",
    ),
    7,
)

# The keys of the range-leased jobs in flight of the keys that `{keys}` (a SELECT of one column)
# lists, one row per job: jobs of such a key below their partition's frontier (the key's index
# read up to it, not the key's fresh jobs past it), not detached, whose range lease has not run
# out. Found from the jobs, not the leases: a lease stays in its slot after its jobs are acked
# (migration 033), so the leases not run out are every take's of the last visibility timeout.
# Only a constant is formatted in, never a value.
_RANGED_IN_FLIGHT = """SELECT e.key
        FROM ({keys}) AS kk(key)
        CROSS JOIN (SELECT f.partition_id, f.frontier AS at FROM queue_frontiers f WHERE f.topic = $1) AS fz
        CROSS JOIN LATERAL (
            SELECT e.key, e."offset" FROM queue_jobs e
            WHERE e.topic = $1 AND e.key = kk.key AND e.partition_id = fz.partition_id
              AND e."offset" < fz.at AND NOT e.detached
            OFFSET 0  -- a range of the key's index per partition, not a join of all its jobs
        ) AS e
        WHERE (SELECT l.last_offset >= e."offset" AND l.visible_at > statement_timestamp()
               FROM queue_leases l WHERE l.partition_id = fz.partition_id AND l.first_offset <= e."offset"
               ORDER BY l.first_offset DESC LIMIT 1)"""

# The take of a queue with a per-key or rate limit, with TAKE's parameters: its fresh jobs stay
# in range leases, unwritten, as in TAKE. Limited takes of every process run one at a time,
# each seeing what the previous ones committed, which makes the counts exact:
#
# - Each writes a new version of the queue's settings row (`lockrow`), which also locks it
#   until the take commits. One statement alone: it goes on only if the version it locked is
#   the one its snapshot saw, that is no limited take committed between its snapshot and its
#   lock (the UPDATE's condition on xmin is checked again against the newest version after a
#   wait). Else it hands out nothing and answers RACED, and the caller takes again in a
#   transaction that locked the row first (LOCK_SETTINGS), where the statement's snapshot
#   comes after the lock. Every limited take writes the row, so none is missed.
# - Rate limit: the take hands out at most the limit less what the takes logged in the window
#   ending now (`cap`), and logs what it handed out (queue_take_log, a sliding window).
# - Per-key limit: a gate on the whole deal. When a key would go over its limit (its jobs in
#   flight and those dealt to it), the take hands out nothing, leaves the frontiers, and
#   answers KEY_AT_LIMIT: the caller takes the exact way (DETACH_FRESH, then TAKE_LIMITED,
#   which passes over the keys at their limit). A limit the load never reaches costs the
#   count of the dealt keys' jobs in flight, not a write per job.
# A queue found without limits answers UNLIMITED (with the jobs it handed out, as TAKE would).
TAKE_WITHIN_LIMITS = _judged_at(
    _TAKE_FRESH.format(
        bound="$8",
        limits="""
), snap AS (
    SELECT s.xmin AS seen FROM queue_settings s WHERE s.topic = $1
), lockrow AS (
    UPDATE queue_settings s SET paused = s.paused
    WHERE s.topic = $1 AND s.xmin = (SELECT seen FROM snap)
    RETURNING s.max_in_flight_per_key AS per_key, s.rate_limit, s.rate_per
), lim AS (
    SELECT NOT EXISTS (SELECT 1 FROM snap) OR EXISTS (SELECT 1 FROM lockrow) AS ok,
           (SELECT per_key FROM lockrow) AS per_key, (SELECT rate_limit FROM lockrow) AS rate_limit,
           (SELECT rate_per FROM lockrow) AS rate_per
), cap AS (
    SELECT CASE WHEN NOT lim.ok THEN 0
                WHEN lim.rate_limit IS NULL THEN $5
                ELSE GREATEST(0, LEAST($5, lim.rate_limit - (
                    SELECT COALESCE(sum(l.n), 0) FROM queue_take_log l
                    WHERE l.topic = $1 AND l.at > statement_timestamp() - make_interval(secs => lim.rate_per))))
           END AS n
    FROM lim
""",
        stop="paused OR NOT (SELECT ok FROM lim)",
        total="(SELECT cap.n FROM cap)",
        gate=(
            """
), dk AS (
    -- the keys the deal would hand out, with how many jobs each
    SELECT n.key, count(*) AS n FROM n JOIN r ON n.rn > r.after AND n.rn <= r.upto
    WHERE n.rn <= (SELECT cap.n FROM cap) AND n.key IS NOT NULL AND (SELECT per_key FROM lim) IS NOT NULL
    GROUP BY n.key
), roomy AS (
    -- no key dealt (or no per-key limit): the count per key is not needed
    SELECT NOT EXISTS (SELECT 1 FROM dk) AS ok
), busy AS (
    -- their jobs in flight (as TAKE_LIMITED counts them): detached ones leased and not run
    -- out, and those of range leases not run out
    SELECT f.key, count(*) AS n FROM (
        SELECT e.key FROM queue_jobs e
        WHERE e.topic = $1 AND e.detached AND e.visible_at > statement_timestamp()
          AND e.leased_by IS NOT NULL AND e.key IN (SELECT dk.key FROM dk)
        UNION ALL
        {ranged}
    ) AS f
    WHERE NOT (SELECT ok FROM roomy)
    GROUP BY f.key
), gate AS (
    SELECT (SELECT ok FROM roomy) IS TRUE
        OR NOT EXISTS (SELECT 1 FROM dk LEFT JOIN busy ON busy.key = dk.key
                       WHERE dk.n + COALESCE(busy.n, 0) > (SELECT per_key FROM lim)) AS ok"""
        ).replace("{ranged}", _RANGED_IN_FLIGHT.format(keys="SELECT dk.key FROM dk")),
        deal_if="\n    WHERE n.rn <= (SELECT cap.n FROM cap) AND (SELECT ok FROM gate)",
        move_if=" AND (SELECT ok FROM gate)",
        log=""", tl AS (
    INSERT INTO queue_take_log (topic, at, n)
    SELECT $1, statement_timestamp(), count(*) FROM k
    HAVING count(*) > 0 AND (SELECT rate_limit FROM lim) IS NOT NULL
), tp AS (
    DELETE FROM queue_take_log l
    WHERE l.topic = $1 AND (SELECT ok FROM lim)
      AND l.at <= statement_timestamp() - make_interval(secs => COALESCE((SELECT rate_per FROM lim), 0))
)""",
        markers="""-2, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE NOT (SELECT ok FROM gate)
UNION ALL
SELECT -3, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE NOT (SELECT ok FROM lim)
UNION ALL
SELECT -4, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE (SELECT ok AND per_key IS NULL AND rate_limit IS NULL FROM lim)""",
    ),
    7,
)

# ordered_by_key: a job is eligible when it is its key's earliest remaining one (j: the job).
_KEY_FIRST = """(j.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM queue_jobs e
            WHERE e.topic = j.topic AND e.key = j.key
              AND (e.partition_id, e."offset") < (j.partition_id, j."offset")))"""

# ordered_by_key: only a key's earliest remaining job is eligible, so a key
# never has two jobs out at once (a leased or delayed job blocks the next one)
# and each key is worked in order. Ordered takes see detached jobs only: the
# consumer detaches the topic's fresh jobs first (DETACH_FRESH); a job in
# another consumer's range lease still blocks its key's later jobs.
# $1..$5 as TAKE; $6 the time leases are judged by (as TAKE's $7); $7 the expiry scan's
# start (as TAKE's $8).
TAKE_ORDERED = _judged_at(
    _bounded(_TAKE_HEAD, 7)
    + """
    SELECT j.partition_id, j."offset", j.visible_at, j.priority FROM queue_jobs j
    WHERE j.topic = $1 AND j.detached AND NOT j.cancelled AND j.visible_at <= statement_timestamp()
      AND NOT (SELECT paused OR limited FROM g)
      AND """
    + _KEY_FIRST
    + """
    ORDER BY j.priority DESC, j.visible_at
    LIMIT $5
    FOR UPDATE SKIP LOCKED
), n AS (
    SELECT partition_id, "offset", 0 AS fresh,
           row_number() OVER (ORDER BY priority DESC, visible_at, partition_id, "offset") AS rn
    FROM c
"""
    + _TAKE_DEAL.format(deal_if="")
    + _TAKE_RESULT
    + """UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE EXISTS (SELECT 1 FROM xj) AND NOT (SELECT paused OR limited FROM g)
UNION ALL
SELECT -1, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE (SELECT limited AND NOT paused FROM g)
ORDER BY 12 DESC, 10, 2, 3
""",
    6,
)

# fair=True (migration 031): takes rotate across keys. Each due job is ranked within its key
# (kr: 1 for a key's first due job, by priority then visibility), and the take deals the jobs
# of rank 1 of every key before any key's second: a key holding thousands of waiting jobs puts
# one of them ahead of another key's job, not thousands. Among equal ranks the key served longest
# ago goes first (queue_fair_served: a turn number per key, written for the keys each take deals),
# so keys take turns even one job at a time. Jobs without a key share one rank.
# Fair takes see detached jobs only (the consumer detaches the topic's fresh jobs first, as for
# ordered takes), and rank every due job of the topic at each take: a cost that grows with the
# due backlog, which fairness needs to see. A queue with limits is taken by TAKE_LIMITED instead.
# $1..$5 as TAKE; $6 the time leases are judged by (as TAKE's $7); $7 the expiry scan's start.
TAKE_FAIR = _judged_at(
    _bounded(_TAKE_HEAD, 7)
    + """
    SELECT j.partition_id, j."offset", j.visible_at, j.priority, j.key, f.kr, COALESCE(s.turn, 0) AS turn
    FROM queue_jobs j
    JOIN (SELECT e.partition_id, e."offset",
                 row_number() OVER (PARTITION BY e.key
                                    ORDER BY e.priority DESC, e.visible_at, e.partition_id, e."offset") AS kr
          FROM queue_jobs e
          WHERE e.topic = $1 AND e.detached AND NOT e.cancelled AND e.visible_at <= statement_timestamp()
            AND NOT (SELECT paused OR limited FROM g)) AS f
      ON j.partition_id = f.partition_id AND j."offset" = f."offset"
    LEFT JOIN queue_fair_served s ON s.topic = $1 AND s.key = COALESCE(j.key, '')
    WHERE f.kr <= $5 AND j.detached AND NOT j.cancelled AND j.visible_at <= statement_timestamp()
    ORDER BY f.kr, COALESCE(s.turn, 0), j.priority DESC, j.visible_at
    LIMIT $5
    FOR UPDATE OF j SKIP LOCKED
), n AS (
    SELECT partition_id, "offset", 0 AS fresh,
           row_number() OVER (ORDER BY kr, turn, priority DESC, visible_at, partition_id, "offset") AS rn
    FROM c
"""
    + _TAKE_DEAL.format(deal_if="")
    + """, fs AS (
    -- the keys dealt are served now (in the order dealt): the next take puts them after the others
    INSERT INTO queue_fair_served (topic, key, turn)
    SELECT $1, d.key, nextval('queue_fair_turns')
    FROM (SELECT COALESCE(c.key, '') AS key, min(k.rn) AS first
          FROM k JOIN c ON c.partition_id = k.partition_id AND c."offset" = k."offset"
          GROUP BY 1 ORDER BY 2) AS d
    ON CONFLICT (topic, key) DO UPDATE SET turn = EXCLUDED.turn
)
"""
    + _TAKE_RESULT
    + """UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE EXISTS (SELECT 1 FROM xj) AND NOT (SELECT paused OR limited FROM g)
UNION ALL
SELECT -1, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE (SELECT limited AND NOT paused FROM g)
ORDER BY 12 DESC, 10, 2, 3
""",
    6,
)

# The take of a queue with a per-key or rate limit (migration 014). It runs in
# a transaction that first locked the queue's settings row and detached its
# fresh jobs (LOCK_AND_DETACH), so limited takes of every process run
# one at a time and each sees what the previous ones committed: the counts
# below are exact. Jobs in flight for a key: taken (their own lease or a range
# lease) and not run out. The rate limit is a sliding window over
# `queue_take_log`: at most rate_limit jobs taken in any rate_per seconds.
# Candidates are the first due jobs by priority (at most $7 of them with a
# per-key limit, else $5): a key at its limit is passed over, a take does not
# look further than that.
# $1..$5 as TAKE; $6: ordered_by_key (bool); $7 how many due jobs to look at; $8 the time
# leases are judged by (as TAKE's $7); $9 the expiry scan's start (as TAKE's $8).
TAKE_LIMITED = _judged_at(
    _bounded(_TAKE_HEAD, 9)
    + """
    SELECT j.partition_id, j."offset", j.visible_at, j.priority, j.key FROM queue_jobs j
    WHERE j.topic = $1 AND j.detached AND NOT j.cancelled AND j.visible_at <= statement_timestamp()
      AND NOT (SELECT paused FROM g)
      AND (NOT $6::bool OR """
    + _KEY_FIRST
    + """)
    ORDER BY j.priority DESC, j.visible_at
    LIMIT (SELECT CASE WHEN max(q.max_in_flight_per_key) IS NULL THEN $5::int ELSE $7::int END
           FROM queue_settings q WHERE q.topic = $1)
), s AS (
    SELECT max(s.max_in_flight_per_key) AS per_key, max(s.rate_limit) AS rate_limit,
           max(s.rate_per) AS rate_per
    FROM queue_settings s WHERE s.topic = $1
), allow AS (
    SELECT CASE WHEN s.rate_limit IS NULL THEN $5
                ELSE GREATEST(0, LEAST($5, s.rate_limit - (
                    SELECT COALESCE(sum(l.n), 0) FROM queue_take_log l
                    WHERE l.topic = $1 AND l.at > statement_timestamp() - make_interval(secs => s.rate_per))))
           END AS n
    FROM s
), busy AS (
    -- the jobs in flight per key: detached ones leased and not run out, and those of range
    -- leases not run out (taken before the queue had its limit)
    SELECT f.key, count(*) AS n FROM (
        SELECT e.key FROM queue_jobs e
        WHERE e.topic = $1 AND e.detached AND e.visible_at > statement_timestamp()
          AND e.leased_by IS NOT NULL AND e.key IS NOT NULL
        UNION ALL
        """
    + _RANGED_IN_FLIGHT.format(keys="SELECT DISTINCT c.key FROM c WHERE c.key IS NOT NULL")
    + """
    ) AS f
    WHERE (SELECT per_key FROM s) IS NOT NULL
    GROUP BY f.key
), ranked AS (
    SELECT c.*, row_number() OVER (PARTITION BY c.key ORDER BY c.priority DESC, c.visible_at,
                                                               c.partition_id, c."offset") AS kr
    FROM c
), ok AS (
    SELECT ranked.* FROM ranked LEFT JOIN busy ON busy.key = ranked.key CROSS JOIN s
    WHERE s.per_key IS NULL OR ranked.key IS NULL OR ranked.kr + COALESCE(busy.n, 0) <= s.per_key
    ORDER BY ranked.priority DESC, ranked.visible_at, ranked.partition_id, ranked."offset"
    LIMIT (SELECT n FROM allow)
), okl AS (
    -- only the jobs dealt are locked (a lock writes the row); one a release without limits
    -- holds is passed over
    -- (primary-key probes whatever the planner thinks of the table, as in ACK_MANY)
    SELECT j.partition_id, j."offset", j.priority, j.visible_at FROM queue_jobs j
    WHERE j.partition_id = ANY(ARRAY(SELECT ok.partition_id FROM ok))
      AND j."offset" = ANY(ARRAY(SELECT ok."offset" FROM ok))
      AND ((j.partition_id, j."offset") IN (SELECT ok.partition_id, ok."offset" FROM ok)) IS TRUE
      AND j.detached AND NOT j.cancelled AND j.visible_at <= statement_timestamp()
    FOR UPDATE SKIP LOCKED
), n AS (
    SELECT partition_id, "offset", 0 AS fresh,
           row_number() OVER (ORDER BY priority DESC, visible_at, partition_id, "offset") AS rn
    FROM okl
"""
    + _TAKE_DEAL.format(deal_if="")
    + """, tl AS (
    INSERT INTO queue_take_log (topic, at, n)
    SELECT $1, statement_timestamp(), count(*) FROM u
    HAVING count(*) > 0 AND (SELECT rate_limit FROM s) IS NOT NULL
), tp AS (
    DELETE FROM queue_take_log l
    WHERE l.topic = $1
      AND l.at <= statement_timestamp() - make_interval(secs => COALESCE((SELECT rate_per FROM s), 0))
)
"""
    + _TAKE_RESULT
    + """UNION ALL
SELECT 0, 0, 0, 0, 0, NULL, NULL, NULL, NULL, '-infinity'::timestamptz, true, 0
WHERE EXISTS (SELECT 1 FROM xj) AND NOT (SELECT paused FROM g)
ORDER BY 12 DESC, 10, 2, 3
""",
    8,
)

# The detaching of a topic's fresh jobs ({topic}: the SQL that names the topic), shared by
# LOCK_AND_DETACH and DETACH_FRESH; only a constant is formatted in, never a value.
_DETACH_FROM = """
lk AS (
    SELECT s.partition_id, queue_frontier_lock(s.partition_id) AS next_offset
    FROM (SELECT f.partition_id FROM queue_frontiers f JOIN partitions p ON p.id = f.partition_id
          WHERE f.topic = {topic} AND p.log_end > f.frontier
          ORDER BY f.partition_id) AS s
), d AS (
    UPDATE queue_jobs j SET detached = true
    FROM lk
    WHERE j.partition_id = lk.partition_id AND j."offset" >= lk.next_offset AND NOT j.detached
    RETURNING j.partition_id, j."offset"
)
SELECT count(queue_frontier_move(lk.partition_id, p.log_end))
FROM lk JOIN partitions p ON p.id = lk.partition_id
WHERE lk.next_offset IS NOT NULL
"""


# Limited takes of a queue run one at a time: the first statement of an ordered
# one's transaction writes (and so locks) the queue's settings row, as every
# limited take does (see TAKE_WITHIN_LIMITS), then detaches its fresh jobs (as
# DETACH_FRESH), so that TAKE_LIMITED, the next statement, sees them.
LOCK_AND_DETACH = """
WITH s AS (
    UPDATE queue_settings SET paused = paused WHERE topic = $1 RETURNING topic
),""" + _DETACH_FROM.format(topic="(SELECT topic FROM s)")

# The first statement of a limited take's transaction when its take alone raced another
# (TAKE_WITHIN_LIMITS): the queue's settings row, written (as every limited take writes it) and
# so locked until the transaction ends (no row: no limits left).
LOCK_SETTINGS = """
UPDATE queue_settings SET paused = paused WHERE topic = $1 RETURNING max_in_flight_per_key, rate_limit
"""

# Give the fresh jobs of topic $1 their own state, moving its frontiers past
# them (under their row locks, in id order, as a take locks them): for ordered
# takes, and before a dead-letter replay takes jobs out of a queue.
DETACH_FRESH = "WITH" + _DETACH_FROM.format(topic="$1")

ACK = """
DELETE FROM queue_jobs WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING "offset"
"""

# The lists come as bigint[] literals (`db.int_array`). Each job is looked up by its key in a
# lateral subquery that locks it (FOR UPDATE: the row as the last writer left it, still of the
# acking lease's epoch), which cannot become a join: a primary-key probe per job whatever the
# planner thinks of the table. That matters when a snapshot held elsewhere fills the table with
# dead rows: a scan of it, which a plan made for a table of few live rows picks, reads every one
# of them. The locked jobs are then deleted by their row address. The range leases the jobs
# came from are left as they are: a lease whose jobs are gone holds nothing, and goes with its
# slot (migration 033).
ACK_MANY = """
WITH lk AS (
    SELECT k.ctid AS at
    FROM unnest($1::text::bigint[], $2::text::bigint[], $3::text::bigint[]) AS a(pid, off, epoch)
    CROSS JOIN LATERAL (SELECT q.ctid FROM queue_jobs q
                        WHERE q.partition_id = a.pid AND q."offset" = a.off AND q.lease_epoch = a.epoch
                        FOR UPDATE) AS k
)
DELETE FROM queue_jobs j WHERE j.ctid = ANY(ARRAY(SELECT lk.at FROM lk))
RETURNING j.partition_id, j."offset"
"""

# A job of a range lease gets its own state here (its attempt, the first, is
# recorded in the row from now on).
# $6: the time the delay counts from (NULL: the server's clock; see TAKE's $7).
NACK = """
UPDATE queue_jobs
SET visible_at = COALESCE($6::timestamptz, clock_timestamp()) + make_interval(secs => $4), leased_by = NULL,
    detached = true, attempts = GREATEST(attempts, 1),
    errors = COALESCE(errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
        'attempt', GREATEST(attempts, 1), 'error', $5::text, 'at', COALESCE($6::timestamptz, clock_timestamp())))
WHERE partition_id = $1 AND "offset" = $2 AND lease_epoch = $3
RETURNING attempts
"""

# A consumer closing gives its jobs back at once, without counting the attempt ($4: now, as NACK's $6).
RETURN_UNACKED = """
UPDATE queue_jobs j
SET visible_at = COALESCE($4::timestamptz, clock_timestamp()), leased_by = NULL, attempts = GREATEST(j.attempts - 1, 0), detached = true
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

# Seconds until the topic's next job becomes visible (a nacked job's delay, a
# delayed publish's time or a lease running out; <= 0: one is visible
# already): the jobs' and the range leases' answers apart, each NULL when there
# is none; both NULL when the queue is paused.
# Nobody sends a NOTIFY for those moments, so an idle consumer sleeps until then.
# $2: now (NULL: the server's clock; see TAKE's $7); $3: the consumer's expiry bound (range
# leases below it were reclaimed, their jobs are detached; NULL: none, see ExpiryBound); $4: the
# longest the caller sleeps anyway (NULL: no limit): a range lease running out later than that
# is not looked for, so the look does not walk the leases acked within a visibility timeout,
# which a snapshot held elsewhere keeps in the index; $5: whether to look at range leases at all
# (ExpiryBound.lease_look: not while an earlier look found none ending before it sleeps out).
SECONDS_UNTIL_VISIBLE = """
SELECT EXTRACT(EPOCH FROM min(t) FILTER (WHERE NOT lease) - COALESCE($2::timestamptz, clock_timestamp()))::float8,
       EXTRACT(EPOCH FROM min(t) FILTER (WHERE lease) - COALESCE($2::timestamptz, clock_timestamp()))::float8
FROM (
    SELECT min(visible_at) AS t, false AS lease FROM queue_jobs WHERE topic = $1 AND detached AND NOT cancelled
    UNION ALL
    SELECT min(visible_at), false FROM queue_jobs WHERE topic = $1 AND cancelled
    UNION ALL
    SELECT min(l.visible_at), true FROM queue_leases l
    WHERE $5 AND l.topic = $1 AND l.visible_at >= COALESCE($3::timestamptz, '-infinity'::timestamptz)
      AND l.visible_at <= COALESCE($2::timestamptz, clock_timestamp()) + COALESCE($4::float8, 1e9) * interval '1 second'
      AND EXISTS (SELECT 1 FROM queue_jobs e
                  WHERE e.partition_id = l.partition_id AND NOT e.detached
                    AND e."offset" BETWEEN l.first_offset AND l.last_offset)
    UNION ALL
    SELECT COALESCE($2::timestamptz, statement_timestamp()) - interval '1 second', false
    FROM queue_bounds($1) AS f(partition_id, at, stop)
    WHERE f.at < f.stop
      AND (SELECT j."offset" FROM queue_jobs j
           WHERE j.partition_id = f.partition_id AND j."offset" >= f.at AND NOT j.detached
           ORDER BY j."offset" LIMIT 1) IS NOT NULL
) AS s
WHERE NOT EXISTS (SELECT 1 FROM queue_settings q WHERE q.topic = $1 AND q.paused)
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
# 10: the marker flag; 11: the job's priority (the rows come higher priority first, then by created_at)

# The requests of the marker rows (after the jobs, if any):
AGAIN = 0  # jobs may be free that the statement could not lease: send it again for what is left
LIMITED = -1  # TAKE: the queue has limits, take it with take_limited
KEY_AT_LIMIT = -2  # TAKE_WITHIN_LIMITS: a key would go over its limit, nothing handed out
RACED = -3  # TAKE_WITHIN_LIMITS: another limited take committed after its snapshot, nothing handed out
UNLIMITED = -4  # TAKE_WITHIN_LIMITS: the queue has no limits (any more)
# Every take statement's: ATTEMPTS holds how many range leases its expiry scan reclaimed (the
# scan's LIMIT is EXPIRY_BATCH), CREATED_AT the time it judged them by (never past the server's
# clock at its start); see ExpiryBound.
SCANNED = -5
EXPIRY_BATCH = 16


class RemovedJob(msgspec.Struct, frozen=True, gc=False):
    """A job `delete_job` removed: its error history as JSON text (None: no errors recorded)."""

    errors: str | None


# What a take's expiry scan reported (its SCANNED row): where it started, how many leases it
# reclaimed, the time it judged them by.
_Scan: TypeAlias = tuple[datetime | None, int, datetime]


def _report(expiry: ExpiryBound | None, scans: list[_Scan]) -> None:
    """Move `expiry` by the reports of committed scans."""
    if expiry is not None:
        for started_at, reclaimed, judged_at in scans:
            expiry.scanned(started_at, reclaimed, judged_at)


async def take(
    conn: Conn,
    topic: str,
    limit: int,
    visibility_timeout: float,
    consumer: str,
    *,
    ordered: bool,
    now: datetime | None = None,
    expiry: ExpiryBound | None = None,
) -> list[TakenJob]:
    """Lease up to `limit` free jobs of `topic` to `consumer` (autocommit on a pool)."""
    return (
        await take_for(
            conn, topic, [consumer], [limit], visibility_timeout, ordered=ordered, now=now, expiry=expiry
        )
    )[0]


async def take_for(
    conn: Conn,
    topic: str,
    consumers: list[str],
    limits: list[int],
    visibility_timeout: float,
    *,
    ordered: bool,
    limited_topics: set[str] | None = None,
    now: datetime | None = None,
    expiry: ExpiryBound | None = None,
    fair: bool = False,
) -> list[list[TakenJob]]:
    """Lease free jobs of `topic` to several takers at once, each up to its limit: the jobs of each.

    `fair` (a queue created with fair=True, taken unordered): TAKE_FAIR, after detaching the
    topic's fresh jobs, as ordered takes do.

    Ordered takes detach the topic's fresh jobs first (one more statement,
    which finds nothing to do while no fresh job arrived). A statement that
    ends with the marker row is sent again for the requests it did not fill
    (at most a few times). A queue with limits answers with the limited
    marker (request -1) and is taken by `take_limited` instead.

    `limited_topics`: the topics the caller last found limited, kept up to
    date here; those are taken by `take_limited` at once, without the
    statement that would answer with the limited marker. `now` (None: the
    server's clock) is the time leases, delays and rate windows are judged by.
    `expiry`: the bound the statements' scans for range leases that ran out
    start at, moved by what they report once committed (None: each scans
    fully); a statement here commits as it returns.
    """
    if limited_topics is not None and topic in limited_topics:
        return await take_limited(
            conn,
            topic,
            consumers,
            limits,
            visibility_timeout,
            ordered=ordered,
            limited_topics=limited_topics,
            now=now,
            expiry=expiry,
        )
    fair = fair and not ordered
    if ordered or fair:
        await detach_fresh(conn, topic)
    statement = TAKE_ORDERED if ordered else TAKE_FAIR if fair else TAKE
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
        if statement is TAKE:
            args.append(next(_turns))
        bound = None if expiry is None else expiry.for_take(now)
        args += (now, bound)
        again = False
        for row in await conn.fetch(statement, *args):
            request = row[REQUEST]
            if request == SCANNED:
                if expiry is not None:
                    expiry.scanned(bound, row[ATTEMPTS], row[CREATED_AT])
                continue
            if request == LIMITED:  # one limited take instead
                if limited_topics is not None:
                    limited_topics.add(topic)
                asking = [i for i, n in enumerate(left) if n > 0]
                limited = await take_limited(
                    conn,
                    topic,
                    [consumers[i] for i in asking],
                    [left[i] for i in asking],
                    visibility_timeout,
                    ordered=ordered,
                    limited_topics=limited_topics,
                    now=now,
                    expiry=expiry,
                )
                for i, rows in zip(asking, limited, strict=True):
                    dealt[i] += rows
                return dealt
            if request == AGAIN:
                again = True
                continue
            i = asking[request - 1]
            dealt[i].append(row)
            left[i] -= 1
        if not again:
            break
    return dealt


@asynccontextmanager
async def _one_connection(conn: Conn) -> AsyncIterator[db.Connection]:
    """A connection of `conn` for a transaction: lent, acquired from the pool, or `conn` itself."""
    if isinstance(conn, db.Lender):
        async with conn.lend() as lent:
            yield lent
    elif isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as acquired:
            yield acquired
    else:
        yield conn


async def take_limited(
    conn: Conn,
    topic: str,
    consumers: list[str],
    limits: list[int],
    visibility_timeout: float,
    *,
    ordered: bool,
    limited_topics: set[str] | None = None,
    now: datetime | None = None,
    expiry: ExpiryBound | None = None,
) -> list[list[TakenJob]]:
    """The take of a queue with a per-key or rate limit: the jobs of each taker.

    Unordered: one TAKE_WITHIN_LIMITS statement, which leases as TAKE does;
    only when it raced another limited take does the take run in a
    transaction that locks the settings row first, and only when a key would
    go over its limit (or for ordered takes) are the fresh jobs detached and
    taken one row at a time (TAKE_LIMITED), the keys at their limit passed
    over. A queue found without limits is dropped from `limited_topics`.
    `expiry` moves by what the statements report once they committed.
    """
    dealt: list[list[TakenJob]] = [[] for _ in consumers]
    left = list(limits)
    outcome = KEY_AT_LIMIT
    scans: list[_Scan] = []
    if not ordered:
        outcome = await _take_within_limits(
            conn, topic, consumers, left, visibility_timeout, dealt, now, expiry, scans
        )
        _report(expiry, scans)
        if outcome == UNLIMITED and limited_topics is not None:
            limited_topics.discard(topic)
        if outcome not in (RACED, KEY_AT_LIMIT):
            return dealt
    scans = []
    rows: list[TakenJob] = []
    asking: list[int] = []
    async with _one_connection(conn) as c, c.transaction():
        if ordered:
            await c.execute(LOCK_AND_DETACH, topic)
        else:
            await c.fetchrow(LOCK_SETTINGS, topic)
            if outcome == RACED:
                outcome = await _take_within_limits(
                    c, topic, consumers, left, visibility_timeout, dealt, now, expiry, scans
                )
            if outcome == KEY_AT_LIMIT:
                await c.execute(DETACH_FRESH, topic)
        asking = [i for i, n in enumerate(left) if n > 0]
        if outcome == KEY_AT_LIMIT and asking:
            total = sum(left[i] for i in asking)
            bound = None if expiry is None else expiry.for_take(now)
            rows = await c.fetch(
                TAKE_LIMITED,
                topic,
                [left[i] for i in asking],
                visibility_timeout,
                [consumers[i] for i in asking],
                total,
                ordered,
                total * 10 + 100,
                now,
                bound,
            )
            scans += [(bound, r[ATTEMPTS], r[CREATED_AT]) for r in rows if r[REQUEST] == SCANNED]
    _report(expiry, scans)  # committed: what the scans reclaimed is gone for every later one
    for row in rows:
        if row[REQUEST] > 0:
            dealt[asking[row[REQUEST] - 1]].append(row)
    return dealt


async def _take_within_limits(
    conn: Conn,
    topic: str,
    consumers: list[str],
    left: list[int],
    visibility_timeout: float,
    dealt: list[list[TakenJob]],
    now: datetime | None,
    expiry: ExpiryBound | None,
    scans: list[_Scan],
) -> int:
    """TAKE_WITHIN_LIMITS, sent again while it says AGAIN: adds to `dealt`, takes from `left`.

    Answers its marker that says why it stopped (RACED, KEY_AT_LIMIT,
    UNLIMITED), or AGAIN when it took what it could. Its scans start at
    `expiry`'s bound; their reports go to `scans`, for the caller to apply
    once they committed.
    """
    outcome = AGAIN
    for _ in range(4):
        asking = [i for i, n in enumerate(left) if n > 0]
        if not asking:
            break
        again = False
        bound = None if expiry is None else expiry.for_take(now)
        rows = await conn.fetch(
            TAKE_WITHIN_LIMITS,
            topic,
            [left[i] for i in asking],
            visibility_timeout,
            [consumers[i] for i in asking],
            sum(left[i] for i in asking),
            next(_turns),
            now,
            bound,
        )
        for row in rows:
            request = row[REQUEST]
            if request > 0:
                i = asking[request - 1]
                dealt[i].append(row)
                left[i] -= 1
            elif request == SCANNED:
                scans.append((bound, row[ATTEMPTS], row[CREATED_AT]))
            elif request == AGAIN:
                again = True
            elif request != LIMITED:
                outcome = request
        if outcome in (RACED, KEY_AT_LIMIT) or not again:
            break
    return outcome


async def partitions(conn: Conn, topic: str) -> dict[int, str]:
    """partition id -> partition name of `topic`."""
    return {r[0]: r[1] for r in await conn.fetch(PARTITIONS, topic)}


async def seconds_until_visible(
    conn: Conn,
    topic: str,
    now: datetime | None = None,
    expiry: ExpiryBound | None = None,
    within: float | None = None,
) -> float | None:
    """Seconds from `now` (None: the server's clock) until the next job of `topic` is free to take.

    <= 0: one is free now; None when it has no jobs. `expiry`: the takes' bound, where the
    look at range leases starts (None: at the topic's first), and what earlier looks found of
    them. `within`: a range lease running out later than that many seconds from now is not
    looked for (None when it is the only one).
    """
    if expiry is None:
        bound, leases, started = None, True, 0.0
    else:
        bound, leases, started = expiry.for_read(now), expiry.lease_look(now), expiry.clock()
    row = await conn.fetchrow(SECONDS_UNTIL_VISIBLE, topic, now, bound, within, leases)
    assert row is not None  # an aggregate
    jobs, lease = row[0], row[1]
    if expiry is not None and leases:
        expiry.looked(now, started, lease, within)
    values = [float(v) for v in (jobs, lease) if v is not None]
    return min(values) if values else None


async def ack(conn: Conn, partition_id: int, offset: int, epoch: int) -> bool:
    """Delete the job if this lease still holds it."""
    return await conn.fetchval(ACK, partition_id, offset, epoch) is not None


async def ack_many(
    conn: Conn, jobs: list[tuple[int, int, int]], leases: Collection[int] = ()
) -> set[tuple[int, int]]:
    """Delete the jobs (partition_id, offset, epoch) still held by these leases; those deleted.

    `leases`: the range leases the jobs came from. Nothing is done with them: a lease whose
    jobs are gone holds nothing and is emptied with its slot (`rotate_leases`).
    """
    del leases  # a lease stays in its slot once its jobs are gone (migration 033)
    rows = await conn.fetch(
        ACK_MANY,
        db.int_array([j[0] for j in jobs]),
        db.int_array([j[1] for j in jobs]),
        db.int_array([j[2] for j in jobs]),
    )
    return {(r[0], r[1]) for r in rows}


# Empty the slots of the lease table that the clock has left (see migration 033): the number of
# slots truncated. $1: the slot leases go to now (NULL: by the server's clock).
ROTATE_LEASES = "SELECT queue_leases_rotate($1::smallint)"
# Seconds between a Bus's rotations of the lease slots (each slot takes ten seconds of leases).
ROTATE_EVERY = 5.0


async def rotate_leases(conn: Conn, current: int | None = None) -> int:
    """Truncate the lease slots no take writes to now, keeping the leases that hold a job; how many.

    Never waits more than a moment for a slot's lock: a slot that a transaction holds (one
    that read the lease table and is still open) keeps its rows until a later rotation.
    `current`: the slot leases go to now (None: by the server's clock).
    """
    return int(await conn.fetchval(ROTATE_LEASES, current))


async def detach_fresh(conn: Conn, topic: str) -> None:
    """Give every fresh job of `topic` its own state (before an ordered take or a dead-letter replay)."""
    await conn.execute(DETACH_FRESH, topic)


async def nack(
    conn: Conn,
    partition_id: int,
    offset: int,
    epoch: int,
    delay: float,
    error: str,
    now: datetime | None = None,
) -> bool:
    """Put the job back `delay` seconds after `now` (None: the server's), recording `error`; False if the lease was lost."""
    return await conn.fetchval(NACK, partition_id, offset, epoch, delay, error, now) is not None


async def return_unacked(conn: Conn, jobs: list[tuple[int, int, int]], now: datetime | None = None) -> None:
    """Give jobs back, free from `now` (None: the server's clock) on (consumer closing)."""
    await conn.execute(RETURN_UNACKED, [j[0] for j in jobs], [j[1] for j in jobs], [j[2] for j in jobs], now)


async def delete_job(conn: Conn, partition_id: int, offset: int, epoch: int) -> RemovedJob | None:
    """Remove the job for dead-lettering; None if the lease was lost."""
    row = await conn.fetchrow(DELETE_JOB, partition_id, offset, epoch)
    return None if row is None else RemovedJob(cast("str | None", row["errors"]))


# Through a transaction pooler the takes run as functions of their text, whose plans the server
# keeps (storage/routines.py): planned at each call, a take of 100 jobs costs about three times as much.
ROUTINES = (TAKE, TAKE_ORDERED, TAKE_FAIR, TAKE_WITHIN_LIMITS, TAKE_LIMITED)
