-- A take deletes the range leases that ran out (its expiry scan locked them)
-- through this function, by their row addresses, with sequential scans off.
--
-- As a join of the lease table with the locked leases, the deletion was planned
-- from the table's statistics: analyzed while it held a few leases, it looked a
-- row small, and the plan walked the whole lease index for each take, even when
-- no lease had run out. While a snapshot is held elsewhere that index keeps
-- every lease acked since the hold began, so every take got slower the longer
-- the hold lasted.
CREATE FUNCTION queue_leases_delete(at tid[]) RETURNS integer
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
    WITH d AS (DELETE FROM queue_leases l WHERE l.ctid = ANY (at) RETURNING 1)
    SELECT count(*)::integer FROM d
$$;
