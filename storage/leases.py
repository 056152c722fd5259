"""Partition leases and fenced commits (invariants 2, 3 and 4).

A PartitionWorker (or a claim) owns a partition of a group by holding the
lease on the group's cursor row: `owner`, a `lease_epoch` bumped on every new
lease, and an expiry. The epoch is the fencing token: every commit, renewal,
fetch-for-commit and release compares owner and epoch in the same statement
that applies it, so a zombie whose lease moved on changes nothing.

Every statement that sets or judges an expiry takes the time it judges by as
its last parameter, `COALESCE($n::timestamptz, clock_timestamp())`: NULL (the
default) is the server's clock; a test's `bus.testing.Clock` moves it, so a
lease runs out without the test sleeping past it.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from storage.db import Conn

# Take the lease if it is free, expired, or already ours (a restarted static
# member), and only while the partition is assigned to this member. $6: now.
ACQUIRE = """
UPDATE offsets o
   SET owner = $3, owner_generation = $4, lease_epoch = o.lease_epoch + 1,
       lease_expires_at = COALESCE($6::timestamptz, clock_timestamp()) + make_interval(secs => $5),
       committed = GREATEST(o.committed, p.log_start)
  FROM partitions p
 WHERE o.group_name = $1 AND o.partition_id = $2 AND p.id = o.partition_id
   AND (o.owner IS NULL OR o.owner = $3 OR o.lease_expires_at <= COALESCE($6::timestamptz, clock_timestamp()))
   AND EXISTS (SELECT 1 FROM members m WHERE m.group_name = $1 AND m.member_id = $3
               AND $2 = ANY(m.assignment))
RETURNING o.lease_epoch, o.committed
"""

# Releasing wakes the partition's next owner (its worker listens on the partition).
RELEASE = """
WITH r AS (
    UPDATE offsets SET owner = NULL, owner_generation = NULL, lease_expires_at = NULL
    WHERE group_name = $1 AND partition_id = $2 AND owner = $3 AND lease_epoch = $4
    RETURNING partition_id
)
SELECT r.partition_id, pg_notify($5, $2::text) FROM r
"""

# A batch of commits for one member; each (partition, offset, epoch) is a
# compare-and-set on owner and epoch with a live lease. Committed offsets only
# move forward (invariant 2); only an admin reset moves them back. $6: now.
COMMIT_FENCED = """
WITH c AS (SELECT * FROM unnest($3::bigint[], $4::bigint[], $5::bigint[]) AS u(pid, off, epoch))
UPDATE offsets o SET committed = GREATEST(o.committed, c.off), committed_at = clock_timestamp()
FROM c
WHERE o.group_name = $1 AND o.partition_id = c.pid AND o.owner = $2 AND o.lease_epoch = c.epoch
  AND o.lease_expires_at > COALESCE($6::timestamptz, clock_timestamp())
RETURNING o.partition_id
"""

# A consumer's commit of all its partitions, all or nothing in one statement (no
# BEGIN/COMMIT round trips): the rows are locked and fence-checked first, and
# the update applies only if every entry passed. Each entry comes back with
# whether it is still owned and its committed offset (to tell a move from a
# re-send of a position already committed). $6: now.
COMMIT_ALL_FENCED = """
WITH c AS (SELECT * FROM unnest($3::bigint[], $4::bigint[], $5::bigint[]) AS u(pid, off, epoch)),
fenced AS (
    SELECT o.partition_id
    FROM offsets o JOIN c ON o.partition_id = c.pid
    WHERE o.group_name = $1 AND o.owner = $2 AND o.lease_epoch = c.epoch
      AND o.lease_expires_at > COALESCE($6::timestamptz, clock_timestamp())
    FOR UPDATE OF o
),
applied AS (
    UPDATE offsets o SET committed = GREATEST(o.committed, c.off), committed_at = clock_timestamp()
    FROM c
    WHERE o.group_name = $1 AND o.partition_id = c.pid
      AND o.partition_id IN (SELECT partition_id FROM fenced)
      AND (SELECT count(*) FROM fenced) = (SELECT count(*) FROM c)
    RETURNING o.partition_id
)
SELECT c.pid, c.pid IN (SELECT partition_id FROM fenced) AS owned,
       (SELECT count(*) FROM applied) > 0 AS applied, o.committed
FROM c LEFT JOIN offsets o ON o.group_name = $1 AND o.partition_id = c.pid
"""

# COMMIT_ALL_FENCED for auto-commit: the same statement, committed without
# waiting for its WAL flush (synchronous_commit off for its own transaction, as
# a queue take). An auto-committed position is soft state: a PostgreSQL crash
# in the moment after may forget it, and the messages are read again
# (at-least-once, as after a process crash between two polls); a clean
# restart forgets nothing.
COMMIT_ALL_SOFT = COMMIT_ALL_FENCED.replace(
    "WITH c AS (SELECT * FROM unnest(",
    "WITH c AS (SELECT *, set_config('synchronous_commit', 'off', true) AS soft FROM unnest(",
    1,
)

# Fetch only while the lease is ours: a zombie reads nothing it could commit. $7: now.
FETCH_FENCED = """
SELECT m."offset", m.key, m.headers::text AS headers, m.payload, m.created_at
FROM messages m
WHERE m.partition_id = $2 AND m."offset" >= $5
  AND EXISTS (SELECT 1 FROM offsets o WHERE o.group_name = $1 AND o.partition_id = $2
              AND o.owner = $3 AND o.lease_epoch = $4
              AND o.lease_expires_at > COALESCE($7::timestamptz, clock_timestamp()))
ORDER BY m."offset"
LIMIT $6
"""

# $3: now.
LEASE_STATE = """
SELECT o.owner, o.lease_epoch, o.lease_expires_at > COALESCE($3::timestamptz, clock_timestamp()) AS live, o.committed, p.log_start, p.log_end AS next_offset
FROM offsets o JOIN partitions p ON p.id = o.partition_id
WHERE o.group_name = $1 AND o.partition_id = $2
"""


async def acquire(
    conn: Conn,
    group: str,
    partition_id: int,
    member_id: str,
    generation: int,
    lease_time: float,
    now: datetime | None = None,
) -> tuple[int, int] | None:
    """(epoch, committed) if the lease is now ours; None if someone else still holds it at `now`.

    `now` (None: the server's clock) is also when the new lease's `lease_time` starts.
    """
    row = await conn.fetchrow(ACQUIRE, group, partition_id, member_id, generation, lease_time, now)
    return None if row is None else (int(row[0]), int(row[1]))


async def release(
    conn: Conn, group: str, partition_id: int, member_id: str, epoch: int, channel: str
) -> bool:
    return await conn.fetchval(RELEASE, group, partition_id, member_id, epoch, channel) is not None


async def commit(
    conn: Conn, group: str, member_id: str, entries: list[tuple[int, int, int]], now: datetime | None = None
) -> set[int]:
    """Apply (partition_id, offset, epoch) commits of leases live at `now`; the partition ids that applied."""
    if not entries:
        return set()
    rows = await conn.fetch(
        COMMIT_FENCED,
        group,
        member_id,
        [e[0] for e in entries],
        [e[1] for e in entries],
        [e[2] for e in entries],
        now,
    )
    return {r[0] for r in rows}


async def commit_all(
    conn: Conn,
    group: str,
    member_id: str,
    entries: list[tuple[int, int, int]],
    *,
    durable: bool = True,
    now: datetime | None = None,
) -> tuple[bool, dict[int, int]]:
    """Apply every (partition_id, offset, epoch) commit or none.

    (applied, {partition_id: committed offset} of the entries no longer owned).
    `durable=False`: the auto-commit's soft commit (COMMIT_ALL_SOFT). `now`:
    the time the leases are judged live at (None: the server's clock).
    """
    rows = await conn.fetch(
        COMMIT_ALL_FENCED if durable else COMMIT_ALL_SOFT,
        group,
        member_id,
        [e[0] for e in entries],
        [e[1] for e in entries],
        [e[2] for e in entries],
        now,
    )
    applied = bool(rows) and bool(rows[0]["applied"])
    return applied, {
        int(r["pid"]): (-1 if r["committed"] is None else int(r["committed"])) for r in rows if not r["owned"]
    }


async def fetch(
    conn: Conn,
    group: str,
    partition_id: int,
    member_id: str,
    epoch: int,
    offset: int,
    limit: int,
    now: datetime | None = None,
) -> list[asyncpg.Record]:
    """Up to `limit` messages from `offset` on, while the lease is ours and live at `now` (None: the server's)."""
    return list(await conn.fetch(FETCH_FENCED, group, partition_id, member_id, epoch, offset, limit, now))


async def state(
    conn: Conn, group: str, partition_id: int, now: datetime | None = None
) -> asyncpg.Record | None:
    """The cursor's owner, epoch, whether its lease is live at `now` (None: the server's), committed, log bounds."""
    return await conn.fetchrow(LEASE_STATE, group, partition_id, now)


# The poll fallback of every idle worker of a process, in one statement: for each (group, member,
# partition, epoch, position) whether a fetch from the position would find messages (`more`) and
# whether the lease of that epoch is still the member's and live (`held`; an epoch of NULL: no lease
# held yet, never reported as lost). Only the entries with something to act on come back.
# $6: now.
IDLE_CHECK = """
SELECT q.i, q.more, q.held FROM (
    SELECT u.i,
           (SELECT m."offset" FROM messages m WHERE m.partition_id = u.pid AND m."offset" >= u.pos
            ORDER BY m."offset" LIMIT 1) IS NOT NULL AS more,
           u.epoch IS NULL OR COALESCE(o.owner = u.mid AND o.lease_epoch = u.epoch
                                       AND o.lease_expires_at > COALESCE($6::timestamptz, clock_timestamp()), false) AS held
    FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[])
         WITH ORDINALITY AS u(g, mid, pid, epoch, pos, i)
    LEFT JOIN offsets o ON o.group_name = u.g AND o.partition_id = u.pid
) AS q
WHERE q.more OR NOT q.held
"""


async def idle_check(
    conn: Conn, entries: list[tuple[str, str, int, int | None, int]], now: datetime | None = None
) -> list[tuple[int, bool, bool]]:
    """For (group, member_id, partition_id, epoch, position) entries: (index, more, held) of those to act on.

    `more`: messages at or past the position; `held`: the lease of that epoch is still live and
    the member's at `now` (None: the server's; always True for an epoch of None). Indexes count from 0.
    """
    if not entries:
        return []
    rows = await conn.fetch(
        IDLE_CHECK,
        [e[0] for e in entries],
        [e[1] for e in entries],
        [e[2] for e in entries],
        [e[3] for e in entries],
        [e[4] for e in entries],
        now,
    )
    return [(int(r[0]) - 1, bool(r[1]), bool(r[2])) for r in rows]
