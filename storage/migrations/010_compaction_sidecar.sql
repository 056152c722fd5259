-- History, round 2: each row archived once, progress in the database, the sidecar.

-- Rows a run archived but could not delete because the watermark moved back
-- between its archive and its delete (an admin reset, a new `earliest` group).
-- A later run deletes them without archiving them again; an entry goes once
-- its row is gone from the log. Small: only what such a reset held back.
CREATE TABLE compaction_archived (
    partition_id  bigint NOT NULL,
    "offset"      bigint NOT NULL,
    run_id        bigint NOT NULL,               -- the run whose archive holds the row
    PRIMARY KEY (partition_id, "offset")
);

-- What the run is doing now, written by the job as it goes (`bus compact --status`).
ALTER TABLE compaction_runs
    ADD COLUMN stage          text NULL,         -- plan | stage | archive | delete | done
    ADD COLUMN stage_done     bigint NULL,
    ADD COLUMN stage_total    bigint NULL,
    ADD COLUMN stage_message  text NULL;

-- One row per `bus compact --every` process: its schedule, whether it is
-- running a compaction now, and the outcome of its last run.
CREATE TABLE compaction_sidecars (
    name              text PRIMARY KEY,          -- host:pid
    every_seconds     double precision NOT NULL,
    master            text NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    heartbeat_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    state             text NOT NULL DEFAULT 'starting'
                      CHECK (state IN ('starting', 'idle', 'running', 'stopped')),
    next_run_at       timestamptz NULL,
    runs_ok           integer NOT NULL DEFAULT 0,
    runs_failed       integer NOT NULL DEFAULT 0,
    last_run_id       bigint NULL,
    last_started_at   timestamptz NULL,
    last_finished_at  timestamptz NULL,
    last_seconds      double precision NULL,
    last_outcome      text NULL CHECK (last_outcome IN ('ok', 'failed', 'busy')),
    last_error        text NULL,
    last_archived     bigint NULL,
    last_removed      bigint NULL
);

-- The view Spark reads, as in 004, minus rows an earlier run already archived.
-- Spark splits its read by partition and offset range (not by heap block:
-- `messages` may be a partitioned table, whose ctids are per leaf).
DROP VIEW IF EXISTS compaction_removable;
CREATE VIEW compaction_removable AS
SELECT p.run_id,
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
WHERE p.run_id = (SELECT r.id FROM compaction_runs r WHERE r.status <> 'done')
  AND p.done_at IS NULL
  AND m."offset" >= p.lo AND m."offset" < p.hi
  AND (p.cleanup = 'delete'
       OR (m.key IS NOT NULL
           AND (p.retention_cutoff IS NULL OR m.created_at < p.retention_cutoff)
           AND NOT EXISTS (SELECT 1 FROM compaction_keep k
                           WHERE k.run_id = p.run_id AND k.partition_id = m.partition_id
                             AND k."offset" = m."offset")))
  AND NOT EXISTS (SELECT 1 FROM compaction_archived a
                  WHERE a.partition_id = m.partition_id AND a."offset" = m."offset");
