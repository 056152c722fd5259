-- Durable workflows: one row per run, one row per recorded step, the runs'
-- inboxes (send/recv) and their published events (set_event/get_event).
--
-- A run is executed by one process at a time: the one whose claim bumped
-- `epoch` last and whose `lease_until` has not passed. Every write an executor
-- makes (a step record, the run's outcome) checks that epoch in the same
-- statement, so an executor that lost its run writes nothing. A step record is
-- written once: its primary key (workflow_id, seq) refuses a second one, which
-- is what makes a transaction step (the user's writes and the record in one
-- transaction) exactly once.
CREATE TABLE workflow_runs (
    workflow_id  text PRIMARY KEY,
    name         text NOT NULL,
    version      text NOT NULL,
    queue        text NOT NULL,
    status       text NOT NULL CHECK (status IN ('pending', 'running', 'waiting', 'succeeded', 'failed', 'cancelled')),
    input        bytea NOT NULL,
    output       bytea NULL,
    error        text NULL,
    error_type   text NULL,
    parent_id    text NULL,
    epoch        bigint NOT NULL DEFAULT 0,
    owner        text NULL,
    lease_until  timestamptz NULL,
    wake_at      timestamptz NULL,
    executions   integer NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at  timestamptz NULL
);
CREATE INDEX workflow_runs_listing ON workflow_runs (name, created_at);
CREATE INDEX workflow_runs_status ON workflow_runs (status, created_at);
CREATE INDEX workflow_runs_lapsed ON workflow_runs (lease_until) WHERE status = 'running';
CREATE INDEX workflow_runs_parent ON workflow_runs (parent_id) WHERE parent_id IS NOT NULL;

CREATE TABLE workflow_steps (
    workflow_id  text NOT NULL REFERENCES workflow_runs (workflow_id) ON DELETE CASCADE,
    seq          integer NOT NULL,
    name         text NOT NULL,
    kind         text NOT NULL,
    output       bytea NULL,
    error        text NULL,
    attempts     integer NOT NULL DEFAULT 1,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (workflow_id, seq)
);

CREATE TABLE workflow_inbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workflow_id  text NOT NULL,
    topic        text NOT NULL,
    payload      bytea NOT NULL,
    consumed     boolean NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX workflow_inbox_pending ON workflow_inbox (workflow_id, topic, id) WHERE NOT consumed;

CREATE TABLE workflow_events (
    workflow_id  text NOT NULL,
    key          text NOT NULL,
    value        bytea NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (workflow_id, key)
);
