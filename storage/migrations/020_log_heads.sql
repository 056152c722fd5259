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
-- where this one ends, and deletes the generations before this one. So a
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
        DELETE FROM log_heads WHERE partition_id = pid AND generation < gen;
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
CROSS JOIN LATERAL (
    SELECT COALESCE((SELECT h.next_offset FROM log_heads h WHERE h.partition_id = p.id
                     ORDER BY h.generation DESC LIMIT 1), p.next_offset) AS next_offset
) e
LEFT JOIN group_topics gt ON gt.topic = p.topic
LEFT JOIN groups g ON g.name = gt.group_name AND g.status IN ('active', 'stopped')
LEFT JOIN offsets o ON o.group_name = g.name AND o.partition_id = p.id
GROUP BY p.id, p.topic, p.name, p.log_start, e.next_offset;
