-- Event store: discovery that does not depend on who happens to run it, and a cheaper guarded append.
--
-- `handled_tags`: the union of the handled event types of every claim_next a
-- group made with this partition_by. Discovery computes the partitions'
-- pending hints from this union, never from the types of the one call that
-- scanned, so a partition found by a worker that does not handle its events is
-- still pending for a worker of the group that does (a deploy that adds a
-- handled type). When a call brings a type the union lacks, the union grows
-- and `scanned` goes back to 0: the log is scanned again (incrementally, like
-- any discovery) to lower the hints for the new type's events. Rows written
-- before this migration start with an empty union, so their first claim_next
-- rescans once and repairs hints computed from a narrower set.
ALTER TABLE es_scans ADD COLUMN handled_tags text[] NOT NULL DEFAULT '{}';

-- The guarded append of migration 005, cheaper per call (same contract and
-- signature). Its guard check, planned with the call's values, has a custom
-- plan far cheaper on paper than the generic one, so PL/pgSQL planned it
-- again on every call (about a third of the backend's CPU per append); the
-- plans are the same index probes either way, so the function now always
-- uses its cached generic plans. The two inserts and the result are one
-- statement instead of three.
CREATE OR REPLACE FUNCTION es_append_guarded(
    p_store text, p_tags text[], p_payloads text[],
    p_idx bigint[], p_names text[], p_values text[], p_attr_tags text[],
    c_tags text[], c_names text[], c_values text[], p_after bigint
) RETURNS TABLE (pos bigint, created timestamptz)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    n bigint := cardinality(p_tags);
    base bigint;
    hit record;
BEGIN
    INSERT INTO es_stores AS s (name, next_position) VALUES (p_store, 1 + n)
    ON CONFLICT (name) DO UPDATE SET next_position = s.next_position + n
    RETURNING s.next_position - n INTO base;

    -- A new statement, so a fresh snapshot: every append committed before
    -- this one took the counter is visible here.
    SELECT a.position, a.tag, a.name, a.value INTO hit
    FROM unnest(c_tags, c_names, c_values) AS c(tag, name, value)
    CROSS JOIN LATERAL (
        SELECT x.position, x.tag, x.name, x.value FROM es_attributes x
        WHERE x.store = p_store AND x.name = c.name AND x.value = c.value AND x.tag = c.tag
          AND x.position > p_after
        ORDER BY x.position
        LIMIT 1
    ) AS a
    ORDER BY a.position
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'append conflicts with its guard' USING
            ERRCODE = 'ES409',
            DETAIL = json_build_object('position', hit.position, 'tag', hit.tag,
                                       'name', hit.name, 'value', hit.value)::text;
    END IF;

    RETURN QUERY
    WITH e AS (
        INSERT INTO es_events (store, position, tag, payload)
        SELECT p_store, base + u.ord - 1, u.tag, u.payload::jsonb
        FROM unnest(p_tags, p_payloads) WITH ORDINALITY AS u(tag, payload, ord)
        RETURNING es_events.position, es_events.created_at
    ), a AS (
        INSERT INTO es_attributes (store, position, name, value, tag)
        SELECT p_store, base + v.idx - 1, v.name, v.value, v.tag
        FROM unnest(p_idx, p_names, p_values, p_attr_tags) AS v(idx, name, value, tag)
    )
    SELECT e.position, e.created_at FROM e ORDER BY e.position;
END
$fn$;
