-- Notifications: webhooks told when a run finishes (succeeded, failed, cancelled) or a trigger
-- starts failing. Targets are copied when a run is submitted (`run_notify_targets`), when a
-- server registers a pipeline's triggers (`pipeline_notify_targets`) and when a server starts
-- (`notify_defaults`, its `--notify`); `notifications` is the outbox the servers deliver from.
-- `events` lists the events a target wants between commas (`,failed,succeeded,`).
CREATE TABLE run_notify_targets (
    run_id    BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    position  BIGINT NOT NULL CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    PRIMARY KEY (run_id, position)
);

CREATE TABLE pipeline_notify_targets (
    pipeline  TEXT NOT NULL,
    position  BIGINT NOT NULL CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    PRIMARY KEY (pipeline, position)
);

CREATE TABLE notify_defaults (
    position  BIGINT PRIMARY KEY CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack'))
);

-- One row per (finish or error streak, URL): `dedupe_key` makes a second insert for the same
-- finish a no-op, whichever transaction or server tries. A lease (`lease_until`, fenced by
-- `lease_token`) keeps two servers from sending one row at once.
CREATE TABLE notifications (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dedupe_key      TEXT NOT NULL UNIQUE,
    run_id          BIGINT REFERENCES runs (id) ON DELETE CASCADE,
    trigger_id      BIGINT,
    event           TEXT NOT NULL CHECK (event IN ('succeeded', 'failed', 'cancelled', 'trigger-error')),
    url             TEXT NOT NULL,
    format          TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    detail          TEXT,
    state           TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts        BIGINT NOT NULL DEFAULT 0,
    next_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_until     TIMESTAMPTZ,
    lease_token     BIGINT NOT NULL DEFAULT 0,
    last_status     BIGINT,
    last_error      TEXT,
    last_attempt_at TIMESTAMPTZ,
    delivered_at    TIMESTAMPTZ,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX notifications_due ON notifications (next_at, id) WHERE state = 'pending';
CREATE INDEX notifications_run ON notifications (run_id, id);

-- Every path that finishes a run (a last success, a failure, a cancel, the reaper) updates its
-- state; this trigger enqueues in that same statement, so no path can forget it.
CREATE FUNCTION enqueue_run_notifications() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO notifications (dedupe_key, run_id, event, url, format)
    SELECT 'run:' || NEW.id || ':' || NEW.state || ':' || t.url, NEW.id, NEW.state, t.url, t.format
    FROM (SELECT url, format, events, 0 AS src, position FROM run_notify_targets WHERE run_id = NEW.id
          UNION ALL
          SELECT url, format, events, 1 AS src, position FROM notify_defaults) t
    WHERE t.events LIKE '%,' || NEW.state || ',%'
    ORDER BY t.src, t.position
    ON CONFLICT (dedupe_key) DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_notify AFTER UPDATE OF state ON runs FOR EACH ROW
    WHEN (NEW.state IN ('succeeded', 'failed', 'cancelled') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION enqueue_run_notifications();

-- A trigger's first error after a success (or ever) starts an error streak: one notification.
CREATE FUNCTION enqueue_trigger_notifications() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO notifications (dedupe_key, trigger_id, event, url, format, detail)
    SELECT 'trigger:' || NEW.id || ':' || extract(epoch FROM NEW.last_error_at)::text || ':' || t.url,
           NEW.id, 'trigger-error', t.url, t.format, NEW.pipeline
    FROM (SELECT url, format, events, 0 AS src, position FROM pipeline_notify_targets WHERE pipeline = NEW.pipeline
          UNION ALL
          SELECT url, format, events, 1 AS src, position FROM notify_defaults) t
    WHERE t.events LIKE '%,trigger-error,%'
    ORDER BY t.src, t.position
    ON CONFLICT (dedupe_key) DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER triggers_notify AFTER UPDATE OF errors ON triggers FOR EACH ROW
    WHEN (NEW.errors = 1 AND OLD.errors = 0)
    EXECUTE FUNCTION enqueue_trigger_notifications();
