"""Claims: lease the free partition with the earliest pending message (Queen's pop).

A claim lives on the group's cursor row in `offsets` (the same row a
consumer-group member would own): `owner` is the worker, `lease_epoch` is
bumped on every new lease, and every ack/extend/release is a compare-and-set
on (owner, lease_epoch) (invariants 3 and 4).

Finding the candidate never scans all partitions: `offsets.pending_since`
(the creation time of the cursor's first unread message, NULL when caught
up) is kept by the acks here and by the publish trigger of migration 003,
and the partial index `offsets_pending` orders the pending cursors.

Every statement that recomputes `pending_since` first locks the partition
row FOR SHARE: a publisher holds that row's lock until it commits, so the
recomputation either sees the new message or the publisher's wake-up sees
the cursor already caught up. No wake-up is lost. The recomputation reads the
first unread message in `claim_first_unread_at` (migration 023), whose
snapshot is taken after the lock was granted: the statement's own snapshot,
taken before it waited, would miss the message of the publisher it waited for.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
import msgspec

from storage.db import Conn, Connection

# Topics a wildcard claim targets (labels, like add_matching_topics).
SELECT_LABELLED_TOPICS = """
SELECT name FROM topics
WHERE ($1::text IS NULL OR namespace = $1) AND ($2::text IS NULL OR task = $2)
ORDER BY name
"""

SELECT_GROUP_STATUS = "SELECT status FROM groups WHERE name = $1"

# Partitions of the targeted topics the group has no cursor on yet. `$3` is a
# partition id mark: only ids above it (the cheap incremental discovery of new
# dynamic partitions); 0 means all (the periodic full reconciliation).
SELECT_UNTRACKED_PARTITIONS = """
SELECT p.id FROM partitions p
WHERE p.topic = ANY($2::text[]) AND p.id > $3
  AND NOT EXISTS (SELECT 1 FROM offsets o WHERE o.group_name = $1 AND o.partition_id = p.id)
ORDER BY p.id
"""

MAX_PARTITION_ID = "SELECT COALESCE(MAX(id), 0) FROM partitions"

# Before a group's first cursors on partitions are made: hold the newest heads
# of the ones not claimed yet (waiting for in-flight publishers, which move the
# head first and lock nothing else of an unclaimed partition; migration 029),
# then lock the rows (in id order) and mark them claimed, so that every later
# publish wakes caught-up cursors there (migration 012). Heads before rows, in
# id order, as a publish takes them: no deadlock. Held until commit.
MARK_CLAIMED = """
WITH h AS MATERIALIZED (
    SELECT s.id, log_head_hold(s.id) AS held FROM (SELECT u.id FROM unnest($1::bigint[]) AS u(id) ORDER BY u.id) AS s
), l AS (
    SELECT p.id FROM partitions p JOIN h ON h.id = p.id AND h.held ORDER BY p.id FOR NO KEY UPDATE OF p
)
UPDATE partitions p SET claimed = true FROM l WHERE p.id = l.id AND NOT p.claimed
"""

# After materialize_offsets: mark the new cursors that have something to read.
# The caller holds the partitions' row locks (MARK_CLAIMED; see the module docstring).
SET_PENDING_FOR_NEW = """
UPDATE offsets o
SET pending_since = claim_first_unread_at(p.id, GREATEST(o.committed, p.log_start))
FROM partitions p
WHERE p.id = o.partition_id AND o.group_name = $1 AND o.partition_id = ANY($2::bigint[])
  AND o.pending_since IS NULL
"""

# The free cursor with the earliest pending message, locked (SKIP LOCKED: two
# workers claiming at once take two different partitions).
PICK_CANDIDATE = """
SELECT o.partition_id, o.committed, p.topic, p.name AS partition, p.log_start, p.log_end AS next_offset
FROM offsets o JOIN partitions p ON p.id = o.partition_id
WHERE o.group_name = $1 AND o.pending_since IS NOT NULL
  AND (o.lease_expires_at IS NULL OR o.lease_expires_at < COALESCE($3::timestamptz, clock_timestamp()))
  AND p.topic = ANY($2::text[])
ORDER BY o.pending_since
LIMIT 1
FOR UPDATE OF o SKIP LOCKED
"""

READ_FROM = """
SELECT "offset", key, headers::text AS headers, payload, created_at
FROM messages
WHERE partition_id = $1 AND "offset" >= $2
ORDER BY "offset"
LIMIT $3
"""

# Recompute pending_since from the cursor (a stale candidate: nothing to read). The first unread
# message is read after the partition's lock is granted (claim_first_unread_at, migration 023).
REFRESH_PENDING = """
WITH p AS (SELECT id, log_start FROM partitions WHERE id = $2 FOR SHARE)
UPDATE offsets o
SET pending_since = claim_first_unread_at(p.id, GREATEST(o.committed, p.log_start))
FROM p
WHERE o.group_name = $1 AND o.partition_id = p.id
"""

# Take the lease: new epoch; a cursor below the log start (a dead group that
# came back after retention) is lifted to it.
TAKE_LEASE = """
UPDATE offsets o
SET owner = $3, owner_generation = NULL, lease_epoch = o.lease_epoch + 1,
    lease_expires_at = COALESCE($6::timestamptz, clock_timestamp()) + make_interval(secs => $4),
    committed = GREATEST(o.committed, $5)
WHERE o.group_name = $1 AND o.partition_id = $2
RETURNING o.lease_epoch, o.lease_expires_at
"""

# Group liveness, at most once a second per group (one row every worker would
# otherwise write on each claim).
TOUCH_GROUP = """
UPDATE groups SET last_active_at = clock_timestamp()
WHERE name = $1 AND last_active_at < clock_timestamp() - interval '1 second'
"""

# Ack: advance (never backwards), release, recompute pending_since (as REFRESH_PENDING). Fenced
# on owner+epoch.
ACK = """
WITH p AS (SELECT id, log_start FROM partitions WHERE id = $2 FOR SHARE)
UPDATE offsets o
SET committed = GREATEST(o.committed, $5), committed_at = clock_timestamp(),
    owner = NULL, lease_expires_at = NULL,
    pending_since = claim_first_unread_at(p.id, GREATEST(o.committed, $5, p.log_start))
FROM p
WHERE o.group_name = $1 AND o.partition_id = p.id AND o.owner = $3 AND o.lease_epoch = $4
RETURNING o.committed
"""

RELEASE = """
UPDATE offsets SET owner = NULL, lease_expires_at = NULL
WHERE group_name = $1 AND partition_id = $2 AND owner = $3 AND lease_epoch = $4
RETURNING partition_id
"""

EXTEND = """
UPDATE offsets SET lease_expires_at = COALESCE($6::timestamptz, clock_timestamp()) + make_interval(secs => $5)
WHERE group_name = $1 AND partition_id = $2 AND owner = $3 AND lease_epoch = $4
RETURNING lease_expires_at
"""

LEASE_STATE = """
SELECT owner, lease_epoch, lease_expires_at FROM offsets WHERE group_name = $1 AND partition_id = $2
"""


async def labelled_topics(conn: Conn, namespace: str | None, task: str | None) -> list[str]:
    """Names of the topics carrying these labels."""
    return [r[0] for r in await conn.fetch(SELECT_LABELLED_TOPICS, namespace, task)]


async def group_status(conn: Conn, group: str) -> str | None:
    """The group's status, or None if it does not exist."""
    value = await conn.fetchval(SELECT_GROUP_STATUS, group)
    return None if value is None else str(value)


async def untracked_partitions(conn: Conn, group: str, topics: list[str], above_id: int) -> list[int]:
    """Partition ids of `topics` above `above_id` the group has no cursor on."""
    return [int(r[0]) for r in await conn.fetch(SELECT_UNTRACKED_PARTITIONS, group, topics, above_id)]


async def max_partition_id(conn: Conn) -> int:
    """The highest partition id so far (the mark for incremental discovery)."""
    return int(await conn.fetchval(MAX_PARTITION_ID))


async def mark_claimed(conn: Connection, partition_ids: list[int]) -> None:
    """Lock partition rows (waits for their in-flight publishers) and mark them read by claims, until commit."""
    await conn.execute(MARK_CLAIMED, partition_ids)


async def mark_new_cursors_pending(conn: Connection, group: str, partition_ids: list[int]) -> None:
    """Set pending_since on freshly materialized cursors; call after mark_claimed, in its transaction."""
    await conn.execute(SET_PENDING_FOR_NEW, group, partition_ids)


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """A free cursor with a pending message: the partition and where the group stands in it."""

    partition_id: int
    committed: int
    topic: str
    partition: str
    log_start: int
    next_offset: int


class Lease(msgspec.Struct, frozen=True, gc=False):
    """A lease just taken: its fencing epoch and when it runs out."""

    lease_epoch: int
    lease_expires_at: datetime


class LeaseState(msgspec.Struct, frozen=True, gc=False):
    """Who holds a cursor now (owner None: nobody)."""

    owner: str | None
    lease_epoch: int
    lease_expires_at: datetime | None


async def pick_candidate(
    conn: Connection, group: str, topics: list[str], now: datetime | None = None
) -> Candidate | None:
    """The free cursor with the earliest pending message, row-locked; None if there is none.

    `now` (None: the server's clock) is the time leases are judged expired against; tests move it.
    """
    row = await conn.fetchrow(PICK_CANDIDATE, group, topics, now)
    return None if row is None else Candidate(*row)


async def read_from(conn: Connection, partition_id: int, offset: int, limit: int) -> list[asyncpg.Record]:
    """Up to `limit` messages of the partition from `offset` on."""
    return list(await conn.fetch(READ_FROM, partition_id, offset, limit))


async def refresh_pending(conn: Connection, group: str, partition_id: int) -> None:
    """Recompute the cursor's pending_since (after finding nothing to read)."""
    await conn.execute(REFRESH_PENDING, group, partition_id)


class TakeLeaseParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Whose lease on which (locked) cursor, for how long."""

    group: str
    partition_id: int
    worker: str
    seconds: float
    #: The partition's log start: a cursor below it moves up to it.
    log_start: int
    #: The lease runs from `now` (None: the server's clock).
    now: datetime | None = None


async def take_lease(conn: Connection, params: TakeLeaseParams) -> Lease:
    """Lease the (locked) cursor to the worker with a new epoch, until `now` + seconds."""
    p = params
    row = await conn.fetchrow(TAKE_LEASE, p.group, p.partition_id, p.worker, p.seconds, p.log_start, p.now)
    assert row is not None
    return Lease(*row)


async def touch_group(conn: Conn, group: str) -> None:
    """Record that the group is alive (rate-limited in SQL)."""
    await conn.execute(TOUCH_GROUP, group)


async def ack(
    conn: Conn, group: str, partition_id: int, worker: str, epoch: int, next_offset: int
) -> int | None:
    """Commit `next_offset` and release, if the lease is still ours; the committed offset or None."""
    value = await conn.fetchval(ACK, group, partition_id, worker, epoch, next_offset)
    return None if value is None else int(value)


async def release(conn: Conn, group: str, partition_id: int, worker: str, epoch: int) -> bool:
    """Release without advancing, if the lease is still ours."""
    return await conn.fetchval(RELEASE, group, partition_id, worker, epoch) is not None


class ExtendParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Which lease (the worker's, at its epoch) to push how far."""

    group: str
    partition_id: int
    worker: str
    epoch: int
    seconds: float
    #: The new expiry is `now` + seconds (None: the server's clock).
    now: datetime | None = None


async def extend(conn: Conn, params: ExtendParams) -> datetime | None:
    """Push the lease's expiry to `now` + seconds, if it is still ours; the new expiry or None."""
    p = params
    expires: datetime | None = await conn.fetchval(
        EXTEND, p.group, p.partition_id, p.worker, p.epoch, p.seconds, p.now
    )
    return expires


async def lease_state(conn: Conn, group: str, partition_id: int) -> LeaseState | None:
    """Who holds the cursor now (for error messages)."""
    row = await conn.fetchrow(LEASE_STATE, group, partition_id)
    return None if row is None else LeaseState(*row)
