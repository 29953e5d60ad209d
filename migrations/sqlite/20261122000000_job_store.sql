-- The Shardline job store on SQLite (the embedded default). Same tables and meaning as
-- migrations/postgres; times are INTEGER milliseconds since the Unix epoch from SQLite's clock
-- (`unixepoch('subsec')`), JSON is TEXT. Writers are serialized (BEGIN IMMEDIATE), so an
-- AUTOINCREMENT id is already commit-ordered and `events.id` is assigned on insert.

CREATE TABLE pipelines (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT NOT NULL,
    spec_text   TEXT NOT NULL,
    spec_hash   TEXT NOT NULL,
    created_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE (name, spec_hash)
) STRICT;

CREATE TABLE runs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    pipeline_id  INTEGER NOT NULL REFERENCES pipelines (id),
    state        TEXT NOT NULL DEFAULT 'queued'
                 CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    params       TEXT NOT NULL,
    spec         TEXT NOT NULL,
    plan         TEXT,
    dedupe_key   TEXT,
    error        TEXT,
    -- Tasks not yet succeeded: +1 per task added, -1 per success (under this row's lock),
    -- recounted by retry_run. Zero ends the run without scanning its tasks.
    open_tasks   INTEGER NOT NULL DEFAULT 0,
    created_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    started_at   INTEGER,
    finished_at  INTEGER,
    updated_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;
CREATE UNIQUE INDEX runs_dedupe_key_live ON runs (dedupe_key)
    WHERE dedupe_key IS NOT NULL AND state IN ('queued', 'running', 'succeeded');
CREATE INDEX runs_state ON runs (state, id);
CREATE INDEX runs_pipeline ON runs (pipeline_id, id);

CREATE TABLE workers (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    name            TEXT NOT NULL,
    resources       TEXT NOT NULL,
    gpus            TEXT NOT NULL,
    state           TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'stopped')),
    registered_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    last_heartbeat  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;

CREATE TABLE tasks (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id            INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    name              TEXT NOT NULL,
    step_id           TEXT NOT NULL,
    kind              TEXT NOT NULL,
    state             TEXT NOT NULL
                      CHECK (state IN ('blocked', 'ready', 'leased', 'succeeded', 'failed', 'cancelled')),
    priority          INTEGER NOT NULL DEFAULT 0,
    cpus              INTEGER NOT NULL CHECK (cpus >= 0),
    memory            INTEGER NOT NULL CHECK (memory >= 0),
    gpus              INTEGER NOT NULL CHECK (gpus >= 0),
    scratch           INTEGER NOT NULL CHECK (scratch >= 0),
    payload           TEXT NOT NULL,
    output            TEXT,
    progress          TEXT,
    attempt           INTEGER NOT NULL DEFAULT 0,
    attempt_base      INTEGER NOT NULL DEFAULT 0,
    max_attempts      INTEGER NOT NULL CHECK (max_attempts >= 1),
    backoff_ms        INTEGER NOT NULL CHECK (backoff_ms >= 0),
    timeout_ms        INTEGER NOT NULL CHECK (timeout_ms >= 0),
    ready_at          INTEGER,
    lease_owner       INTEGER REFERENCES workers (id) ON DELETE SET NULL,
    lease_token       INTEGER NOT NULL DEFAULT 0,
    leased_at         INTEGER,
    lease_expires_at  INTEGER,
    heartbeat_at      INTEGER,
    cache_key         TEXT,
    error             TEXT,
    created_at        INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    finished_at       INTEGER,
    updated_at        INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE (run_id, name)
) STRICT;
CREATE INDEX tasks_claimable ON tasks (priority DESC, ready_at, id) WHERE state = 'ready';
CREATE INDEX tasks_lease_expiry ON tasks (lease_expires_at) WHERE state = 'leased';
CREATE INDEX tasks_unfinished ON tasks (run_id) WHERE state <> 'succeeded';

CREATE TABLE task_deps (
    task_id   INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    needs_id  INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    PRIMARY KEY (task_id, needs_id),
    CHECK (task_id <> needs_id)
) STRICT, WITHOUT ROWID;
CREATE INDEX task_deps_needs ON task_deps (needs_id);

CREATE TABLE attempts (
    task_id      INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    token        INTEGER NOT NULL,
    attempt      INTEGER NOT NULL,
    run_id       INTEGER NOT NULL,
    worker_id    INTEGER,
    worker_name  TEXT NOT NULL,
    started_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    ended_at     INTEGER,
    outcome      TEXT CHECK (outcome IN ('succeeded', 'failed', 'expired', 'timed_out', 'cancelled')),
    error        TEXT,
    PRIMARY KEY (task_id, token)
) STRICT;
CREATE INDEX attempts_open ON attempts (run_id) WHERE outcome IS NULL;

CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      INTEGER NOT NULL,
    task_id     INTEGER,
    state       TEXT NOT NULL,
    attempt     INTEGER,
    message     TEXT,
    created_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;

CREATE TABLE logs (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id  INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    run_id   INTEGER NOT NULL,
    attempt  INTEGER NOT NULL,
    ts       INTEGER NOT NULL,
    stream   TEXT NOT NULL CHECK (stream IN ('stdout', 'stderr', 'system')),
    line     TEXT NOT NULL
) STRICT;
CREATE INDEX logs_task ON logs (task_id, id);
CREATE INDEX logs_run ON logs (run_id, id);

CREATE TABLE cache (
    key         TEXT PRIMARY KEY,
    output      TEXT NOT NULL,
    created_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;
