-- Triggers: what starts runs without a submission (a pipeline spec's `triggers:`), and the
-- firings they made. Same tables and meaning as migrations/postgres; times in milliseconds.
CREATE TABLE triggers (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    pipeline       TEXT NOT NULL,
    position       INTEGER NOT NULL CHECK (position >= 0),
    kind           TEXT NOT NULL CHECK (kind IN ('schedule', 'watch')),
    spec           TEXT NOT NULL,
    summary        TEXT NOT NULL,
    state          TEXT NOT NULL DEFAULT '{}',
    last_check_at  INTEGER,
    next_at        INTEGER,
    last_sha       TEXT,
    last_fired_at  INTEGER,
    last_run_id    INTEGER REFERENCES runs (id) ON DELETE SET NULL,
    last_error     TEXT,
    last_error_at  INTEGER,
    errors         INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    updated_at     INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE (pipeline, position)
) STRICT;

CREATE TABLE trigger_firings (
    dedupe_key  TEXT PRIMARY KEY,
    trigger_id  INTEGER NOT NULL,
    detail      TEXT NOT NULL,
    claimed_at  INTEGER NOT NULL,
    run_id      INTEGER REFERENCES runs (id) ON DELETE SET NULL,
    fired_at    INTEGER
) STRICT;
CREATE INDEX trigger_firings_trigger ON trigger_firings (trigger_id, claimed_at);
