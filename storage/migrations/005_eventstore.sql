-- The event store: one globally ordered log per store, every scalar attribute
-- indexed as a (name, value) pair, and consumer groups with attribute partitions.

-- One row per store. `next_position` is the counter taken (row-locked) in each
-- appending transaction: positions are dense and become visible in position
-- order, and a guarded append checks for conflicts while holding that lock.
CREATE TABLE es_stores (
    name           text PRIMARY KEY,
    next_position  bigint NOT NULL DEFAULT 1,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE es_events (
    store       text NOT NULL,
    position    bigint NOT NULL,
    tag         text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (store, position)
);

-- One row per scalar attribute of each event. The primary key serves scans by
-- position (partition discovery, conditional-AND checks); the lookup index
-- serves guards, ad-hoc reads and partition fetches by (name, value).
CREATE TABLE es_attributes (
    store     text NOT NULL,
    position  bigint NOT NULL,
    name      text NOT NULL,
    value     text NOT NULL,
    tag       text NOT NULL,
    PRIMARY KEY (store, position, name)
);
CREATE INDEX es_attributes_lookup ON es_attributes (store, name, value, tag, position);

-- Consumer groups of a store. status: active | stopped | failed (after a
-- partition exhausted its retries; error_context says which and why).
CREATE TABLE es_groups (
    store          text NOT NULL,
    name           text NOT NULL,
    status         text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'stopped', 'failed')),
    error_context  jsonb NULL,
    max_attempts   integer NOT NULL DEFAULT 5,
    retry_backoff  double precision NOT NULL DEFAULT 1.0,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (store, name)
);

-- How far partition discovery has scanned the log, per group and partition_by
-- list, so each claim only looks at events appended since the last scan.
CREATE TABLE es_scans (
    store         text NOT NULL,
    group_name    text NOT NULL,
    partition_by  text[] NOT NULL,
    scanned       bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (store, group_name, partition_by),
    FOREIGN KEY (store, group_name) REFERENCES es_groups (store, name) ON DELETE CASCADE
);

-- One cursor per (group, partition). `position` is the last handled position.
-- `next_position` is a lower bound of the earliest pending handled event (NULL:
-- none known), kept up to date by discovery so that finding the next partition
-- to claim is one index probe; `bumps` counts discovery updates so a claimer
-- never overwrites a hint lowered while it held the claim.
CREATE TABLE es_offsets (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    store            text NOT NULL,
    group_name       text NOT NULL,
    names            text[] NOT NULL,
    vals             text[] NOT NULL,
    partition_key    text NOT NULL,
    position         bigint NOT NULL DEFAULT 0,
    next_position    bigint NULL,
    bumps            bigint NOT NULL DEFAULT 0,
    claimed_by       text NULL,
    claimed_at       timestamptz NULL,
    claim_bumps      bigint NULL,
    attempts         integer NOT NULL DEFAULT 0,
    retry_at         timestamptz NULL,
    last_error       text NULL,
    UNIQUE (store, group_name, names, vals),
    FOREIGN KEY (store, group_name) REFERENCES es_groups (store, name) ON DELETE CASCADE
);
-- "The partition with the earliest pending event": claimed rows stay in the
-- index (a claim whose worker stopped heartbeating is claimable again).
CREATE INDEX es_offsets_pending ON es_offsets (store, group_name, names, next_position, id)
    WHERE next_position IS NOT NULL;
CREATE INDEX es_offsets_claimed ON es_offsets (store, claimed_by) WHERE claimed_by IS NOT NULL;

-- The (name, value) pairs of each cursor's partition: discovery finds the
-- partitions a new event touches through this index.
CREATE TABLE es_offset_keys (
    offset_id   bigint NOT NULL REFERENCES es_offsets (id) ON DELETE CASCADE,
    store       text NOT NULL,
    group_name  text NOT NULL,
    name        text NOT NULL,
    value       text NOT NULL,
    PRIMARY KEY (offset_id, name)
);
CREATE INDEX es_offset_keys_lookup ON es_offset_keys (store, group_name, name, value);

-- A guarded append in one round trip: take the positions (locking the
-- store's counter until commit), look for an event matching any condition
-- (tag, name, value) after p_after, and insert only if there is none. In a
-- VOLATILE function each statement takes a fresh snapshot, so the check,
-- which runs after the lock is held, sees every append committed before.
-- A conflict raises SQLSTATE ES409 (its DETAIL is the conflicting event as
-- JSON), which rolls back the counter too: nothing is written.
CREATE FUNCTION es_append_guarded(
    p_store text, p_tags text[], p_payloads text[],
    p_idx bigint[], p_names text[], p_values text[], p_attr_tags text[],
    c_tags text[], c_names text[], c_values text[], p_after bigint
) RETURNS TABLE (pos bigint, created timestamptz)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    n bigint := cardinality(p_tags);
    base bigint;
    hit record;
BEGIN
    INSERT INTO es_stores AS s (name, next_position) VALUES (p_store, 1 + n)
    ON CONFLICT (name) DO UPDATE SET next_position = s.next_position + n
    RETURNING s.next_position - n INTO base;

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

    INSERT INTO es_events (store, position, tag, payload)
    SELECT p_store, base + u.ord - 1, u.tag, u.payload::jsonb
    FROM unnest(p_tags, p_payloads) WITH ORDINALITY AS u(tag, payload, ord);
    INSERT INTO es_attributes (store, position, name, value, tag)
    SELECT p_store, base + v.idx - 1, v.name, v.value, v.tag
    FROM unnest(p_idx, p_names, p_values, p_attr_tags) AS v(idx, name, value, tag);

    RETURN QUERY
    SELECT e.position, e.created_at FROM es_events e
    WHERE e.store = p_store AND e.position >= base AND e.position < base + n
    ORDER BY e.position;
END
$fn$;
