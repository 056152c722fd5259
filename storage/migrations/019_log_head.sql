-- Offsets from the log's head instead of a counter updated per publish.
--
-- A publish used to take its offsets with `UPDATE partitions SET next_offset =
-- next_offset + n`: one new version of the partition's row per publishing
-- statement. While any session holds a snapshot open (a report in REPEATABLE
-- READ, a pg_dump) no version can be pruned, and every publish walks all of
-- them to find the live one: publish latency grew with the length of the hold.
--
-- A publisher now locks the partition's row FOR NO KEY UPDATE (a lock writes
-- no version) and then, in a later statement (a fresh snapshot, which sees
-- what the previous holder of the lock committed), reads the partition's head
-- from the log's index: max("offset") + 1, floored by `next_offset` and
-- `log_start`. Publishers of one partition still serialize on its row, so
-- offsets stay dense and commit in offset order (invariant 1).
--
-- `next_offset` becomes a lower bound of the head. Nothing removes messages at
-- or above it: retention cuts below the low watermark, which
-- `partition_watermarks` bounds by `next_offset`, and compaction deletes below
-- the same watermark; so the floor never hides a gap. The library refreshes
-- the counter to the head lazily (storage/messages.py, SYNC_COUNTERS), for the
-- previous release's consumers, which read it as the partition's end.

-- The head of a partition as of the caller's snapshot (readers: lag, fetch,
-- 'latest' starts, claims). STABLE: it runs in the calling statement's snapshot.
CREATE FUNCTION log_head(pid bigint, counter bigint) RETURNS bigint
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT GREATEST(counter, (SELECT max(m."offset") + 1 FROM messages m WHERE m.partition_id = pid))
$$;

-- For an append of `n` messages: lock partition `pid` (FOR NO KEY UPDATE,
-- kept until the caller's transaction ends) and return its head, read after
-- the lock in a statement of its own (plpgsql takes a new snapshot per
-- statement in READ COMMITTED), so it sees every message the previous lock
-- holder committed. NULL when the partition does not exist.
--
-- While a member of the previous release is live (a `members` row without a
-- protocol, migration 018), a partition of a queue topic keeps its counter
-- exact (moved by `n` here, one row version per append): that release's queue
-- consumers take fresh jobs up to the counter only, and would otherwise lose
-- every race for new jobs to this release's consumers until the counter is
-- refreshed. A process of that release that runs queue consumers but no group
-- member is not seen: it gets fresh jobs once the counter is refreshed.
--
-- The partition's caught-up claim cursors are woken (what the row trigger of
-- migration 012 does when the counter moves), under the same lock, so a claim
-- ack that clears pending_since under FOR SHARE cannot interleave with it.
-- The live members of the previous release, found without a scan.
CREATE INDEX members_without_protocol ON members (group_name) WHERE protocol IS NULL;

CREATE FUNCTION append_head(pid bigint, n integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    floor_offset bigint;
    is_claimed boolean;
    is_queue boolean;
    top bigint;
BEGIN
    SELECT GREATEST(p.next_offset, p.log_start), p.claimed, t.semantics = 'queue'
    INTO floor_offset, is_claimed, is_queue
    FROM partitions p JOIN topics t ON t.name = p.topic
    WHERE p.id = pid
    FOR NO KEY UPDATE OF p;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT max(m."offset") + 1 INTO top FROM messages m WHERE m.partition_id = pid;
    top := GREATEST(floor_offset, top);
    IF is_queue AND EXISTS (SELECT 1 FROM members m
                            WHERE m.protocol IS NULL
                              AND m.last_heartbeat > clock_timestamp() - make_interval(secs => m.session_timeout)) THEN
        -- the trigger below moves it from the head: to top + n (and wakes claim cursors)
        UPDATE partitions SET next_offset = next_offset + n WHERE id = pid;
    ELSIF is_claimed THEN
        UPDATE offsets SET pending_since = clock_timestamp() WHERE partition_id = pid AND pending_since IS NULL;
    END IF;
    RETURN top;
END
$$;

-- Whoever still moves the counter (the previous release's publishers, the SQL
-- `publish()` function, a counter refresh that sets `next_offset =
-- next_offset`) moves it from the real head: the row is locked when a BEFORE
-- ROW trigger runs, and its query sees what the lock's previous holders
-- committed. An increase of n becomes head + n, so such a publisher's
-- RETURNING gives offsets right after the newest message. A decrease (an
-- explicit set) is left alone.
CREATE FUNCTION partitions_counter_from_head() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    top bigint;
BEGIN
    IF NEW.next_offset >= OLD.next_offset THEN
        SELECT max(m."offset") + 1 INTO top FROM messages m WHERE m.partition_id = OLD.id;
        NEW.next_offset := GREATEST(OLD.next_offset, OLD.log_start, top) + (NEW.next_offset - OLD.next_offset);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER partitions_counter_from_head
BEFORE UPDATE OF next_offset ON partitions
FOR EACH ROW EXECUTE FUNCTION partitions_counter_from_head();
