-- Queue takes lease fresh jobs by range instead of writing every job.
--
-- Before: a take rewrote each job row it leased (visible_at, indexed, so a
-- non-HOT update with two index inserts), a write per job on top of the ack's
-- delete. Now every queue partition has a frontier: its jobs at or above
-- `queue_frontiers.next_offset` that are not `detached` are fresh (never taken).
-- A take leases fresh jobs by moving the frontier (one row per partition,
-- row-locked) and inserting one `queue_leases` row per (taker, partition):
-- the jobs between the lease's first and last offset that are still there and
-- not detached belong to it. Their job rows are not written; the ack deletes
-- them as before, fenced by `lease_epoch` (0 for a job in a range lease).
--
-- A job gets its own state (`detached`: its visible_at, leased_by, attempts and
-- lease_epoch then say everything, as before) when it is nacked, given back,
-- or its range lease runs out and a take reclaims the lease: from then on the
-- takes lease it one row at a time, as before. Job rows still exist exactly
-- for the messages not yet acked (the watermark, retention, the dashboard and
-- ordered_by_key read them as before).
ALTER TABLE queue_jobs ADD COLUMN detached boolean NOT NULL DEFAULT false;

-- Existing schemas: every job keeps the state it has; the frontiers start past them.
UPDATE queue_jobs SET detached = true;

CREATE TABLE queue_frontiers (
    partition_id  bigint PRIMARY KEY REFERENCES partitions (id) ON DELETE CASCADE,
    topic         text NOT NULL,
    next_offset   bigint NOT NULL
);
CREATE INDEX queue_frontiers_topic ON queue_frontiers (topic);

INSERT INTO queue_frontiers (partition_id, topic, next_offset)
SELECT p.id, p.topic, p.next_offset
FROM partitions p JOIN topics t ON t.name = p.topic
WHERE t.semantics = 'queue';

-- Every partition of a queue topic gets its frontier when it is created
-- (also the partitions a dynamic topic creates as keys are published).
CREATE FUNCTION queue_partition_frontier() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO queue_frontiers (partition_id, topic, next_offset)
    SELECT NEW.id, NEW.topic, NEW.next_offset
    FROM topics t WHERE t.name = NEW.topic AND t.semantics = 'queue';
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_queue_frontier AFTER INSERT ON partitions
FOR EACH ROW EXECUTE FUNCTION queue_partition_frontier();

-- One row per take of fresh jobs from one partition for one taker.
CREATE TABLE queue_leases (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic         text NOT NULL,
    partition_id  bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    first_offset  bigint NOT NULL,
    last_offset   bigint NOT NULL,
    leased_by     text NOT NULL,
    visible_at    timestamptz NOT NULL          -- the lease runs out
);
CREATE INDEX queue_leases_expiry ON queue_leases (topic, visible_at);
CREATE INDEX queue_leases_range ON queue_leases (partition_id, first_offset);

-- Only detached jobs are found through visibility; fresh jobs through the frontier.
DROP INDEX queue_jobs_ready;
CREATE INDEX queue_jobs_ready ON queue_jobs (topic, visible_at) WHERE detached;

-- Each job's lease as the dashboard shows it: its own, or that of the range
-- lease holding it (a fresh job, at or past its frontier, has none and is
-- ready since its publish; only the jobs below a frontier look a lease up).
CREATE VIEW queue_job_states AS
SELECT j.partition_id, j."offset", j.topic, j.key, j.detached,
       CASE WHEN j.detached THEN j.leased_by ELSE l.leased_by END AS leased_by,
       CASE WHEN j.detached OR l.visible_at IS NULL THEN j.visible_at ELSE l.visible_at END AS visible_at
FROM queue_jobs j
LEFT JOIN queue_frontiers f ON f.partition_id = j.partition_id
LEFT JOIN LATERAL (
    SELECT l.leased_by, l.visible_at FROM queue_leases l
    WHERE NOT j.detached AND j."offset" < f.next_offset
      AND l.partition_id = j.partition_id
      AND l.first_offset <= j."offset" AND l.last_offset >= j."offset"
    ORDER BY l.first_offset DESC
    LIMIT 1
) AS l ON true;
