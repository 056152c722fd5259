"""Group membership: members, heartbeats, session sweeps, leadership, assignments.

Membership changes never rebalance on the spot: they set `rebalance_due_at`
(kept if already set), so a burst of joins and leaves inside
`rebalance_delay` becomes one rebalance, run by the leader's Rebalancer.
While a group forms (no member holds a partition yet) each join moves the
rebalance to `rebalance_delay` after it, up to 10 x `rebalance_delay` after
its earliest member joined: processes that start together, each joining its
members one by one, make one generation instead of one per wave.

Sessions (`last_heartbeat` against `session_timeout`) and the partition leases
a heartbeat renews are written and judged at a `now` the statements take as a
parameter, `COALESCE($n::timestamptz, clock_timestamp())`: NULL (the default)
is the server's clock; a test's `bus.testing.Clock` moves it. Rebalance delays
always run on the server's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from storage.db import Conn, Connection

# $1 group, $2 member_id, $3 instance_id, $4 client_id, $5 host, $6 pid, $7 topics,
# $8 session_timeout, $9 rebalance_delay, $10 the member's group protocol, $11 now (the session's
# clock; NULL: the server's). A static member (instance_id) that comes
# back before its session expired takes its row over: same member id, same
# assignment, no rebalance.
JOIN = """
WITH prev AS (
    SELECT member_id FROM members
    WHERE group_name = $1 AND member_id = $2
      AND last_heartbeat > COALESCE($11::timestamptz, clock_timestamp()) - make_interval(secs => session_timeout)
), up AS (
    INSERT INTO members (group_name, member_id, instance_id, client_id, host, pid, topics, session_timeout,
                         protocol, last_heartbeat)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $10, COALESCE($11::timestamptz, clock_timestamp()))
    ON CONFLICT (group_name, member_id) DO UPDATE
       SET client_id = EXCLUDED.client_id, host = EXCLUDED.host, pid = EXCLUDED.pid,
           topics = EXCLUDED.topics, session_timeout = EXCLUDED.session_timeout, protocol = EXCLUDED.protocol,
           last_heartbeat = EXCLUDED.last_heartbeat
    RETURNING member_id, generation
), g AS (
    UPDATE groups
       SET leader = CASE WHEN leader IS NULL
                          OR NOT EXISTS (SELECT 1 FROM members m WHERE m.group_name = $1 AND m.member_id = groups.leader)
                         THEN $2 ELSE leader END,
           rebalance_due_at = CASE WHEN EXISTS (SELECT 1 FROM prev) THEN rebalance_due_at
                                   -- Forming (no member holds a partition yet): each join moves the
                                   -- rebalance to $9 after it, up to 10 x $9 after the earliest member
                                   -- joined, so processes starting together form one generation.
                                   WHEN NOT EXISTS (SELECT 1 FROM members m WHERE m.group_name = $1
                                                    AND cardinality(m.assignment) > 0)
                                   THEN GREATEST(
                                       COALESCE(rebalance_due_at, clock_timestamp() + make_interval(secs => $9)),
                                       LEAST(clock_timestamp() + make_interval(secs => $9),
                                             COALESCE((SELECT min(m.joined_at) FROM members m WHERE m.group_name = $1),
                                                      clock_timestamp()) + make_interval(secs => 10 * $9)))
                                   ELSE COALESCE(rebalance_due_at, clock_timestamp() + make_interval(secs => $9)) END,
           state = CASE WHEN EXISTS (SELECT 1 FROM prev) THEN state ELSE 'preparing_rebalance' END,
           status = 'active',
           last_active_at = clock_timestamp(),
           updated_at = clock_timestamp()
     WHERE name = $1
    RETURNING generation, leader
)
SELECT up.member_id, g.generation, g.leader, EXISTS (SELECT 1 FROM prev) AS rejoined FROM up, g
"""

# Leaving: release the member's leases, drop it, schedule a rebalance, hand leadership on.
LEAVE = """
WITH rel AS (
    UPDATE offsets SET owner = NULL, owner_generation = NULL, lease_expires_at = NULL
    WHERE group_name = $1 AND owner = $2
), del AS (
    DELETE FROM members WHERE group_name = $1 AND member_id = $2 RETURNING member_id
)
UPDATE groups
   SET rebalance_due_at = CASE WHEN EXISTS (SELECT 1 FROM members m WHERE m.group_name = $1 AND m.member_id <> $2)
                               THEN COALESCE(rebalance_due_at, clock_timestamp() + make_interval(secs => $3)) END,
       state = CASE WHEN EXISTS (SELECT 1 FROM members m WHERE m.group_name = $1 AND m.member_id <> $2)
                    THEN 'preparing_rebalance' ELSE 'empty' END,
       last_active_at = clock_timestamp(),
       leader = CASE WHEN leader = $2 THEN
                    (SELECT m.member_id FROM members m WHERE m.group_name = $1 AND m.member_id <> $2
                     ORDER BY m.joined_at, m.member_id LIMIT 1)
                ELSE leader END,
       updated_at = clock_timestamp()
 WHERE name = $1 AND EXISTS (SELECT 1 FROM del)
RETURNING name
"""

# One statement for every local member of every group: their heartbeats and
# their leases; back come each group's generation and leader. It never locks a
# group row (a group's liveness is its members' heartbeats), so it cannot
# deadlock with a rebalance, which locks the group row first, then members. $4: now.
# A lease is renewed once a quarter of it has run ($3 is lease_time), not at every beat: renewing
# every owned partition's cursor row at every beat would be, at thousands of partitions and short
# heartbeats, most of what the server writes for an idle group (each beat of each process
# rewriting the rows of its hundred partitions). A lease still held has three quarters of its time
# left, less one heartbeat, at worst. Only the leases of the partitions assigned to the member are
# renewed: one whose release failed when a rebalance moved it away (the database was away) runs out
# and goes to its new owner, instead of being kept by the old one's beats while nobody reads it.
HEARTBEAT = """
WITH hb AS (
    UPDATE members m SET last_heartbeat = COALESCE($4::timestamptz, clock_timestamp())
    FROM unnest($1::text[], $2::text[]) AS u(g, mid)
    WHERE m.group_name = u.g AND m.member_id = u.mid
      AND m.last_heartbeat > COALESCE($4::timestamptz, clock_timestamp()) - make_interval(secs => m.session_timeout)
    RETURNING m.group_name, m.member_id, m.generation, m.assignment
), leases AS (
    UPDATE offsets o SET lease_expires_at = COALESCE($4::timestamptz, clock_timestamp()) + make_interval(secs => $3)
    FROM hb
    WHERE o.group_name = hb.group_name AND o.owner = hb.member_id AND o.partition_id = ANY (hb.assignment)
      AND o.lease_expires_at > COALESCE($4::timestamptz, clock_timestamp())
      AND o.lease_expires_at < COALESCE($4::timestamptz, clock_timestamp()) + make_interval(secs => $3 * 0.75)
)
SELECT hb.group_name, hb.member_id, hb.generation AS member_generation,
       g.generation AS group_generation, g.leader, g.state
FROM hb JOIN groups g ON g.name = hb.group_name
"""

# Members whose session expired, in any process. Lock order everywhere: the
# group row first, then member rows (as the Rebalancer does). DELETE …
# RETURNING with SKIP LOCKED: two processes sweeping at once never remove a
# member twice. $1 (EXPIRED_GROUPS), $2 (SWEEP_MEMBERS): now.
EXPIRED_GROUPS = """
SELECT DISTINCT group_name FROM members
WHERE last_heartbeat < COALESCE($1::timestamptz, clock_timestamp()) - make_interval(secs => session_timeout)
ORDER BY group_name
"""

# NO KEY UPDATE: the row is serialized among group writers, while foreign-key
# checks (KEY SHARE) of inserts into members/offsets never wait on it.
LOCK_GROUPS = "SELECT name FROM groups WHERE name = ANY($1::text[]) ORDER BY name FOR NO KEY UPDATE"

SWEEP_MEMBERS = """
WITH gone AS (
    DELETE FROM members
    WHERE (group_name, member_id) IN (
        SELECT group_name, member_id FROM members
        WHERE group_name = ANY($1::text[])
          AND last_heartbeat < COALESCE($2::timestamptz, clock_timestamp()) - make_interval(secs => session_timeout)
        FOR UPDATE SKIP LOCKED)
    RETURNING group_name, member_id
), rel AS (
    UPDATE offsets o SET owner = NULL, owner_generation = NULL, lease_expires_at = NULL
    FROM gone WHERE o.group_name = gone.group_name AND o.owner = gone.member_id
)
SELECT group_name, member_id FROM gone
"""

# After a sweep: schedule the rebalance and move leadership off removed leaders.
AFTER_SWEEP = """
UPDATE groups g
   SET rebalance_due_at = CASE WHEN EXISTS (SELECT 1 FROM members m WHERE m.group_name = g.name
                                            AND m.member_id <> ALL($3::text[]))
                               THEN COALESCE(rebalance_due_at, clock_timestamp() + make_interval(secs => $2)) END,
       state = CASE WHEN EXISTS (SELECT 1 FROM members m WHERE m.group_name = g.name AND m.member_id <> ALL($3::text[]))
                    THEN 'preparing_rebalance' ELSE 'empty' END,
       last_active_at = clock_timestamp(),
       leader = CASE WHEN g.leader = ANY($3::text[]) OR g.leader IS NULL THEN
                    (SELECT m.member_id FROM members m WHERE m.group_name = g.name
                     AND m.member_id <> ALL($3::text[])
                     ORDER BY m.joined_at, m.member_id LIMIT 1)
                ELSE g.leader END,
       updated_at = clock_timestamp()
 WHERE g.name = ANY($1::text[])
RETURNING g.name
"""

SELECT_ASSIGNMENT = """
SELECT m.generation, m.assignment, g.generation AS group_generation, g.leader
FROM members m JOIN groups g ON g.name = m.group_name
WHERE m.group_name = $1 AND m.member_id = $2
"""

PARTITION_NAMES = "SELECT id, topic, name FROM partitions WHERE id = ANY($1::bigint[])"

# --- the Rebalancer ---------------------------------------------------------------

LOCK_GROUP_FOR_REBALANCE = """
SELECT name, generation, state, leader, assignor, rebalance_due_at,
       rebalance_due_at IS NOT NULL AND rebalance_due_at <= clock_timestamp() AS due
FROM groups WHERE name = $1 FOR NO KEY UPDATE
"""

# $2: now.
LIVE_MEMBERS = """
SELECT member_id, instance_id, topics, assignment, joined_at, COALESCE(protocol, 1) AS protocol
FROM members
WHERE group_name = $1
  AND last_heartbeat > COALESCE($2::timestamptz, clock_timestamp()) - make_interval(secs => session_timeout)
ORDER BY member_id
"""

GROUP_PARTITION_LIST = """
SELECT p.id, p.topic, p.name
FROM group_topics gt JOIN partitions p ON p.topic = gt.topic
WHERE gt.group_name = $1
ORDER BY p.topic, p.id
"""

PARTITION_FINGERPRINT = """
SELECT count(*) AS n, COALESCE(max(p.id), 0) AS max_id, COALESCE(sum(p.id), 0) AS sum_id
FROM group_topics gt JOIN partitions p ON p.topic = gt.topic
WHERE gt.group_name = $1
"""

WRITE_ASSIGNMENTS = """
UPDATE members m SET assignment = u.parts::bigint[], generation = $3
FROM (SELECT mid, parts FROM unnest($2::text[], $4::text[]) AS x(mid, parts)) AS u
WHERE m.group_name = $1 AND m.member_id = u.mid
"""

FINISH_REBALANCE = """
UPDATE groups SET generation = $2, state = $3, protocol = $4, rebalance_due_at = NULL,
                  updated_at = clock_timestamp()
WHERE name = $1
"""

REQUEST_REBALANCE = """
UPDATE groups SET rebalance_due_at = COALESCE(rebalance_due_at, clock_timestamp() + make_interval(secs => $2)),
                  state = 'preparing_rebalance', updated_at = clock_timestamp()
WHERE name = $1
"""

# Stable once every assigned partition's lease is held by the member it is assigned to (live at $3: now).
MARK_STABLE = """
UPDATE groups g SET state = 'stable', updated_at = clock_timestamp()
WHERE g.name = $1 AND g.generation = $2 AND g.state = 'rebalancing' AND g.rebalance_due_at IS NULL
  AND NOT EXISTS (
      SELECT 1 FROM members m CROSS JOIN LATERAL unnest(m.assignment) AS a(pid)
      LEFT JOIN offsets o ON o.group_name = m.group_name AND o.partition_id = a.pid
      WHERE m.group_name = g.name
        AND (o.owner IS DISTINCT FROM m.member_id
             OR o.lease_expires_at <= COALESCE($3::timestamptz, clock_timestamp())))
RETURNING name
"""

NOTIFY = "SELECT pg_notify($1, $2)"


#: The group protocol this release speaks: what a member records at join. Release 0.1.0
#: records none (protocol 1). Raise it with a change to what members and leaders exchange
#: (the member rows, the assignment), and keep serving every lower version still released.
PROTOCOL = 1

SELECT_GROUP_PROTOCOL = "SELECT protocol FROM groups WHERE name = $1"


def group_protocol(spoken: Iterable[int | None]) -> int:
    """The protocol a group runs on: the lowest its members speak (none recorded: 1)."""
    return min((p or 1 for p in spoken), default=PROTOCOL)


async def current_protocol(conn: Conn, group: str) -> int | None:
    """The protocol of the group's current generation (None before the first rebalance)."""
    value = await conn.fetchval(SELECT_GROUP_PROTOCOL, group)
    return None if value is None else int(value)


class JoinParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Who joins a group, what it reads and how long its session lasts without a heartbeat."""

    group: str
    member_id: str
    #: A static member's id (`instance_id=`): back before its session expired, it takes its row over.
    instance_id: str | None
    client_id: str
    host: str
    pid: int
    topics: list[str]
    session_timeout: float
    #: How long membership changes gather before the leader rebalances.
    rebalance_delay: float
    #: When the session starts (None: the server's clock).
    now: datetime | None = None


async def join(conn: Connection, params: JoinParams) -> asyncpg.Record:
    """Join the group: the member row (taken over by a static member still live), leadership, a rebalance due."""
    p = params
    async with conn.transaction():
        await conn.execute(LOCK_GROUPS, [p.group])
        row = await conn.fetchrow(
            JOIN,
            p.group,
            p.member_id,
            p.instance_id,
            p.client_id,
            p.host,
            p.pid,
            p.topics,
            p.session_timeout,
            p.rebalance_delay,
            PROTOCOL,
            p.now,
        )
    assert row is not None, "group row missing at join: record_group must run first"
    return row


async def leave(conn: Connection, group: str, member_id: str, delay: float, channel: str) -> None:
    async with conn.transaction():
        await conn.execute(LOCK_GROUPS, [group])
        await conn.execute(LEAVE, group, member_id, delay)
        await conn.execute(NOTIFY, channel, group)


async def heartbeat(
    conn: Conn, groups: list[str], members: list[str], lease_time: float, now: datetime | None = None
) -> list[asyncpg.Record]:
    """Beat for the members whose session is live at `now` (None: the server's clock), renewing their leases."""
    return list(await conn.fetch(HEARTBEAT, groups, members, lease_time, now))


async def sweep(
    conn: Connection, delay: float, channel: str, now: datetime | None = None
) -> list[tuple[str, str]]:
    """Remove members whose session expired at `now` (None: the server's clock), of any process.

    Returns the (group, member) removed.
    """
    candidates = [r[0] for r in await conn.fetch(EXPIRED_GROUPS, now)]
    if not candidates:
        return []
    async with conn.transaction():
        await conn.execute(LOCK_GROUPS, candidates)
        gone = [(r[0], r[1]) for r in await conn.fetch(SWEEP_MEMBERS, candidates, now)]
        if gone:
            groups = sorted({g for g, _ in gone})
            await conn.execute(AFTER_SWEEP, groups, delay, [m for _, m in gone])
            for g in groups:
                await conn.execute(NOTIFY, channel, g)
    return gone


async def assignment(conn: Conn, group: str, member_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(SELECT_ASSIGNMENT, group, member_id)


async def partition_names(conn: Conn, ids: list[int]) -> dict[int, tuple[str, str]]:
    return {r[0]: (r[1], r[2]) for r in await conn.fetch(PARTITION_NAMES, ids)}


async def request_rebalance(conn: Conn, group: str, delay: float) -> None:
    await conn.execute(REQUEST_REBALANCE, group, delay)


async def partition_fingerprint(conn: Conn, group: str) -> tuple[int, int, int]:
    row = await conn.fetchrow(PARTITION_FINGERPRINT, group)
    assert row is not None
    return (int(row[0]), int(row[1]), int(row[2]))


async def mark_stable(conn: Conn, group: str, generation: int, now: datetime | None = None) -> bool:
    """Mark the group stable once its members hold their partitions' leases, live at `now` (None: the server's)."""
    return await conn.fetchval(MARK_STABLE, group, generation, now) is not None


class RebalanceOutcome:
    """What one rebalance wrote (or why it did not)."""

    def __init__(
        self, ran: bool, generation: int, moved: int = 0, reason: str = "", protocol: int | None = None
    ) -> None:
        self.ran = ran
        self.protocol = protocol
        self.generation = generation
        self.moved = moved
        self.reason = reason


class RebalanceParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Which group to rebalance, on behalf of which leader, and whom to tell."""

    group: str
    leader_id: str
    #: The NOTIFY channel the group's members listen on.
    channel: str
    #: Rebalance even if none is due.
    force: bool = False
    #: Live members are those whose session has not run out at `now` (None: the server's clock).
    now: datetime | None = None


async def rebalance(conn: Connection, params: RebalanceParams, compute: Any) -> RebalanceOutcome:
    """Run one rebalance of the group if it is due (or forced) and the leader named still leads it.

    `compute(members, partitions, assignor)` gets the live members (member_id,
    instance_id, topics, previous assignment) and the group's partitions (id,
    topic, name) and returns {member_id: [partition ids]}. Generation and every
    member's assignment are written in one transaction, then a NOTIFY tells
    the members.
    """
    from storage.groups import materialize_offsets

    group = params.group
    async with conn.transaction():
        g = await conn.fetchrow(LOCK_GROUP_FOR_REBALANCE, group)
        if g is None:
            return RebalanceOutcome(False, 0, reason="group gone")
        if g["leader"] != params.leader_id:
            return RebalanceOutcome(False, g["generation"], reason="not leader")
        if not (g["due"] or params.force):
            return RebalanceOutcome(False, g["generation"], reason="not due")
        members = list(await conn.fetch(LIVE_MEMBERS, group, params.now))
        parts = list(await conn.fetch(GROUP_PARTITION_LIST, group))
        await materialize_offsets(conn, group, [p["id"] for p in parts])
        plan: dict[str, list[int]] = compute(members, parts, g["assignor"])
        generation = g["generation"] + 1
        before = {m["member_id"]: set(m["assignment"]) for m in members}
        moved = sum(len(set(plan.get(mid, [])) - before.get(mid, set())) for mid in plan)
        mids = [m["member_id"] for m in members]
        await conn.execute(
            WRITE_ASSIGNMENTS,
            group,
            mids,
            generation,
            ["{" + ",".join(str(p) for p in sorted(plan.get(mid, []))) + "}" for mid in mids],
        )
        state = "empty" if not members else ("rebalancing" if moved else "stable")
        protocol = group_protocol(m["protocol"] for m in members)
        await conn.execute(FINISH_REBALANCE, group, generation, state, protocol)
        await conn.execute(NOTIFY, params.channel, group)
    return RebalanceOutcome(True, generation, moved, protocol=protocol)
