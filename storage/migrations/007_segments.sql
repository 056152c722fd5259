-- Segments: `messages` becomes a table partitioned by time (created_at), one
-- PostgreSQL partition ("segment") per time range, shared by every topic.
-- docs/segments.md explains the design; storage/segments.py maintains it.
-- Runs with search_path set to the bus schema; names stay unqualified.
--
-- Inserts do not change: the partition key is created_at, which every
-- publish already fills (DEFAULT clock_timestamp()). Segments are created
-- ahead of time by the cleaner; a DEFAULT partition catches any row no
-- segment covers (the cleaner was not running, or an explicit old/future
-- created_at), so an insert never fails for want of a segment.
--
-- The primary key must contain the partition key, so it is
-- (partition_id, "offset", created_at): reads by (partition_id, "offset")
-- use it as before. Offsets stay unique because they come from the
-- partition's counter (invariant 1), as before; created_at only adds a column.

DROP VIEW IF EXISTS compaction_removable;

ALTER TABLE messages RENAME TO messages_unsegmented;
ALTER INDEX messages_pkey RENAME TO messages_unsegmented_pkey;
ALTER INDEX messages_created RENAME TO messages_unsegmented_created;

CREATE TABLE messages (
    partition_id  bigint NOT NULL,
    "offset"      bigint NOT NULL,
    key           text NULL,
    headers       jsonb NULL,
    payload       bytea NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (partition_id, "offset", created_at)
) PARTITION BY RANGE (created_at);
CREATE INDEX messages_created ON messages (partition_id, created_at);

-- Rows no segment covers. Retired (truncated) like a segment once every row
-- in it is below its partition's log start; never dropped.
CREATE TABLE messages_default PARTITION OF messages DEFAULT;

-- The segments (not the DEFAULT partition): [lo, hi) of created_at; lo NULL
-- is MINVALUE (the first segment, which holds the history migrated below).
CREATE TABLE message_segments (
    name        text PRIMARY KEY,
    lo          timestamptz NULL,
    hi          timestamptz NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- DDL cannot take bind parameters: these functions take the bounds and the
-- segment name as parameters and quote them themselves (format %I / %L), so
-- the Python side only ever runs parameterized SELECTs.

-- Create and attach the segment [p_lo, p_hi) (p_lo NULL: MINVALUE); returns its name.
-- A standalone table is attached (SHARE UPDATE EXCLUSIVE on `messages`:
-- publishes and reads go on); ATTACH builds the parent's indexes on it and
-- checks that the DEFAULT partition holds no row of the new range.
CREATE FUNCTION message_segment_create(p_lo timestamptz, p_hi timestamptz) RETURNS text
LANGUAGE plpgsql AS $fn$
DECLARE
    seg text := 'messages_' || to_char(p_hi AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS"_"US');
BEGIN
    IF p_lo IS NOT NULL AND p_lo >= p_hi THEN
        RAISE EXCEPTION 'segment bounds out of order: % >= %', p_lo, p_hi;
    END IF;
    -- Insert-only until retired whole: vacuums triggered by inserts alone
    -- would be wasted work (dead tuples, from the sweep or the compaction
    -- job, still trigger autovacuum; so does wraparound protection).
    EXECUTE format('CREATE TABLE %I (LIKE messages INCLUDING DEFAULTS) WITH (autovacuum_vacuum_insert_threshold = -1)', seg);
    EXECUTE format('ALTER TABLE messages ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%L)',
                   seg, CASE WHEN p_lo IS NULL THEN 'MINVALUE' ELSE quote_literal(p_lo) END, p_hi);
    INSERT INTO message_segments (name, lo, hi) VALUES (seg, p_lo, p_hi);
    RETURN seg;
END
$fn$;

-- What a segment holds, read without locks (a cheap look before locking):
-- 'empty', 'dead' (every row below its partition's log start) or 'live'.
CREATE FUNCTION message_segment_state(p_name text) RETURNS text
LANGUAGE plpgsql AS $fn$
DECLARE
    any_row boolean;
    live boolean;
BEGIN
    IF p_name <> 'messages_default' AND NOT EXISTS (SELECT 1 FROM message_segments WHERE name = p_name) THEN
        RAISE EXCEPTION 'no segment %', p_name;
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', p_name) INTO any_row;
    IF NOT any_row THEN
        RETURN 'empty';
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM partitions p WHERE EXISTS '
                   '(SELECT 1 FROM %I m WHERE m.partition_id = p.id AND m."offset" >= p.log_start))', p_name)
        INTO live;
    RETURN CASE WHEN live THEN 'live' ELSE 'dead' END;
END
$fn$;

-- Retire a segment (or the DEFAULT partition) if every row in it is below its
-- partition's log start: TRUNCATE, so no dead tuple is left for autovacuum.
-- The segment is locked ACCESS EXCLUSIVE first (the caller sets
-- lock_timeout), so no insert can slip in between the check and the
-- truncate; log_start only ever moves forward, so a row found below it stays
-- there. Returns the bytes freed, or -1 when a row is still live.
CREATE FUNCTION message_segment_retire(p_name text) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    live boolean;
    freed bigint;
BEGIN
    IF p_name <> 'messages_default' AND NOT EXISTS (SELECT 1 FROM message_segments WHERE name = p_name) THEN
        RAISE EXCEPTION 'no segment %', p_name;
    END IF;
    EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', p_name);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM partitions p WHERE EXISTS '
                   '(SELECT 1 FROM %I m WHERE m.partition_id = p.id AND m."offset" >= p.log_start))', p_name)
        INTO live;
    IF live THEN
        RETURN -1;
    END IF;
    freed := pg_total_relation_size(p_name::regclass);
    EXECUTE format('TRUNCATE %I', p_name);
    RETURN freed - pg_total_relation_size(p_name::regclass);
END
$fn$;

-- Detach and drop an empty segment (after its retirement, or one that never
-- got a row); false if it holds a row. Takes ACCESS EXCLUSIVE on `messages`
-- for a moment (the caller sets lock_timeout and retries on a later pass).
CREATE FUNCTION message_segment_drop(p_name text) RETURNS boolean
LANGUAGE plpgsql AS $fn$
DECLARE
    nonempty boolean;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM message_segments WHERE name = p_name) THEN
        RAISE EXCEPTION 'no segment %', p_name;
    END IF;
    -- The parent first, as readers and publishers take their locks: no lock cycle.
    LOCK TABLE ONLY messages IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', p_name);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', p_name) INTO nonempty;
    IF nonempty THEN
        RETURN false;
    END IF;
    EXECUTE format('ALTER TABLE messages DETACH PARTITION %I', p_name);
    EXECUTE format('DROP TABLE %I', p_name);
    DELETE FROM message_segments WHERE name = p_name;
    RETURN true;
END
$fn$;

-- Physically delete, a bounded batch at a time, rows of a segment (or of the
-- DEFAULT partition) that are below their partition's log start: the
-- fallback for a segment that cannot be retired whole (it also holds rows of
-- compact topics, or of topics with a longer retention). Returns the count.
CREATE FUNCTION message_segment_sweep(p_name text, p_limit integer) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    IF p_name <> 'messages_default' AND NOT EXISTS (SELECT 1 FROM message_segments WHERE name = p_name) THEN
        RAISE EXCEPTION 'no segment %', p_name;
    END IF;
    EXECUTE format('DELETE FROM %1$I WHERE ctid IN (SELECT m.ctid FROM %1$I m JOIN partitions p ON p.id = m.partition_id '
                   'WHERE m."offset" < p.log_start LIMIT $1)', p_name) USING p_limit;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$fn$;

-- Move the existing history across: one segment up to now holds all of it
-- (it retires whole once all of it is below the log starts; until then the
-- sweep removes what retention retires from it). Later segments are made by
-- the cleaner.
SELECT message_segment_create(NULL, clock_timestamp());
INSERT INTO messages (partition_id, "offset", key, headers, payload, created_at)
SELECT partition_id, "offset", key, headers, payload, created_at FROM messages_unsegmented;
DROP TABLE messages_unsegmented;

-- As in 004 (a later migration may redefine it); ctid is the leaf's.
CREATE VIEW compaction_removable AS
SELECT m.ctid AS row_ctid,
       p.run_id,
       m.partition_id,
       p.topic,
       p.partition,
       m."offset",
       m.key,
       m.headers::text AS headers,
       m.payload,
       m.created_at
FROM messages m
JOIN compaction_plan p ON p.partition_id = m.partition_id
WHERE p.run_id = (SELECT r.id FROM compaction_runs r WHERE r.status <> 'done')
  AND p.done_at IS NULL
  AND m."offset" >= p.lo AND m."offset" < p.hi
  AND (p.cleanup = 'delete'
       OR (m.key IS NOT NULL
           AND (p.retention_cutoff IS NULL OR m.created_at < p.retention_cutoff)
           AND NOT EXISTS (SELECT 1 FROM compaction_keep k
                           WHERE k.run_id = p.run_id AND k.partition_id = m.partition_id
                             AND k."offset" = m."offset")));
