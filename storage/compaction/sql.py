"""Every statement the compaction job runs from its driver (bookkeeping, plan, deletes).

The Spark executors read the views `compaction_key_scan` and
`compaction_removable` (migration 004) and append to `compaction_keep`; the
only text ever formatted is `CTID_RANGE`, and only with integers the job
computed itself (block numbers).
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

BUMP_ATTEMPTS = "UPDATE compaction_runs SET attempts = attempts + 1, updated_at = clock_timestamp() WHERE id = $1"

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

# How many heap blocks `messages` has now: the JDBC read is split by block ranges.
MESSAGES_BLOCKS = "SELECT (pg_relation_size('messages') / current_setting('block_size')::bigint)::bigint"

# One JDBC predicate per Spark task (a WHERE clause Spark adds to its read of
# the view): heap block ranges of `messages`. JDBC predicates cannot carry
# parameters, so these are the one spot where text is formatted, and only with
# block numbers the job computed itself, checked to be integers.
_CTID_RANGE = "row_ctid >= '({lo},0)'::tid AND row_ctid < '({hi},0)'::tid"
_CTID_FROM = "row_ctid >= '({lo},0)'::tid"


def ctid_predicate(lo: int, hi: int | None) -> str:
    """The predicate for heap blocks [lo, hi) (hi None: to the end of the table)."""
    for value in (lo, hi):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"block numbers are non-negative integers, got {value!r}")
    return _CTID_FROM.format(lo=lo) if hi is None else _CTID_RANGE.format(lo=lo, hi=hi)


CLEAR_KEEP = "DELETE FROM compaction_keep WHERE run_id = $1"
ANALYZE_KEEP = "ANALYZE compaction_keep"

RECORD_KEEP_COUNTS = """
UPDATE compaction_plan p
SET keep_rows = (SELECT count(*) FROM compaction_keep k WHERE k.run_id = p.run_id AND k.partition_id = p.partition_id)
WHERE p.run_id = $1 AND p.cleanup = 'compact' AND p.done_at IS NULL
"""

RECORD_SCANNED = "UPDATE compaction_plan SET rows_scanned = $3 WHERE run_id = $1 AND partition_id = $2"

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

LOCK_PARTITION = "SELECT id, log_start, next_offset FROM partitions WHERE id = $1 FOR UPDATE"

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
                                  p.next_offset))
WHERE p.id = $1
RETURNING log_start
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

SELECT_RUNS = """
SELECT id, status, archive_root, topics, planned_at, finished_at, attempts, rows_scanned, rows_kept,
       rows_archived, rows_removed, cardinality(archive_files) AS files,
       (SELECT count(*) FROM compaction_plan p WHERE p.run_id = r.id) AS partitions
FROM compaction_runs r
ORDER BY id DESC
LIMIT $1
"""
