"""Segments: `messages` partitioned by time, retired whole (migration 007, docs/segments.md).

Retention (storage/retention.py) only moves a partition's `log_start`
forward; every reader starts at `log_start`, so what is below it is gone for
the API at once. The rows themselves leave with their segment: once every row
of a segment is below its partition's log start, the segment is TRUNCATEd (no
dead tuple, no vacuum) and then detached and dropped. `maintain` does this on
each cleaner tick, in this order:

1. make segments ahead of time, so publishes land in a segment, not in the
   DEFAULT partition (width from the shortest and longest retention of the
   delete topics, so a handful of segments covers the longest retention);
2. retire closed segments (and the DEFAULT partition) whose rows are all dead;
3. drop closed segments that are empty;
4. sweep: a closed segment that stays pinned (it also holds rows of a compact
   topic, or of a topic with a longer retention) past a grace period gets its
   dead rows deleted row by row, a bounded batch per pass: the pre-segment
   behaviour, never worse. The DEFAULT partition is swept without grace.

Every step takes its locks with a short `lock_timeout` and gives up (until
the next tick) rather than queue publishers and readers behind it. Several
processes may run cleaners: a session advisory lock lets one maintain at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg

from storage import db
from storage.logs import get_logger

log = get_logger(__name__)

DEFAULT_PARTITION = "messages_default"

#: Width bounds of a new segment, and the width with no delete topic with a retention.
MIN_WIDTH = 5.0
MAX_WIDTH = 86_400.0
IDLE_WIDTH = 3_600.0
#: Segments a retention spans at most (the longest retention / this = the width floor).
SPAN = 48
#: Attached segments at most: past this, new rows go to the DEFAULT partition (swept row by row).
MAX_SEGMENTS = 96
#: How long a closed segment may stay pinned (in widths) before its dead rows are swept.
GRACE_WIDTHS = 4
SWEEP_BATCH = 10_000
LOCK_TIMEOUT = "200ms"
#: Seconds after now that a segment made to catch up starts (see `ensure`).
CATCH_UP_MARGIN = 2.0
# Session advisory lock: one maintainer per schema (the schema name is mixed in).
_MAINTAIN_LOCK = 0x6275_7347

# A queue topic without a retention keeps its acked jobs for its result_ttl (storage/retention.py).
RETENTIONS = """
SELECT min(r), max(r) FROM (
    SELECT COALESCE(t.retention_seconds,
                    CASE WHEN t.semantics = 'queue' THEN COALESCE(s.result_ttl, 86400) END) AS r
    FROM topics t LEFT JOIN queue_settings s ON s.topic = t.name
    WHERE t.cleanup = 'delete'
) AS retentions
WHERE r IS NOT NULL
"""
NOW = "SELECT clock_timestamp()"
LAST_HI = "SELECT max(hi) FROM message_segments"
SEGMENT_COUNT = "SELECT count(*) FROM message_segments"
LOCK_DEFAULT = "LOCK TABLE messages_default IN ACCESS EXCLUSIVE MODE"
DEFAULT_NEWEST = "SELECT max(created_at) FROM messages_default"
CLOSED = "SELECT name, lo, hi FROM message_segments WHERE hi <= clock_timestamp() ORDER BY hi"
ALL_SEGMENTS = "SELECT name, lo, hi FROM message_segments ORDER BY hi"
CREATE = "SELECT message_segment_create($1, $2)"
STATE = "SELECT message_segment_state($1)"
RETIRE = "SELECT message_segment_retire($1)"
DROP = "SELECT message_segment_drop($1)"
SWEEP = "SELECT message_segment_sweep($1, $2)"
SET_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', $1, true)"
TRY_LOCK = "SELECT pg_try_advisory_lock($1, hashtext(current_schema()))"
TRY_XACT_LOCK = "SELECT pg_try_advisory_xact_lock($1, hashtext(current_schema()))"
UNLOCK = "SELECT pg_advisory_unlock($1, hashtext(current_schema()))"

_MICRO = timedelta(microseconds=1)


@dataclass
class Maintenance:
    """What one `maintain` pass did."""

    created: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    swept_rows: int = 0
    freed_bytes: int = 0
    skipped: bool = False  # another process was maintaining


@dataclass(frozen=True)
class Segment:
    """One segment: created_at in [lo, hi); lo None is MINVALUE."""

    name: str
    lo: datetime | None
    hi: datetime


def width_for(min_retention: float | None, max_retention: float | None) -> float:
    """Seconds one new segment spans, from the delete topics' shortest and longest retention.

    A quarter of the shortest retention keeps a retired row's segment at most
    ~1.25x its retention on disk; the longest retention / SPAN bounds how many
    segments it takes to hold it (every read visits each attached segment).
    """
    if min_retention is None or max_retention is None:
        return IDLE_WIDTH
    return min(MAX_WIDTH, max(MIN_WIDTH, min_retention / 4, max_retention / SPAN))


async def segments(conn: asyncpg.Connection | asyncpg.Pool) -> list[Segment]:
    """The attached segments, oldest first (the DEFAULT partition is not one)."""
    return [Segment(r["name"], r["lo"], r["hi"]) for r in await conn.fetch(ALL_SEGMENTS)]


async def ensure(
    conn: asyncpg.Connection, *, width: float, ahead: float, margin: float = CATCH_UP_MARGIN
) -> list[str]:
    """Create segments of `width` seconds until they cover `ahead` seconds past now; returns the new names.

    A new segment starts where the last one ends; if that is (nearly) past (no
    maintainer ran for a while: rows went to the DEFAULT partition), it starts
    `margin` seconds from now instead, and always after the newest
    DEFAULT row, so that ATTACH never finds a row of its range there.
    """
    created: list[str] = []
    step = timedelta(seconds=width)
    while True:
        async with conn.transaction():
            await conn.execute(SET_LOCK_TIMEOUT, LOCK_TIMEOUT)
            now: datetime = await conn.fetchval(NOW)
            last: datetime | None = await conn.fetchval(LAST_HI)
            if last is not None and last >= now + timedelta(seconds=ahead):
                return created
            if int(await conn.fetchval(SEGMENT_COUNT)) >= MAX_SEGMENTS:
                log.warning("segments_at_limit", limit=MAX_SEGMENTS)
                return created
            # No row may enter the DEFAULT partition while the new range is
            # chosen and attached (ATTACH would find it there and fail).
            await conn.execute(LOCK_DEFAULT)
            now = await conn.fetchval(NOW)
            # A publish blocked on that lock already has its created_at (< the
            # commit of this transaction), and PostgreSQL re-checks a row
            # routed to the DEFAULT partition against its new bounds: a
            # segment that starts now would fail it. So a catching-up segment
            # starts a margin later; ahead of time, it starts where the last ends.
            soonest = now + timedelta(seconds=margin)
            lo = soonest if last is None or last < soonest else last
            newest: datetime | None = await conn.fetchval(DEFAULT_NEWEST)
            if newest is not None and newest >= lo:
                lo = newest + _MICRO
            created.append(str(await conn.fetchval(CREATE, lo, lo + step)))


async def _locked(conn: asyncpg.Connection, statement: str, *args: object) -> object:
    """Run one segment function in its own transaction with the short lock timeout; None if it timed out."""
    try:
        async with conn.transaction():
            await conn.execute(SET_LOCK_TIMEOUT, LOCK_TIMEOUT)
            return await conn.fetchval(statement, *args)
    except asyncpg.LockNotAvailableError:
        return None


async def retire_and_drop(
    conn: asyncpg.Connection, *, grace: float, sweep_batch: int = SWEEP_BATCH
) -> Maintenance:
    """Retire dead closed segments and the DEFAULT partition, drop empty closed segments, sweep pinned ones."""
    done = Maintenance()
    now: datetime = await conn.fetchval(NOW)
    for row in await conn.fetch(CLOSED):
        name = str(row["name"])
        state = await conn.fetchval(STATE, name)
        if state == "dead":
            freed = await _locked(conn, RETIRE, name)
            if isinstance(freed, int) and freed >= 0:
                done.retired.append(name)
                done.freed_bytes += freed
                state = "empty"
        if state == "empty":
            if await _locked(conn, DROP, name):
                done.dropped.append(name)
        elif state == "live" and row["hi"] + timedelta(seconds=grace) <= now:
            done.swept_rows += int(await conn.fetchval(SWEEP, name, sweep_batch))
    state = await conn.fetchval(STATE, DEFAULT_PARTITION)
    if state == "dead":
        freed = await _locked(conn, RETIRE, DEFAULT_PARTITION)
        if isinstance(freed, int) and freed >= 0:
            done.retired.append(DEFAULT_PARTITION)
            done.freed_bytes += freed
    elif state == "live":
        done.swept_rows += int(await conn.fetchval(SWEEP, DEFAULT_PARTITION, sweep_batch))
    return done


async def maintain(conn: asyncpg.Connection, *, interval: float) -> Maintenance:
    """One maintenance pass (see the module docstring); `interval` is the caller's tick, in seconds."""
    if db.through_transaction_pooler(conn):
        # A session lock would stay with whichever server connection the pooler lent: the pass
        # runs as one transaction under a transaction-level lock instead (its steps as savepoints).
        async with conn.transaction():
            if not await conn.fetchval(TRY_XACT_LOCK, _MAINTAIN_LOCK):
                return Maintenance(skipped=True)
            return await _maintain(conn, interval)
    if not await conn.fetchval(TRY_LOCK, _MAINTAIN_LOCK):
        return Maintenance(skipped=True)
    try:
        return await _maintain(conn, interval)
    finally:
        await conn.fetchval(UNLOCK, _MAINTAIN_LOCK)


async def _maintain(conn: asyncpg.Connection, interval: float) -> Maintenance:
    """The pass itself, under the maintenance lock."""
    row = await conn.fetchrow(RETENTIONS)  # an aggregate: always one row
    shortest, longest = (None, None) if row is None else (row[0], row[1])
    width = width_for(shortest, longest)
    done = await retire_and_drop(conn, grace=GRACE_WIDTHS * width)
    if shortest is not None:  # nothing would ever retire a segment: rows stay in the DEFAULT partition
        done.created = await ensure(conn, width=width, ahead=max(2 * width, 3 * interval))
    if done.retired or done.dropped or done.swept_rows:
        log.debug(
            "segments_maintained",
            retired=len(done.retired),
            dropped=len(done.dropped),
            swept=done.swept_rows,
            freed_bytes=done.freed_bytes,
        )
    return done
