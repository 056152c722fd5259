"""Retention by watermark (invariant 7) and group liveness.

A message may be removed once (a) every live group reading its partition has
committed past it, (b) on a queue topic, it has been acked, and (c) its
topic's retention has passed (a queue topic without one: its result_ttl). (a) and (b) are the partition's low watermark
(view `partition_watermarks`); the cleaner re-checks it under lock before
deleting: the partition row FOR NO KEY UPDATE (one cleaner per partition;
publishers wait a few milliseconds) and every live cursor of the partition
FOR SHARE, so a cursor moved backwards by an admin just before is seen, and
one moved after has to wait for the delete to commit (and then reads from the
new log start: cursors below it are lifted when read).

Removal is logical: the cleaner moves `log_start` (every reader starts
there), and the rows leave with their whole segment when every row in it is
below its partition's log start (storage/segments.py: TRUNCATE, then DROP;
no row-by-row DELETE, so no dead tuples for autovacuum). Passes are bounded
(`batch` offsets per partition per pass, `max_partitions` per pass) and walk
the partitions round-robin by id, so one huge partition never starves the
rest. Retention is for `cleanup="delete"` topics; compacted topics are the
Spark job's.

Group liveness: a group with no live member, no unexpired claim lease and no
activity for `group_heartbeat_timeout` becomes `dead` and stops holding
retention back (the view only counts `active` and `stopped` groups).
"""

from __future__ import annotations

import asyncpg

from storage.db import Conn, Connection

# The partitions of topics with retention, from partition id $1 on, in id order. A queue topic
# without one is bounded all the same: an acked job's message goes once it is older than the
# topic's result_ttl (default one day), when its result has expired too; a job not yet acked or
# dead-lettered is never below the watermark. Such a partition is passed over while its first
# message is younger than that (one keyed lookup): working out its watermark reads its jobs.
RETENTION_PARTITIONS = """
SELECT p.id AS partition_id,
       COALESCE(t.retention_seconds, COALESCE(s.result_ttl, 86400)) AS retention_seconds
FROM partitions p JOIN topics t ON t.name = p.topic
LEFT JOIN queue_settings s ON s.topic = t.name
WHERE t.cleanup = 'delete' AND p.id > $1
  AND (t.retention_seconds IS NOT NULL
       OR (t.semantics = 'queue'
           AND EXISTS (SELECT 1 FROM messages m
                       WHERE m.partition_id = p.id AND m."offset" = p.log_start
                         AND m.created_at < clock_timestamp() - make_interval(secs => COALESCE(s.result_ttl, 86400)))))
ORDER BY p.id
LIMIT $2
"""

# Those of partitions $1 with something below the watermark. The watermark is worked out for them
# only (the condition on the view's grouping column is pushed into it): it reads each partition's
# first queue job, and a snapshot held elsewhere keeps every job acked since it began in front of
# that one, so a pass that worked it out for every partition read more the longer the hold lasted.
BELOW_WATERMARK = """
SELECT w.partition_id FROM partition_watermarks w
WHERE w.partition_id = ANY ($1::bigint[]) AND w.log_start < w.low_watermark
"""

LOCK_PARTITION = (
    "SELECT p.log_start, p.log_end AS next_offset FROM partitions p WHERE p.id = $1 FOR NO KEY UPDATE"
)

# Cursors of the live groups that read the partition, locked against moves.
LOCK_LIVE_CURSORS = """
SELECT o.committed
FROM offsets o
JOIN groups g ON g.name = o.group_name AND g.status IN ('active', 'stopped')
JOIN partitions p ON p.id = o.partition_id
JOIN group_topics gt ON gt.group_name = g.name AND gt.topic = p.topic
WHERE o.partition_id = $1
FOR SHARE OF o
"""

# A live group that reads the topic but has no cursor here yet holds everything.
LIVE_GROUP_WITHOUT_CURSOR = """
SELECT EXISTS (
    SELECT 1 FROM partitions p
    JOIN group_topics gt ON gt.topic = p.topic
    JOIN groups g ON g.name = gt.group_name AND g.status IN ('active', 'stopped')
    WHERE p.id = $1
      AND NOT EXISTS (SELECT 1 FROM offsets o WHERE o.group_name = g.name AND o.partition_id = p.id))
"""

MIN_QUEUE_JOB = 'SELECT MIN("offset") FROM queue_jobs WHERE partition_id = $1'

# The first offset in [$2, $3) still inside the retention window, if any.
FIRST_RETAINED = """
SELECT "offset" FROM messages
WHERE partition_id = $1 AND "offset" >= $2 AND "offset" < $3
  AND created_at >= clock_timestamp() - make_interval(secs => $4)
ORDER BY "offset"
LIMIT 1
"""

ADVANCE_LOG_START = "UPDATE partitions SET log_start = GREATEST(log_start, $2) WHERE id = $1"

TOPIC_PARTITIONS = "SELECT id FROM partitions WHERE topic = $1 ORDER BY id"

MARK_DEAD_GROUPS = """
UPDATE groups g SET status = 'dead', state = 'empty', updated_at = clock_timestamp()
WHERE g.status = 'active'
  AND g.last_active_at < clock_timestamp() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM members m WHERE m.group_name = g.name
                  AND m.last_heartbeat > clock_timestamp() - make_interval(secs => m.session_timeout))
  AND NOT EXISTS (SELECT 1 FROM offsets o WHERE o.group_name = g.name
                  AND o.owner IS NOT NULL AND o.lease_expires_at > clock_timestamp())
RETURNING g.name
"""


async def clean_partition(conn: Connection, partition_id: int, retention_seconds: float, batch: int) -> int:
    """Retire up to `batch` offsets of the partition that are below its watermark and past retention.

    Moves the partition's log start past them (the rows go with their
    segment, storage/segments.py). Runs in its own transaction; returns the
    number of offsets retired.
    """
    async with conn.transaction():
        part = await conn.fetchrow(LOCK_PARTITION, partition_id)
        if part is None:
            return 0
        log_start, watermark = int(part["log_start"]), int(part["next_offset"])
        if await conn.fetchval(LIVE_GROUP_WITHOUT_CURSOR, partition_id):
            return 0
        for row in await conn.fetch(LOCK_LIVE_CURSORS, partition_id):
            watermark = min(watermark, int(row["committed"]))
        queued = await conn.fetchval(MIN_QUEUE_JOB, partition_id)
        if queued is not None:
            watermark = min(watermark, int(queued))
        limit = min(watermark, log_start + batch)
        if limit <= log_start:
            return 0
        retained = await conn.fetchval(FIRST_RETAINED, partition_id, log_start, limit, retention_seconds)
        cut = limit if retained is None else int(retained)
        if cut <= log_start:
            return 0
        await conn.execute(ADVANCE_LOG_START, partition_id, cut)
    return cut - log_start


async def clean_some(
    conn: asyncpg.Connection, after_id: int, *, max_partitions: int, batch: int
) -> tuple[int, int]:
    """One bounded retention pass over the partitions with retention and id > after_id (at most
    `max_partitions` of them, each retiring at most `batch` offsets).

    Returns (the id to continue after next time (0: start over), offsets retired).
    """
    rows = await conn.fetch(RETENTION_PARTITIONS, after_id, max_partitions)
    below = (
        {r[0] for r in await conn.fetch(BELOW_WATERMARK, [r["partition_id"] for r in rows])}
        if rows
        else set()
    )
    deleted = 0
    for row in rows:
        if row["partition_id"] in below:
            deleted += await clean_partition(
                conn, row["partition_id"], float(row["retention_seconds"]), batch
            )
    next_after = rows[-1]["partition_id"] if len(rows) == max_partitions else 0
    return int(next_after), deleted


async def force_complete(conn: Connection, topic: str, older_than: float, *, batch: int = 10_000) -> int:
    """Remove the topic's messages older than `older_than` seconds that no live group still needs.

    Dead and cancelled groups do not count (that is what this is for: orphans
    they held back); the topic's own retention is ignored. Returns the count.
    """
    total = 0
    for row in await conn.fetch(TOPIC_PARTITIONS, topic):
        while (n := await clean_partition(conn, row["id"], older_than, batch)) > 0:
            total += n
    return total


async def mark_dead_groups(conn: Conn, group_heartbeat_timeout: float) -> list[str]:
    """Mark `dead` every active group with no live member, no live claim and no activity for the timeout."""
    return [r[0] for r in await conn.fetch(MARK_DEAD_GROUPS, group_heartbeat_timeout)]
