-- A queue partition's frontier lives in `queue_frontier_heads`, in rows that each
-- take a bounded number of moves, as a partition's end lives in `log_heads`
-- (020_log_heads.sql) and for the same reason: every take moved the frontier
-- row, one new version per take, and while a snapshot is held open anywhere in
-- the database every take walked all of those versions (of every frontier of
-- the queue) to read, lock and move it.
--
-- A take still locks the `queue_frontiers` row (FOR UPDATE, a lock that writes
-- no new version): takes of one partition go one at a time as before. Under
-- that lock it reads the frontier from the newest head row and moves it there;
-- every 64 moves a new head row replaces it. Both are functions, so that their
-- statements see what the take it waited for committed.
--
-- The previous release reads and moves `queue_frontiers.next_offset` itself.
-- While it may run on the schema (previous_release_may_run(), migration 020:
-- until `bus migrate --finalize`), a move also writes that row, so the
-- previous release's takes see the exact frontier; and a move it makes is
-- carried to the head by a trigger.
CREATE TABLE queue_frontier_heads (
    partition_id  bigint NOT NULL,
    generation    bigint NOT NULL,
    next_offset   bigint NOT NULL,
    moves         integer NOT NULL DEFAULT 0,
    PRIMARY KEY (partition_id, generation)
);

INSERT INTO queue_frontier_heads (partition_id, generation, next_offset)
SELECT partition_id, 0, next_offset FROM queue_frontiers;

CREATE FUNCTION queue_frontier_heads_of_new_frontiers() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO queue_frontier_heads (partition_id, generation, next_offset)
    SELECT n.partition_id, 0, n.next_offset FROM born n
    ON CONFLICT (partition_id, generation) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_frontiers_heads_insert
AFTER INSERT ON queue_frontiers
REFERENCING NEW TABLE AS born
FOR EACH STATEMENT EXECUTE FUNCTION queue_frontier_heads_of_new_frontiers();

CREATE FUNCTION queue_frontier_heads_of_deleted_frontiers() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM queue_frontier_heads h USING gone g WHERE h.partition_id = g.partition_id;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_frontiers_heads_cascade
AFTER DELETE ON queue_frontiers
REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION queue_frontier_heads_of_deleted_frontiers();

-- A queue partition's frontier, for the frontier row aliased `f`: `f.frontier`.
CREATE FUNCTION frontier(f queue_frontiers) RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT COALESCE((SELECT h.next_offset FROM queue_frontier_heads h WHERE h.partition_id = f.partition_id
                     ORDER BY h.generation DESC LIMIT 1), f.next_offset)
$$;

-- Lock partition `pid`'s frontier row (FOR UPDATE: takes of a partition go one at
-- a time) and return the frontier as the take that held the lock before left it.
-- NULL when the partition has no frontier.
CREATE FUNCTION queue_frontier_lock(pid bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    row_offset bigint;
    at bigint;
BEGIN
    SELECT f.next_offset INTO row_offset FROM queue_frontiers f WHERE f.partition_id = pid FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT h.next_offset INTO at FROM queue_frontier_heads h WHERE h.partition_id = pid
    ORDER BY h.generation DESC LIMIT 1;
    RETURN COALESCE(at, row_offset);
END
$$;

-- Move partition `pid`'s frontier up to `upto` (never down); the caller holds the
-- frontier row's lock (queue_frontier_lock). The move that makes a head row's
-- `moves` reach 64 starts the next row and deletes the one before its own (by
-- its key, as log_head_advance does).
CREATE FUNCTION queue_frontier_move(pid bigint, upto bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    gen bigint;
    used integer;
BEGIN
    UPDATE queue_frontier_heads h SET next_offset = upto, moves = h.moves + 1
    WHERE h.partition_id = pid AND h.next_offset < upto
      AND h.generation = (SELECT max(x.generation) FROM queue_frontier_heads x WHERE x.partition_id = pid)
    RETURNING h.generation, h.moves INTO gen, used;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM queue_frontier_heads h WHERE h.partition_id = pid) THEN
            INSERT INTO queue_frontier_heads (partition_id, generation, next_offset)
            SELECT f.partition_id, 0, GREATEST(f.next_offset, upto) FROM queue_frontiers f WHERE f.partition_id = pid;
        END IF;
    ELSIF used >= 64 THEN
        INSERT INTO queue_frontier_heads (partition_id, generation, next_offset) VALUES (pid, gen + 1, upto);
        DELETE FROM queue_frontier_heads WHERE partition_id = pid AND generation = gen - 1;
    END IF;
    IF previous_release_may_run() THEN
        UPDATE queue_frontiers SET next_offset = upto WHERE partition_id = pid AND next_offset < upto;
    END IF;
    RETURN upto;
END
$$;

-- A move of `queue_frontiers.next_offset` (the previous release's take, or this
-- release's own while that release may run) carried to the head.
CREATE FUNCTION queue_frontiers_row_to_head() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE queue_frontier_heads h SET next_offset = NEW.next_offset, moves = h.moves + 1
    WHERE h.partition_id = NEW.partition_id AND h.next_offset < NEW.next_offset
      AND h.generation = (SELECT max(x.generation) FROM queue_frontier_heads x
                          WHERE x.partition_id = NEW.partition_id);
    RETURN NEW;
END
$$;

CREATE TRIGGER queue_frontiers_row_to_head
BEFORE UPDATE OF next_offset ON queue_frontiers
FOR EACH ROW WHEN (NEW.next_offset > OLD.next_offset)
EXECUTE FUNCTION queue_frontiers_row_to_head();

-- The dashboard's view of each job's lease: fresh jobs are those at or past the head.
CREATE OR REPLACE VIEW queue_job_states AS
SELECT j.partition_id, j."offset", j.topic, j.key, j.detached,
       CASE WHEN j.detached THEN j.leased_by ELSE l.leased_by END AS leased_by,
       CASE WHEN j.detached OR l.visible_at IS NULL THEN j.visible_at ELSE l.visible_at END AS visible_at
FROM queue_jobs j
LEFT JOIN queue_frontiers f ON f.partition_id = j.partition_id
LEFT JOIN LATERAL (
    SELECT l.leased_by, l.visible_at FROM queue_leases l
    WHERE NOT j.detached AND j."offset" < f.frontier
      AND l.partition_id = j.partition_id
      AND l.first_offset <= j."offset" AND l.last_offset >= j."offset"
    ORDER BY l.first_offset DESC
    LIMIT 1
) AS l ON true;
