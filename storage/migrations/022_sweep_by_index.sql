-- The sweep of a segment (or of the DEFAULT partition) that cannot be retired
-- whole finds the rows below their partitions' log starts through each
-- partition's key, from its lowest offset up to its log start, never by
-- reading the whole segment: a segment of topics without retention (or with a
-- long one) holds nothing to sweep however large it grows, and a maintenance
-- pass sweeps it at every tick. Only partitions whose log start moved can hold
-- such rows; the rows go by their addresses.
CREATE OR REPLACE FUNCTION message_segment_sweep(p_name text, p_limit integer) RETURNS bigint
LANGUAGE plpgsql AS $fn$
DECLARE
    n bigint;
BEGIN
    IF p_name <> 'messages_default' AND NOT EXISTS (SELECT 1 FROM message_segments WHERE name = p_name) THEN
        RAISE EXCEPTION 'no segment %', p_name;
    END IF;
    EXECUTE format('DELETE FROM %1$I WHERE ctid = ANY (ARRAY('
                   'SELECT b.ctid FROM partitions p CROSS JOIN LATERAL ('
                   'SELECT m.ctid FROM %1$I m WHERE m.partition_id = p.id AND m."offset" < p.log_start '
                   'ORDER BY m."offset" LIMIT $1) AS b '
                   'WHERE p.log_start > 0 LIMIT $1))', p_name) USING p_limit;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$fn$;
