"""Durable workflows: runs, their step records, inboxes and events (migration 030).

A run belongs to the executor whose claim bumped its `epoch` last, for as long
as its `lease_until` lasts (renewed by the owning process). Every write of an
executor names that epoch and applies only while it is still the run's: an
executor that lost its run (lease lapsed, run cancelled) writes nothing. A
step record is written once (primary key (workflow_id, seq)).
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
import msgspec

from storage.db import Conn

ACTIVE = ("pending", "running", "waiting")
TERMINAL = ("succeeded", "failed", "cancelled")

# A new run; an existing id returns its row unchanged (inserted = false).
CREATE = """
WITH ins AS (
    INSERT INTO workflow_runs (workflow_id, name, version, queue, status, input, parent_id)
    VALUES ($1, $2, $3, $4, 'pending', $5, $6)
    ON CONFLICT (workflow_id) DO NOTHING
    RETURNING workflow_id, name, version, true AS inserted
)
SELECT workflow_id, name, version, inserted FROM ins
UNION ALL
SELECT workflow_id, name, version, false FROM workflow_runs
 WHERE workflow_id = $1 AND NOT EXISTS (SELECT 1 FROM ins)
"""

# Take a run over: a pending or waiting one, or a running one whose lease lapsed.
CLAIM = """
UPDATE workflow_runs
   SET status = 'running', epoch = epoch + 1, owner = $2,
       lease_until = clock_timestamp() + make_interval(secs => $3),
       executions = executions + 1, updated_at = clock_timestamp()
 WHERE workflow_id = $1
   AND (status IN ('pending', 'waiting')
        OR (status = 'running' AND lease_until < clock_timestamp()))
RETURNING workflow_id, name, version, input, epoch, parent_id, created_at, wake_at
"""

# Only the runs the process still executes ($3): a run it stopped executing (given back after the
# database went away, with the give-back lost too) must lapse, so that a process takes it over.
RENEW = """
UPDATE workflow_runs SET lease_until = clock_timestamp() + make_interval(secs => $2)
 WHERE owner = $1 AND status = 'running' AND workflow_id = ANY($3::text[])
"""

# A closing process lets its runs' leases lapse at once (the reaper gives them back to the queue).
DROP_LEASES = """
UPDATE workflow_runs SET lease_until = clock_timestamp() - interval '1 second'
 WHERE owner = $1 AND status = 'running'
"""

# Runs whose executor vanished: back to pending (the caller publishes their kicks in the same transaction).
LAPSED = """
UPDATE workflow_runs r SET status = 'pending', owner = NULL, updated_at = clock_timestamp()
  FROM (SELECT workflow_id FROM workflow_runs
         WHERE status = 'running' AND lease_until < clock_timestamp()
         ORDER BY lease_until LIMIT $1
         FOR UPDATE SKIP LOCKED) lapsed
 WHERE r.workflow_id = lapsed.workflow_id
RETURNING r.workflow_id, r.queue
"""

STEPS = """
SELECT seq, name, kind, output, error, attempts, started_at, finished_at
  FROM workflow_steps WHERE workflow_id = $1 ORDER BY seq
"""

RECORD = """
INSERT INTO workflow_steps (workflow_id, seq, name, kind, output, error, attempts, started_at)
SELECT $1, $3, $4, $5, $6, $7, $8, $9
 WHERE EXISTS (SELECT 1 FROM workflow_runs
                WHERE workflow_id = $1 AND epoch = $2 AND status = 'running')
ON CONFLICT (workflow_id, seq) DO NOTHING
RETURNING seq
"""

# The run's outcome, fenced by epoch; NOTIFY its id (and its parent's, which may wait for it).
FINISH = """
WITH done AS (
    UPDATE workflow_runs
       SET status = $3, output = $4, error = $5, error_type = $6, owner = NULL, lease_until = NULL,
           finished_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE workflow_id = $1 AND epoch = $2 AND status = 'running'
 RETURNING workflow_id, parent_id
)
SELECT d.workflow_id, pg_notify($7, d.workflow_id),
       CASE WHEN d.parent_id IS NOT NULL THEN pg_notify($7, d.parent_id) END
  FROM done d
"""

# Park a run until `wake_at` (its timer job is published in the same transaction).
PARK = """
UPDATE workflow_runs
   SET status = 'waiting', wake_at = $3, owner = NULL, lease_until = NULL, updated_at = clock_timestamp()
 WHERE workflow_id = $1 AND epoch = $2 AND status = 'running'
RETURNING queue
"""

# Give a run back to the queue (a process without its version took it).
RELEASE = """
UPDATE workflow_runs
   SET status = 'pending', owner = NULL, lease_until = NULL, updated_at = clock_timestamp()
 WHERE workflow_id = $1 AND epoch = $2 AND status = 'running'
RETURNING queue
"""

STATUS = """
SELECT workflow_id, name, version, status, output, error, error_type, epoch
  FROM workflow_runs WHERE workflow_id = $1
"""

RUN = """
SELECT workflow_id, name, version, queue, status, input, output, error, error_type, parent_id,
       epoch, owner, lease_until, wake_at, executions, created_at, updated_at, finished_at
  FROM workflow_runs WHERE workflow_id = $1
"""

LIST = """
SELECT workflow_id, name, version, queue, status, input, output, error, error_type, parent_id,
       epoch, owner, lease_until, wake_at, executions, created_at, updated_at, finished_at
  FROM workflow_runs
 WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR name = $2)
 ORDER BY created_at DESC, workflow_id
 LIMIT $3
"""

# Cancel a run and every unfinished run below it; the epoch bump fences their executors.
CANCEL = """
WITH RECURSIVE tree AS (
    SELECT workflow_id FROM workflow_runs WHERE workflow_id = $1
    UNION
    SELECT r.workflow_id FROM workflow_runs r JOIN tree t ON r.parent_id = t.workflow_id
), cancelled AS (
    UPDATE workflow_runs r
       SET status = 'cancelled', epoch = r.epoch + 1, owner = NULL, lease_until = NULL,
           finished_at = clock_timestamp(), updated_at = clock_timestamp()
      FROM tree WHERE r.workflow_id = tree.workflow_id AND r.status IN ('pending', 'running', 'waiting')
    RETURNING r.workflow_id
)
SELECT workflow_id, pg_notify($2, workflow_id) FROM cancelled
"""

# A failed run goes on from its last successful step: the records of the failed step and of what
# ran after it (compensations) are removed. A cancelled run keeps every record.
FORGET_FAILURE = """
DELETE FROM workflow_steps s
 WHERE s.workflow_id = $1
   AND EXISTS (SELECT 1 FROM workflow_runs r WHERE r.workflow_id = $1 AND r.status = 'failed')
   AND s.seq >= (SELECT coalesce(min(f.seq), 2147483647) FROM workflow_steps f
                  WHERE f.workflow_id = $1 AND f.error IS NOT NULL)
"""

RESUME = """
UPDATE workflow_runs
   SET status = 'pending', epoch = epoch + 1, owner = NULL, lease_until = NULL, output = NULL,
       error = NULL, error_type = NULL, finished_at = NULL, updated_at = clock_timestamp()
 WHERE workflow_id = $1 AND status IN ('cancelled', 'failed')
RETURNING queue
"""

FORK_RUN = """
INSERT INTO workflow_runs (workflow_id, name, version, queue, status, input, parent_id)
SELECT $2, name, version, queue, 'pending', input, NULL FROM workflow_runs WHERE workflow_id = $1
RETURNING queue
"""

FORK_STEPS = """
INSERT INTO workflow_steps (workflow_id, seq, name, kind, output, error, attempts, started_at, finished_at)
SELECT $2, seq, name, kind, output, error, attempts, started_at, finished_at
  FROM workflow_steps WHERE workflow_id = $1 AND seq < $3
"""

# send: the NOTIFY of the run's id goes out with the commit; a recv registers for it before it
# looks at the inbox, so a message is either found or heard (no lost wake-up).
SEND = """
WITH msg AS (
    INSERT INTO workflow_inbox (workflow_id, topic, payload) VALUES ($1, $2, $3) RETURNING id
)
SELECT id, pg_notify($4, $1) FROM msg
"""

# recv: the oldest message of the topic, consumed together with the step's record.
TAKE_MESSAGE = """
UPDATE workflow_inbox SET consumed = true
 WHERE id = (SELECT id FROM workflow_inbox
              WHERE workflow_id = $1 AND topic = $2 AND NOT consumed
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING payload
"""

SET_EVENT = """
WITH ev AS (
    INSERT INTO workflow_events (workflow_id, key, value) VALUES ($1, $2, $3)
    ON CONFLICT (workflow_id, key) DO UPDATE SET value = EXCLUDED.value, updated_at = clock_timestamp()
    RETURNING workflow_id
)
SELECT pg_notify($4, workflow_id) FROM ev
"""

GET_EVENT = "SELECT value FROM workflow_events WHERE workflow_id = $1 AND key = $2"

# wait_for: the first message of `topic` with `key` created at or after the run began and after
# the message this run's previous wait on the same topic and key returned.
FIND_MESSAGE = """
SELECT p.name AS partition, m.partition_id, m."offset", m.key, m.headers, m.payload, m.created_at
  FROM partitions p
  JOIN messages m ON m.partition_id = p.id
 WHERE p.topic = $1 AND m.key = $2 AND m.created_at >= $3
   AND (m.created_at, m.partition_id, m."offset") > ($4::timestamptz, $5::bigint, $6::bigint)
 ORDER BY m.created_at, m.partition_id, m."offset"
 LIMIT 1
"""

TOPIC_PARTITIONS = "SELECT id FROM partitions WHERE topic = $1"

CHILDREN = "SELECT workflow_id FROM workflow_runs WHERE parent_id = $1 ORDER BY created_at"


class CreateParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A new run: which workflow, at which version, on which queue, with which encoded arguments."""

    workflow_id: str
    name: str
    version: str
    queue: str
    payload: bytes
    #: The run that started this one as a child (None: a top-level run).
    parent_id: str | None = None


async def create(conn: Conn, params: CreateParams) -> asyncpg.Record:
    """The run's row (inserted or not). A concurrent insert of the same id that committed while this
    statement waited on it is not in this statement's snapshot: the next statement sees it."""
    p = params
    while True:
        row = await conn.fetchrow(CREATE, p.workflow_id, p.name, p.version, p.queue, p.payload, p.parent_id)
        if row is not None:
            return row


async def claim(conn: Conn, workflow_id: str, owner: str, lease: float) -> asyncpg.Record | None:
    return await conn.fetchrow(CLAIM, workflow_id, owner, lease)


async def renew(conn: Conn, owner: str, lease: float, running: list[str]) -> None:
    await conn.execute(RENEW, owner, lease, running)


async def drop_leases(conn: Conn, owner: str) -> None:
    await conn.execute(DROP_LEASES, owner)


async def lapsed(conn: Conn, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(LAPSED, limit))


async def steps(conn: Conn, workflow_id: str) -> list[asyncpg.Record]:
    return list(await conn.fetch(STEPS, workflow_id))


class RecordParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step's record, written by the executor holding the run at `epoch`."""

    workflow_id: str
    epoch: int
    #: The step's place in the run (the record's key with `workflow_id`).
    seq: int
    name: str
    kind: str
    #: The step's encoded result, or its error.
    output: bytes | None
    error: str | None = None
    attempts: int = 1
    started_at: datetime


async def record(conn: Conn, params: RecordParams) -> bool:
    """Write a step's record; False if the executor no longer holds the run or the step was recorded."""
    p = params
    got = await conn.fetchval(
        RECORD, p.workflow_id, p.epoch, p.seq, p.name, p.kind, p.output, p.error, p.attempts, p.started_at
    )
    return got is not None


class FinishParams(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A run's end, written by the executor holding it at `epoch`."""

    workflow_id: str
    epoch: int
    #: succeeded, failed or cancelled.
    status: str
    output: bytes | None
    error: str | None = None
    error_type: str | None = None
    #: The NOTIFY channel that wakes those waiting on the run's result.
    channel: str


async def finish(conn: Conn, params: FinishParams) -> bool:
    """End the run; False if the executor no longer holds it."""
    p = params
    got = await conn.fetchval(
        FINISH, p.workflow_id, p.epoch, p.status, p.output, p.error, p.error_type, p.channel
    )
    return got is not None


async def park(conn: Conn, workflow_id: str, epoch: int, wake_at: datetime) -> str | None:
    queue: str | None = await conn.fetchval(PARK, workflow_id, epoch, wake_at)
    return queue


async def release(conn: Conn, workflow_id: str, epoch: int) -> str | None:
    queue: str | None = await conn.fetchval(RELEASE, workflow_id, epoch)
    return queue


async def status(conn: Conn, workflow_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(STATUS, workflow_id)


async def run(conn: Conn, workflow_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(RUN, workflow_id)


async def list_runs(conn: Conn, status: str | None, name: str | None, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(LIST, status, name, limit))


async def cancel(conn: Conn, workflow_id: str, channel: str) -> list[str]:
    return [r["workflow_id"] for r in await conn.fetch(CANCEL, workflow_id, channel)]


async def resume(conn: Conn, workflow_id: str) -> str | None:
    """Back to pending (a cancelled or failed run); the queue to kick it on, None if not resumable."""
    await conn.execute(FORGET_FAILURE, workflow_id)
    queue: str | None = await conn.fetchval(RESUME, workflow_id)
    return queue


async def fork(conn: Conn, workflow_id: str, new_id: str, from_step: int) -> str | None:
    queue: str | None = await conn.fetchval(FORK_RUN, workflow_id, new_id)
    if queue is not None:
        await conn.execute(FORK_STEPS, workflow_id, new_id, from_step)
    return queue


async def send(conn: Conn, workflow_id: str, topic: str, payload: bytes, channel: str) -> None:
    await conn.execute(SEND, workflow_id, topic, payload, channel)


async def take_message(conn: Conn, workflow_id: str, topic: str) -> bytes | None:
    got: bytes | None = await conn.fetchval(TAKE_MESSAGE, workflow_id, topic)
    return got


async def set_event(conn: Conn, workflow_id: str, key: str, value: bytes, channel: str) -> None:
    await conn.execute(SET_EVENT, workflow_id, key, value, channel)


async def get_event(conn: Conn, workflow_id: str, key: str) -> bytes | None:
    got: bytes | None = await conn.fetchval(GET_EVENT, workflow_id, key)
    return got


async def find_message(
    conn: Conn, topic: str, key: str, since: datetime, after: tuple[datetime, int, int]
) -> asyncpg.Record | None:
    return await conn.fetchrow(FIND_MESSAGE, topic, key, since, *after)


async def topic_partitions(conn: Conn, topic: str) -> list[int]:
    return [r["id"] for r in await conn.fetch(TOPIC_PARTITIONS, topic)]


async def children(conn: Conn, workflow_id: str) -> list[str]:
    return [r["workflow_id"] for r in await conn.fetch(CHILDREN, workflow_id)]
