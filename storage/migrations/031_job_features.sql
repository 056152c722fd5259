-- Job features of queue topics: unique jobs, progress, fair takes, groups of jobs with a
-- completion callback (storage/job_features.py).

-- Unique jobs: the newest job published under each (topic, unique key). A publish with that key
-- runs under a transaction-scoped advisory lock of the pair, so concurrent publishes in every
-- process see each other: while the job is still there (waiting or running), or was published
-- less than `period` ago, the publish returns it and adds nothing.
CREATE TABLE queue_unique (
    topic         text NOT NULL REFERENCES topics (name) ON DELETE CASCADE,
    unique_key    text NOT NULL,
    partition_id  bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    "offset"      bigint NOT NULL,
    published_at  timestamptz NOT NULL,
    PRIMARY KEY (topic, unique_key)
);

-- Progress a running job reported (q.progress): kept with the job, gone with it. A nullable
-- column without a default: adding it rewrites nothing, and no take or ack reads it.
ALTER TABLE queue_jobs ADD COLUMN progress jsonb NULL;
ALTER TABLE queue_jobs ADD COLUMN progress_at timestamptz NULL;

-- Fair takes (create_topic(fair=True)): takes rotate across keys (storage/queues.py, TAKE_FAIR).
ALTER TABLE queue_settings ADD COLUMN fair boolean NOT NULL DEFAULT false;
-- When each key of a fair queue was last served (a turn number; '' stands for the jobs without a
-- key): among keys' first due jobs, the key served longest ago goes first.
CREATE SEQUENCE queue_fair_turns;
CREATE TABLE queue_fair_served (
    topic  text NOT NULL REFERENCES topics (name) ON DELETE CASCADE,
    key    text NOT NULL,
    turn   bigint NOT NULL,
    PRIMARY KEY (topic, key)
);

-- Groups of jobs (publish_group): `remaining` counts the jobs not yet acked, dead-lettered or
-- cancelled; the statement that removes the last one publishes the callback (bus.publish) in its
-- own transaction, so the callback exists exactly when the group is complete, once.
CREATE TABLE queue_groups (
    id                 bigserial PRIMARY KEY,
    topic              text NOT NULL,
    remaining          integer NOT NULL CHECK (remaining >= 0),
    callback_topic     text NOT NULL,
    callback_payload   jsonb NOT NULL,
    callback_key       text NULL,
    callback_headers   jsonb NULL,
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at       timestamptz NULL
);
CREATE INDEX queue_groups_open ON queue_groups (id) WHERE remaining > 0;

CREATE TABLE queue_group_jobs (
    partition_id  bigint NOT NULL,
    "offset"      bigint NOT NULL,
    group_id      bigint NOT NULL REFERENCES queue_groups (id) ON DELETE CASCADE,
    PRIMARY KEY (partition_id, "offset")
);

-- Every statement that removes jobs (acks, dead-lettering, cancels, the takes' removal of
-- cancelled jobs) counts down the groups of those it removed. While no group is open the
-- trigger costs one probe of an empty index.
CREATE FUNCTION queue_groups_count_down() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    g record;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM queue_groups WHERE remaining > 0) THEN
        RETURN NULL;
    END IF;
    FOR g IN
        WITH gone AS (
            -- a primary-key probe per removed job (a lateral subquery cannot become a join that
            -- reads every member of the open groups), then a delete by row address
            DELETE FROM queue_group_jobs m
            WHERE m.ctid = ANY(ARRAY(
                SELECT k.ctid FROM removed r
                CROSS JOIN LATERAL (SELECT q.ctid FROM queue_group_jobs q
                                    WHERE q.partition_id = r.partition_id AND q."offset" = r."offset") AS k))
            RETURNING m.group_id
        ), c AS (
            SELECT group_id, count(*)::int AS n FROM gone GROUP BY group_id
        )
        UPDATE queue_groups q SET remaining = q.remaining - c.n,
               completed_at = CASE WHEN q.remaining - c.n = 0 THEN clock_timestamp() END
        FROM c WHERE q.id = c.group_id
        RETURNING q.*
    LOOP
        IF g.remaining = 0 THEN
            PERFORM publish(g.callback_topic, g.callback_payload, key => g.callback_key,
                            headers => COALESCE(g.callback_headers, '{}'::jsonb)
                                       || jsonb_build_object('group.id', g.id::text, 'group.topic', g.topic));
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_jobs_groups
AFTER DELETE ON queue_jobs
REFERENCING OLD TABLE AS removed
FOR EACH STATEMENT
EXECUTE FUNCTION queue_groups_count_down();
