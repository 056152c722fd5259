-- A partition's end offset lives in `log_heads`, in rows that each take a bounded
-- number of publishes.
--
-- A publish used to move `partitions.next_offset`: one new version of the
-- partition's row per publish. While any transaction in the database holds an
-- old snapshot (a pg_dump, a long report, a session idle in transaction) none of
-- those versions can be pruned, and every publish to the partition walks all of
-- them to find the current one: publishing got slower the longer someone else's
-- transaction stayed open.
--
-- `log_heads` holds one row per (partition, generation). A publish locks the
-- partition's row (a lock writes no new version) and moves the newest
-- generation's `next_offset`; the publish that makes a generation's
-- `appends` reach the rotation size inserts the next generation, starting
-- where this one ends, and deletes the one before this one (by its key: a range
-- would walk every deleted generation the held snapshot keeps in the index). So a
-- publish walks at most one generation's versions however long a snapshot is
-- held, and a reader takes a partition's end from its newest generation (the
-- rotating transaction commits both rows at once, and they agree).
--
-- The previous release moves `partitions.next_offset` itself (so do the SQL
-- publish function and compaction's bulk append). A BEFORE UPDATE trigger turns
-- such a move into an allocation from the head: the statement's row gets the
-- head's new end and its RETURNING the head's base, so both releases hand out
-- dense offsets from one sequence. While that release may run on the schema
-- (its minimum release is below 0.2.0: a schema it made, until `bus migrate
-- --finalize`), a publish of this release moves the counter too, so that
-- release reads exact ends; the trigger knows such a move by the setting
-- `pgactorbus.head_sync`, on for its transaction.
CREATE TABLE log_heads (
    partition_id  bigint NOT NULL,
    generation    bigint NOT NULL,
    next_offset   bigint NOT NULL,
    appends       integer NOT NULL DEFAULT 0,
    PRIMARY KEY (partition_id, generation)
);

INSERT INTO log_heads (partition_id, generation, next_offset)
SELECT id, 0, next_offset FROM partitions;

-- A new partition (from either release) starts its head at its counter. A
-- deleted one takes its heads with it; no foreign key, so that a rotation's
-- insert takes no key-share lock on the partition's row.
CREATE FUNCTION log_heads_of_new_partitions() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO log_heads (partition_id, generation, next_offset)
    SELECT n.id, 0, n.next_offset FROM born n
    ON CONFLICT (partition_id, generation) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_log_heads_insert
AFTER INSERT ON partitions
REFERENCING NEW TABLE AS born
FOR EACH STATEMENT EXECUTE FUNCTION log_heads_of_new_partitions();

CREATE FUNCTION log_heads_of_deleted_partitions() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM log_heads h USING gone g WHERE h.partition_id = g.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_log_heads_cascade
AFTER DELETE ON partitions
REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION log_heads_of_deleted_partitions();

-- Allocate `n` offsets of partition `pid` from its head; the first of them.
-- The caller holds the partition's row lock (FOR NO KEY UPDATE or an UPDATE of
-- the row), so heads of one partition move one at a time. `floor` starts a
-- head that is missing (it never is once this migration ran; a partition row
-- restored by hand would be). In REPEATABLE READ a head moved since the
-- snapshot fails the UPDATE with a serialization failure, as the counter did.
CREATE FUNCTION log_head_advance(pid bigint, n bigint, floor bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    gen bigint;
    base bigint;
    used integer;
BEGIN
    UPDATE log_heads h SET next_offset = h.next_offset + n, appends = h.appends + 1
    WHERE h.partition_id = pid
      AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
    RETURNING h.generation, h.next_offset - n, h.appends INTO gen, base, used;
    IF NOT FOUND THEN
        INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, 0, floor + n);
        RETURN floor;
    END IF;
    IF used >= 64 THEN
        INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, base + n);
        DELETE FROM log_heads WHERE partition_id = pid AND generation = gen - 1;
    END IF;
    RETURN base;
END
$$;

-- Whether a release older than 0.2.0 may still run on the schema.
CREATE FUNCTION previous_release_may_run() RETURNS boolean
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT COALESCE((SELECT string_to_array(r.min_release, '.')::integer[] < ARRAY[0, 2, 0]
                     FROM bus_schema_release r), true)
$$;

-- A publish's allocation: lock the partition's row (no new version), move its
-- head, and wake the partition's caught-up claim cursors as the counter's
-- trigger does (under the same row lock, so a claim ack that clears
-- pending_since under FOR SHARE cannot interleave with it). No row when the
-- partition does not exist. Callers lock several partitions in id order.
CREATE FUNCTION log_take_offsets(pid bigint, n bigint)
RETURNS TABLE (base bigint, topic text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    part record;
BEGIN
    SELECT p.topic, p.claimed, p.next_offset INTO part FROM partitions p WHERE p.id = pid FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    base := log_head_advance(pid, n, part.next_offset);
    topic := part.topic;
    IF previous_release_may_run() THEN
        -- the counter as that release reads it; the row trigger of migration 012 wakes the cursors
        PERFORM set_config('pgactorbus.head_sync', 'on', true);
        UPDATE partitions SET next_offset = base + n WHERE id = pid;
        PERFORM set_config('pgactorbus.head_sync', 'off', true);
    ELSIF part.claimed THEN
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = pid AND pending_since IS NULL;
    END IF;
    RETURN NEXT;
END
$$;

-- A move of `partitions.next_offset` by a statement that allocates offsets the
-- counter's way: the allocation comes from the head instead.
CREATE FUNCTION partitions_counter_to_head() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    base bigint;
BEGIN
    IF current_setting('pgactorbus.head_sync', true) = 'on' THEN
        RETURN NEW;
    END IF;
    base := log_head_advance(NEW.id, NEW.next_offset - OLD.next_offset, OLD.next_offset);
    NEW.next_offset := base + (NEW.next_offset - OLD.next_offset);
    RETURN NEW;
END
$$;

CREATE TRIGGER partitions_counter_to_head
BEFORE UPDATE OF next_offset ON partitions
FOR EACH ROW WHEN (NEW.next_offset > OLD.next_offset)
EXECUTE FUNCTION partitions_counter_to_head();

-- A partition's end, the offset its next message gets: `p.log_end` for a
-- partition row `p` (a function of the row type reads like a column). No
-- search_path of its own, so that the call stays cheap: the bus runs every
-- statement with its schema first on the search_path.
CREATE FUNCTION log_end(p partitions) RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT COALESCE((SELECT h.next_offset FROM log_heads h WHERE h.partition_id = p.id
                     ORDER BY h.generation DESC LIMIT 1), p.next_offset)
$$;

-- The watermark's upper end is the head.
CREATE OR REPLACE VIEW partition_watermarks AS
SELECT p.id AS partition_id,
       p.topic,
       p.name AS partition,
       p.log_start,
       e.next_offset,
       LEAST(e.next_offset,
             COALESCE(MIN(COALESCE(o.committed, p.log_start))
                      FILTER (WHERE g.name IS NOT NULL), e.next_offset),
             COALESCE((SELECT MIN(j."offset") FROM queue_jobs j WHERE j.partition_id = p.id),
                      e.next_offset)) AS low_watermark
FROM partitions p
CROSS JOIN LATERAL (SELECT p.log_end AS next_offset OFFSET 0) e
LEFT JOIN group_topics gt ON gt.topic = p.topic
LEFT JOIN groups g ON g.name = gt.group_name AND g.status IN ('active', 'stopped')
LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
GROUP BY p.id, p.topic, p.name, p.log_start, e.next_offset;

-- SQL publishing (016) takes its offset from the head like the Python publish: the
-- function as 016 wrote it but for the allocation. CREATE OR REPLACE keeps who may
-- call it; its search_path is pinned again as 016 pinned it.
CREATE OR REPLACE FUNCTION publish(
    topic text,
    payload jsonb,
    key text DEFAULT NULL,
    "partition" text DEFAULT NULL,
    headers jsonb DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    delay interval DEFAULT NULL,
    priority integer DEFAULT NULL
) RETURNS published
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $fn$
#variable_conflict use_column
DECLARE
    t record;
    pname text;
    pid bigint;
    base bigint;
    at timestamptz;
    data bytea;
    claimed boolean;
    original published;
BEGIN
    IF publish.topic IS NULL THEN
        RAISE EXCEPTION 'publish: topic is NULL' USING ERRCODE = '22023', HINT = 'pass the name of an existing topic';
    END IF;
    SELECT name, partitions, semantics, cleanup, max_message_bytes, dedupe_window_seconds INTO t
    FROM topics WHERE name = publish.topic;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'publish: topic % does not exist', quote_literal(publish.topic)
            USING ERRCODE = '22023', HINT = 'create it first (b.create_topic or `bus topics create`)';
    END IF;

    IF publish.payload IS NULL THEN
        IF t.cleanup <> 'compact' THEN
            RAISE EXCEPTION 'publish: payload NULL is a tombstone and only allowed on cleanup=''compact'' topics'
                USING ERRCODE = '22023', HINT = 'publish a JSON value';
        END IF;
    ELSE
        data := convert_to(publish.payload::text, 'UTF8');
        IF length(data) > t.max_message_bytes THEN
            RAISE EXCEPTION 'publish: message of % bytes is larger than max_message_bytes=%', length(data), t.max_message_bytes
                USING ERRCODE = '22023', HINT = 'split it, store it elsewhere and publish a reference, or raise the topic''s limit';
        END IF;
    END IF;

    IF publish.headers IS NOT NULL AND (jsonb_typeof(publish.headers) <> 'object'
            OR EXISTS (SELECT 1 FROM jsonb_each(publish.headers) e WHERE jsonb_typeof(e.value) <> 'string')) THEN
        RAISE EXCEPTION 'publish: headers must be a JSON object of strings, got %', publish.headers
            USING ERRCODE = '22023', HINT = 'e.g. headers => ''{"source": "trigger"}''::jsonb';
    END IF;

    IF publish.idempotency_key IS NOT NULL AND NOT length(publish.idempotency_key) BETWEEN 1 AND 256 THEN
        RAISE EXCEPTION 'publish: idempotency_key must be 1 to 256 characters long, got %', length(publish.idempotency_key)
            USING ERRCODE = '22023', HINT = 'pass a short stable id (hash a long one, e.g. md5(...))';
    END IF;

    IF publish.delay IS NOT NULL OR publish.priority IS NOT NULL THEN
        IF t.semantics <> 'queue' THEN
            RAISE EXCEPTION 'publish: delay and priority apply to queue topics; % is a pubsub topic', quote_literal(t.name)
                USING ERRCODE = '22023', HINT = 'leave delay and priority out, or publish to a topic created with semantics=''queue''';
        END IF;
        IF publish.delay < interval '0' THEN
            RAISE EXCEPTION 'publish: delay must not be negative, got %', publish.delay USING ERRCODE = '22023';
        END IF;
    END IF;

    -- The partition, chosen as the Python publish chooses it.
    IF publish."partition" IS NOT NULL THEN
        IF publish."partition" !~ '^[A-Za-z0-9][A-Za-z0-9._:@=-]{0,199}$' OR position('..' IN publish."partition") > 0 THEN
            RAISE EXCEPTION 'publish: invalid partition name %', quote_literal(publish."partition")
                USING ERRCODE = '22023', HINT = 'use 1 to 200 ASCII letters, digits or ''._:@=-'', starting with a letter or digit';
        END IF;
        IF t.partitions IS NOT NULL AND NOT (publish."partition" ~ '^(0|[1-9][0-9]{0,8})$'
                                            AND publish."partition"::bigint < t.partitions) THEN
            RAISE EXCEPTION 'publish: topic % has % fixed partitions named ''0''..''%''; % is not one of them',
                quote_literal(t.name), t.partitions, t.partitions - 1, quote_literal(publish."partition")
                USING ERRCODE = '22023';
        END IF;
        pname := publish."partition";
    ELSIF t.partitions IS NULL THEN
        pname := CASE WHEN publish.key ~ '^[A-Za-z0-9][A-Za-z0-9._:@=-]{0,199}$' AND position('..' IN publish.key) = 0
                      THEN publish.key ELSE 'default' END;
    ELSIF publish.key IS NOT NULL THEN
        pname := key_partition(publish.key, t.partitions);
    ELSE
        pname := floor(random() * t.partitions)::integer::text;   -- no key: spread over the partitions
    END IF;

    -- The idempotency key first (storage/idempotency.py's CLAIM): a concurrent publish with the same
    -- key waits here until this transaction ends, then finds the original.
    IF publish.idempotency_key IS NOT NULL THEN
        INSERT INTO idempotency_keys (topic, key, expires_at)
        VALUES (t.name, publish.idempotency_key, clock_timestamp() + make_interval(secs => t.dedupe_window_seconds))
        ON CONFLICT (topic, key) DO UPDATE
        SET expires_at = EXCLUDED.expires_at, partition_id = NULL, "offset" = NULL, created_at = NULL
        WHERE idempotency_keys.expires_at IS NOT NULL AND idempotency_keys.expires_at <= clock_timestamp()
        RETURNING true INTO claimed;
        IF claimed IS NULL THEN
            SELECT p.name, k."offset" INTO original
            FROM idempotency_keys k JOIN partitions p ON p.id = k.partition_id
            WHERE k.topic = t.name AND k.key = publish.idempotency_key;
            IF original."offset" IS NULL THEN
                RAISE EXCEPTION 'publish: idempotency key % of topic % names a message that no longer exists',
                    quote_literal(publish.idempotency_key), quote_literal(t.name) USING ERRCODE = '22023';
            END IF;
            RETURN original;
        END IF;
    END IF;

    IF t.partitions IS NULL THEN
        INSERT INTO partitions (topic, name) VALUES (t.name, pname) ON CONFLICT (topic, name) DO NOTHING;
    END IF;
    -- The partition's head, its row locked until the caller's transaction ends: dense offsets,
    -- committed in order (log_take_offsets above).
    SELECT p.id, o.base INTO pid, base
    FROM partitions p CROSS JOIN LATERAL log_take_offsets(p.id, 1) AS o
    WHERE p.topic = t.name AND p.name = pname;
    IF pid IS NULL THEN
        RAISE EXCEPTION 'publish: topic % has no partition %', quote_literal(t.name), quote_literal(pname)
            USING ERRCODE = '22023';
    END IF;
    at := clock_timestamp();
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    VALUES (pid, base, publish.key, publish.headers, data, at);

    IF t.semantics = 'queue' THEN
        IF publish.delay IS NULL AND coalesce(publish.priority, 0) = 0 THEN
            INSERT INTO queue_jobs (partition_id, "offset", topic, key) VALUES (pid, base, t.name, publish.key);
        ELSE
            -- A delayed or prioritized job, as the Python publish writes it (storage/messages.py,
            -- APPEND_QUEUE_TIMED): detached, visible from its delivery time, with its priority.
            INSERT INTO queue_jobs (partition_id, "offset", topic, key, detached, visible_at, priority)
            VALUES (pid, base, t.name, publish.key, true, at + coalesce(publish.delay, interval '0'),
                    coalesce(publish.priority, 0));
        END IF;
    END IF;

    IF publish.idempotency_key IS NOT NULL THEN
        UPDATE idempotency_keys SET partition_id = pid, "offset" = base, created_at = at
        WHERE topic = t.name AND key = publish.idempotency_key;
    END IF;

    PERFORM pg_notify(current_schema() || '.messages', pid::text);   -- sent when the caller commits
    RETURN (pname, base)::published;
END
$fn$;

-- SECURITY DEFINER: a role granted EXECUTE (and USAGE on the schema) publishes without any table
-- rights. Its search_path is pinned to the bus schema with pg_temp last, so a caller's temporary
-- tables cannot stand in for the bus's. Nobody may call it until granted (docs/operations.md).
DO $do$
BEGIN
    EXECUTE format('ALTER FUNCTION publish(text, jsonb, text, text, jsonb, text, interval, integer) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$do$;
