"""The log: publishing and reading messages.

Offsets come from the partition's head (`log_heads`, migrations 020 and 029),
moved in the publishing transaction: two publishers to one partition
serialize on the head row's lock, so offsets are dense and commit in offset
order (invariant 1). A `bigserial` alone would let offset 8 commit before
offset 7 and a reader that already moved past 7 would miss it for good. A
publish writes no version of the partition's row and a head row takes a
bounded number of publishes before the next one replaces it, so a snapshot
held open elsewhere does not make publishing slower the longer it stays open.
A partition's end is its newest head (`p.log_end` for a partition row `p`).
While the previous release may run on the schema (until `bus migrate
--finalize`), a publish also moves `partitions.next_offset`, which that release
reads and moves itself. On a caller's own connection (the outbox) the same
statements run with the bus's tables named by schema (`in_schema`), one
statement of the caller's transaction. On the Producer's own connections,
whose session settings keep every plan by key (`PLANNED_SETTINGS`), a flush
moves its heads in its own statement (`APPEND_PLANNED`, `APPEND_ONE_PLANNED`,
`APPEND_SINGLE_PLANNED`) rather than through the head functions of migration
029, which cost more than the statement that calls them; a head that does not
move there sends the flush through them.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from typing import NamedTuple

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from storage import db, idempotency

#: What `append` runs on: the pool (one autocommit statement) or one connection.
Target = asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy

# What `append` runs: any partitions, one statement (atomic without an explicit
# transaction). $1..$4 are parallel arrays (partition id, key, headers,
# payload); $5 is each message's index among the input's messages of its
# partition (computed by the caller: no sort or window function here); $6/$7
# the distinct partition ids and their message counts; $8 a channel to NOTIFY
# once per partition written (NULL: none; the wake-up goes with the commit,
# see actors/announcer.py for when that is wanted). Partition heads are
# moved in id order (no deadlock between two such statements), each once, so offsets are dense and commit in order (invariant 1). Every
# message of the statement gets one created_at, and the answer is one row per
# partition (its first offset) rather than one per message.
APPEND = """
WITH bumped AS (
    SELECT t.id, t.base FROM log_take_offsets_many($6::bigint[], $7::bigint[]) AS t
), ts AS (
    SELECT clock_timestamp() AS at
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT u.pid, b.base + u.i, u.k, u.h::jsonb, u.p, ts.at
    FROM unnest($1::text::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text::int[]) AS u(pid, k, h, p, i)
    JOIN bumped b ON b.id = u.pid CROSS JOIN ts
)
SELECT b.id, b.base, ts.at, (SELECT pg_notify($8, b.id::text) WHERE $8::text IS NOT NULL)
FROM bumped b CROSS JOIN ts
"""

# APPEND for an input of one partition (the common flush): no lock-ordering
# step (one row cannot deadlock), the offsets follow input order.
# $1 partition id, $2..$4 key, headers, payload arrays, $5 as APPEND's $8.
APPEND_ONE = """
WITH p AS (
    SELECT t.base FROM log_take_offset($1, cardinality($4::bytea[])) AS t(base)
), ts AS (
    SELECT clock_timestamp() AS at
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT $1, p.base + u.i - 1, u.k, u.h::jsonb, u.p, ts.at
    FROM p CROSS JOIN ts CROSS JOIN unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS u(k, h, p, i)
)
SELECT p.base, ts.at, (SELECT pg_notify($5, $1::text) WHERE $5::text IS NOT NULL) FROM p CROSS JOIN ts
"""

# APPEND for one message (the flush of a lone publish): scalar parameters, no
# arrays to encode and unnest. $1 partition id, $2..$4 key, headers, payload,
# $5 as APPEND's $8.
APPEND_SINGLE = """
WITH p AS (
    SELECT t.base FROM log_take_offset($1, 1) AS t(base)
), ts AS (
    SELECT clock_timestamp() AS at
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT $1, p.base, $2::text, $3::text::jsonb, $4::bytea, ts.at FROM p CROSS JOIN ts
)
SELECT p.base, ts.at, (SELECT pg_notify($5, $1::text) WHERE $5::text IS NOT NULL) FROM p CROSS JOIN ts
"""

# APPEND for inputs that include queue topics: a message of a
# `semantics='queue'` topic also gets its job row, in the same statement.
# The end of APPEND_QUEUE and APPEND_QUEUE_PLANNED: `rows` (one per message, `queued`
# for a queue topic's) written to the log and the queue, one answer per head in {heads}.
_WRITE_ROWS_AND_JOBS = """, m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT r.pid, r.off, r.k, r.h::jsonb, r.p, ts.at FROM rows r CROSS JOIN ts
), j AS (
    -- in input order: a job is visible from its insert, and due jobs go in visible_at order
    INSERT INTO queue_jobs (partition_id, "offset", topic, key)
    SELECT pid, off, topic, k FROM rows WHERE queued ORDER BY ord
)
SELECT b.id, b.base, ts.at, (SELECT pg_notify($8, b.id::text) WHERE $8::text IS NOT NULL)
FROM {heads} b CROSS JOIN ts
"""

APPEND_QUEUE = """
WITH bumped AS (
    SELECT t.id, t.base, t.topic FROM log_take_offsets_many($6::bigint[], $7::bigint[]) AS t
), ts AS (
    SELECT clock_timestamp() AS at
), rows AS (
    SELECT u.pid, b.base + u.i AS off, u.k, u.h, u.p, b.topic, t.semantics = 'queue' AS queued, u.ord
    FROM unnest($1::text::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text::int[])
         WITH ORDINALITY AS u(pid, k, h, p, i, ord)
    JOIN bumped b ON b.id = u.pid JOIN topics t ON t.name = b.topic
)""" + _WRITE_ROWS_AND_JOBS.format(heads="bumped")

# APPEND_QUEUE for inputs with delayed or prioritized queue messages. $9..$11
# (one element per message, NULL for a plain one): a delay in seconds, a
# delivery time, a priority. A job with any of them is inserted detached (its
# own visible_at and priority say when and in which order it is taken); the
# others are fresh jobs, leased by range (see storage/queues.py).
APPEND_QUEUE_TIMED = """
WITH bumped AS (
    SELECT t.id, t.base, t.topic FROM log_take_offsets_many($6::bigint[], $7::bigint[]) AS t
), ts AS (
    SELECT clock_timestamp() AS at
), rows AS (
    SELECT u.pid, b.base + u.i AS off, u.k, u.h, u.p, b.topic, t.semantics = 'queue' AS queued,
           u.delay, u.at, u.prio,
           (u.delay IS NOT NULL OR u.at IS NOT NULL OR COALESCE(u.prio, 0) <> 0) AS timed, u.ord
    FROM unnest($1::text::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text::int[],
                $9::float8[], $10::timestamptz[], $11::int[]) WITH ORDINALITY AS u(pid, k, h, p, i, delay, at, prio, ord)
    JOIN bumped b ON b.id = u.pid JOIN topics t ON t.name = b.topic
), m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT r.pid, r.off, r.k, r.h::jsonb, r.p, ts.at FROM rows r CROSS JOIN ts
), j AS (
    INSERT INTO queue_jobs (partition_id, "offset", topic, key)
    SELECT pid, off, topic, k FROM rows WHERE queued AND NOT timed ORDER BY ord
), jt AS (
    -- delayed or prioritized jobs: detached, visible from their delivery time (migration 014)
    INSERT INTO queue_jobs (partition_id, "offset", topic, key, detached, visible_at, priority)
    SELECT r.pid, r.off, r.topic, r.k, true,
           COALESCE(r.at, ts.at + make_interval(secs => COALESCE(r.delay, 0))), COALESCE(r.prio, 0)
    FROM rows r CROSS JOIN ts WHERE r.queued AND r.timed
)
SELECT b.id, b.base, ts.at, (SELECT pg_notify($8, b.id::text) WHERE $8::text IS NOT NULL)
FROM bumped b CROSS JOIN ts
"""


# On the Producer's own connections (`PLANNED_SETTINGS`): the head's move in the
# statement itself, no function around it. Each partition's newest head is read
# once (`snap`), and one UPDATE moves them by key (in id order: a nested loop
# over $6, the only join those settings leave) and closes one that takes its
# 64th move, which log_heads_moved then rotates (the next generation inserted,
# the one before deleted), as log_take_offsets_many does (migration 029). The statement itself
# writes nothing but the head and the log, so that it starts as quickly as the
# UPDATE and INSERT it is. A head that does not move here
# (a rotation committed while the statement waited for it, a partition gone or
# without a head, the previous release may run) makes log_heads_moved fail the
# statement (SQLSTATE PBH01; the message insert, which runs to its end whatever
# the answer, asks for the check first): nothing is written, and the flush is
# written again with APPEND. log_heads_moved also wakes the claimed partitions' cursors (migration
# 035), reading the claims with a snapshot of its own; it is called only when
# some head did not move, or one moved is claimed (the flag the head itself
# carries, read from the version the statement wrote: migration 037), or was
# moved by someone else since the statement's snapshot was taken (a claim's
# first cursors move it before they are made: a statement that waited for
# them, or began before they committed, sees it moved). Parameters as APPEND's.
_MOVE_HEADS = """
WITH snap AS MATERIALIZED (
    -- each partition's newest head as this statement's snapshot shows it, in the flush's id order
    SELECT c.pid, c.n, s.generation, s.appends
    FROM unnest({pids}, {counts}) AS c(pid, n)
    CROSS JOIN LATERAL (SELECT x.generation, x.appends FROM log_heads x WHERE x.partition_id = c.pid
                        ORDER BY x.generation DESC LIMIT 1) AS s
), moved AS (
    UPDATE log_heads h
    SET next_offset = h.next_offset + c.n, appends = h.appends + 1, closed = h.appends + 1 >= 64
    FROM snap c
    WHERE h.partition_id = c.pid AND h.generation = c.generation AND NOT h.closed
      AND NOT previous_release_may_run()
    RETURNING h.partition_id AS id, h.next_offset - c.n AS base, h.generation AS gen, h.closed AS closing, c.n,
              -- moved by someone else since the snapshot, or claimed (the head's flag, migration 037)
              h.appends <> c.appends + 1 OR h.claimed AS wake
), checked AS (
    SELECT CASE WHEN count(*) = {expected} AND NOT bool_or(o.wake OR o.closing) THEN true
                ELSE log_heads_moved(array_agg(o.id ORDER BY o.id), {expected},
                                     array_agg(o.gen ORDER BY o.id) FILTER (WHERE o.closing),
                                     array_agg(o.id ORDER BY o.id) FILTER (WHERE o.closing),
                                     array_agg(o.base + o.n ORDER BY o.id) FILTER (WHERE o.closing)) END AS ok
    FROM moved o
), ts AS (
    SELECT clock_timestamp() AS at
)"""

APPEND_PLANNED = (
    _MOVE_HEADS.format(pids="$6::bigint[]", counts="$7::bigint[]", expected="cardinality($6::bigint[])")
    + """, m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT u.pid, b.base + u.i, u.k, u.h::jsonb, u.p, ts.at
    FROM unnest($1::text::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text::int[]) AS u(pid, k, h, p, i)
    JOIN moved b ON b.id = u.pid CROSS JOIN ts
    WHERE (SELECT ok FROM checked)
)
SELECT b.id, b.base, ts.at, (SELECT pg_notify($8, b.id::text) WHERE $8::text IS NOT NULL)
FROM moved b CROSS JOIN ts
"""
)

# APPEND_PLANNED for inputs that include queue topics (APPEND_QUEUE's
# parameters, no delays or priorities): a message of a queue topic also gets its
# job row, as APPEND_QUEUE writes it.
APPEND_QUEUE_PLANNED = (
    _MOVE_HEADS.format(pids="$6::bigint[]", counts="$7::bigint[]", expected="cardinality($6::bigint[])")
    + """, rows AS (
    SELECT u.pid, b.base + u.i AS off, u.k, u.h, u.p, p.topic, t.semantics = 'queue' AS queued, u.ord
    FROM unnest($1::text::bigint[], $2::text[], $3::text[], $4::bytea[], $5::text::int[])
         WITH ORDINALITY AS u(pid, k, h, p, i, ord)
    JOIN moved b ON b.id = u.pid JOIN partitions p ON p.id = u.pid JOIN topics t ON t.name = p.topic
    WHERE (SELECT ok FROM checked)
)"""
    + _WRITE_ROWS_AND_JOBS.format(heads="moved")
)

# APPEND_PLANNED for a flush of one partition (APPEND_ONE's parameters; for one
# message, APPEND_SINGLE's): the newest head is read once, in the statement's
# snapshot, and moved by its key. A head moved by someone else since that
# snapshot (seen as more than this statement's one move since), a claimed
# partition (the head's own flag) and a head this move closes call log_heads_moved, which wakes the
# cursors and rotates the head. No row when the head did not move (a rotation
# committed while the statement waited for it, the partition gone or without a
# head, the previous release may run): nothing was written, and the flush is
# written again with APPEND_ONE or APPEND_SINGLE, whose head functions tell
# those apart.
_MOVE_HEAD = """
WITH snap AS MATERIALIZED (
    SELECT x.generation, x.appends FROM log_heads x WHERE x.partition_id = $1 ORDER BY x.generation DESC LIMIT 1
), moved AS (
    UPDATE log_heads h
    SET next_offset = h.next_offset + {n}, appends = h.appends + 1, closed = h.appends + 1 >= 64
    FROM snap
    WHERE h.partition_id = $1 AND h.generation = snap.generation AND NOT h.closed
      AND NOT previous_release_may_run()
    RETURNING h.next_offset - {n} AS base, h.generation AS gen, h.closed AS closing,
              h.appends <> snap.appends + 1 OR h.claimed AS wake
), ts AS (
    SELECT clock_timestamp() AS at
), checked AS (
    SELECT NOT (o.wake OR o.closing)
           OR log_heads_moved(ARRAY[$1::bigint], 1, CASE WHEN o.closing THEN ARRAY[o.gen] END,
                              CASE WHEN o.closing THEN ARRAY[$1::bigint] END,
                              CASE WHEN o.closing THEN ARRAY[o.base + {n}] END) AS ok
    FROM moved o
)"""

APPEND_ONE_PLANNED = (
    _MOVE_HEAD.format(n="cardinality($4::bytea[])")
    + """, m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT $1, o.base + u.i - 1, u.k, u.h::jsonb, u.p, ts.at
    FROM moved o CROSS JOIN ts CROSS JOIN unnest($2::text[], $3::text[], $4::bytea[]) WITH ORDINALITY AS u(k, h, p, i)
    WHERE (SELECT ok FROM checked)
)
SELECT o.base, ts.at, (SELECT pg_notify($5, $1::text) WHERE $5::text IS NOT NULL) FROM moved o CROSS JOIN ts
"""
)

APPEND_SINGLE_PLANNED = (
    _MOVE_HEAD.format(n="1")
    + """, m AS (
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    SELECT $1, o.base, $2::text, $3::text::jsonb, $4::bytea, ts.at FROM moved o CROSS JOIN ts
    WHERE (SELECT ok FROM checked)
)
SELECT o.base, ts.at, (SELECT pg_notify($5, $1::text) WHERE $5::text IS NOT NULL) FROM moved o CROSS JOIN ts
"""
)

#: The session settings of a connection that runs APPEND_PLANNED: each plan
#: made once (generic), by the heads' primary key whatever the planner makes of the heads
#: table's size (a snapshot held elsewhere grows it with versions its statistics do not show;
#: migrations 024 to 027), joins as nested loops (the heads move in the order of the flush's
#: partition ids), and no JIT compilation of plans priced that way. Nothing else runs there.
PLANNED_SETTINGS = {
    "enable_seqscan": "off",
    "enable_bitmapscan": "off",
    "enable_hashjoin": "off",
    "enable_mergejoin": "off",
    "jit": "off",
    "plan_cache_mode": "force_generic_plan",
}

# log_heads_moved's SQLSTATE: a head did not move in the statement, which wrote nothing.
HEADS_MOVED_AWAY = "PBH01"


class AppendStatements(NamedTuple):
    """The statements `append` runs: in the bus schema (`IN_BUS_SCHEMA`), or named in a schema (`in_schema`)."""

    plain: str  # APPEND
    one: str  # APPEND_ONE
    single: str  # APPEND_SINGLE
    queue: str  # APPEND_QUEUE
    queue_timed: str  # APPEND_QUEUE_TIMED


#: On the bus's own connections, whose search_path is the bus schema.
IN_BUS_SCHEMA = AppendStatements(APPEND, APPEND_ONE, APPEND_SINGLE, APPEND_QUEUE, APPEND_QUEUE_TIMED)

# The bus's tables and functions the append statements name: each follows FROM, JOIN or INTO.
_BUS_OBJECTS = re.compile(
    r"\b(FROM|JOIN|INTO)(\s+)(log_take_offsets_many|log_take_offset|messages|queue_jobs|topics)\b"
)


@functools.cache
def in_schema(schema: str) -> AppendStatements:
    """The append statements naming the bus's tables and functions in `schema` (validated and quoted).

    For the outbox: they run on the caller's connection, whose search_path is the caller's own,
    as they are (no round trips to set the search_path and put it back). The functions they
    call run with the bus schema as their search_path (`SET search_path FROM CURRENT`).
    """
    prefix = db.search_path(schema) + "."
    return AppendStatements(
        *(_BUS_OBJECTS.sub(lambda m: m[1] + m[2] + prefix + m[3], sql) for sql in IN_BUS_SCHEMA)
    )


# An outbox publish of one message with an idempotency key: claim, append and fill in one call
# (migration 032). {schema}: the bus schema, validated and quoted. $1 topic, $2 idempotency key,
# $3 window seconds (NULL: for ever), $4 now (NULL: the server's clock), $5..$8 partition id, key,
# headers, payload, $9 channel to NOTIFY (NULL: none), $10 a queue topic, $11..$13 delay seconds,
# delivery time, priority (NULL: a fresh job). At most one row: partition id, offset, created_at,
# and the partition's name for a repeated key.
APPEND_KEYED = (
    "SELECT * FROM {schema}.log_append_keyed($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
)


@functools.cache
def _append_keyed(schema: str) -> str:
    return APPEND_KEYED.format(schema=db.search_path(schema))


ANNOUNCE = "SELECT count(pg_notify($1, x::text)) FROM unnest($2::bigint[]) AS x"

# From the log start on: rows below it may still be stored (retention is
# logical until their segment retires, storage/segments.py).
READ = """
SELECT "offset", key, headers::text AS headers, payload, created_at
FROM messages
WHERE partition_id = $1 AND "offset" >= GREATEST($2, (SELECT log_start FROM partitions WHERE id = $1))
ORDER BY "offset"
LIMIT $3
"""

BOUNDS = "SELECT p.log_start, p.log_end FROM partitions p WHERE p.id = $1"


#: Where one message of `append` landed: (partition id, offset, created_at, partition name). The
#: name is only filled in for a repeated idempotency key (its original may be on another partition).
Placed = tuple[int, int, datetime, str | None]


class Timing:
    """The delivery side of a queue `append`, one element per message (None: a fresh job).

    `delays`: seconds from the write; `times`: a delivery time; `priorities`: higher first.
    """

    __slots__ = ("delays", "priorities", "times")

    def __init__(
        self, delays: list[float | None], times: list[datetime | None], priorities: list[int | None]
    ) -> None:
        self.delays = delays
        self.times = times
        self.priorities = priorities

    def row(self, index: int) -> tuple[float | None, datetime | None, int | None]:
        """Message `index`'s delay, delivery time and priority."""
        return self.delays[index], self.times[index], self.priorities[index]

    def pick(self, indexes: list[int]) -> Timing:
        """The timing of the messages at `indexes`."""
        return Timing(
            [self.delays[i] for i in indexes],
            [self.times[i] for i in indexes],
            [self.priorities[i] for i in indexes],
        )

    @staticmethod
    def none(count: int) -> Timing:
        """The timing of `count` plain messages (fresh jobs)."""
        return Timing([None] * count, [None] * count, [None] * count)

    def extend(self, other: Timing) -> None:
        """Add `other`'s messages after these."""
        self.delays += other.delays
        self.times += other.times
        self.priorities += other.priorities


#: A message's idempotency key and its scope: (topic, key, dedupe window in seconds; None: for ever).
IdempotencyKey = tuple[str, str, float | None]


class Batch:
    """Messages to append, as parallel lists (one element per message): what `append` writes.

    A publish call's messages make one batch (`bus.publishing` builds it); the Producer writes a
    lone call's batch as it is, and the calls of a flush as one batch joined from theirs: the
    lists go to the statement's array parameters as they are.

    `pids`: partition ids; `names`: their names (a repeated idempotency key reports its
    original's); `keys`, `headers` (JSON text) and `payloads`; `queue`: some messages belong to
    queue topics (their job rows are written too); `ikeys`: per message its idempotency key or
    None (None for the whole list: no message has one); `timing`: delays, delivery times and
    priorities of queue messages (None: no message has any); `nbytes`: what the messages weigh
    (payloads, headers and keys), for the Producer's `max_batch_bytes`.
    """

    __slots__ = ("headers", "ikeys", "keys", "names", "nbytes", "payloads", "pids", "queue", "timing")

    def __init__(self, queue: bool = False) -> None:
        self.queue = queue
        self.pids: list[int] = []
        self.names: list[str] = []
        self.keys: list[str | None] = []
        self.headers: list[str | None] = []
        self.payloads: list[bytes | None] = []
        self.ikeys: list[IdempotencyKey | None] | None = None
        self.timing: Timing | None = None
        self.nbytes = 0

    @classmethod
    def of(
        cls,
        pids: list[int],
        names: list[str],
        keys: list[str | None],
        headers: list[str | None],
        payloads: list[bytes | None],
        *,
        queue: bool = False,
    ) -> Batch:
        """A batch of these messages (no idempotency keys, no timing; weight not counted)."""
        batch = cls(queue)
        batch.pids, batch.names, batch.keys, batch.headers, batch.payloads = (
            pids,
            names,
            keys,
            headers,
            payloads,
        )
        return batch

    @classmethod
    def joined(cls, batches: list[Batch]) -> Batch:
        """One batch of `batches`' messages, one batch after the other (the calls of one flush).

        The batches themselves are left as they are (a flush that fails writes them again one by one).
        """
        out = cls()
        pids, names, keys, headers, payloads = out.pids, out.names, out.keys, out.headers, out.payloads
        nbytes, queue, sides = 0, False, False
        for b in batches:  # one pass, locals only: this runs for every flush of many calls
            pids += b.pids
            names += b.names
            keys += b.keys
            headers += b.headers
            payloads += b.payloads
            nbytes += b.nbytes
            queue = queue or b.queue
            sides = sides or b.ikeys is not None or b.timing is not None
        out.nbytes, out.queue = nbytes, queue
        if sides and any(b.ikeys is not None for b in batches):
            ikeys: list[IdempotencyKey | None] = []
            for b in batches:
                ikeys += b.ikeys if b.ikeys is not None else [None] * len(b.pids)
            out.ikeys = ikeys
        if sides and any(b.timing is not None for b in batches):
            timing = out.timing = Timing.none(0)
            for b in batches:
                timing.extend(b.timing if b.timing is not None else Timing.none(len(b.pids)))
        return out

    async def append(
        self, conn: Target, notify: str | None = None, now: datetime | None = None, planned: bool = False
    ) -> list[Placed | None]:
        """Write this batch: `append(conn, self, notify=notify, now=now, planned=planned)`."""
        return await append(conn, self, notify=notify, now=now, planned=planned)


async def _append(
    conn: Target,
    queue: bool,
    partition_ids: list[int],
    keys: list[str | None],
    headers: list[str | None],
    payloads: list[bytes | None],
    notify: str | None,
    timing: Timing | None = None,
    sql: AppendStatements = IN_BUS_SCHEMA,
    planned: bool = False,
) -> list[Placed | None]:
    """Run APPEND(_QUEUE) and place every input message: offsets follow input order within a partition.

    `planned`: `conn` is one connection with PLANNED_SETTINGS, outside a transaction; a batch
    without delays or priorities is first written with APPEND_PLANNED (one partition of a topic
    that is not a queue: APPEND_ONE_PLANNED or APPEND_SINGLE_PLANNED; queues: APPEND_QUEUE_PLANNED),
    which move the heads in the statement itself.
    """
    # A list of nothing but None goes as NULL: unnest pads it with NULLs all the same, and
    # asyncpg's array encoder checks every element.
    keys_arg = None if keys.count(None) == len(keys) else keys
    headers_arg = None if headers.count(None) == len(headers) else headers
    planned = planned and timing is None
    if not queue and partition_ids and partition_ids.count(partition_ids[0]) == len(partition_ids):
        pid = partition_ids[0]
        if len(partition_ids) == 1:
            args1: list[object] = [pid, keys[0], headers[0], payloads[0], notify]
            statements = (APPEND_SINGLE_PLANNED, sql.single)
        else:
            args1 = [pid, keys_arg, headers_arg, payloads, notify]
            statements = (APPEND_ONE_PLANNED, sql.one)
        rows = await _planned_rows(conn, statements[0], args1) if planned else []
        row = rows[0] if rows else await conn.fetchrow(statements[1], *args1)
        if row is None:  # the partition no longer exists
            return [None] * len(partition_ids)
        first, at = row[0], row[1]
        return [(pid, first + i, at, None) for i in range(len(partition_ids))]
    counters: defaultdict[int, Iterator[int]] = defaultdict(itertools.count)
    index = [next(counters[pid]) for pid in partition_ids]
    # In partition id order: the heads move in that order (no deadlock between two flushes).
    counts = {pid: next(counters[pid]) for pid in sorted(counters)}
    args: list[object] = [
        db.int_array(partition_ids),
        keys_arg,
        headers_arg,
        payloads,
        db.int_array(index),
        list(counts),
        list(counts.values()),
        notify,
    ]
    statement = sql.queue if queue else sql.plain
    if timing is not None:
        statement = sql.queue_timed
        args += [timing.delays, timing.times, timing.priorities]
    rows = (
        await _planned_rows(conn, APPEND_QUEUE_PLANNED if queue else APPEND_PLANNED, args) if planned else []
    )
    if not rows:
        rows = await conn.fetch(statement, *args)
    base = {r[0]: r[1] for r in rows}
    if not rows:
        return [None] * len(partition_ids)
    at = rows[0][2]  # one created_at for the whole statement
    if len(base) == len(counts):
        return [(pid, base[pid] + i, at, None) for pid, i in zip(partition_ids, index, strict=True)]
    placed: list[Placed | None] = []
    for pid, i in zip(partition_ids, index, strict=True):
        first = base.get(pid)
        placed.append(None if first is None else (pid, first + i, at, None))
    return placed


async def _planned_rows(conn: Target, statement: str, args: list[object]) -> list[asyncpg.Record]:
    """The rows of APPEND_PLANNED; none when a head did not move in it (it wrote nothing)."""
    try:
        return list(await conn.fetch(statement, *args))
    except asyncpg.PostgresError as exc:
        if exc.sqlstate != HEADS_MOVED_AWAY:
            raise
        return []


async def append(
    conn: Target,
    batch: Batch,
    *,
    notify: str | None = None,
    now: datetime | None = None,
    planned: bool = False,
) -> list[Placed | None]:
    """Append a batch of messages to any partitions in one statement; per message where it landed.

    None for a message whose partition no longer exists (its topic was deleted),
    or whose key's original is gone. With idempotency keys (`batch.ikeys`), `conn`
    must be a connection inside a transaction: messages whose key was already
    written within its window are not written again and get the original's
    place, and so does every later message of the same key in the batch; `now`
    is when the windows are judged and start (None: the server's clock).
    Wake-ups are the caller's (after commit; see actors/announcer.py), unless
    `notify` names the channel to NOTIFY in the same statement (its commit sends
    them: one per partition written). `planned`: `conn` is a connection of the
    Producer's, with PLANNED_SETTINGS (a batch without idempotency keys may then
    be written with APPEND_PLANNED).
    """
    ikeys = batch.ikeys
    if ikeys is None:
        return await _append(
            conn,
            batch.queue,
            batch.pids,
            batch.keys,
            batch.headers,
            batch.payloads,
            notify,
            batch.timing,
            planned=planned,
        )
    assert not isinstance(conn, asyncpg.Pool), "keyed appends need one connection inside a transaction"
    first: dict[tuple[str, str], int] = {}
    windows: dict[tuple[str, str], float | None] = {}
    for i, ikey in enumerate(ikeys):
        if ikey is not None and ikey[:2] not in first:
            first[ikey[:2]] = i
            windows[ikey[:2]] = ikey[2]
    pairs = list(first)
    claimed = await idempotency.claim(
        conn,
        [t for t, _ in pairs],
        [k for _, k in pairs],
        [windows[p] for p in pairs],
        now,
    )
    write = [
        i for i, ikey in enumerate(ikeys) if ikey is None or (first[ikey[:2]] == i and ikey[:2] in claimed)
    ]
    results: list[Placed | None] = [None] * len(batch.pids)
    if write:
        written = await _append(
            conn,
            batch.queue,
            [batch.pids[i] for i in write],
            [batch.keys[i] for i in write],
            [batch.headers[i] for i in write],
            [batch.payloads[i] for i in write],
            notify,
            None if batch.timing is None else batch.timing.pick(write),
        )
        for i, placed in zip(write, written, strict=True):
            results[i] = placed
    landed = [(p, results[first[p]]) for p in pairs if p in claimed]
    kept = [(p, r) for p, r in landed if r is not None]
    if kept:
        await idempotency.fill(
            conn,
            [p[0] for p, _ in kept],
            [p[1] for p, _ in kept],
            [r[0] for _, r in kept],
            [r[1] for _, r in kept],
            [r[2] for _, r in kept],
        )
    lost = [p for p, r in landed if r is None]
    if lost:  # the partition vanished: do not keep a key that points nowhere
        await idempotency.release(conn, [t for t, _ in lost], [k for _, k in lost])
    repeated = [p for p in pairs if p not in claimed]
    if repeated:
        found = await idempotency.lookup(conn, [t for t, _ in repeated], [k for _, k in repeated])
        for p in repeated:
            hit = found.get(p)
            if hit is not None:
                results[first[p]] = (hit[0], hit[2], hit[3], hit[1])
    for i, ikey in enumerate(ikeys):
        if ikey is not None and (j := first[ikey[:2]]) != i:
            original = results[j]
            if original is not None and original[3] is None:
                original = (original[0], original[1], original[2], batch.names[j])
            results[i] = original
    return results


async def append_outbox(
    conn: asyncpg.Connection | PoolConnectionProxy,
    schema: str,
    batch: Batch,
    *,
    notify: str | None = None,
    now: datetime | None = None,
) -> list[Placed | None]:
    """`append` on a caller's connection, inside the caller's transaction (the outbox), in one round trip.

    Whatever the connection's search_path: the statement names the bus's objects in `schema`.
    One statement and no savepoint of its own, so it is part of the caller's transaction as any
    statement of the caller's is: an error in it fails that transaction, and what it wrote goes
    or stays with the caller's commit or rollback (the wake-ups `notify` sends too). A single
    message with an idempotency key is one call (claim, append, fill). Several messages with
    keys run the Producer's statements in the bus schema, under a savepoint (`db.on_schema`):
    they are more than one statement, and must be all or nothing.
    """
    ikeys = batch.ikeys
    if ikeys is None:
        return await _append(
            conn,
            batch.queue,
            batch.pids,
            batch.keys,
            batch.headers,
            batch.payloads,
            notify,
            batch.timing,
            in_schema(schema),
        )
    if len(batch.pids) == 1 and ikeys[0] is not None:
        topic, ikey, window = ikeys[0]
        delay, at, priority = (None, None, None) if batch.timing is None else batch.timing.row(0)
        row = await conn.fetchrow(
            _append_keyed(schema),
            topic,
            ikey,
            window,
            now,
            batch.pids[0],
            batch.keys[0],
            batch.headers[0],
            batch.payloads[0],
            notify,
            batch.queue,
            delay,
            at,
            priority,
        )
        return [None if row is None else (int(row[0]), int(row[1]), row[2], row[3])]
    async with db.on_schema(conn, schema):
        return await append(conn, batch, notify=notify, now=now)


async def announce(conn: asyncpg.Connection, channel: str, partition_ids: list[int]) -> None:
    """NOTIFY `channel` once per partition id (post-commit wake-ups)."""
    await conn.fetchval(ANNOUNCE, channel, partition_ids)


async def read(conn: db.Conn, partition_id: int, offset: int, limit: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(READ, partition_id, offset, limit))


async def bounds(conn: db.Conn, partition_id: int) -> tuple[int, int] | None:
    row = await conn.fetchrow(BOUNDS, partition_id)
    return None if row is None else (int(row[0]), int(row[1]))
