-- A publish orders itself on its partition's head row alone: one row written
-- per partition a publishing statement writes to, instead of a lock on the
-- partition's row and then a new version of its head.
--
-- Migration 020 locked the partition's row (FOR NO KEY UPDATE: no new version,
-- but a write of the row's lock to its page and to the WAL) before moving the
-- head, so that the publishers of a partition moved its heads one at a time
-- even across a rotation. That lock cost about as much as the head's move
-- itself, and the two, with a function call per partition, made a publish of
-- many partitions two to three times the server work of the single counter
-- update it replaced.
--
-- Now the head's own row lock orders the publishers. A head row that takes its
-- 64th publish is `closed` in that same update, and the next generation is
-- inserted and the one before the closed one deleted in the same transaction.
-- A publisher moves only the newest generation that is not closed: one that
-- waited for a rotating publisher finds the row it waited for closed when the
-- rotation commits, and reads the newest generation again (a statement of its
-- own, with a new snapshot, which sees the rotation). So offsets stay dense and
-- each partition's publishers commit in offset order (invariant 1), and a
-- publish writes no version of anything but its head row, which a snapshot
-- held elsewhere keeps for at most one generation (64 publishes).
--
-- The partition's row is still locked where it orders more than publishers:
--
-- * a partition with claim cursors (`claimed`, migration 012): after the head
--   moved, the partition's row is locked and its caught-up cursors are woken
--   under that lock, which a claim's recomputation of `pending_since` waits
--   for (FOR SHARE, migration 023). The flag is read after the head moved, so
--   a publisher that moved the head before a group's first cursor was made
--   is waited for by that cursor's creation (it holds the newest head,
--   `log_head_hold` below, storage/claims.py) and one that moved it after sees
--   the flag;
-- * while the previous release may run on the schema (before `bus migrate
--   --finalize`): that release moves `partitions.next_offset` under the row's
--   lock, so every publish locks the row first, as migration 020 did.
--
-- The functions plan with sequential and bitmap scans off (as migrations 024
-- and 026 explain: the heads table's statistics say nothing of the versions a
-- held snapshot keeps) and without JIT (those settings price every plan far
-- above the JIT thresholds of a server that has it on).

ALTER TABLE log_heads ADD COLUMN closed boolean NOT NULL DEFAULT false;

-- Move partition `pid`'s head by `n` offsets; the first of them. NULL when the
-- partition has neither a head nor a row. A missing head (a partition row
-- restored by hand) starts at the row's counter.
CREATE FUNCTION log_head_move(pid bigint, n bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    gen bigint;
    base bigint;
    closing boolean;
    floor bigint;
BEGIN
    FOR attempt IN 1 .. 1000 LOOP
        UPDATE log_heads h
        SET next_offset = h.next_offset + n, appends = h.appends + 1, closed = h.appends + 1 >= 64
        WHERE h.partition_id = pid
          AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
          AND NOT h.closed
        RETURNING h.generation, h.next_offset - n, h.closed INTO gen, base, closing;
        IF FOUND THEN
            IF closing THEN
                INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, base + n);
                DELETE FROM log_heads WHERE partition_id = pid AND generation = gen - 1;
            END IF;
            RETURN base;
        END IF;
        -- Nothing moved: the newest generation was closed by a rotation that committed after
        -- this statement's snapshot (read again), or the partition has no head.
        IF NOT EXISTS (SELECT 1 FROM log_heads x WHERE x.partition_id = pid) THEN
            SELECT p.next_offset INTO floor FROM partitions p WHERE p.id = pid;
            IF NOT FOUND THEN
                RETURN NULL;
            END IF;
            INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, 0, floor)
            ON CONFLICT (partition_id, generation) DO NOTHING;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'log_head_move: the head of partition % kept moving away', pid USING ERRCODE = '40001';
END
$$;

-- Lock partition `pid`'s newest head (no new version) unless the partition is
-- claimed already: the creation of a group's first cursors waits for the
-- publishers that moved the head before it, and the ones after it wait for it
-- and then see the partition claimed (storage/claims.py, MARK_CLAIMED, which
-- holds the partition's row lock). Always true, to be called in a qualifier.
CREATE FUNCTION log_head_hold(pid bigint) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    -- Claimed already, or publishers lock the partition's row first (the previous release may run).
    IF (SELECT p.claimed FROM partitions p WHERE p.id = pid) OR previous_release_may_run() THEN
        RETURN true;
    END IF;
    FOR attempt IN 1 .. 1000 LOOP
        PERFORM 1 FROM log_heads h
        WHERE h.partition_id = pid
          AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
          AND NOT h.closed
        FOR NO KEY UPDATE;
        IF FOUND OR NOT EXISTS (SELECT 1 FROM log_heads x WHERE x.partition_id = pid) THEN
            RETURN true;
        END IF;
    END LOOP;
    RETURN true;
END
$$;

-- The counter's allocation (migration 020's trigger, under the partition's row
-- lock) moves the head the same way, closing and rotating it.
CREATE OR REPLACE FUNCTION log_head_advance(pid bigint, n bigint, floor bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    base bigint;
BEGIN
    base := log_head_move(pid, n);
    IF base IS NULL THEN
        INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, 0, floor + n);
        RETURN floor;
    END IF;
    RETURN base;
END
$$;

-- Allocate offsets on several partitions at once (a flush of the Producer):
-- `ns[i]` offsets of partition `pids[i]`; the caller passes the partitions in
-- id order (no deadlock between two such calls). One row per partition that
-- exists: its first offset and its topic. The head's move is log_head_move's,
-- written out here, and the partitions' rows are read once for all of them
-- after every head moved: this runs at every publish, and a statement per
-- partition more cost a third of it.
CREATE FUNCTION log_take_offsets_many(pids bigint[], ns bigint[])
RETURNS TABLE (id bigint, base bigint, topic text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    compat boolean;
    part record;
    pid bigint;
    n bigint;
    gen bigint;
    first bigint;
    closing boolean;
    bases bigint[];
    woken bigint[];
BEGIN
    -- previous_release_may_run(), read here rather than called
    SELECT COALESCE((SELECT string_to_array(r.min_release, '.')::integer[] < ARRAY[0, 2, 0]
                     FROM bus_schema_release r), true) INTO compat;
    IF compat THEN
        -- as migration 020: each row locked first, the counter moved too
        FOR i IN 1 .. cardinality(pids) LOOP
            pid := pids[i];
            n := ns[i];
            SELECT p.topic, p.claimed, p.next_offset INTO part FROM partitions p WHERE p.id = pid FOR NO KEY UPDATE;
            CONTINUE WHEN NOT FOUND;
            id := pid;
            base := log_head_advance(pid, n, part.next_offset);
            topic := part.topic;
            PERFORM set_config('pgactorbus.head_sync', 'on', true);
            UPDATE partitions SET next_offset = base + n WHERE partitions.id = pid;
            PERFORM set_config('pgactorbus.head_sync', 'off', true);
            RETURN NEXT;
        END LOOP;
        RETURN;
    END IF;
    bases := array_fill(NULL::bigint, ARRAY[cardinality(pids)]);
    FOR i IN 1 .. cardinality(pids) LOOP
        pid := pids[i];
        n := ns[i];
        UPDATE log_heads h
        SET next_offset = h.next_offset + n, appends = h.appends + 1, closed = h.appends + 1 >= 64
        WHERE h.partition_id = pid
          AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
          AND NOT h.closed
        RETURNING h.generation, h.next_offset - n, h.closed INTO gen, first, closing;
        IF NOT FOUND THEN
            first := log_head_move(pid, n);   -- a rotation to wait out, or no head (NULL: no partition)
        ELSIF closing THEN
            INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, first + n);
            DELETE FROM log_heads WHERE partition_id = pid AND generation = gen - 1;
        END IF;
        bases[i] := first;
    END LOOP;
    -- Claimed partitions: read once every head is held; their rows locked (in id order) to wake their cursors.
    SELECT array_agg(p.id ORDER BY p.id) INTO woken FROM partitions p WHERE p.id = ANY(pids) AND p.claimed;
    IF woken IS NOT NULL THEN
        PERFORM 1 FROM partitions p WHERE p.id = ANY(woken) ORDER BY p.id FOR NO KEY UPDATE;
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = ANY(woken) AND pending_since IS NULL;
    END IF;
    RETURN QUERY
    SELECT u.pid, u.first, p.topic
    FROM unnest(pids, bases) AS u(pid, first) JOIN partitions p ON p.id = u.pid
    WHERE u.first IS NOT NULL;
END
$$;

-- The first of `n` offsets of partition `pid` (no row: the partition is gone):
-- log_take_offsets_many for the one partition of a lone publish, without the
-- arrays and the topic.
CREATE FUNCTION log_take_offset(pid bigint, n bigint) RETURNS SETOF bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    compat boolean;
    claimed boolean;
    gen bigint;
    first bigint;
    closing boolean;
BEGIN
    SELECT COALESCE((SELECT string_to_array(r.min_release, '.')::integer[] < ARRAY[0, 2, 0]
                     FROM bus_schema_release r), true) INTO compat;
    IF compat THEN
        RETURN QUERY SELECT t.base FROM log_take_offsets_many(ARRAY[pid], ARRAY[n]) AS t;
        RETURN;
    END IF;
    UPDATE log_heads h
    SET next_offset = h.next_offset + n, appends = h.appends + 1, closed = h.appends + 1 >= 64
    WHERE h.partition_id = pid
      AND h.generation = (SELECT max(x.generation) FROM log_heads x WHERE x.partition_id = pid)
      AND NOT h.closed
    RETURNING h.generation, h.next_offset - n, h.closed INTO gen, first, closing;
    IF NOT FOUND THEN
        first := log_head_move(pid, n);
        IF first IS NULL THEN
            RETURN;
        END IF;
    ELSIF closing THEN
        INSERT INTO log_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, first + n);
        DELETE FROM log_heads WHERE partition_id = pid AND generation = gen - 1;
    END IF;
    SELECT p.claimed INTO claimed FROM partitions p WHERE p.id = pid;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF claimed THEN
        PERFORM 1 FROM partitions p WHERE p.id = pid FOR NO KEY UPDATE;
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = pid AND pending_since IS NULL;
    END IF;
    RETURN NEXT first;
END
$$;

-- One partition (the SQL `publish` function, compaction's bulk append): the same allocation.
CREATE OR REPLACE FUNCTION log_take_offsets(pid bigint, n bigint)
RETURNS TABLE (base bigint, topic text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY SELECT t.base, t.topic FROM log_take_offsets_many(ARRAY[pid], ARRAY[n]) AS t;
END
$$;
