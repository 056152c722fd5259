-- The functions that move or read a partition's head keep one plan per
-- statement for the session (`plan_cache_mode = force_generic_plan`), instead
-- of planning some of their statements again at every call.
--
-- They run with sequential and bitmap scans off (migrations 024 to 029), so
-- that a lookup by key uses the key whatever the planner makes of the heads
-- table's size. With those paths priced out, a statement with an array
-- parameter (the partitions of a flush: `p.id = ANY(pids)`, a join with
-- `unnest(pids, bases)`) costs more as a generic plan, sized for an array of
-- unknown length, than as a plan made for the array at hand; PostgreSQL then
-- keeps planning it for each call, and a publish of several partitions spent
-- more time planning those two reads than running every statement of the
-- head's move. Their generic plans are the plans wanted (by key, through the
-- primary keys), so these functions always use them.
ALTER FUNCTION log_take_offsets_many(bigint[], bigint[]) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION log_take_offset(bigint, bigint) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION log_head_move(bigint, bigint) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION log_head_hold(bigint) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION log_head_advance(bigint, bigint, bigint) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION partitions_counter_to_head() SET plan_cache_mode = force_generic_plan;

-- The end of a flush that moved its partitions' heads in the flush's own
-- statement (storage/messages.py, the statements of the Producer's
-- connections, which plan with the settings these functions set themselves),
-- called when there is more to do than the statement did. `moved`: the
-- partitions whose head moved, in id order; `expected`: how many the flush
-- writes to; `closed_*`: the heads the statement closed (their generations,
-- partitions and ends), rotated here as log_take_offsets_many rotates them.
-- A head that did not move (a rotation committed while
-- the statement waited for it, a partition without a head or gone, the
-- previous release may run) fails the statement with SQLSTATE PBH01, so that
-- nothing of it is written and the flush runs again through
-- log_take_offsets_many. Otherwise the claimed partitions' caught-up cursors
-- are woken as log_take_offsets_many wakes them: read here, after every head
-- moved, with a snapshot taken now (a cursor made while the statement waited
-- for a head is seen), and their rows locked in id order. Always true. No
-- settings of its own, so that the call stays cheap: it runs where those
-- statements run, with their settings and the bus schema first on the
-- search_path.
CREATE FUNCTION log_heads_moved(
    moved bigint[], expected integer, closed_gens bigint[], closed_ids bigint[], closed_ends bigint[]
) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    woken bigint[];
BEGIN
    IF COALESCE(cardinality(moved), 0) < expected THEN
        RAISE EXCEPTION 'log_heads_moved: % of % heads moved', COALESCE(cardinality(moved), 0), expected
            USING ERRCODE = 'PBH01', HINT = 'append again through log_take_offsets_many';
    END IF;
    -- The heads the statement closed: the next generation starts where each ends, the one before goes.
    IF closed_ids IS NOT NULL THEN
        INSERT INTO log_heads (partition_id, generation, next_offset)
        SELECT c.id, c.gen + 1, c.ending FROM unnest(closed_ids, closed_gens, closed_ends) AS c(id, gen, ending);
        DELETE FROM log_heads h USING unnest(closed_ids, closed_gens) AS c(id, gen)
        WHERE h.partition_id = c.id AND h.generation = c.gen - 1;
    END IF;
    SELECT array_agg(p.id ORDER BY p.id) INTO woken FROM partitions p WHERE p.id = ANY(moved) AND p.claimed;
    IF woken IS NOT NULL THEN
        PERFORM 1 FROM partitions p WHERE p.id = ANY(woken) ORDER BY p.id FOR NO KEY UPDATE;
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = ANY(woken) AND pending_since IS NULL;
    END IF;
    RETURN true;
END
$$;

-- Before a group's first claim cursors on a partition are made, its newest head
-- is moved (one more counted in `appends`, no offset) instead of only locked,
-- as migration 029 held it: a publish that moves the head by the statement
-- itself (APPEND_PLANNED) compares the head it wrote with the one its snapshot
-- shows, and calls log_heads_moved, which reads the claims with a snapshot of
-- its own, whenever anything moved the head in between. So a publish that
-- waited for the cursors' creation, or started before it committed, wakes
-- them; one that did not reads the partition's claim flag in its own
-- snapshot. Otherwise as migration 029 wrote it.
CREATE OR REPLACE FUNCTION log_head_hold(pid bigint) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- Claimed already, or publishers lock the partition's row first (the previous release may run).
    IF (SELECT p.claimed FROM partitions p WHERE p.id = pid) OR previous_release_may_run() THEN
        RETURN true;
    END IF;
    FOR attempt IN 1 .. 1000 LOOP
        UPDATE log_heads h SET appends = h.appends + 1
        WHERE h.partition_id = pid
          AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
          AND NOT h.closed;
        IF FOUND OR NOT EXISTS (SELECT 1 FROM log_heads x WHERE x.partition_id = pid) THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN true;
END
$$;
