-- The functions that plan with sequential or bitmap scans off (migrations 024
-- to 026) also run with JIT compilation off.
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
ALTER FUNCTION log_head_advance(bigint, bigint, bigint) SET jit = off;
ALTER FUNCTION partitions_counter_to_head() SET jit = off;
ALTER FUNCTION log_end(partitions) SET jit = off;
ALTER FUNCTION frontier(queue_frontiers) SET jit = off;
ALTER FUNCTION queue_frontier_lock(bigint) SET jit = off;
ALTER FUNCTION queue_frontier_move(bigint, bigint) SET jit = off;
ALTER FUNCTION queue_frontiers_row_to_head() SET jit = off;
ALTER FUNCTION queue_leases_delete(tid[]) SET jit = off;
