-- The functions that read or move a partition's head row (`log_heads`,
-- migration 020; `queue_frontier_heads`, migration 021) find it by its key,
-- whatever the planner makes of the table's size.
--
-- A heads table holds a few live rows per partition, so the planner, sizing it
-- by its statistics (a page or two), plans a sequential scan and a sort for a
-- lookup by key. While a snapshot is held elsewhere every move of a head leaves
-- a dead version that no vacuum may remove, and the table grows by one row per
-- publish or take: each plan made for the small table then reads all of them,
-- and a publish or a take gets slower the longer the snapshot has been held,
-- until the next autovacuum or analyze updates the table's size and the plans
-- are made anew. With sequential scans off in these functions their plans use
-- the primary key from the start; nothing else in the statements that call
-- them changes.
ALTER FUNCTION log_head_advance(bigint, bigint, bigint) SET enable_seqscan = off;
ALTER FUNCTION partitions_counter_to_head() SET enable_seqscan = off;
ALTER FUNCTION log_end(partitions) SET enable_seqscan = off;
ALTER FUNCTION frontier(queue_frontiers) SET enable_seqscan = off;
ALTER FUNCTION queue_frontier_lock(bigint) SET enable_seqscan = off;
ALTER FUNCTION queue_frontier_move(bigint, bigint) SET enable_seqscan = off;
ALTER FUNCTION queue_frontiers_row_to_head() SET enable_seqscan = off;
