-- Range leases are written once and never updated or deleted one by one: the
-- lease table is split into slots that are emptied whole (TRUNCATE), and a
-- partition's frontier is the end of its newest lease.
--
-- A take of fresh jobs wrote three row versions a snapshot held elsewhere keeps
-- beside the job's own delete: a new version of the partition's frontier head
-- (migration 021), the lease row, and the lease's delete by the ack that emptied
-- it. Now:
--
-- * `queue_leases` is list-partitioned by `slot`: the time of the inserting
--   transaction picks one of two slots, ten seconds each in turn. Nothing deletes a
--   lease when its jobs are acked. `queue_leases_rotate()` empties a slot the
--   clock has left: under the slot's ACCESS EXCLUSIVE lock (never waited for
--   more than a moment: a slot it cannot lock is tried again at the next
--   rotation, and only keeps its rows meanwhile) the leases that still hold a
--   job, and the newest lease of each partition, are copied to the current
--   slot, and the slot is truncated. A truncated slot leaves no dead version.
-- * A partition's frontier is the newest of its head row and the end of its
--   newest lease: a take that leases what it moves past writes only its lease.
--   The head is moved only when a take moves the frontier past offsets it does
--   not lease (jobs detached at publish, or no fresh job left) and by
--   DETACH_FRESH.
-- * A lease whose jobs are all acked or detached holds nothing: the expiry scan
--   and the look for the next lease's end pass over such leases.
--
-- The previous release deletes leases by id (its ack and its expiry scan) and
-- reads the frontier from `queue_frontiers.next_offset`. While it may run on the
-- schema (previous_release_may_run(), migration 020), this release's takes still
-- move the head and the row at each take, and no slot is rotated: that release
-- deletes rows the rotation would copy.
ALTER TABLE queue_leases RENAME TO queue_leases_before_slots;
ALTER INDEX queue_leases_expiry RENAME TO queue_leases_before_slots_expiry;
ALTER INDEX queue_leases_range RENAME TO queue_leases_before_slots_range;

CREATE SEQUENCE queue_leases_ids;
SELECT setval('queue_leases_ids', COALESCE((SELECT max(id) FROM queue_leases_before_slots), 0) + 1, false);

-- The slot of leases inserted at `at`: ten seconds each, two in turn (each read of a frontier
-- probes every slot's index, and one slot being written while the other is emptied suffices).
CREATE FUNCTION queue_leases_slot_at(at timestamptz) RETURNS smallint
LANGUAGE sql STABLE
AS $$
    SELECT (floor(extract(epoch FROM at) / 10)::bigint % 2)::smallint
$$;

CREATE TABLE queue_leases (
    id            bigint NOT NULL DEFAULT nextval('queue_leases_ids'),
    topic         text NOT NULL,
    partition_id  bigint NOT NULL,
    first_offset  bigint NOT NULL,
    last_offset   bigint NOT NULL,
    leased_by     text NOT NULL,
    visible_at    timestamptz NOT NULL,          -- the lease runs out
    slot          smallint NOT NULL DEFAULT queue_leases_slot_at(transaction_timestamp())
) PARTITION BY LIST (slot);
ALTER SEQUENCE queue_leases_ids OWNED BY queue_leases.id;

CREATE TABLE queue_leases_0 PARTITION OF queue_leases FOR VALUES IN (0);
CREATE TABLE queue_leases_1 PARTITION OF queue_leases FOR VALUES IN (1);

INSERT INTO queue_leases (id, topic, partition_id, first_offset, last_offset, leased_by, visible_at)
SELECT id, topic, partition_id, first_offset, last_offset, leased_by, visible_at FROM queue_leases_before_slots;

-- The view reads the lease table: it goes with the old one and is made again on the new one.
DROP VIEW queue_job_states;
DROP TABLE queue_leases_before_slots;

CREATE INDEX queue_leases_expiry ON queue_leases (topic, visible_at);
CREATE INDEX queue_leases_range ON queue_leases (partition_id, first_offset);
CREATE INDEX queue_leases_id ON queue_leases (id);  -- the previous release deletes by id

CREATE VIEW queue_job_states AS
SELECT j.partition_id, j."offset", j.topic, j.key, j.detached,
       CASE WHEN j.detached THEN j.leased_by ELSE l.leased_by END AS leased_by,
       CASE WHEN j.detached OR l.visible_at IS NULL THEN j.visible_at ELSE l.visible_at END AS visible_at
FROM queue_jobs j
LEFT JOIN queue_frontiers f ON f.partition_id = j.partition_id
LEFT JOIN LATERAL (
    SELECT l.leased_by, l.visible_at FROM queue_leases l
    WHERE NOT j.detached AND j."offset" < f.frontier
      AND l.partition_id = j.partition_id
      AND l.first_offset <= j."offset" AND l.last_offset >= j."offset"
    ORDER BY l.first_offset DESC
    LIMIT 1
) AS l ON true;

-- Leases are no longer deleted by their row address (ctid is not unique across slots).
DROP FUNCTION queue_leases_delete(tid[]);

-- A partition's frontier: its head, or past its newest lease if that ends later.
CREATE OR REPLACE FUNCTION frontier(f queue_frontiers) RETURNS bigint
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN GREATEST(
        COALESCE((SELECT h.next_offset FROM queue_frontier_heads h WHERE h.partition_id = f.partition_id
                  ORDER BY h.generation DESC LIMIT 1), f.next_offset),
        (SELECT l.last_offset + 1 FROM queue_leases l WHERE l.partition_id = f.partition_id
         ORDER BY l.first_offset DESC LIMIT 1));
END
$$;

CREATE OR REPLACE FUNCTION queue_frontier_lock(pid bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    row_offset bigint;
    at bigint;
    leased bigint;
BEGIN
    SELECT f.next_offset INTO row_offset FROM queue_frontiers f WHERE f.partition_id = pid FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT h.next_offset INTO at FROM queue_frontier_heads h WHERE h.partition_id = pid
    ORDER BY h.generation DESC LIMIT 1;
    SELECT l.last_offset + 1 INTO leased FROM queue_leases l WHERE l.partition_id = pid
    ORDER BY l.first_offset DESC LIMIT 1;
    RETURN GREATEST(COALESCE(at, row_offset), leased);
END
$$;

-- Empty the slot the clock has left (`current`: the slot leases go to now; NULL: by the
-- server's clock). Per slot: its leases that still hold a job and each partition's newest
-- lease (the partition's frontier) are copied to the current slot, then the slot is
-- truncated, all under the slot's lock, which is waited for at most `lock_timeout` (a take
-- waits behind that wait; the takes that hold it now end within it) and not asked for while a
-- transaction older than a second holds the slot. The slot is looked at first without the lock; under it, only the
-- leases found holding a job then are looked at again (a lease that holds none never holds
-- one again), and the slot is left as it is if a lease it did not see was added meanwhile. One rotation at
-- a time per schema (an advisory lock; a rotation that finds it taken does nothing). The
-- number of slots truncated.
CREATE FUNCTION queue_leases_rotate(current smallint DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '20ms'
SET jit = off
AS $$
DECLARE
    cur smallint := COALESCE(current, queue_leases_slot_at(clock_timestamp()));
    s smallint;
    seen bigint[];
    keep bigint[];
    truncated integer := 0;
BEGIN
    IF previous_release_may_run()
       OR NOT pg_try_advisory_xact_lock(hashtext(current_schema() || '.queue_leases_rotate')) THEN
        RETURN 0;
    END IF;
    FOR s IN 0..1 LOOP
        CONTINUE WHEN s = cur;
        SELECT array_agg(l.id) INTO seen FROM queue_leases l WHERE l.slot = s;
        CONTINUE WHEN seen IS NULL;
        SELECT array_agg(l.id) INTO keep FROM queue_leases l
        WHERE l.slot = s
          AND (EXISTS (SELECT 1 FROM queue_jobs j
                       WHERE j.partition_id = l.partition_id AND NOT j.detached
                         AND j."offset" BETWEEN l.first_offset AND l.last_offset)
               OR NOT EXISTS (SELECT 1 FROM queue_leases n
                              WHERE n.partition_id = l.partition_id AND n.first_offset > l.first_offset));
        -- A transaction that holds the slot for more than a moment (a report that read the lease
        -- table and stays open) would hold the lock's wait, and every take behind it, to the end
        -- of the timeout at each rotation: such a slot is left alone without asking for the lock.
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_locks k JOIN pg_stat_activity a ON a.pid = k.pid
            WHERE k.locktype = 'relation' AND k.granted AND k.pid <> pg_backend_pid()
              AND k.relation = to_regclass(quote_ident('queue_leases_' || s))
              AND a.xact_start < clock_timestamp() - interval '1 second');
        BEGIN
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', 'queue_leases_' || s);
            IF NOT EXISTS (SELECT 1 FROM queue_leases l
                           WHERE l.slot = s AND l.id NOT IN (SELECT unnest(seen))) THEN
                INSERT INTO queue_leases (id, topic, partition_id, first_offset, last_offset, leased_by,
                                          visible_at, slot)
                SELECT l.id, l.topic, l.partition_id, l.first_offset, l.last_offset, l.leased_by,
                       l.visible_at, cur
                FROM queue_leases l WHERE l.slot = s AND l.id = ANY (keep);
                EXECUTE format('TRUNCATE %I', 'queue_leases_' || s);
                truncated := truncated + 1;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- busy (a transaction that read the slot holds it): tried again at the next rotation
        END;
    END LOOP;
    RETURN truncated;
END
$$;
