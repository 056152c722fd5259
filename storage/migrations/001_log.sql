-- The ordered log: topics, their named partitions, and the messages.
-- Runs with search_path set to the bus schema; names stay unqualified.

CREATE TABLE topics (
    name                         text PRIMARY KEY,
    partitions                   integer NULL CHECK (partitions IS NULL OR partitions > 0),  -- NULL: dynamic
    semantics                    text NOT NULL CHECK (semantics IN ('pubsub', 'queue')),
    cleanup                      text NOT NULL CHECK (cleanup IN ('delete', 'compact')),
    retention_seconds            double precision NULL,
    tombstone_retention_seconds  double precision NULL,
    namespace                    text NULL,
    task                         text NULL,
    max_message_bytes            integer NOT NULL,
    created_at                   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX topics_namespace ON topics (namespace) WHERE namespace IS NOT NULL;
CREATE INDEX topics_task ON topics (task) WHERE task IS NOT NULL;

-- One row per partition. `next_offset` is the per-partition counter taken
-- (row-locked) inside each publishing transaction: offsets are dense and
-- become visible in offset order (invariant 1). `log_start` is the first
-- offset still in the log; retention and compaction move it forward.
CREATE TABLE partitions (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic        text NOT NULL REFERENCES topics (name) ON DELETE CASCADE,
    name         text NOT NULL,
    next_offset  bigint NOT NULL DEFAULT 0,
    log_start    bigint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (topic, name)
);

CREATE TABLE messages (
    partition_id  bigint NOT NULL,
    "offset"      bigint NOT NULL,
    key           text NULL,
    headers       jsonb NULL,
    payload       bytea NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (partition_id, "offset")
);
CREATE INDEX messages_created ON messages (partition_id, created_at);
