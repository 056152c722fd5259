-- Periodic jobs: one row per named schedule, and one scheduler leader per schema.
--
-- `last_tick` is the last tick the schedule is done with (published, or skipped
-- by its catch_up policy). A tick's publish and the advance of `last_tick`
-- commit in one transaction, and the advance is a compare-and-set on the value
-- read before: a tick is published once even if two processes ever fired it.
CREATE TABLE schedules (
    name        text PRIMARY KEY,
    cron        text NOT NULL,
    topic       text NOT NULL,
    payload     bytea,
    timezone    text NOT NULL,
    catch_up    text NOT NULL CHECK (catch_up IN ('one', 'none', 'all')),
    last_tick   timestamptz NOT NULL,
    defined_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The single row of the scheduler's lease: only its holder fires ticks. A
-- leader that dies is replaced once `expires_at` has passed.
CREATE TABLE scheduler_lease (
    id          boolean PRIMARY KEY DEFAULT true CHECK (id),
    owner       text NOT NULL,
    epoch       bigint NOT NULL,
    expires_at  timestamptz NOT NULL
);
