-- A claim cursor's `pending_since` (the creation time of its first unread
-- message, NULL when it has read everything) is recomputed by an ack and by a
-- claim that found nothing to read, under a FOR SHARE lock of the partition
-- row, which waits for a publisher of that partition to commit. In READ
-- COMMITTED a statement keeps the snapshot it started with after such a wait:
-- its own read of `messages` missed the message that publisher committed
-- meanwhile, while the publisher's wake-up had found the cursor still pending
-- and left it alone. The cursor was left caught up with a message to read,
-- and no claim picked it until the next publish to the partition.
--
-- The first unread message is read by this function instead: a statement of
-- its own in a volatile function, whose snapshot is taken when it runs, after
-- the caller's lock was granted; so it sees every message of a publisher that
-- held the lock.
CREATE FUNCTION claim_first_unread_at(pid bigint, from_offset bigint) RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    at timestamptz;
BEGIN
    SELECT m.created_at INTO at FROM messages m
    WHERE m.partition_id = pid AND m."offset" >= from_offset
    ORDER BY m."offset" LIMIT 1;
    RETURN at;
END
$$;
