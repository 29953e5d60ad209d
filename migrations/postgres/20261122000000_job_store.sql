-- The Shardline job store on PostgreSQL.
-- `Store::connect` creates the schema `shardline` and sets `search_path` to it on every
-- connection, so every object below (and sqlx's own `_sqlx_migrations`) lives in that schema.
-- Times are `timestamptz` from the server clock (`now()`); leases are judged by that clock only.

-- One row per version of a pipeline spec: a run points at the exact spec text it was built from.
CREATE TABLE pipelines (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        TEXT NOT NULL,
    spec_text   TEXT NOT NULL,
    spec_hash   TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (name, spec_hash)
);

CREATE TABLE runs (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pipeline_id  BIGINT NOT NULL REFERENCES pipelines (id),
    state        TEXT NOT NULL DEFAULT 'queued'
                 CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    params       JSONB NOT NULL,
    spec         JSONB NOT NULL,
    plan         JSONB,
    dedupe_key   TEXT,
    error        TEXT,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    started_at   TIMESTAMPTZ,
    finished_at  TIMESTAMPTZ,
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Idempotent submission: while a run with this key is queued, running or succeeded, an identical
-- submission returns it; once it failed or was cancelled, a new run may take the key.
CREATE UNIQUE INDEX runs_dedupe_key_live ON runs (dedupe_key)
    WHERE dedupe_key IS NOT NULL AND state IN ('queued', 'running', 'succeeded');
CREATE INDEX runs_state ON runs (state, id);
CREATE INDEX runs_pipeline ON runs (pipeline_id, id);

CREATE TABLE workers (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name            TEXT NOT NULL,
    resources       JSONB NOT NULL,   -- {"cpus", "memory", "gpus", "scratch"} at registration
    gpus            JSONB NOT NULL,   -- device indices, e.g. [0, 1]
    state           TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'stopped')),
    registered_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_heartbeat  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE tasks (
    id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id            BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    name              TEXT NOT NULL,
    step_id           TEXT NOT NULL,
    kind              TEXT NOT NULL,
    state             TEXT NOT NULL
                      CHECK (state IN ('blocked', 'ready', 'leased', 'succeeded', 'failed', 'cancelled')),
    priority          BIGINT NOT NULL DEFAULT 0,
    cpus              BIGINT NOT NULL CHECK (cpus >= 0),
    memory            BIGINT NOT NULL CHECK (memory >= 0),
    gpus              BIGINT NOT NULL CHECK (gpus >= 0),
    scratch           BIGINT NOT NULL CHECK (scratch >= 0),
    payload           JSONB NOT NULL,
    output            JSONB,
    progress          JSONB,
    -- Attempts started so far (never reset, so (task, attempt) names one attempt for ever);
    -- attempts counted against max_attempts are attempt - attempt_base (retry_run moves the base).
    attempt           BIGINT NOT NULL DEFAULT 0,
    attempt_base      BIGINT NOT NULL DEFAULT 0,
    max_attempts      BIGINT NOT NULL CHECK (max_attempts >= 1),
    backoff_ms        BIGINT NOT NULL CHECK (backoff_ms >= 0),
    timeout_ms        BIGINT NOT NULL CHECK (timeout_ms >= 0),   -- 0: no limit
    ready_at          TIMESTAMPTZ,        -- when it became (or becomes, after a backoff) claimable
    lease_owner       BIGINT REFERENCES workers (id) ON DELETE SET NULL,
    lease_token       BIGINT NOT NULL DEFAULT 0,   -- fencing token: +1 on every claim, never reset
    leased_at         TIMESTAMPTZ,
    lease_expires_at  TIMESTAMPTZ,
    heartbeat_at      TIMESTAMPTZ,
    cache_key         TEXT,
    error             TEXT,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at       TIMESTAMPTZ,
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (run_id, name)
);
-- The claim walks this index in claim order and stops at the first row that fits and is unlocked.
CREATE INDEX tasks_claimable ON tasks (priority DESC, ready_at, id) WHERE state = 'ready';
CREATE INDEX tasks_lease_expiry ON tasks (lease_expires_at) WHERE state = 'leased';
-- "Is anything of this run still unfinished?" stays cheap however many tasks have succeeded.
CREATE INDEX tasks_unfinished ON tasks (run_id) WHERE state <> 'succeeded';

-- Edges of the task graph: task_id waits for needs_id.
CREATE TABLE task_deps (
    task_id   BIGINT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    needs_id  BIGINT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    PRIMARY KEY (task_id, needs_id),
    CHECK (task_id <> needs_id)
);
CREATE INDEX task_deps_needs ON task_deps (needs_id);

-- One row per lease ever granted; kept when the worker row is gone (no foreign key to workers).
CREATE TABLE attempts (
    task_id      BIGINT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    token        BIGINT NOT NULL,
    attempt      BIGINT NOT NULL,
    run_id       BIGINT NOT NULL,
    worker_id    BIGINT,
    worker_name  TEXT NOT NULL,
    started_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    ended_at     TIMESTAMPTZ,
    outcome      TEXT CHECK (outcome IN ('succeeded', 'failed', 'expired', 'timed_out', 'cancelled')),
    error        TEXT,
    PRIMARY KEY (task_id, token)
);
CREATE INDEX attempts_open ON attempts (run_id) WHERE outcome IS NULL;

-- State changes of runs and tasks, in one total order for the dashboard and SSE.
-- `seq` is the insertion order, which concurrent transactions may commit out of. `id` is the
-- published order: `Store::events_after` numbers committed rows that have none yet (in `seq`
-- order, after the highest id so far, one publisher at a time), so a row that commits late
-- gets a later id and a reader that follows `id` never skips one.
CREATE TABLE events (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id          BIGINT UNIQUE,
    run_id      BIGINT NOT NULL,
    task_id     BIGINT,
    state       TEXT NOT NULL,
    attempt     BIGINT,
    message     TEXT,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX events_unpublished ON events (seq) WHERE id IS NULL;

-- Task output, kept for ever and independent of workers.
CREATE TABLE logs (
    id       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id  BIGINT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    run_id   BIGINT NOT NULL,
    attempt  BIGINT NOT NULL,
    ts       TIMESTAMPTZ NOT NULL,
    stream   TEXT NOT NULL CHECK (stream IN ('stdout', 'stderr', 'system')),
    line     TEXT NOT NULL
);
CREATE INDEX logs_task ON logs (task_id, id);
CREATE INDEX logs_run ON logs (run_id, id);

-- Content-addressed step outputs.
CREATE TABLE cache (
    key         TEXT PRIMARY KEY,
    output      JSONB NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
