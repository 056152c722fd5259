-- The wake-up of caught-up cursors (003, 011) only matters on partitions that
-- claim cursors read: a partition read by consumer groups alone, or by nobody
-- yet, paid the trigger on every publish anyway (a quarter of a one-message
-- publishing statement). `partitions.claimed` marks the partitions that have
-- claim cursors; it is set (under the partition's row lock) in the transaction
-- that creates their first cursor (storage/claims.py, MARK_CLAIMED), and never
-- cleared. A publisher that bumps the counter after that transaction commits
-- sees the flag on the row it locks; one that bumped it before is waited for,
-- and the new cursor's pending_since then sees its message.
--
-- A row trigger with a WHEN clause is skipped without a call when the flag is
-- off; where it is on, one call per claimed partition a statement bumps.
ALTER TABLE partitions ADD COLUMN claimed boolean NOT NULL DEFAULT false;

-- Existing schemas: every partition with any cursor (claims or consumer
-- groups; the two are not told apart in `offsets`) keeps being woken.
UPDATE partitions p SET claimed = true WHERE EXISTS (SELECT 1 FROM offsets o WHERE o.partition_id = p.id);

DROP TRIGGER partitions_wake_cursors ON partitions;
DROP FUNCTION wake_caught_up_cursors();

CREATE FUNCTION wake_caught_up_cursors() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE offsets SET pending_since = clock_timestamp()
    WHERE partition_id = NEW.id AND pending_since IS NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_wake_cursors
AFTER UPDATE OF next_offset ON partitions
FOR EACH ROW WHEN (NEW.claimed AND NEW.next_offset > OLD.next_offset)
EXECUTE FUNCTION wake_caught_up_cursors();
