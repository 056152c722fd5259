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
-- connections, which plan with the settings these functions set themselves).
-- `moved`: the partitions whose head moved, in id order; `expected`: how many
-- the flush writes to. A head that did not move (a rotation committed while
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
CREATE FUNCTION log_heads_moved(moved bigint[], expected integer) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    woken bigint[];
BEGIN
    IF COALESCE(cardinality(moved), 0) < expected THEN
        RAISE EXCEPTION 'log_heads_moved: % of % heads moved', COALESCE(cardinality(moved), 0), expected
            USING ERRCODE = 'PBH01', HINT = 'append again through log_take_offsets_many';
    END IF;
    SELECT array_agg(p.id ORDER BY p.id) INTO woken FROM partitions p WHERE p.id = ANY(moved) AND p.claimed;
    IF woken IS NOT NULL THEN
        PERFORM 1 FROM partitions p WHERE p.id = ANY(woken) ORDER BY p.id FOR NO KEY UPDATE;
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = ANY(woken) AND pending_since IS NULL;
    END IF;
    RETURN true;
END
$$;
