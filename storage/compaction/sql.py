"""Every statement the compaction job runs from its driver (bookkeeping, plan, keep-set, deletes).

The Spark executors read the view `compaction_removable` (migrations 004,
010); the only text ever formatted is a read split (`split_predicate`), and
only with integers the job computed itself from its plan.
"""

from __future__ import annotations

# A session-level advisory lock: one compaction job per schema at a time.
# The key is fixed; the schema is mixed in by hashtext(current_schema()).
COMPACTION_LOCK_KEY = 0x6275_7343

TRY_LOCK = "SELECT pg_try_advisory_lock($1, hashtext(current_schema()))"
UNLOCK = "SELECT pg_advisory_unlock($1, hashtext(current_schema()))"

SELECT_OPEN_RUN = """
SELECT id, status, archive_root, topics, planned_at, attempts
FROM compaction_runs WHERE status <> 'done'
"""

INSERT_RUN = """
INSERT INTO compaction_runs (archive_root, topics) VALUES ($1, $2)
RETURNING id, status, archive_root, topics, planned_at, attempts
"""

BUMP_ATTEMPTS = (
    "UPDATE compaction_runs SET attempts = attempts + 1, updated_at = clock_timestamp() WHERE id = $1"
)

SET_RUN_STATUS = "UPDATE compaction_runs SET status = $2, updated_at = clock_timestamp() WHERE id = $1"

# The plan: for every partition with history, the range [lo, hi) the run may
# remove from, fixed now. Delete topics: history is the prefix below the
# watermark whose records are past retention (no retention: kept forever).
# Compact topics: everything below the watermark is a candidate; the keep-set
# decides. `young` finds the first record still inside retention through the
# (partition_id, created_at) index.
INSERT_PLAN = """
INSERT INTO compaction_plan (run_id, partition_id, topic, partition, cleanup, lo, hi, end_offset,
                             retention_cutoff, tombstone_cutoff)
SELECT * FROM (
    SELECT $1::bigint AS run_id, w.partition_id, w.topic, w.partition, t.cleanup,
           w.log_start AS lo,
           CASE WHEN t.cleanup = 'delete'
                THEN LEAST(w.low_watermark, COALESCE(young.first_offset, w.low_watermark))
                ELSE w.low_watermark END AS hi,
           w.next_offset AS end_offset,
           CASE WHEN t.retention_seconds IS NULL THEN NULL
                ELSE r.planned_at - make_interval(secs => t.retention_seconds) END AS retention_cutoff,
           r.planned_at - make_interval(secs => COALESCE(t.tombstone_retention_seconds, $3::double precision))
               AS tombstone_cutoff
    FROM partition_watermarks w
    JOIN topics t ON t.name = w.topic
    JOIN compaction_runs r ON r.id = $1
    LEFT JOIN LATERAL (
        SELECT m."offset" AS first_offset
        FROM messages m
        WHERE t.cleanup = 'delete'
          AND m.partition_id = w.partition_id
          AND m.created_at >= r.planned_at - make_interval(secs => t.retention_seconds)
        ORDER BY m.created_at, m."offset"
        LIMIT 1
    ) young ON true
    WHERE ($2::text[] IS NULL OR w.topic = ANY ($2::text[]))
      AND (t.cleanup = 'compact' OR t.retention_seconds IS NOT NULL)
) planned
WHERE planned.hi > planned.lo
"""

SELECT_PLAN = """
SELECT partition_id, topic, partition, cleanup, lo, hi, end_offset, rows_scanned, keep_rows,
       archived_rows, removed_rows, cut, log_start_after, done_at
FROM compaction_plan WHERE run_id = $1 ORDER BY topic, partition_id
"""

# One JDBC predicate per Spark task (a WHERE clause Spark adds to its read of
# the view): a set of whole partitions, or one partition's offset range. The
# split never looks at the heap (`messages` may be a partitioned table, whose
# ctids are per leaf), and partition pruning applies when segments are offset
# ranges. JDBC predicates cannot carry parameters, so these are the one spot
# where text is formatted, and only with integers the job computed itself
# from its plan, checked to be integers.
_WHOLE = "partition_id IN ({ids})"
_RANGE = 'partition_id = {pid} AND "offset" >= {lo} AND "offset" < {hi}'
_FROM = 'partition_id = {pid} AND "offset" >= {lo}'
_BELOW = 'partition_id = {pid} AND "offset" < {hi}'


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"partition ids and offsets are non-negative integers, got {value!r}")
    return value


def split_predicate(pieces: list[tuple[int, int | None, int | None]]) -> str:
    """The predicate for `pieces` of (partition_id, from offset or None, below offset or None).

    None on both sides means the whole planned range of that partition; the
    view itself bounds every partition to its plan's [lo, hi).
    """
    if not pieces:
        raise ValueError("a split needs at least one piece")
    whole = [_int(pid) for pid, lo, hi in pieces if lo is None and hi is None]
    terms = [_WHOLE.format(ids=", ".join(str(i) for i in whole))] if whole else []
    for pid, lo, hi in pieces:
        if lo is None and hi is None:
            continue
        if lo is None:
            terms.append(_BELOW.format(pid=_int(pid), hi=_int(hi)))
        elif hi is None:
            terms.append(_FROM.format(pid=_int(pid), lo=_int(lo)))
        else:
            terms.append(_RANGE.format(pid=_int(pid), lo=_int(lo), hi=_int(hi)))
    return terms[0] if len(terms) == 1 else " OR ".join(f"({t})" for t in terms)


CLEAR_KEEP = "DELETE FROM compaction_keep WHERE run_id = $1"

# The keep-set of the run's pending compact partitions, in one set-based
# statement: for each key its newest record in [lo, end_offset), kept when it
# is below hi and not a tombstone past its retention. The key columns never
# leave PostgreSQL: a hash aggregate here costs a fraction of shipping them to
# Spark over JDBC, and only the newest record of each key is looked up again
# (by primary key) for its tombstone flag and time. rows_scanned and keep_rows
# of every pending compact plan row are recorded by the same statement.
STAGE_KEEP = """
WITH newest AS (
    SELECT m.partition_id, max(m."offset") AS "offset", count(*) AS n
    FROM compaction_plan p
    JOIN messages m ON m.partition_id = p.partition_id AND m."offset" >= p.lo AND m."offset" < p.end_offset
    WHERE p.run_id = $1 AND p.cleanup = 'compact' AND p.done_at IS NULL AND m.key IS NOT NULL
    GROUP BY m.partition_id, m.key
), kept AS (
    INSERT INTO compaction_keep (run_id, partition_id, "offset")
    SELECT $1, n.partition_id, n."offset"
    FROM newest n
    JOIN compaction_plan p ON p.run_id = $1 AND p.partition_id = n.partition_id
    JOIN messages m ON m.partition_id = n.partition_id AND m."offset" = n."offset"
    WHERE n."offset" < p.hi
      AND NOT (m.payload IS NULL AND m.created_at < p.tombstone_cutoff)
    RETURNING partition_id
), scanned AS (
    SELECT partition_id, sum(n)::bigint AS n FROM newest GROUP BY partition_id
), counted AS (
    SELECT partition_id, count(*) AS n FROM kept GROUP BY partition_id
)
UPDATE compaction_plan p
SET rows_scanned = COALESCE(s.n, 0), keep_rows = COALESCE(c.n, 0)
FROM compaction_plan q
LEFT JOIN scanned s ON s.partition_id = q.partition_id
LEFT JOIN counted c ON c.partition_id = q.partition_id
WHERE q.run_id = $1 AND q.cleanup = 'compact' AND q.done_at IS NULL
  AND p.run_id = q.run_id AND p.partition_id = q.partition_id
"""
ANALYZE_KEEP = "ANALYZE compaction_keep"
# Fresh statistics on the plan rows (one per partition) so that the keep-set
# statement and the archive read hash-join them with `messages` instead of
# guessing one row and choosing nested loops.
ANALYZE_PLAN = "ANALYZE compaction_plan"

RECORD_ARCHIVED = "UPDATE compaction_plan SET archived_rows = $3 WHERE run_id = $1 AND partition_id = $2"

ZERO_UNARCHIVED = "UPDATE compaction_plan SET archived_rows = 0 WHERE run_id = $1 AND archived_rows IS NULL"

SET_ARCHIVE_FILES = """
UPDATE compaction_runs SET archive_files = $2, status = 'archived', updated_at = clock_timestamp() WHERE id = $1
"""

# Pending compact partitions whose keep-set is not what was recorded (the
# UNLOGGED table lost its rows in a server crash): the run must rebuild it.
KEEP_MISMATCH = """
SELECT count(*) FROM compaction_plan p
WHERE p.run_id = $1 AND p.cleanup = 'compact' AND p.done_at IS NULL
  AND p.keep_rows IS DISTINCT FROM
      (SELECT count(*) FROM compaction_keep k WHERE k.run_id = $1 AND k.partition_id = p.partition_id)
"""

# -- the per-partition delete transaction ------------------------------------------

LOCK_PARTITION = (
    "SELECT p.id, p.log_start, p.log_end AS next_offset FROM partitions p WHERE p.id = $1 FOR UPDATE"
)

PARTITION_WATERMARK = "SELECT low_watermark FROM partition_watermarks WHERE partition_id = $1"

KEEP_COUNT = "SELECT count(*) FROM compaction_keep WHERE run_id = $1 AND partition_id = $2"

# Only below the watermark re-checked under the partition row lock ($4): a
# group that committed backwards or a new `earliest` group is never robbed.
DELETE_RANGE = """
DELETE FROM messages
WHERE partition_id = $1 AND "offset" >= $2 AND "offset" < LEAST($3::bigint, $4::bigint)
"""

DELETE_COMPACTED = """
DELETE FROM messages m
WHERE m.partition_id = $2 AND m."offset" >= $3 AND m."offset" < LEAST($4::bigint, $5::bigint)
  AND m.key IS NOT NULL
  AND ($6::timestamptz IS NULL OR m.created_at < $6::timestamptz)
  AND NOT EXISTS (SELECT 1 FROM compaction_keep k
                  WHERE k.run_id = $1 AND k.partition_id = m.partition_id AND k."offset" = m."offset")
"""

# The log start is the first offset still present (never moved backwards):
# for delete topics the cut, for compact topics past a contiguous removed prefix.
ADVANCE_LOG_START = """
UPDATE partitions p
SET log_start = GREATEST(p.log_start,
                         COALESCE((SELECT min(m."offset") FROM messages m
                                   WHERE m.partition_id = p.id AND m."offset" >= p.log_start),
                                  p.log_end))
WHERE p.id = $1
RETURNING log_start
"""

# The watermark moved back between this run's archive and its delete: the
# rows it archived at or above the cut stay in the log. Remember them, so a
# later run deletes them without archiving them a second time. The view
# still describes exactly what this run archived (its plan row is not done
# yet, its keep-set is unchanged, and log rows never change).
HOLD_ARCHIVED = """
INSERT INTO compaction_archived (partition_id, "offset", run_id)
SELECT partition_id, "offset", run_id FROM compaction_removable
WHERE partition_id = $1 AND "offset" >= $2
ON CONFLICT DO NOTHING
"""

# Entries whose rows are gone (deleted by this run, the retention cleaner, a
# dropped segment or topic) are no longer needed.
FORGET_ARCHIVED = """
DELETE FROM compaction_archived a
WHERE a.partition_id = $1
  AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.partition_id = a.partition_id AND m."offset" = a."offset")
"""
FORGET_GONE_ARCHIVED = """
DELETE FROM compaction_archived a
WHERE NOT EXISTS (SELECT 1 FROM messages m WHERE m.partition_id = a.partition_id AND m."offset" = a."offset")
"""

MARK_PARTITION_DONE = """
UPDATE compaction_plan
SET removed_rows = $3, cut = $4, log_start_after = $5, done_at = clock_timestamp()
WHERE run_id = $1 AND partition_id = $2
"""

SELECT_PLAN_ROW = """
SELECT lo, hi, cleanup, retention_cutoff, keep_rows, done_at FROM compaction_plan WHERE run_id = $1 AND partition_id = $2
"""

FINISH_RUN = """
UPDATE compaction_runs r
SET status = 'done', finished_at = clock_timestamp(), updated_at = clock_timestamp(),
    rows_scanned = s.scanned, rows_kept = s.kept, rows_archived = s.archived, rows_removed = s.removed
FROM (SELECT COALESCE(sum(rows_scanned), 0)::bigint AS scanned, COALESCE(sum(keep_rows), 0)::bigint AS kept,
             COALESCE(sum(archived_rows), 0)::bigint AS archived, COALESCE(sum(removed_rows), 0)::bigint AS removed
      FROM compaction_plan WHERE run_id = $1) s
WHERE r.id = $1
RETURNING r.rows_scanned, r.rows_kept, r.rows_archived, r.rows_removed
"""

SELECT_RUN = """
SELECT id, status, archive_root, topics, planned_at, finished_at, attempts, rows_scanned, rows_kept,
       rows_archived, rows_removed, archive_files
FROM compaction_runs WHERE id = $1
"""

# Progress of the open run, written as the job goes.
SET_STAGE = """
UPDATE compaction_runs
SET stage = $2, stage_done = $3, stage_total = $4, stage_message = $5, updated_at = clock_timestamp()
WHERE id = $1
"""

SELECT_RUNS = """
SELECT id, status, archive_root, topics, planned_at, finished_at, attempts, rows_scanned, rows_kept,
       rows_archived, rows_removed, cardinality(archive_files) AS files,
       stage, stage_done, stage_total, stage_message, updated_at,
       (SELECT count(*) FROM compaction_plan p WHERE p.run_id = r.id) AS partitions
FROM compaction_runs r
ORDER BY id DESC
LIMIT $1
"""

# -- the sidecar (`bus compact --every`) -------------------------------------------------

SIDECAR_REGISTER = """
INSERT INTO compaction_sidecars (name, every_seconds, master)
VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE
SET every_seconds = EXCLUDED.every_seconds, master = EXCLUDED.master, started_at = clock_timestamp(),
    heartbeat_at = clock_timestamp(), state = 'starting', next_run_at = NULL
"""

SIDECAR_STATE = """
UPDATE compaction_sidecars
SET state = $2, next_run_at = $3, heartbeat_at = clock_timestamp()
WHERE name = $1
"""

SIDECAR_RUN_STARTED = """
UPDATE compaction_sidecars
SET state = 'running', last_started_at = clock_timestamp(), heartbeat_at = clock_timestamp(), next_run_at = NULL
WHERE name = $1
"""

# $2 outcome ok|failed|busy, $3 run id, $4 seconds, $5 error text, $6 archived, $7 removed.
SIDECAR_RUN_FINISHED = """
UPDATE compaction_sidecars
SET last_outcome = $2, last_run_id = COALESCE($3, last_run_id), last_seconds = $4, last_error = $5,
    last_archived = $6, last_removed = $7, last_finished_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
    runs_ok = runs_ok + (CASE WHEN $2 = 'ok' THEN 1 ELSE 0 END),
    runs_failed = runs_failed + (CASE WHEN $2 = 'failed' THEN 1 ELSE 0 END)
WHERE name = $1
"""

SELECT_SIDECARS = """
SELECT name, every_seconds, master, started_at, heartbeat_at, state, next_run_at, runs_ok, runs_failed,
       last_run_id, last_started_at, last_finished_at, last_seconds, last_outcome, last_error,
       last_archived, last_removed
FROM compaction_sidecars
ORDER BY started_at DESC
"""
