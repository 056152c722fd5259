-- Claims (pending cursors found through an index), queue jobs, and the
-- watermark rule for queue topics.

-- Claims pick "the free partition with the earliest pending message". Scanning
-- every cursor of a group for that would cost O(partitions) per claim, so each
-- cursor carries the creation time of its first unread message (NULL when it
-- has read everything) and an index orders the pending ones.
ALTER TABLE offsets ADD COLUMN pending_since timestamptz NULL;
CREATE INDEX offsets_pending ON offsets (group_name, pending_since) WHERE pending_since IS NOT NULL;
CREATE INDEX offsets_caught_up ON offsets (partition_id) WHERE pending_since IS NULL;

-- A publish wakes the cursors that had read everything. It runs in the
-- publishing transaction, under the partition's row lock: a claim ack that
-- clears pending_since takes that lock FOR SHARE first, so the two cannot
-- interleave and lose a wake-up. Cursors already pending are not touched, so
-- a busy partition costs one index probe per publish.
CREATE FUNCTION wake_caught_up_cursors() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE offsets SET pending_since = clock_timestamp()
    WHERE partition_id = NEW.id AND pending_since IS NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_wake_cursors
AFTER UPDATE OF next_offset ON partitions
FOR EACH ROW WHEN (NEW.next_offset > OLD.next_offset)
EXECUTE FUNCTION wake_caught_up_cursors();

-- One row per message of a `semantics="queue"` topic that is not yet acked
-- (inserted by the publishing statement itself). A job is free when
-- visible_at has passed: a take pushes visible_at by the visibility timeout,
-- so an unacked job comes back by itself; an ack deletes the row. lease_epoch
-- fences acks and nacks of a job that came back and was taken again.
CREATE TABLE queue_jobs (
    partition_id  bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    "offset"      bigint NOT NULL,
    topic         text NOT NULL,
    key           text NULL,
    attempts      integer NOT NULL DEFAULT 0,
    lease_epoch   bigint NOT NULL DEFAULT 0,
    leased_by     text NULL,
    visible_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    errors        jsonb NULL,                 -- [{"attempt": n, "error": "...", "at": "..."}]
    PRIMARY KEY (partition_id, "offset")
);
CREATE INDEX queue_jobs_ready ON queue_jobs (topic, visible_at);
-- ordered_by_key: "is an earlier job of this key still there?"
CREATE INDEX queue_jobs_key ON queue_jobs (topic, key, partition_id, "offset") WHERE key IS NOT NULL;

-- The low watermark (invariant 7), now also for queue topics: a queue message
-- is held until it is acked (its job row is gone). Groups reading a queue
-- topic (claims on it) hold it as well.
CREATE OR REPLACE VIEW partition_watermarks AS
SELECT p.id AS partition_id,
       p.topic,
       p.name AS partition,
       p.log_start,
       p.next_offset,
       LEAST(p.next_offset,
             COALESCE(MIN(COALESCE(o.committed, p.log_start))
                      FILTER (WHERE g.name IS NOT NULL), p.next_offset),
             COALESCE((SELECT MIN(j."offset") FROM queue_jobs j WHERE j.partition_id = p.id),
                      p.next_offset)) AS low_watermark
FROM partitions p
LEFT JOIN group_topics gt ON gt.topic = p.topic
LEFT JOIN groups g ON g.name = gt.group_name AND g.status IN ('active', 'stopped')
LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
GROUP BY p.id, p.topic, p.name, p.log_start, p.next_offset;
