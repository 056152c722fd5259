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
