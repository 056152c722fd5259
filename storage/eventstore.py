"""The event store's SQL: appends with guards, attribute index, group cursors.

Positions come from `es_stores.next_position`, incremented (and so row-locked)
in the appending transaction: appends to one store serialize on that row, so
positions are dense and commit in position order. A guarded append checks for
conflicting events in a statement that runs after it holds that lock, so no
conflicting append can commit between the check and its own commit.

Consumer-group cursors (`es_offsets`) carry `next_position`, a lower bound of
the earliest pending event of their partition whose type the group handles
(the union of the handled types of all its calls, `es_scans.handled_tags`).
Discovery keeps it up to date incrementally (only events appended since the
group's last scan are looked at, a bounded window per step), so finding the
next partition to claim is one index probe however long the log is. A hint
that is too low is harmless: the claimer fetches, finds nothing, clears it and
moves on.

This module runs every statement of the event store and opens every one of
its transactions (a claim and its fetch, a discovery step, a nack that fails
its group, a group's state change), as `storage/leases.py` does for
partition leases: `bus/eventstore.py` calls the functions at the end of this
file with the pool (or one connection) and gets typed structs back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.db import Conn, Connection, Lender

# -- appending -------------------------------------------------------------------

# Unguarded append in one statement: take the positions, insert events and
# their attributes. $2/$3: tags and JSON payloads; $4..$7: one row per
# attribute (1-based event index, name, value, tag).
APPEND_EVENTS = """
WITH s AS (
    INSERT INTO es_stores AS s (name, next_position) VALUES ($1, 1 + cardinality($2::text[]))
    ON CONFLICT (name) DO UPDATE SET next_position = s.next_position + cardinality($2::text[])
    RETURNING s.next_position - cardinality($2::text[]) AS base
), e AS (
    INSERT INTO es_events (store, position, tag, payload)
    SELECT $1, s.base + u.ord - 1, u.tag, u.payload::jsonb
    FROM s, unnest($2::text[], $3::text[]) WITH ORDINALITY AS u(tag, payload, ord)
    RETURNING position, created_at
), a AS (
    INSERT INTO es_attributes (store, position, name, value, tag)
    SELECT $1, s.base + v.idx - 1, v.name, v.value, v.tag
    FROM s, unnest($4::bigint[], $5::text[], $6::text[], $7::text[]) AS v(idx, name, value, tag)
)
SELECT position, created_at FROM e ORDER BY position
"""

# A guarded append in one round trip (the function es_append_guarded, defined in
# the migrations): lock the counter, check the conditions
# with a fresh snapshot, insert. A conflict raises SQLSTATE ES409 with the event in DETAIL.
APPEND_GUARDED = """
SELECT pos, created FROM es_append_guarded($1, $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[],
                                           $7::text[], $8::text[], $9::text[], $10::text[], $11::bigint)
"""
CONFLICT_SQLSTATE = "ES409"

# The last committed position (0 for an empty or unknown store). Reading the
# counter without locking sees its last committed value, and every position
# below it is committed (appends commit while holding the counter).
LAST_POSITION = "SELECT coalesce((SELECT next_position - 1 FROM es_stores WHERE name = $1), 0)"

# -- reading ---------------------------------------------------------------------

READ_ALL = """
SELECT position, tag, payload::text AS payload, created_at
FROM es_events
WHERE store = $1 AND position > $2
ORDER BY position
LIMIT $3
"""

# Events matching any of the conditions (tag, name, value).
READ_MATCHING = """
SELECT e.position, e.tag, e.payload::text AS payload, e.created_at
FROM es_events e
WHERE e.store = $1 AND e.position IN (
    SELECT a.position FROM es_attributes a
    JOIN unnest($3::text[], $4::text[], $5::text[]) AS c(tag, name, value)
      ON a.name = c.name AND a.value = c.value AND a.tag = c.tag
    WHERE a.store = $1 AND a.position > $2)
ORDER BY e.position
LIMIT $6
"""

# -- groups ----------------------------------------------------------------------

REGISTER_GROUP = """
INSERT INTO es_groups (store, name, max_attempts, retry_backoff) VALUES ($1, $2, $3, $4)
ON CONFLICT (store, name) DO NOTHING
"""

GROUP_ROW = """
SELECT status, error_context::text AS error_context, max_attempts, retry_backoff
FROM es_groups WHERE store = $1 AND name = $2
"""

STOP_GROUP = """
UPDATE es_groups SET status = 'stopped', updated_at = clock_timestamp()
WHERE store = $1 AND name = $2
RETURNING name
"""

# Starting clears a failure: the error context goes, and every partition's
# attempt count restarts so a fixed handler gets its full retries.
START_GROUP = """
WITH g AS (
    UPDATE es_groups SET status = 'active', error_context = NULL, updated_at = clock_timestamp()
    WHERE store = $1 AND name = $2
    RETURNING name
), o AS (
    UPDATE es_offsets SET attempts = 0, retry_at = NULL, last_error = NULL
    WHERE store = $1 AND group_name = $2 AND (attempts > 0 OR retry_at IS NOT NULL)
)
SELECT name FROM g
"""

# Forget every cursor (and discovery progress): the group starts over from the
# beginning of the log.
RESET_GROUP = """
WITH g AS (
    SELECT name FROM es_groups WHERE store = $1 AND name = $2
), o AS (
    DELETE FROM es_offsets WHERE store = $1 AND group_name = $2
), s AS (
    DELETE FROM es_scans WHERE store = $1 AND group_name = $2
)
SELECT name FROM g
"""

DELETE_GROUP = "DELETE FROM es_groups WHERE store = $1 AND name = $2 RETURNING name"

FAIL_GROUP = """
UPDATE es_groups SET status = 'failed', error_context = $3::jsonb, updated_at = clock_timestamp()
WHERE store = $1 AND name = $2
"""

CLEAR_STORE = """
WITH g AS (DELETE FROM es_groups WHERE store = $1),
     a AS (DELETE FROM es_attributes WHERE store = $1),
     e AS (DELETE FROM es_events WHERE store = $1)
DELETE FROM es_stores WHERE name = $1
"""

# -- claiming --------------------------------------------------------------------

# One round trip before claiming: the group's status, how far discovery has
# scanned for this partition_by and with which handled types, and the last
# committed position.
CLAIM_STATE = """
SELECT (SELECT status FROM es_groups WHERE store = $1 AND name = $2) AS status,
       coalesce(s.scanned, 0) AS scanned, s.handled_tags,
       coalesce((SELECT next_position - 1 FROM es_stores WHERE name = $1), 0) AS upto
FROM (SELECT 1) AS one
LEFT JOIN es_scans s ON s.store = $1 AND s.group_name = $2 AND s.partition_by = $3::text[]
"""

# Add a call's handled types ($4) to the group's union. A type the union
# lacked sends discovery back to position 0: the hints of the partitions
# already found must come to include that type's events (see migration 009).
ADD_HANDLED_TAGS = """
INSERT INTO es_scans AS s (store, group_name, partition_by, handled_tags)
VALUES ($1, $2, $3::text[], ARRAY(SELECT DISTINCT t FROM unnest($4::text[]) AS t ORDER BY t))
ON CONFLICT (store, group_name, partition_by) DO UPDATE
SET handled_tags = ARRAY(SELECT DISTINCT t FROM unnest(s.handled_tags || $4::text[]) AS t ORDER BY t),
    scanned = CASE WHEN s.handled_tags @> $4::text[] THEN s.scanned ELSE 0 END
RETURNING handled_tags
"""

# Discovery runs one step at a time per (group, partition_by): this lock keeps
# the scanned windows disjoint and contiguous, and the union read with it is
# the one the step uses.
LOCK_SCAN = """
SELECT scanned, handled_tags FROM es_scans WHERE store = $1 AND group_name = $2 AND partition_by = $3::text[]
FOR UPDATE
"""

SET_SCANNED = """
UPDATE es_scans SET scanned = $4 WHERE store = $1 AND group_name = $2 AND partition_by = $3::text[]
"""

# A discovery step must cost in proportion to its window of the log, never to
# the number of partitions the group already has. The cursor tables grow from
# empty during a first discovery, so their statistics are always behind: the
# statements below are shaped so that the only sensible plans probe indexes
# once per event of the window (unique-index arbiters, fenced LATERAL
# subqueries, updates driven by unnested id arrays) instead of joining with
# every cursor of the group.

# New partitions (AND): value tuples of the events in (scanned, upto] that carry
# every partition_by attribute ($3, sorted), whatever their type. Existing
# ones are skipped by the unique index. A new cursor's hint starts at its
# first such event of a handled type ($6, the group's union) in the window;
# BUMP_HINTS, run next, lowers it to the window's events sharing only some of
# its pairs, later steps set it from theirs (if it has none yet), and
# LOOKBACK_HINTS from the events before the window.
DISCOVER_PARTITIONS = """
WITH found AS (
    SELECT t.vals, min(t.position) FILTER (WHERE t.handled) AS first FROM (
        SELECT a.position, array_agg(a.value ORDER BY k.ord) AS vals, bool_and(a.tag = ANY($6::text[])) AS handled
        FROM es_attributes a
        JOIN unnest($3::text[]) WITH ORDINALITY AS k(name, ord) ON a.name = k.name
        WHERE a.store = $1 AND a.position > $4 AND a.position <= $5
        GROUP BY a.position
        HAVING count(*) = cardinality($3::text[])
    ) AS t
    GROUP BY t.vals
), ins AS (
    INSERT INTO es_offsets (store, group_name, names, vals, partition_key, next_position)
    SELECT $1, $2, $3::text[], f.vals,
           (SELECT string_agg(kv.n || ':' || kv.v, '|' ORDER BY kv.o)
              FROM unnest($3::text[], f.vals) WITH ORDINALITY AS kv(n, v, o)),
           f.first
    FROM found f
    ON CONFLICT (store, group_name, names, vals) DO NOTHING
    RETURNING id, vals
), keys AS (
    INSERT INTO es_offset_keys (offset_id, store, group_name, name, value)
    SELECT ins.id, $1, $2, kv.n, kv.v FROM ins, unnest($3::text[], ins.vals) AS kv(n, v)
)
SELECT coalesce(array_agg(id), '{}') FROM ins
"""

# DISCOVER_PARTITIONS for a partition_by of one attribute: an event carries
# at most one value of it, so the partitions are the window's distinct values
# (one hash aggregate, no per-event arrays).
DISCOVER_PARTITIONS_ONE = """
WITH found AS (
    SELECT a.value, min(a.position) FILTER (WHERE a.tag = ANY($6::text[])) AS first
    FROM es_attributes a
    WHERE a.store = $1 AND a.position > $4 AND a.position <= $5 AND a.name = ($3::text[])[1]
    GROUP BY a.value
), ins AS (
    INSERT INTO es_offsets (store, group_name, names, vals, partition_key, next_position)
    SELECT $1, $2, $3::text[], ARRAY[f.value], ($3::text[])[1] || ':' || f.value, f.first
    FROM found f
    ON CONFLICT (store, group_name, names, vals) DO NOTHING
    RETURNING id, vals
), keys AS (
    INSERT INTO es_offset_keys (offset_id, store, group_name, name, value)
    SELECT ins.id, $1, $2, ($3::text[])[1], ins.vals[1] FROM ins
)
SELECT coalesce(array_agg(id), '{}') FROM ins
"""

# New cursors ($2 ids) of a partition_by with several attributes: an event
# before the window ($4 = scanned) may share some of their pairs (a
# CourseCreated before the first UserJoinedCourse of the course): lower the
# hint to the first such event of a handled type ($3). With one attribute
# there is none, since the partition's first event is its discovery.
LOOKBACK_HINTS = """
UPDATE es_offsets o
SET next_position = LEAST(o.next_position, (
        SELECT min(x.position)
        FROM unnest(o.names, o.vals) AS kv(name, value)
        JOIN es_attributes x ON x.store = $1 AND x.name = kv.name AND x.value = kv.value
        WHERE x.tag = ANY($3::text[]) AND x.position <= $4))
FROM unnest($2::bigint[]) AS n(id)
WHERE o.id = n.id
"""

# Partitions touched (OR, by any of their pairs) by handled events in
# (scanned, upto], new ones included: lower their hint. A cursor whose hint is already at or below
# the new event is left alone (no write) unless it is claimed: then `bumps`
# tells the claimer that the hint moved while it held the claim, so its
# release or ack keeps the hint instead of clearing it.
BUMP_HINTS = """
WITH w AS MATERIALIZED (
    SELECT a.position, a.name, a.value
    FROM es_attributes a
    WHERE a.store = $1 AND a.position > $4 AND a.position <= $5
      AND a.name = ANY($3::text[]) AND a.tag = ANY($6::text[])
), touched AS (
    SELECT array_agg(t.id) AS ids, array_agg(t.p) AS ps FROM (
        SELECT c.id, min(w.position) AS p
        FROM w CROSS JOIN LATERAL (
            SELECT o.id, o.position FROM es_offset_keys k JOIN es_offsets o ON o.id = k.offset_id
            WHERE k.store = $1 AND k.group_name = $2 AND k.name = w.name AND k.value = w.value
              AND o.names = $3::text[]
            OFFSET 0
        ) AS c
        WHERE w.position > c.position
        GROUP BY c.id
    ) AS t
)
UPDATE es_offsets o SET next_position = LEAST(o.next_position, t.p), bumps = o.bumps + 1
FROM touched, unnest(touched.ids, touched.ps) AS t(id, p)
WHERE o.id = t.id
  AND (o.next_position IS NULL OR t.p < o.next_position OR o.claimed_by IS NOT NULL)
"""

# Claim the partition with the earliest pending event that nobody holds (or
# whose holder stopped heartbeating for $5 seconds), if the group is active.
# $6: cursors this call already passed over (their pending events are of
# types other workers of the group handle).
CLAIM_PARTITION = """
UPDATE es_offsets o
SET claimed_by = $4, claimed_at = COALESCE($7::timestamptz, clock_timestamp()), claim_bumps = o.bumps
WHERE o.id = (
        SELECT c.id FROM es_offsets c
        WHERE c.store = $1 AND c.group_name = $2 AND c.names = $3::text[]
          AND c.next_position IS NOT NULL
          AND (c.claimed_by IS NULL OR c.claimed_at < COALESCE($7::timestamptz, clock_timestamp()) - make_interval(secs => $5))
          AND (c.retry_at IS NULL OR c.retry_at <= COALESCE($7::timestamptz, clock_timestamp()))
          AND c.id <> ALL($6::bigint[])
        ORDER BY c.next_position, c.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
  AND (o.claimed_by IS NULL OR o.claimed_at < COALESCE($7::timestamptz, clock_timestamp()) - make_interval(secs => $5))
  AND EXISTS (SELECT 1 FROM es_groups g WHERE g.store = $1 AND g.name = $2 AND g.status = 'active')
RETURNING o.id, o.partition_key, o.vals, o.position, o.attempts, o.next_position
"""

# The conditional-AND fetch: candidates share at least one of the partition's
# pairs ($2 names, $3 values); an event is kept unless it carries a partition
# attribute with another value (every partition attribute it has must match).
FETCH_PARTITION = """
SELECT e.position, e.tag, e.payload::text AS payload, e.created_at
FROM es_events e
WHERE e.store = $1
  AND e.position IN (
      SELECT a.position FROM es_attributes a
      JOIN unnest($2::text[], $3::text[]) AS k(name, value) ON a.name = k.name AND a.value = k.value
      WHERE a.store = $1 AND a.tag = ANY($5::text[]) AND a.position > $4)
  AND NOT EXISTS (
      SELECT 1 FROM es_attributes x
      JOIN unnest($2::text[], $3::text[]) AS k(name, value) ON x.name = k.name
      WHERE x.store = $1 AND x.position = e.position AND x.value <> k.value)
ORDER BY e.position
LIMIT $6
"""

# The claim found nothing to hand out (a hint was too low): release, and
# clear the hint unless discovery lowered it meanwhile.
RELEASE_EMPTY = """
UPDATE es_offsets
SET next_position = CASE WHEN bumps = claim_bumps THEN NULL ELSE next_position END,
    claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL
WHERE id = $1 AND claimed_by = $2
"""

# The claim's first event lies after its hint (the hint came from an event that
# shares only some pairs): record the exact value and release, so the next
# claim picks the partition whose pending event really is the earliest.
REQUEUE_EXACT = """
UPDATE es_offsets
SET next_position = CASE WHEN bumps = claim_bumps THEN $3 ELSE next_position END,
    claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL
WHERE id = $1 AND claimed_by = $2
"""


# Advance (never backwards) and release. The hint: unchanged if discovery moved
# it during the claim; just past the ack if more may be pending; else none.
# $6/$7: the claim's last fetched position and whether the fetch was cut
# short, known to the process that claimed (NULL elsewhere: then the hint is
# the conservative "just past the ack", which costs one empty claim at most).
ACK = """
UPDATE es_offsets
SET position = GREATEST(position, $4),
    next_position = CASE
        WHEN claim_bumps IS NULL OR bumps <> claim_bumps THEN next_position
        WHEN $6::bigint IS NULL OR $7::boolean OR $4 < $6::bigint THEN GREATEST(next_position, $4 + 1)
        ELSE NULL END,
    claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL,
    attempts = 0, retry_at = NULL, last_error = NULL
WHERE store = $1 AND group_name = $2 AND id = $3 AND ($5::text IS NULL OR claimed_by = $5)
RETURNING id
"""

RELEASE = """
UPDATE es_offsets
SET claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL
WHERE store = $1 AND group_name = $2 AND id = $3 AND ($4::text IS NULL OR claimed_by = $4)
RETURNING id
"""

OFFSET_EXISTS = "SELECT claimed_by FROM es_offsets WHERE store = $1 AND group_name = $2 AND id = $3"

# A failed attempt: count it, release, and retry after a delay ($5 seconds, or
# the group's backoff doubled per attempt, at most 5 minutes).
NACK = """
UPDATE es_offsets o
SET attempts = o.attempts + 1, last_error = $4,
    retry_at = COALESCE($7::timestamptz, clock_timestamp()) + make_interval(
        secs => coalesce($5::float8, LEAST(300.0, g.retry_backoff * power(2.0, o.attempts)))),
    claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL
FROM es_groups g
WHERE g.store = $1 AND g.name = $2
  AND o.store = $1 AND o.group_name = $2 AND o.id = $3 AND ($6::text IS NULL OR o.claimed_by = $6)
RETURNING o.attempts, g.max_attempts, o.partition_key, o.names, o.vals, o.position
"""

HEARTBEAT = """
UPDATE es_offsets SET claimed_at = COALESCE($3::timestamptz, clock_timestamp()) WHERE store = $1 AND claimed_by = $2
"""

RELEASE_STALE = """
UPDATE es_offsets
SET claimed_by = NULL, claimed_at = NULL, claim_bumps = NULL
WHERE store = $1 AND claimed_by IS NOT NULL
  AND claimed_at < COALESCE($3::timestamptz, clock_timestamp()) - make_interval(secs => $2)
"""

GROUP_OFFSETS = """
SELECT id, partition_key, names, vals, position, next_position, claimed_by, claimed_at, attempts, retry_at, last_error
FROM es_offsets WHERE store = $1 AND group_name = $2
ORDER BY id
"""

# Refresh planner statistics after a bulk load (COPY straight into the tables).
ANALYZE_TABLES = (
    "ANALYZE es_stores, es_events, es_attributes, es_groups, es_scans, es_offsets, es_offset_keys"
)

COUNT_GROUP_ROWS = """
SELECT (SELECT count(*) FROM es_groups WHERE store = $1) AS groups,
       (SELECT count(*) FROM es_offsets WHERE store = $1) AS offsets,
       (SELECT count(*) FROM es_offset_keys WHERE store = $1) AS offset_keys,
       (SELECT count(*) FROM es_events WHERE store = $1) AS events
"""


# -- entry points: every statement above runs through one of these, and every
# transaction of the event store opens here. What they hand back to bus/ is
# typed (the structs below), never a raw record.

# Claims whose hint turned out too low are skipped in a loop; this bounds it.
_MAX_EMPTY_CLAIMS = 1000
# How many times one claim puts back a partition whose hint was too low (to
# hand out the truly earliest one) before it settles for what it holds.
_MAX_REFINEMENTS = 8

_json = msgspec.json.Encoder()


class StoredEvent(msgspec.Struct, frozen=True, gc=False):
    """One event as stored: its position, type tag, JSON payload (text) and append time."""

    position: int
    tag: str
    payload: str
    created_at: datetime


class GroupRow(msgspec.Struct, frozen=True, gc=False):
    """A consumer group's settings and state; `error_context` is JSON text (None unless failed)."""

    status: str
    error_context: str | None
    max_attempts: int
    retry_backoff: float


class ClaimState(msgspec.Struct, frozen=True, gc=False):
    """What a claim needs to know first: the group's status (None: no such group), how far discovery
    scanned for the partition_by and with which handled types (None: never), and the last position."""

    status: str | None
    scanned: int
    handled_tags: list[str] | None
    upto: int


class DiscoveryStep(msgspec.Struct, frozen=True, gc=False):
    """One discovery step: it scanned positions (scanned, upto] of a log ending at `last`
    and created `created` partition cursors."""

    scanned: int
    upto: int
    last: int
    created: int


class ClaimedPartition(msgspec.Struct, frozen=True, gc=False):
    """A claimed partition cursor and its pending events of the handled types.

    `last_read` and `more` bound what the claim read (not only what it hands
    out): the position of the last event fetched, and whether the fetch was
    cut short by its limit. The ack passes them back.
    """

    offset_id: int
    partition_key: str
    vals: list[str]
    attempts: int
    events: list[StoredEvent]
    last_read: int
    more: bool


class OffsetRow(msgspec.Struct, frozen=True, gc=False):
    """One partition cursor of a group (inspection)."""

    offset_id: int
    partition_key: str
    names: list[str]
    vals: list[str]
    position: int
    claimed_by: str | None
    claimed_at: datetime | None
    attempts: int
    retry_at: datetime | None
    last_error: str | None


class OffsetState(msgspec.Struct, frozen=True, gc=False):
    """Why an ack, release or nack matched no cursor: whether the cursor exists
    (then who holds it now) and whether the group exists."""

    exists: bool
    claimed_by: str | None
    group_exists: bool


class NackOutcome(msgspec.Struct, frozen=True, gc=False):
    """A recorded failed attempt: the partition's attempts, the group's limit, and whether
    this attempt failed the group."""

    partition_key: str
    attempts: int
    max_attempts: int
    failed: bool


@asynccontextmanager
async def _connection(conn: Conn) -> AsyncIterator[Connection]:
    """One connection for a transaction: `conn` itself, or one acquired from it if it is a pool or a Lender."""
    if isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as acquired:
            yield acquired
    elif isinstance(conn, Lender):
        async with conn.lend() as lent:
            yield lent
    else:
        yield conn


def _stored(row: asyncpg.Record) -> StoredEvent:
    return StoredEvent(row[0], row[1], row[2], row[3])


def _affected(status: str) -> int:
    """The row count of a command status such as 'UPDATE 3'."""
    return int(status.split()[-1])


# -- appending and reading


async def append(
    conn: Conn,
    store: str,
    tags: list[str],
    payloads: list[str],
    attrs: tuple[list[int], list[str], list[str], list[str]],
) -> list[tuple[int, datetime]]:
    """Append events without a guard, in one statement; (position, created_at) in order."""
    rows = await conn.fetch(APPEND_EVENTS, store, tags, payloads, *attrs)
    return [(r[0], r[1]) for r in rows]


class AppendGuardedParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Events to append to a store, and the guard they are appended under."""

    store: str
    #: One tag and one encoded payload per event.
    tags: list[str]
    payloads: list[str]
    #: The events' partition attributes as parallel arrays: (event index, name, value, tag).
    attrs: tuple[list[int], list[str], list[str], list[str]]
    #: The guard's (tag, name, value) conditions as parallel arrays.
    conditions: tuple[list[str], list[str], list[str]]
    #: No event matching a condition may exist after this position.
    after: int


async def append_guarded(
    conn: Conn, params: AppendGuardedParams
) -> tuple[list[tuple[int, datetime]], dict[str, Any] | None]:
    """Append under a guard in one statement: ([], conflicting event) when a match exists after `after`."""
    p = params
    try:
        rows = await conn.fetch(APPEND_GUARDED, p.store, p.tags, p.payloads, *p.attrs, *p.conditions, p.after)
    except asyncpg.PostgresError as exc:
        if getattr(exc, "sqlstate", None) != CONFLICT_SQLSTATE:
            raise
        conflict: dict[str, Any] = json.loads(getattr(exc, "detail", None) or "{}")
        return [], conflict
    return [(r[0], r[1]) for r in rows], None


async def last_position(conn: Conn, store: str) -> int:
    """The position of the store's last committed event (0 when empty or unknown)."""
    return int(await conn.fetchval(LAST_POSITION, store))


async def read_all(conn: Conn, store: str, after: int, limit: int | None) -> list[StoredEvent]:
    """Every event after position `after`, in order (at most `limit`; None: all)."""
    return [_stored(r) for r in await conn.fetch(READ_ALL, store, after, limit)]


async def read_matching(
    conn: Conn, store: str, after: int, conditions: tuple[list[str], list[str], list[str]], limit: int | None
) -> list[StoredEvent]:
    """The events after `after` matching any (tag, name, value) condition, in order."""
    return [_stored(r) for r in await conn.fetch(READ_MATCHING, store, after, *conditions, limit)]


async def clear(conn: Conn, store: str) -> None:
    """Delete the store: events, attribute index, groups and their cursors."""
    await conn.execute(CLEAR_STORE, store)


# -- groups


async def register_group(conn: Conn, store: str, group: str, max_attempts: int, retry_backoff: float) -> None:
    """Create the group (active) unless it exists."""
    await conn.execute(REGISTER_GROUP, store, group, max_attempts, retry_backoff)


async def group_row(conn: Conn, store: str, group: str) -> GroupRow | None:
    """The group's state and settings; None if it does not exist."""
    row = await conn.fetchrow(GROUP_ROW, store, group)
    if row is None:
        return None
    return GroupRow(
        status=str(row["status"]),
        error_context=row["error_context"],
        max_attempts=int(row["max_attempts"]),
        retry_backoff=float(row["retry_backoff"]),
    )


async def _group_update(conn: Conn, statement: str, store: str, group: str) -> bool:
    async with _connection(conn) as c, c.transaction():
        return await c.fetchval(statement, store, group) is not None


async def stop_group(conn: Conn, store: str, group: str) -> bool:
    """Mark the group stopped; False if it does not exist."""
    return await _group_update(conn, STOP_GROUP, store, group)


async def start_group(conn: Conn, store: str, group: str) -> bool:
    """Mark the group active, clearing a failure and its partitions' attempts; False if it does not exist."""
    return await _group_update(conn, START_GROUP, store, group)


async def reset_group(conn: Conn, store: str, group: str) -> bool:
    """Delete the group's cursors and discovery progress; False if it does not exist."""
    return await _group_update(conn, RESET_GROUP, store, group)


async def delete_group(conn: Conn, store: str, group: str) -> bool:
    """Delete the group and its cursors; False if it does not exist."""
    return await _group_update(conn, DELETE_GROUP, store, group)


async def group_offsets(conn: Conn, store: str, group: str) -> list[OffsetRow]:
    """The group's partition cursors, in creation order."""
    return [
        OffsetRow(
            offset_id=r["id"],
            partition_key=r["partition_key"],
            names=list(r["names"]),
            vals=list(r["vals"]),
            position=r["position"],
            claimed_by=r["claimed_by"],
            claimed_at=r["claimed_at"],
            attempts=r["attempts"],
            retry_at=r["retry_at"],
            last_error=r["last_error"],
        )
        for r in await conn.fetch(GROUP_OFFSETS, store, group)
    ]


# -- discovery


async def claim_state(conn: Conn, store: str, group: str, names: list[str]) -> ClaimState:
    """The group's status, its discovery progress for `names` and the store's last position, in one round trip."""
    row = await conn.fetchrow(CLAIM_STATE, store, group, names)
    assert row is not None  # a SELECT without FROM filters always returns its row
    tags = row["handled_tags"]
    return ClaimState(
        status=row["status"],
        scanned=int(row["scanned"]),
        handled_tags=None if tags is None else list(tags),
        upto=int(row["upto"]),
    )


async def add_handled_tags(
    conn: Conn, store: str, group: str, names: list[str], tags: list[str]
) -> list[str] | None:
    """Add `tags` to the group's union of handled types for `names`; the union (None: no such group).

    A type the union lacked makes discovery start over from position 0.
    """
    try:
        union = await conn.fetchval(ADD_HANDLED_TAGS, store, group, names, tags)
    except asyncpg.ForeignKeyViolationError:
        return None
    return list(union)


async def discover_step(
    conn: Conn, store: str, group: str, names: list[str], window: int
) -> DiscoveryStep | None:
    """Scan up to `window` positions of the log not yet scanned for (group, names), in one transaction.

    Creates the cursors of the new partitions found there and lowers the
    hints of those its handled events touch. None when there is nothing to
    scan: the log is scanned to its end, or the group was reset or deleted.
    """
    async with _connection(conn) as c, c.transaction():
        scan = await c.fetchrow(LOCK_SCAN, store, group, names)
        if scan is None:  # the group was reset or deleted meanwhile
            return None
        scanned, union = int(scan["scanned"]), scan["handled_tags"]
        last = int(await c.fetchval(LAST_POSITION, store))
        if last <= scanned:
            return None
        upto = min(last, scanned + window)
        discover = DISCOVER_PARTITIONS if len(names) > 1 else DISCOVER_PARTITIONS_ONE
        created = await c.fetchval(discover, store, group, names, scanned, upto, union)
        await c.execute(BUMP_HINTS, store, group, names, scanned, upto, union)
        if created and len(names) > 1:
            await c.execute(LOOKBACK_HINTS, store, created, union, scanned)
        await c.execute(SET_SCANNED, store, group, names, upto)
    return DiscoveryStep(scanned=scanned, upto=upto, last=last, created=len(created))


# -- claiming


class ClaimParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Who claims a partition of which group, by which attributes, and which events it handles."""

    store: str
    group: str
    #: The partition attributes (`partition_by`).
    names: list[str]
    worker: str
    #: How long the claim lasts without a heartbeat, in seconds.
    ttl: float
    #: The event types this worker handles.
    handled: set[str]
    #: The event types any worker of the group handles.
    union: list[str]
    max_messages: int
    #: The claim is judged and runs from `now` (None: the server's clock).
    now: datetime | None = None


async def claim(
    conn: Conn, params: ClaimParams, *, unsure: list[int] | None = None
) -> ClaimedPartition | None:
    """Take the partition with the earliest pending event; it and its events of the `handled` types.

    `unsure`, when given, names the cursor of the claim transaction under way:
    if this raises with it non-empty, that claim may have committed although
    the answer to its COMMIT was lost.

    Hints count the events of every type the group handles (`union`), so
    the fetch reads those too: that is what tells "nothing pending for the
    group" (clear the hint) from "pending only for other workers of the
    group, which handle more types" (leave it to them: skipped this call).
    None when nothing is claimable (or the group is not active).
    """
    store, group, names, worker = params.store, params.group, params.names, params.worker
    handled, union, max_messages = params.handled, params.union, params.max_messages
    narrow = not handled.issuperset(union)
    skipped: list[int] = []
    refinements = 0
    async with _connection(conn) as c:
        for _ in range(_MAX_EMPTY_CLAIMS):
            if unsure is not None:
                unsure.clear()  # the previous round's transaction (a release or a requeue) committed
            # The claim and the fetch commit together: a claim whose events never
            # reached the worker (a lost connection, any error) rolls back, instead
            # of staying held by a worker whose heartbeats would keep it forever.
            # Only a commit whose answer is lost can leave one: `unsure` names it.
            async with c.transaction():
                row = await c.fetchrow(
                    CLAIM_PARTITION, store, group, names, worker, params.ttl, skipped, params.now
                )
                if row is None:
                    return None
                offset_id = int(row["id"])
                if unsure is not None:
                    unsure[:] = [offset_id]
                rows = await c.fetch(
                    FETCH_PARTITION, store, names, row["vals"], row["position"], union, max_messages + 1
                )
                if not rows:
                    await c.execute(RELEASE_EMPTY, offset_id, worker)
                    continue
                first = int(rows[0]["position"])
                if first > row["next_position"] and refinements < _MAX_REFINEMENTS:
                    # Another partition may have an earlier pending event: put this
                    # one back under its exact position and pick again.
                    refinements += 1
                    await c.execute(REQUEUE_EXACT, offset_id, worker, first)
                    continue
                more = len(rows) > max_messages
                rows = rows[:max_messages]
                mine = [r for r in rows if r["tag"] in handled] if narrow else rows
                if not mine:
                    # Pending, but only events other workers of the group handle.
                    await c.execute(REQUEUE_EXACT, offset_id, worker, first)
                    skipped.append(offset_id)
                    continue
            return ClaimedPartition(
                offset_id=offset_id,
                partition_key=row["partition_key"],
                vals=list(row["vals"]),
                attempts=int(row["attempts"]),
                events=[_stored(r) for r in mine],
                # The bounds of what was read, not of what is handed out: the ack
                # must not clear a hint that still covers other workers' events.
                last_read=int(rows[-1]["position"]),
                more=more,
            )
    return None


class AckParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Which claimed partition's cursor to advance to which position."""

    store: str
    group: str
    offset_id: int
    position: int
    #: Only this worker's claim matches (None: anyone's).
    worker: str | None = None
    #: The claim's bounds when known (ClaimedPartition), else None.
    last_read: int | None = None
    more: bool | None = None


async def ack(conn: Conn, params: AckParams) -> bool:
    """Advance the cursor to `position` (never back) and release it; False if no cursor matched."""
    p = params
    return (
        await conn.fetchval(ACK, p.store, p.group, p.offset_id, p.position, p.worker, p.last_read, p.more)
        is not None
    )


async def release(conn: Conn, store: str, group: str, offset_id: int, worker: str | None) -> bool:
    """Release the claim without advancing; False if no cursor matched (with `worker`: held by it)."""
    return await conn.fetchval(RELEASE, store, group, offset_id, worker) is not None


class NackParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Which claimed partition failed, why, and when to retry it."""

    store: str
    group: str
    offset_id: int
    error: str
    #: Retry after this many seconds (None: the group's backoff).
    delay: float | None = None
    #: Only this worker's claim matches (None: anyone's).
    worker: str | None = None
    #: The retry delay runs from `now` (None: the server's clock).
    now: datetime | None = None


async def nack(conn: Conn, params: NackParams) -> NackOutcome | None:
    """Record a failed attempt and release the claim for a retry after `delay`.

    The attempt that reaches the group's max_attempts marks the group failed,
    with the partition, position, attempts, error and worker as its error
    context, in the same transaction. None if no cursor matched.
    """
    store, group, offset_id, error, worker = (
        params.store,
        params.group,
        params.offset_id,
        params.error,
        params.worker,
    )
    async with _connection(conn) as c, c.transaction():
        row = await c.fetchrow(NACK, store, group, offset_id, error, params.delay, worker, params.now)
        if row is None:
            return None
        attempts, max_attempts = int(row["attempts"]), int(row["max_attempts"])
        failed = attempts >= max_attempts
        if failed:
            context = {
                "offset_id": offset_id,
                "partition_key": row["partition_key"],
                "partition_value": dict(zip(row["names"], row["vals"], strict=True)),
                "position": row["position"],
                "attempts": attempts,
                "error": error,
                "worker_id": worker,
            }
            await c.execute(FAIL_GROUP, store, group, _json.encode(context).decode())
    return NackOutcome(
        partition_key=row["partition_key"], attempts=attempts, max_attempts=max_attempts, failed=failed
    )


async def offset_state(conn: Conn, store: str, group: str, offset_id: int) -> OffsetState:
    """Whether the group's cursor `offset_id` exists (and who holds it), and whether the group does."""
    row = await conn.fetchrow(OFFSET_EXISTS, store, group, offset_id)
    if row is not None:
        return OffsetState(exists=True, claimed_by=row["claimed_by"], group_exists=True)
    group_exists = await conn.fetchrow(GROUP_ROW, store, group) is not None
    return OffsetState(exists=False, claimed_by=None, group_exists=group_exists)


async def heartbeat(conn: Conn, store: str, worker: str, now: datetime | None = None) -> int:
    """Refresh every claim `worker` holds in the store; how many it holds."""
    return _affected(await conn.execute(HEARTBEAT, store, worker, now))


async def release_stale(conn: Conn, store: str, ttl: float, now: datetime | None = None) -> int:
    """Release the store's claims not heartbeaten for `ttl` seconds; how many."""
    return _affected(await conn.execute(RELEASE_STALE, store, ttl, now))
