"""Consumer groups: the group row, its subscription start, topics and cursors.

The start is recorded once, when the group row is first inserted (invariant 6);
every cursor the group later materializes, on any partition of any topic,
is computed from that record, never from "now".
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import asyncpg
import msgspec

from storage.db import Conn, Connection

# $1 name, $2 start_mode, $3 start_time (timestamp mode), $4 start_offsets json,
# $5 lookback seconds (latest mode), $6 assignor, $7 namespace, $8 task
RECORD_GROUP = """
INSERT INTO groups (name, start_mode, start_time, start_offsets, assignor, namespace, task)
VALUES ($1, $2,
        CASE WHEN $2 = 'latest' THEN clock_timestamp() - make_interval(secs => $5) ELSE $3 END,
        $4::jsonb, $6, $7, $8)
ON CONFLICT (name) DO NOTHING
RETURNING name
"""

SELECT_GROUP = """
SELECT name, generation, state, status, leader, assignor, start_mode, start_time,
       start_offsets::text AS start_offsets, recorded_at, namespace, task,
       rebalance_due_at, last_active_at
FROM groups WHERE name = $1
"""

# A dead or cancelled group that comes back resumes (from its cursors, or the log start).
REVIVE_GROUP = """
UPDATE groups SET status = 'active', last_active_at = clock_timestamp(), updated_at = clock_timestamp()
WHERE name = $1 AND status IN ('dead', 'cancelled')
RETURNING name
"""

ADD_GROUP_TOPICS = """
INSERT INTO group_topics (group_name, topic)
SELECT $1, t FROM unnest($2::text[]) AS t
ON CONFLICT DO NOTHING
"""

# Topics matched by the group's labels (wildcard subscriptions), added to group_topics.
ADD_MATCHING_TOPICS = """
INSERT INTO group_topics (group_name, topic)
SELECT g.name, t.name FROM groups g JOIN topics t
  ON (g.namespace IS NULL OR t.namespace = g.namespace)
 AND (g.task IS NULL OR t.task = g.task)
 AND (g.namespace IS NOT NULL OR g.task IS NOT NULL)
WHERE g.name = $1
ON CONFLICT DO NOTHING
"""

SELECT_GROUP_TOPICS = "SELECT topic FROM group_topics WHERE group_name = $1 ORDER BY topic"

# Create the group's cursor on each partition, at the position its recorded
# start gives: 'earliest' the log start; 'latest'/'timestamp' the first message
# created at or after start_time (or the end when there is none); 'offsets' the
# given offset. Never below the log start. Existing cursors are left alone.
# The offset a group's recorded start gives on partition p (aliases: g groups, p partitions).
START_OFFSET = """
GREATEST(p.log_start, CASE g.start_mode
    WHEN 'earliest' THEN p.log_start
    WHEN 'offsets' THEN COALESCE((g.start_offsets -> p.topic ->> p.name)::bigint, p.log_start)
    ELSE COALESCE((SELECT m."offset" FROM messages m
                   WHERE m.partition_id = p.id AND m.created_at >= g.start_time
                   ORDER BY m.created_at, m."offset" LIMIT 1),
                  p.log_end)
END)"""

MATERIALIZE_OFFSETS = (
    """
INSERT INTO offsets (group_name, partition_id, committed)
SELECT g.name, p.id, """
    + START_OFFSET
    + """
FROM groups g JOIN partitions p ON p.id = ANY($2::bigint[])
WHERE g.name = $1
  -- the start is worked out only for cursors still missing (every rebalance passes all the
  -- group's partitions; the start of a 'latest' or time start reads the log per partition)
  AND NOT EXISTS (SELECT 1 FROM offsets o WHERE o.group_name = g.name AND o.partition_id = p.id)
ON CONFLICT (group_name, partition_id) DO NOTHING
"""
)

# Every partition of every topic the group reads, with its cursor (if any).
SELECT_GROUP_PARTITIONS = """
SELECT p.id AS partition_id, p.topic, p.name AS partition, p.log_start, p.log_end AS next_offset,
       o.committed, o.owner, o.owner_generation, o.lease_epoch, o.lease_expires_at, o.committed_at
FROM group_topics gt
JOIN partitions p ON p.topic = gt.topic
LEFT JOIN offsets o ON o.group_name = gt.group_name AND o.partition_id = p.id
WHERE gt.group_name = $1
ORDER BY p.topic, p.id
"""


class RecordGroupParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A group and where it starts reading (`bus.start.StartSpec`), as its first subscriber asks."""

    name: str
    #: earliest, latest, timestamp or offsets.
    start_mode: str
    #: The start of `timestamp` mode.
    start_time: datetime | None = None
    #: `offsets` mode: {"topic": {"partition": offset}}.
    start_offsets_json: str | None = None
    #: `latest` mode starts this many seconds before the group row is inserted.
    lookback_seconds: float
    assignor: str = "range"
    #: A wildcard group reads every topic of this namespace and task.
    namespace: str | None = None
    task: str | None = None


async def record_group(conn: Conn, params: RecordGroupParams) -> bool:
    """Record the group and its start if it is new (first subscriber wins); True if it was new."""
    p = params
    created = await conn.fetchval(
        RECORD_GROUP,
        p.name,
        p.start_mode,
        p.start_time,
        p.start_offsets_json,
        p.lookback_seconds,
        p.assignor,
        p.namespace,
        p.task,
    )
    if created is None:
        await conn.execute(REVIVE_GROUP, p.name)
    return created is not None


async def get_group(conn: Conn, name: str) -> asyncpg.Record | None:
    return await conn.fetchrow(SELECT_GROUP, name)


async def add_group_topics(conn: Conn, name: str, topics: list[str]) -> None:
    await conn.execute(ADD_GROUP_TOPICS, name, topics)


async def add_matching_topics(conn: Conn, name: str) -> None:
    await conn.execute(ADD_MATCHING_TOPICS, name)


async def group_topics(conn: Conn, name: str) -> list[str]:
    return [r[0] for r in await conn.fetch(SELECT_GROUP_TOPICS, name)]


async def materialize_offsets(conn: Conn, name: str, partition_ids: list[int]) -> None:
    """Create missing cursors at the group's recorded start."""
    if partition_ids:
        await conn.execute(MATERIALIZE_OFFSETS, name, partition_ids)


async def group_partitions(conn: Conn, name: str) -> list[asyncpg.Record]:
    return list(await conn.fetch(SELECT_GROUP_PARTITIONS, name))


# close(cancel=True): the group stops holding retention, unless someone else still reads.
CANCEL_GROUP = """
UPDATE groups g SET status = 'cancelled', updated_at = clock_timestamp()
WHERE g.name = $1 AND NOT EXISTS (
    SELECT 1 FROM members m WHERE m.group_name = g.name
      AND m.last_heartbeat > clock_timestamp() - make_interval(secs => m.session_timeout))
RETURNING g.name
"""


async def cancel_group(conn: Conn, name: str) -> bool:
    """Mark the group cancelled if no member is live; True if it was."""
    return await conn.fetchval(CANCEL_GROUP, name) is not None


# --- admin ------------------------------------------------------------------------

LIST_GROUPS = """
SELECT g.name, g.state, g.status, g.generation,
       (SELECT count(*) FROM members m WHERE m.group_name = g.name
          AND m.last_heartbeat > clock_timestamp() - make_interval(secs => m.session_timeout)) AS members,
       COALESCE((SELECT sum(GREATEST(p.log_end - GREATEST(COALESCE(o.committed, p.log_start), p.log_start), 0))
                 FROM group_topics gt JOIN partitions p ON p.topic = gt.topic
                 LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
                 WHERE gt.group_name = g.name), 0)::bigint AS total_lag
FROM groups g ORDER BY g.name
"""

SELECT_MEMBERS = """
SELECT member_id, instance_id, host, pid, last_heartbeat, joined_at, generation, assignment,
       last_heartbeat > clock_timestamp() - make_interval(secs => session_timeout) AS live
FROM members WHERE group_name = $1 ORDER BY member_id
"""

# Lag never counts what the group's start skipped: a partition without a cursor
# yet is measured from the offset the recorded start gives (read-only: admin
# views never write cursors, so they never contend with a rebalance).
DESCRIBE_PARTITIONS = (
    """
SELECT q.*, GREATEST(q.next_offset - q.position, 0) AS lag,
       (SELECT EXTRACT(EPOCH FROM clock_timestamp() - m.created_at) FROM messages m
         WHERE m.partition_id = q.partition_id AND m."offset" >= q.position
         ORDER BY m."offset" LIMIT 1) AS lag_seconds
FROM (
    SELECT p.id AS partition_id, p.topic, p.name AS partition, p.log_start, p.log_end AS next_offset,
           o.committed, o.owner, o.lease_expires_at > clock_timestamp() AS lease_live,
           GREATEST(COALESCE(o.committed, """
    + START_OFFSET
    + """), p.log_start) AS position
    FROM groups g
    JOIN group_topics gt ON gt.group_name = g.name
    JOIN partitions p ON p.topic = gt.topic
    LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
    WHERE g.name = $1
) AS q
ORDER BY q.topic, q.partition_id
"""
)

# The new committed offset of each partition for an admin reset ($2 mode, $3 time, $4 offset, $5 topic filter).
RESET_PLAN = """
SELECT p.id AS partition_id, p.topic, p.name AS partition, o.committed AS current,
       CASE $2
         WHEN 'earliest' THEN p.log_start
         WHEN 'latest' THEN p.log_end
         WHEN 'offset' THEN LEAST(GREATEST($4::bigint, p.log_start), p.log_end)
         ELSE COALESCE((SELECT m."offset" FROM messages m WHERE m.partition_id = p.id AND m.created_at >= $3
                        ORDER BY m.created_at, m."offset" LIMIT 1), p.log_end)
       END AS new
FROM group_topics gt JOIN partitions p ON p.topic = gt.topic
LEFT JOIN offsets o ON o.group_name = gt.group_name AND o.partition_id = p.id
WHERE gt.group_name = $1 AND ($5::text IS NULL OR p.topic = $5)
ORDER BY p.topic, p.id
"""

# The one place committed offsets may move backwards (invariant 2's exception).
APPLY_RESET = """
INSERT INTO offsets (group_name, partition_id, committed)
SELECT $1, u.pid, u.off FROM unnest($2::bigint[], $3::bigint[]) AS u(pid, off)
ON CONFLICT (group_name, partition_id) DO UPDATE
   SET committed = EXCLUDED.committed, committed_at = clock_timestamp(),
       owner = NULL, owner_generation = NULL, lease_expires_at = NULL
"""

LOCK_GROUP = "SELECT name FROM groups WHERE name = $1 FOR NO KEY UPDATE"

LIVE_MEMBER_COUNT = """
SELECT count(*) FROM members WHERE group_name = $1
  AND last_heartbeat > clock_timestamp() - make_interval(secs => session_timeout)
"""

DELETE_GROUP = "DELETE FROM groups WHERE name = $1 RETURNING name"


class GroupRow(msgspec.Struct, frozen=True, gc=False):
    """One group as `list_groups` sees it: state, status, generation, live members, total lag."""

    name: str
    state: str
    status: str
    generation: int
    members: int
    total_lag: int


class MemberRow(msgspec.Struct, frozen=True, gc=False):
    """One member of a group: identity, heartbeat, generation, assigned partition ids, liveness."""

    member_id: str
    instance_id: str | None
    host: str
    pid: int
    last_heartbeat: datetime
    joined_at: datetime
    generation: int
    assignment: list[int]
    live: bool


class PartitionLagRow(msgspec.Struct, frozen=True, gc=False):
    """One partition a group reads: bounds, committed offset, owner, lag in messages and seconds."""

    partition_id: int
    topic: str
    partition: str
    log_start: int
    next_offset: int
    committed: int | None
    owner: str | None
    lease_live: bool | None
    position: int
    lag: int
    lag_seconds: Decimal | float | None


class ResetPlanRow(msgspec.Struct, frozen=True, gc=False):
    """One partition of an offset reset: its committed offset now (None: none yet) and the new one."""

    partition_id: int
    topic: str
    partition: str
    current: int | None
    new: int


async def list_groups(conn: Conn) -> list[GroupRow]:
    """Every group, by name."""
    return [GroupRow(**dict(r.items())) for r in await conn.fetch(LIST_GROUPS)]


async def members(conn: Conn, name: str) -> list[MemberRow]:
    """The group's members, by member id."""
    return [MemberRow(**dict(r.items())) for r in await conn.fetch(SELECT_MEMBERS, name)]


async def describe_partitions(conn: Conn, name: str) -> list[PartitionLagRow]:
    """Every partition the group reads, by topic and partition id, with its lag."""
    return [PartitionLagRow(**dict(r.items())) for r in await conn.fetch(DESCRIBE_PARTITIONS, name)]


async def live_member_count(conn: Conn, name: str) -> int:
    return int(await conn.fetchval(LIVE_MEMBER_COUNT, name))


async def lock_group(conn: Connection, name: str) -> bool:
    return await conn.fetchval(LOCK_GROUP, name) is not None


async def reset_plan(
    conn: Conn, name: str, mode: str, at: datetime | None, offset: int | None, topic: str | None
) -> list[ResetPlanRow]:
    """Where an offset reset would move each partition's committed offset."""
    return [ResetPlanRow(*r) for r in await conn.fetch(RESET_PLAN, name, mode, at, offset, topic)]


async def apply_reset(conn: Connection, name: str, plan: list[tuple[int, int]]) -> None:
    await conn.execute(APPLY_RESET, name, [p for p, _ in plan], [o for _, o in plan])


async def delete_group(conn: Conn, name: str) -> bool:
    return await conn.fetchval(DELETE_GROUP, name) is not None


# The bounds of the named partitions, the group's committed offset on each, and the first offset
# created at or after a time ($4, NULL: not asked): what a poll consumer's offset lookups return.
# $1 group, $2 topics, $3 partition names, $4 times (one per partition). Rows come in input order;
# a partition that does not exist has no row.
PARTITION_OFFSETS = """
SELECT t.i, p.id AS partition_id, p.topic, p.name AS partition, p.log_start, p.log_end AS next_offset, o.committed,
       CASE WHEN t.at IS NULL THEN NULL
            ELSE (SELECT m."offset" FROM messages m
                  WHERE m.partition_id = p.id AND m.created_at >= t.at AND m."offset" >= p.log_start
                  ORDER BY m.created_at, m."offset" LIMIT 1)
       END AS at_offset
FROM unnest($2::text[], $3::text[], $4::timestamptz[]) WITH ORDINALITY AS t(topic, name, at, i)
JOIN partitions p ON p.topic = t.topic AND p.name = t.name
LEFT JOIN offsets o ON o.group_name = $1 AND o.partition_id = p.id
ORDER BY t.i
"""


class PartitionOffsetsRow(msgspec.Struct, frozen=True, gc=False):
    """One partition's bounds, a group's committed offset on it, and the offset found for a time."""

    i: int
    partition_id: int
    topic: str
    partition: str
    log_start: int
    next_offset: int
    committed: int | None
    at_offset: int | None


async def partition_offsets(
    conn: Conn, group: str, partitions: list[tuple[str, str]], times: list[datetime | None] | None = None
) -> list[PartitionOffsetsRow]:
    """Bounds, committed offset and (with `times`) the offset at a time of each existing partition named."""
    topics = [t for t, _ in partitions]
    names = [p for _, p in partitions]
    at = times if times is not None else [None] * len(partitions)
    rows = await conn.fetch(PARTITION_OFFSETS, group, topics, names, at)
    return [PartitionOffsetsRow(**dict(r)) for r in rows]
