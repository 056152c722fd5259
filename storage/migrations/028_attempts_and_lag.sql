-- The failed attempts of the message a transactional handler (or a poll consumer's
-- transaction with retries) is stuck on, one row per group and partition.
--
-- A group reads a partition in order, so at most one message of a partition is
-- being retried at a time: the row names its offset, how many attempts failed and
-- their errors. It is written in the same transaction that commits the offsets of
-- the messages before it, and deleted in the transaction that commits past it (its
-- success, or its dead-letter publish), so the count survives a crash or a move of
-- the partition to another member, and a message is dead-lettered once.
CREATE TABLE handler_attempts (
    group_name    text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    partition_id  bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    "offset"      bigint NOT NULL,
    attempts      integer NOT NULL,
    errors        jsonb NOT NULL DEFAULT '[]'::jsonb,
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, partition_id)
);
CREATE INDEX handler_attempts_partition ON handler_attempts (partition_id);

-- The lag of each group over time, sampled by whoever watches it (the dashboard):
-- one row per group and 10-second bucket (two watchers write a bucket once), kept
-- for an hour, so a chart opened later shows the last hour, not only what its own
-- process saw.
CREATE TABLE lag_samples (
    group_name  text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    bucket      timestamptz NOT NULL,
    lag         bigint NOT NULL,
    PRIMARY KEY (group_name, bucket)
);
CREATE INDEX lag_samples_bucket ON lag_samples (bucket);
