-- A lone publish's head move costs one statement of the function, not three.
--
-- 1. `previous_release_may_run()` is a constant. It read `bus_schema_release`
--    at every call: a query of its own on every publish and every queue take,
--    for an answer that changes once in a schema's life (when `bus migrate
--    --finalize` raises the minimum release). It is now an IMMUTABLE function
--    whose body is that answer (`SELECT true` or `SELECT false`), and a trigger
--    on `bus_schema_release` writes the body again whenever the minimum release
--    is written. The planner folds the constant into the plans that call it,
--    and PostgreSQL invalidates those plans when the body is replaced, so a
--    session plans again with the new answer at its next statement. The answer
--    only ever goes from true to false; a statement that still runs with true
--    takes the path that is correct whichever release runs beside it.
--
-- 2. `log_take_offset` (the flush of a lone publish, or of one partition)
--    reads the claim flag in the RETURNING of the head's UPDATE instead of a
--    statement after it. The RETURNING sees the statement's snapshot, taken
--    before the head's row lock was waited for, where the function's next
--    statement took a new one. So, as APPEND_PLANNED does (storage/messages.py,
--    migration 035), the move also compares the head it wrote with the one
--    the snapshot shows: a head that someone else moved since then (a group's
--    first claim cursors move it before they are made, `log_head_hold`) sends
--    the publish through the reading of the flag in a new snapshot, as before.

CREATE OR REPLACE FUNCTION previous_release_may_run() RETURNS boolean
LANGUAGE sql IMMUTABLE
AS 'SELECT true';

-- Write previous_release_may_run()'s answer for the minimum release recorded
-- now (none: true), when it differs from the one it gives; and the trigger that
-- calls this on every write of the release, if the table lacks it. The migrator
-- calls it after writing the release, so a release table made again (by hand,
-- or by a restore without its triggers) still gets the right answer.
CREATE FUNCTION previous_release_may_run_sync() RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    may_run boolean;
BEGIN
    SELECT COALESCE((SELECT string_to_array(r.min_release, '.')::integer[] < ARRAY[0, 2, 0]
                     FROM bus_schema_release r), true) INTO may_run;
    IF previous_release_may_run() IS DISTINCT FROM may_run THEN
        -- replacing the body invalidates every session's plans that folded the answer in
        EXECUTE format(
            'CREATE OR REPLACE FUNCTION %I.previous_release_may_run() RETURNS boolean LANGUAGE sql IMMUTABLE AS %L',
            current_schema(), 'SELECT ' || may_run::text);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger t
                   WHERE t.tgrelid = 'bus_schema_release'::regclass AND t.tgname = 'bus_schema_release_written') THEN
        CREATE TRIGGER bus_schema_release_written
        AFTER INSERT OR UPDATE OR DELETE ON bus_schema_release
        FOR EACH STATEMENT EXECUTE FUNCTION previous_release_may_run_written();
    END IF;
    RETURN may_run;
END
$$;

CREATE FUNCTION previous_release_may_run_written() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM previous_release_may_run_sync();
    RETURN NULL;
END
$$;

SELECT previous_release_may_run_sync();

CREATE OR REPLACE FUNCTION log_take_offset(pid bigint, n bigint) RETURNS SETOF bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    claimed boolean;
    gen bigint;
    first bigint;
    closing boolean;
    wake boolean;
BEGIN
    IF previous_release_may_run() THEN
        RETURN QUERY SELECT t.base FROM log_take_offsets_many(ARRAY[pid], ARRAY[n]) AS t;
        RETURN;
    END IF;
    UPDATE log_heads h
    SET next_offset = h.next_offset + n, appends = h.appends + 1, closed = h.appends + 1 >= 64
    WHERE h.partition_id = pid
      AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
      AND NOT h.closed
    RETURNING h.generation, h.next_offset - n, h.closed,
              -- moved by someone else since this statement's snapshot, or claimed in it
              h.appends IS DISTINCT FROM 1 + (SELECT s.appends FROM log_heads s
                                              WHERE s.partition_id = pid AND s.generation = h.generation)
              OR (SELECT p.claimed FROM partitions p WHERE p.id = pid)
    INTO gen, first, closing, wake;
    IF NOT FOUND THEN
        first := log_head_move(pid, n);  -- a rotation to wait out, or no head (NULL: no partition)
        IF first IS NULL THEN
            RETURN;
        END IF;
        wake := true;
    ELSIF closing THEN
        INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, first + n);
        DELETE FROM log_heads WHERE partition_id = pid AND generation = gen - 1;
    END IF;
    IF wake THEN
        -- read in a snapshot taken now: a claim made while the move waited is seen
        SELECT p.claimed INTO claimed FROM partitions p WHERE p.id = pid;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        IF claimed THEN
            PERFORM 1 FROM partitions p WHERE p.id = pid FOR NO KEY UPDATE;
            UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = pid AND pending_since IS NULL;
        END IF;
    ELSIF wake IS NULL THEN
        -- the partition's row is gone (its topic deleted while the head was moved): nothing placed
        RETURN;
    END IF;
    RETURN NEXT first;
END
$$;
