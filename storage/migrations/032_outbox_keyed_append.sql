-- An outbox publish with an idempotency key in one call (storage/messages.py,
-- `append_outbox`). The outbox runs on the caller's own connection, inside the
-- caller's transaction, in one round trip: a publish without a key is one
-- statement naming the bus's tables by schema; one with a key is this
-- function, which does in one call what storage/idempotency.py and
-- storage/messages.py do in three statements for the Producer: claim the key
-- (a concurrent publish of the same key waits on it until this transaction
-- ends), append the message as APPEND_SINGLE and APPEND_QUEUE(_TIMED) do
-- (log_take_offset moves the partition's head: dense offsets, committed in
-- order, invariant 1), and record where it landed. A key already written
-- within its window writes nothing and answers the original's place.
--
-- The key is claimed before the partition's head is moved, as in a flush of
-- the Producer, so key and head locks never wait on each other in a cycle.
-- It runs with the bus schema as its search_path whatever the caller's is,
-- pg_temp last (below), as migration 016 pins `publish`'s: a temporary table
-- of the caller's named as a bus table cannot stand in for it.

-- `p_topic`/`p_ikey`: the idempotency key; `p_window`: its dedupe window in
-- seconds (NULL: for ever); `p_now`: when the window is judged and starts
-- (NULL: the server's clock). `p_pid` .. `p_payload`: the message (headers as
-- JSON text); `p_notify`: the channel to wake listeners on with the caller's
-- commit (NULL: none); `p_queued`: the topic is a queue (a job row too), with
-- `p_delay` (seconds), `p_deliver_at` and `p_priority` for a delayed or
-- prioritized job. One row: the message's partition id, offset, created_at,
-- and (for a repeated key only) its partition's name; no row when the
-- partition no longer exists (then no key is kept).
CREATE FUNCTION log_append_keyed(
    p_topic text,
    p_ikey text,
    p_window float8,
    p_now timestamptz,
    p_pid bigint,
    p_key text,
    p_headers text,
    p_payload bytea,
    p_notify text,
    p_queued boolean,
    p_delay float8,
    p_deliver_at timestamptz,
    p_priority integer
)
RETURNS TABLE (placed_partition_id bigint, placed_offset bigint, placed_at timestamptz, placed_partition text)
LANGUAGE plpgsql
SET jit = off
AS $$
DECLARE
    first bigint;
    at timestamptz;
BEGIN
    INSERT INTO idempotency_keys AS k (topic, key, expires_at)
    VALUES (p_topic, p_ikey, COALESCE(p_now, clock_timestamp()) + make_interval(secs => p_window))
    ON CONFLICT (topic, key) DO UPDATE
    SET expires_at = EXCLUDED.expires_at, partition_id = NULL, "offset" = NULL, created_at = NULL
    WHERE k.expires_at IS NOT NULL AND k.expires_at <= COALESCE(p_now, clock_timestamp());
    IF NOT FOUND THEN
        -- Written within its window: the original's place (none if its partition is gone).
        RETURN QUERY
        SELECT k.partition_id, k."offset", k.created_at, p.name
        FROM idempotency_keys k JOIN partitions p ON p.id = k.partition_id
        WHERE k.topic = p_topic AND k.key = p_ikey;
        RETURN;
    END IF;
    SELECT t.base INTO first FROM log_take_offset(p_pid, 1) AS t(base);
    IF first IS NULL THEN
        -- The partition is gone (its topic was deleted): keep no key that points nowhere.
        DELETE FROM idempotency_keys k WHERE k.topic = p_topic AND k.key = p_ikey;
        RETURN;
    END IF;
    at := clock_timestamp();
    INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
    VALUES (p_pid, first, p_key, p_headers::jsonb, p_payload, at);
    IF p_queued THEN
        IF p_delay IS NULL AND p_deliver_at IS NULL AND COALESCE(p_priority, 0) = 0 THEN
            INSERT INTO queue_jobs (partition_id, "offset", topic, key) VALUES (p_pid, first, p_topic, p_key);
        ELSE
            -- delayed or prioritized: detached, visible from its delivery time (migration 014)
            INSERT INTO queue_jobs (partition_id, "offset", topic, key, detached, visible_at, priority)
            VALUES (p_pid, first, p_topic, p_key, true,
                    COALESCE(p_deliver_at, at + make_interval(secs => COALESCE(p_delay, 0))),
                    COALESCE(p_priority, 0));
        END IF;
    END IF;
    UPDATE idempotency_keys k SET partition_id = p_pid, "offset" = first, created_at = at
    WHERE k.topic = p_topic AND k.key = p_ikey;
    IF p_notify IS NOT NULL THEN
        PERFORM pg_notify(p_notify, p_pid::text);   -- sent when the caller commits
    END IF;
    placed_partition_id := p_pid;
    placed_offset := first;
    placed_at := at;
    RETURN NEXT;
END
$$;

DO $do$
BEGIN
    EXECUTE format('ALTER FUNCTION log_append_keyed(text, text, float8, timestamptz, bigint, text, text, bytea, '
                   'text, boolean, float8, timestamptz, integer) SET search_path = %I, pg_temp', current_schema());
END
$do$;
