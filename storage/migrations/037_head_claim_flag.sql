-- A partition's head carries the partition's claim flag.
--
-- A flush that moves its heads in its own statement (storage/messages.py,
-- the statements of the Producer's connections) wakes a claimed partition's
-- caught-up cursors, and so has to know whether each partition it wrote is
-- claimed. It read `partitions.claimed` by key for every partition of the
-- flush, in the RETURNING of its head move: one more index probe per
-- partition, about an eighth of the server's time for a flush of eight
-- partitions. The flag is now also a column of the head, read from the very
-- row the statement moves, at no cost:
--
-- * a group's first claim cursors (storage/claims.py, MARK_CLAIMED) move the
--   partition's newest head (`log_head_hold`), then mark the partition's row
--   claimed; a trigger marks the heads in the same transaction. A publish
--   that waited for that head reads the flag from the head's newest version
--   (the UPDATE's RETURNING sees the row it wrote); one that moved the head
--   before has committed before the cursors are made, and they start after it;
-- * a head's next generation (a rotation, a partition's first head) takes the
--   flag from the partition's row, in a trigger on the insert;
-- * the heads of partitions claimed before this migration are marked here.
--
-- `partitions.claimed` stays what the head functions and an earlier process
-- beside this one read; the flag only ever goes from false to true.

ALTER TABLE log_heads ADD COLUMN claimed boolean NOT NULL DEFAULT false;

UPDATE log_heads h SET claimed = true FROM partitions p WHERE p.id = h.partition_id AND p.claimed;

CREATE FUNCTION log_heads_claim_of_partition() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    NEW.claimed := NEW.claimed OR COALESCE((SELECT p.claimed FROM partitions p WHERE p.id = NEW.partition_id), false);
    RETURN NEW;
END
$$;

CREATE TRIGGER log_heads_claim_of_partition
BEFORE INSERT ON log_heads
FOR EACH ROW EXECUTE FUNCTION log_heads_claim_of_partition();

CREATE FUNCTION partitions_claim_to_heads() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    UPDATE log_heads h SET claimed = true WHERE h.partition_id = NEW.id AND NOT h.claimed AND NOT h.closed;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_claim_to_heads
AFTER UPDATE OF claimed ON partitions
FOR EACH ROW WHEN (NEW.claimed AND NOT OLD.claimed)
EXECUTE FUNCTION partitions_claim_to_heads();
