-- Consumer groups: membership, generations, subscription start, cursors and leases.

CREATE TABLE groups (
    name              text PRIMARY KEY,
    generation        bigint NOT NULL DEFAULT 0,
    state             text NOT NULL DEFAULT 'empty'
                      CHECK (state IN ('empty', 'preparing_rebalance', 'rebalancing', 'stable')),
    status            text NOT NULL DEFAULT 'active'
                      CHECK (status IN ('active', 'stopped', 'dead', 'cancelled')),
    leader            text NULL,                 -- member id whose process runs the Rebalancer
    assignor          text NOT NULL DEFAULT 'range',
    -- The subscription start, recorded once when the group first joins (invariant 6).
    -- 'latest' stores start_time = recorded_at - new_lookback; 'timestamp' stores the datetime;
    -- 'offsets' stores {"topic": {"partition": offset}} in start_offsets.
    start_mode        text NOT NULL CHECK (start_mode IN ('earliest', 'latest', 'timestamp', 'offsets')),
    start_time        timestamptz NULL,
    start_offsets     jsonb NULL,
    recorded_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Wildcard subscriptions (topics created later with these labels join the group).
    namespace         text NULL,
    task              text NULL,
    rebalance_due_at  timestamptz NULL,          -- debounce: apply the pending membership change then
    last_active_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at        timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The topics a group reads (explicit or matched by its namespace/task labels).
CREATE TABLE group_topics (
    group_name  text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    topic       text NOT NULL REFERENCES topics (name) ON DELETE CASCADE,
    added_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (group_name, topic)
);
CREATE INDEX group_topics_topic ON group_topics (topic);

CREATE TABLE members (
    group_name      text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    member_id       text NOT NULL,
    instance_id     text NULL,
    client_id       text NOT NULL,               -- the Bus (process) that hosts the member
    host            text NOT NULL,
    pid             integer NOT NULL,
    topics          text[] NOT NULL DEFAULT '{}',
    session_timeout double precision NOT NULL,
    joined_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_heartbeat  timestamptz NOT NULL DEFAULT clock_timestamp(),
    generation      bigint NOT NULL DEFAULT 0,   -- generation of `assignment`
    assignment      bigint[] NOT NULL DEFAULT '{}',  -- partition ids
    PRIMARY KEY (group_name, member_id),
    UNIQUE (group_name, instance_id)
);
CREATE INDEX members_heartbeat ON members (last_heartbeat);

-- One cursor per (group, partition): the whole cost of fan-out.
-- `committed` is Kafka's: the next offset to read. The owner columns hold the
-- lease of whoever works the partition now (a group member's PartitionWorker,
-- or a claim); every commit is a compare-and-set on owner, generation and
-- lease_epoch (invariants 3 and 4).
CREATE TABLE offsets (
    group_name        text NOT NULL REFERENCES groups (name) ON DELETE CASCADE,
    partition_id      bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    committed         bigint NOT NULL,
    committed_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    owner             text NULL,
    owner_generation  bigint NULL,
    lease_epoch       bigint NOT NULL DEFAULT 0,
    lease_expires_at  timestamptz NULL,
    PRIMARY KEY (group_name, partition_id)
);
CREATE INDEX offsets_partition ON offsets (partition_id);

-- The low watermark of each partition: the smallest committed offset over the
-- live groups that read it (invariant 7). A live group that reads the topic but
-- has no cursor on the partition yet holds the whole partition (log_start).
CREATE VIEW partition_watermarks AS
SELECT p.id AS partition_id,
       p.topic,
       p.name AS partition,
       p.log_start,
       p.next_offset,
       LEAST(p.next_offset,
             COALESCE(MIN(COALESCE(o.committed, p.log_start))
                      FILTER (WHERE g.name IS NOT NULL), p.next_offset)) AS low_watermark
FROM partitions p
LEFT JOIN group_topics gt ON gt.topic = p.topic
LEFT JOIN groups g ON g.name = gt.group_name AND g.status IN ('active', 'stopped')
LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
GROUP BY p.id, p.topic, p.name, p.log_start, p.next_offset;
