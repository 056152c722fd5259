-- A queue take inserts one `queue_leases` row per (taker, partition). Its
-- foreign key to `partitions` made every such insert lock the partition's row
-- FOR KEY SHARE while the publishers of that partition update the same row
-- (its offset counter): the two lock modes do not conflict, so the row's
-- xmax became a MultiXact of both transactions, one per publish. With a
-- snapshot held open anywhere in the database no version of the row can be
-- pruned, and every publish walks all of them, each through the MultiXact
-- SLRU: publish latency grew with the length of the hold.
--
-- The lease rows keep what the key gave them, without the lock: a deleted
-- partition takes its leases with it (the trigger below), and a take only
-- leases jobs of a partition whose frontier it holds FOR UPDATE (the
-- frontier row goes with its partition, through its own key). The previous
-- release reads and writes `queue_leases` as it did; only the key is gone.
ALTER TABLE queue_leases DROP CONSTRAINT queue_leases_partition_id_fkey;

CREATE FUNCTION queue_leases_of_deleted_partitions() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    DELETE FROM queue_leases l USING gone g WHERE l.partition_id = g.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER partitions_queue_leases_cascade
AFTER DELETE ON partitions
REFERENCING OLD TABLE AS gone
FOR EACH STATEMENT EXECUTE FUNCTION queue_leases_of_deleted_partitions();
