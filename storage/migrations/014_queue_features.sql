-- Queue features: delayed delivery, priorities, per-key and rate limits,
-- pause, cancel, job results.
--
-- A job published with a delay (or deliver_at) or a priority other than 0 is
-- inserted `detached` with `visible_at` = its delivery time: the takes find it
-- through its own visibility (never through the frontier's range leases), so
-- it is not taken before that time. A release without this migration's code
-- takes such a job at its time too, and ignores its priority.
ALTER TABLE queue_jobs ADD COLUMN priority integer NOT NULL DEFAULT 0;
-- A job cancelled while taken: its ack still works; nothing takes it again
-- (a take deletes it once its lease runs out or it is nacked).
ALTER TABLE queue_jobs ADD COLUMN cancelled boolean NOT NULL DEFAULT false;

-- Due detached jobs, higher priority first, then by visibility.
CREATE INDEX queue_jobs_due ON queue_jobs (topic, priority DESC, visible_at) WHERE detached AND NOT cancelled;
CREATE INDEX queue_jobs_cancelled ON queue_jobs (topic, visible_at) WHERE cancelled;

-- Per-queue settings shared by every process (a topic without a row has none).
CREATE TABLE queue_settings (
    topic                  text PRIMARY KEY REFERENCES topics (name) ON DELETE CASCADE,
    paused                 boolean NOT NULL DEFAULT false,
    max_in_flight_per_key  integer NULL CHECK (max_in_flight_per_key IS NULL OR max_in_flight_per_key > 0),
    rate_limit             integer NULL CHECK (rate_limit IS NULL OR rate_limit > 0),  -- jobs per rate_per seconds
    rate_per               double precision NULL CHECK (rate_per IS NULL OR rate_per > 0),
    result_ttl             double precision NOT NULL DEFAULT 86400
);

-- The takes of a rate-limited queue within its window (a sliding window,
-- exact across processes: limited takes run one at a time under the
-- settings row's lock, see storage/queues.py).
CREATE TABLE queue_take_log (
    topic  text NOT NULL REFERENCES topics (name) ON DELETE CASCADE,
    at     timestamptz NOT NULL,
    n      integer NOT NULL
);
CREATE INDEX queue_take_log_at ON queue_take_log (topic, at);

-- What became of a job: its ack's result, its dead-lettering, its cancel.
CREATE TABLE queue_results (
    partition_id  bigint NOT NULL REFERENCES partitions (id) ON DELETE CASCADE,
    "offset"      bigint NOT NULL,
    topic         text NOT NULL,
    status        text NOT NULL CHECK (status IN ('done', 'failed', 'cancelled')),
    result        jsonb NULL,
    errors        jsonb NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (partition_id, "offset")
);
CREATE INDEX queue_results_expiry ON queue_results (expires_at);
