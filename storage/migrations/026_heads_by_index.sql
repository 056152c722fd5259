-- The functions that read or move a partition's head row (migration 024) also
-- run with bitmap scans off, so a lookup of the newest generation reads the
-- index from its end and stops at the first row it may see.
--
-- With sequential scans off alone, a heads table analyzed while a snapshot is
-- held elsewhere (many pages, two live rows per partition) gets bitmap plans:
-- `max(generation)` of a partition then reads every heap page that holds a
-- version of any of its generations, a few hundred after minutes of hold, at
-- every publish and take, until the next analyze changes the plan again.
ALTER FUNCTION log_head_advance(bigint, bigint, bigint) SET enable_bitmapscan = off;
ALTER FUNCTION partitions_counter_to_head() SET enable_bitmapscan = off;
ALTER FUNCTION log_end(partitions) SET enable_bitmapscan = off;
ALTER FUNCTION frontier(queue_frontiers) SET enable_bitmapscan = off;
ALTER FUNCTION queue_frontier_lock(bigint) SET enable_bitmapscan = off;
ALTER FUNCTION queue_frontier_move(bigint, bigint) SET enable_bitmapscan = off;
ALTER FUNCTION queue_frontiers_row_to_head() SET enable_bitmapscan = off;
