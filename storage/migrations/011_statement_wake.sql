-- The wake-up of caught-up cursors (003_queues.sql) runs once per publishing
-- statement instead of once per partition row it bumps: a flush that writes to
-- twelve partitions called the row trigger's function twelve times. Same rule
-- and the same moment: at the end of the publishing statement, inside its
-- transaction, while the partitions' row locks are held (so a claim ack that
-- clears pending_since under FOR SHARE still cannot interleave with it).
-- Transition tables do not go with a column list, so the trigger fires on
-- every UPDATE of `partitions` and keeps the rows whose next_offset grew.
DROP TRIGGER partitions_wake_cursors ON partitions;
DROP FUNCTION wake_caught_up_cursors();

CREATE FUNCTION wake_caught_up_cursors() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE offsets o SET pending_since = clock_timestamp()
    FROM bumped_new n JOIN bumped_old d ON d.id = n.id
    WHERE o.partition_id = n.id AND o.pending_since IS NULL AND n.next_offset > d.next_offset;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_wake_cursors
AFTER UPDATE ON partitions
REFERENCING OLD TABLE AS bumped_old NEW TABLE AS bumped_new
FOR EACH STATEMENT EXECUTE FUNCTION wake_caught_up_cursors();
