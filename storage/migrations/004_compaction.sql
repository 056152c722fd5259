-- History: the Spark compaction and archive job's bookkeeping.
--
-- A run is planned first (one plan row per partition, with the offset ranges
-- and the retention cut-offs fixed at plan time), then executed step by step;
-- every step is idempotent, so an interrupted run is simply resumed by the next
-- job. At most one run is open (status <> 'done') at a time.

CREATE TABLE compaction_runs (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- planned: plan rows recorded; staged: keep-set written; archived: Parquet
    -- files in place; done: every partition deleted and the run summarised.
    status         text NOT NULL DEFAULT 'planned'
                   CHECK (status IN ('planned', 'staged', 'archived', 'done')),
    archive_root   text NOT NULL,
    topics         text[] NULL,                  -- NULL: every topic
    planned_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz NULL,
    attempts       integer NOT NULL DEFAULT 1,   -- 1 + the number of resumptions
    rows_scanned   bigint NOT NULL DEFAULT 0,
    rows_kept      bigint NOT NULL DEFAULT 0,
    rows_archived  bigint NOT NULL DEFAULT 0,
    rows_removed   bigint NOT NULL DEFAULT 0,
    archive_files  text[] NOT NULL DEFAULT '{}',
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE UNIQUE INDEX compaction_runs_one_open ON compaction_runs ((true)) WHERE status <> 'done';

-- One row per partition a run works on. [lo, hi) is the range the run may
-- remove from; end_offset bounds "the newest record per key" (compact topics),
-- so a resumed run decides exactly as the first attempt did.
CREATE TABLE compaction_plan (
    run_id            bigint NOT NULL REFERENCES compaction_runs (id) ON DELETE CASCADE,
    partition_id      bigint NOT NULL,           -- no FK: a topic may be deleted meanwhile
    topic             text NOT NULL,
    partition         text NOT NULL,
    cleanup           text NOT NULL CHECK (cleanup IN ('delete', 'compact')),
    lo                bigint NOT NULL,
    hi                bigint NOT NULL,
    end_offset        bigint NOT NULL,
    retention_cutoff  timestamptz NULL,          -- compact: superseded records newer than this stay
    tombstone_cutoff  timestamptz NULL,          -- compact: newest tombstones older than this go
    rows_scanned      bigint NULL,
    keep_rows         bigint NULL,
    archived_rows     bigint NULL,
    removed_rows      bigint NULL,
    cut               bigint NULL,               -- LEAST(hi, watermark re-checked at delete time)
    log_start_after   bigint NULL,
    done_at           timestamptz NULL,
    PRIMARY KEY (run_id, partition_id)
);

-- The keep-set of compact partitions: for each key, its newest record inside
-- [lo, hi) unless that is an expired tombstone. Everything else in range (with
-- a key, past retention) is removable. Small (at most one row per key), so the
-- anti-joins below stay cheap. Written by one INSERT ... SELECT (STAGE_KEEP).
-- UNLOGGED for speed: a server crash empties it, and the job notices
-- (plan.keep_rows) and rebuilds it before deleting.
CREATE UNLOGGED TABLE compaction_keep (
    run_id        bigint NOT NULL,
    partition_id  bigint NOT NULL,
    "offset"      bigint NOT NULL
);
CREATE INDEX compaction_keep_row ON compaction_keep (run_id, partition_id, "offset");

-- What the run archives and then removes (read by Spark over JDBC, split by
-- heap block ranges of `messages` through row_ctid): delete topics, the whole
-- planned range; compact topics, every keyed record in range past retention
-- and not in the keep-set. Keyless records of compact topics are never
-- removed. The payload travels as bytea (Spark reads BinaryType): no hex
-- encoding on the server, half the bytes on the wire.
CREATE VIEW compaction_removable AS
SELECT m.ctid AS row_ctid,
       p.run_id,
       m.partition_id,
       p.topic,
       p.partition,
       m."offset",
       m.key,
       m.headers::text AS headers,
       m.payload,
       m.created_at
FROM messages m
JOIN compaction_plan p ON p.partition_id = m.partition_id
-- At most one run is open (compaction_runs_one_open): a scalar lookup, so the
-- planner never joins (or materializes) the message rows against the runs.
WHERE p.run_id = (SELECT r.id FROM compaction_runs r WHERE r.status <> 'done')
  AND p.done_at IS NULL
  AND m."offset" >= p.lo AND m."offset" < p.hi
  AND (p.cleanup = 'delete'
       OR (m.key IS NOT NULL
           AND (p.retention_cutoff IS NULL OR m.created_at < p.retention_cutoff)
           AND NOT EXISTS (SELECT 1 FROM compaction_keep k
                           WHERE k.run_id = p.run_id AND k.partition_id = m.partition_id
                             AND k."offset" = m."offset")));
