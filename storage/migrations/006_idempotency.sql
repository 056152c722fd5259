-- Idempotent publishing: a topic's dedupe window, and the keys written within it.
-- Runs with search_path set to the bus schema; names stay unqualified.

-- Seconds a publish's idempotency key is remembered (NULL: for ever).
ALTER TABLE topics ADD COLUMN dedupe_window_seconds double precision NULL DEFAULT 86400;

-- One row per (topic, idempotency key) written within the topic's window.
-- Kept apart from `messages` (which may be reorganised, e.g. partitioned):
-- the row points at the message the key first wrote. The key is claimed
-- (inserted) before the message is appended, in the same transaction, so a
-- concurrent publish with the same key waits on this primary key and then
-- finds the original instead of writing a second copy. `partition_id` and
-- `offset` are filled in by that transaction once the message has its offset.
CREATE TABLE idempotency_keys (
    topic         text NOT NULL,
    key           text NOT NULL,
    partition_id  bigint NULL,
    "offset"      bigint NULL,
    created_at    timestamptz NULL,          -- the message's created_at (part of the Record)
    expires_at    timestamptz NULL,          -- NULL: never (dedupe_window None)
    PRIMARY KEY (topic, key)
);
-- The retention cleaner deletes expired keys a bounded batch at a time.
CREATE INDEX idempotency_keys_expires ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL;
