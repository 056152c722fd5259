-- The functions that plan with sequential or bitmap scans off (migrations 024
-- to 026) also run with JIT compilation off, and the SQL-language ones among
-- them, with what they call, become PL/pgSQL, whose plans a session keeps.
--
-- A plan setting turned off does not remove a path, it prices it at
-- 10,000,000,000 and more; a statement with no other path (a read of a
-- one-row table, such as `previous_release_may_run()` called from a frontier
-- move) keeps such a price, and settings reach every function these ones call.
-- Most packaged PostgreSQL servers have JIT on, with `jit_above_cost` at
-- 100,000: each of those statements was compiled at every call, some 50 ms
-- for a one-row read on a take's path. These functions read a few rows by
-- their keys, which JIT never makes faster, so they turn it off for what they
-- run; the server's setting stays as its operator chose it for every other
-- statement.
--
-- A SQL-language function with settings of its own is not inlined into the
-- statement that calls it, and its body is parsed and planned again at every
-- execution of that statement: a tenth of a millisecond or more per call for
-- `log_end` and `frontier` (every take reads both), `queue_leases_delete` and
-- `previous_release_may_run`. As PL/pgSQL the same statements are planned
-- once per session (with the same settings, so by the same keys) and run from
-- that plan. `log_end` and `frontier` keep no search_path of their own: they
-- run on the caller's, the bus schema first, as every bus statement does.
ALTER FUNCTION log_head_advance(bigint, bigint, bigint) SET jit = off;
ALTER FUNCTION partitions_counter_to_head() SET jit = off;
ALTER FUNCTION queue_frontier_lock(bigint) SET jit = off;
ALTER FUNCTION queue_frontier_move(bigint, bigint) SET jit = off;
ALTER FUNCTION queue_frontiers_row_to_head() SET jit = off;

CREATE OR REPLACE FUNCTION log_end(p partitions) RETURNS bigint
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN COALESCE((SELECT h.next_offset FROM log_heads h WHERE h.partition_id = p.id
                     ORDER BY h.generation DESC LIMIT 1), p.next_offset);
END
$$;

CREATE OR REPLACE FUNCTION frontier(f queue_frontiers) RETURNS bigint
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN COALESCE((SELECT h.next_offset FROM queue_frontier_heads h WHERE h.partition_id = f.partition_id
                     ORDER BY h.generation DESC LIMIT 1), f.next_offset);
END
$$;

CREATE OR REPLACE FUNCTION queue_leases_delete(at tid[]) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    deleted integer;
BEGIN
    IF cardinality(at) = 0 THEN
        RETURN 0;
    END IF;
    DELETE FROM queue_leases l WHERE l.ctid = ANY (at);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

CREATE OR REPLACE FUNCTION previous_release_may_run() RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    RETURN COALESCE((SELECT string_to_array(r.min_release, '.')::integer[] < ARRAY[0, 2, 0]
                     FROM bus_schema_release r), true);
END
$$;
