-- Notifications: same tables and meaning as migrations/postgres; times in milliseconds.
CREATE TABLE run_notify_targets (
    run_id    INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    position  INTEGER NOT NULL CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    PRIMARY KEY (run_id, position)
) STRICT;

CREATE TABLE pipeline_notify_targets (
    pipeline  TEXT NOT NULL,
    position  INTEGER NOT NULL CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    PRIMARY KEY (pipeline, position)
) STRICT;

CREATE TABLE notify_defaults (
    position  INTEGER PRIMARY KEY CHECK (position >= 0),
    url       TEXT NOT NULL,
    events    TEXT NOT NULL,
    format    TEXT NOT NULL CHECK (format IN ('json', 'slack'))
) STRICT;

CREATE TABLE notifications (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    dedupe_key      TEXT NOT NULL UNIQUE,
    run_id          INTEGER REFERENCES runs (id) ON DELETE CASCADE,
    trigger_id      INTEGER,
    event           TEXT NOT NULL CHECK (event IN ('succeeded', 'failed', 'cancelled', 'trigger-error')),
    url             TEXT NOT NULL,
    format          TEXT NOT NULL CHECK (format IN ('json', 'slack')),
    detail          TEXT,
    state           TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_at         INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    lease_until     INTEGER,
    lease_token     INTEGER NOT NULL DEFAULT 0,
    last_status     INTEGER,
    last_error      TEXT,
    last_attempt_at INTEGER,
    delivered_at    INTEGER,
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;
CREATE INDEX notifications_due ON notifications (next_at, id) WHERE state = 'pending';
CREATE INDEX notifications_run ON notifications (run_id, id);

-- Enqueued by the statement that finishes the run, whichever path it is (see postgres).
CREATE TRIGGER runs_notify AFTER UPDATE OF state ON runs
WHEN NEW.state IN ('succeeded', 'failed', 'cancelled') AND OLD.state IS NOT NEW.state
BEGIN
    INSERT OR IGNORE INTO notifications (dedupe_key, run_id, event, url, format)
    SELECT 'run:' || NEW.id || ':' || NEW.state || ':' || t.url, NEW.id, NEW.state, t.url, t.format
    FROM (SELECT url, format, events, 0 AS src, position FROM run_notify_targets WHERE run_id = NEW.id
          UNION ALL
          SELECT url, format, events, 1 AS src, position FROM notify_defaults) t
    WHERE t.events LIKE '%,' || NEW.state || ',%'
    ORDER BY t.src, t.position;
END;

CREATE TRIGGER triggers_notify AFTER UPDATE OF errors ON triggers
WHEN NEW.errors = 1 AND OLD.errors = 0
BEGIN
    INSERT OR IGNORE INTO notifications (dedupe_key, trigger_id, event, url, format, detail)
    SELECT 'trigger:' || NEW.id || ':' || NEW.last_error_at || ':' || t.url,
           NEW.id, 'trigger-error', t.url, t.format, NEW.pipeline
    FROM (SELECT url, format, events, 0 AS src, position FROM pipeline_notify_targets WHERE pipeline = NEW.pipeline
          UNION ALL
          SELECT url, format, events, 1 AS src, position FROM notify_defaults) t
    WHERE t.events LIKE '%,trigger-error,%'
    ORDER BY t.src, t.position;
END;
