-- Publishing from SQL: `publish(topic, payload, key => , partition => , headers => ,
-- idempotency_key => , delay => , priority => )` in the bus schema, for triggers, psql and other
-- languages. Runs with search_path set to the bus schema; names stay unqualified.
--
-- The same guarantees as the Python publish (storage/messages.py): the offset comes from the
-- partition's counter, row-locked by the UPDATE, so SQL and Python publishers to one partition
-- serialize on that row and offsets stay dense and commit in offset order (invariant 1); the
-- NOTIFY on `<schema>.messages` goes out with the commit (the wake-up of waiting consumers);
-- an idempotency key is claimed before the append, exactly as storage/idempotency.py does;
-- and it runs inside the caller's transaction (the outbox): a rolled-back insert publishes nothing.
-- A key picks the partition Python's key_partition picks (CRC-32 of its UTF-8 bytes).

-- What publish returns: where the message landed (or, for a repeated idempotency key, the original).
CREATE TYPE published AS ("partition" text, "offset" bigint);

-- CRC-32 (IEEE, zlib.crc32) of the key's UTF-8 bytes, modulo the partition count, as text.
CREATE FUNCTION key_partition(key text, partitions integer) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
DECLARE
    data bytea := convert_to(key, 'UTF8');
    crc bigint := 4294967295;
BEGIN
    FOR i IN 0 .. length(data) - 1 LOOP
        crc := crc # get_byte(data, i);
        FOR j IN 1 .. 8 LOOP
            IF (crc & 1) = 1 THEN
                crc := (crc >> 1) # 3988292384;   -- 0xEDB88320
            ELSE
                crc := crc >> 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN ((crc # 4294967295) % partitions)::text;
END
$fn$;

CREATE FUNCTION publish(
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
    -- The counter, row-locked until the caller's transaction ends: dense offsets, committed in order.
    UPDATE partitions SET next_offset = next_offset + 1 WHERE topic = t.name AND name = pname
    RETURNING id, next_offset - 1 INTO pid, base;
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
REVOKE ALL ON FUNCTION publish(text, jsonb, text, text, jsonb, text, interval, integer) FROM PUBLIC;
