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
    -- Tasks not yet succeeded: +1 per task added, -1 per success (under this row's lock),
    -- recounted by retry_run. Zero ends the run without scanning its tasks.
    open_tasks   BIGINT NOT NULL DEFAULT 0,
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

-- The claim (`Store::claim`) in one statement: lease the first ready task that fits, by
-- priority, readiness and id, skipping rows other claimers hold; record the attempt and the
-- events; a queued run becomes running. The planner settings make it walk `tasks_claimable`
-- in claim order and stop at the first fitting row whatever the statistics say (with stale
-- statistics it sorts every ready row instead, on every claim).
CREATE FUNCTION claim_task(p_worker BIGINT, p_cpus BIGINT, p_memory BIGINT, p_gpus BIGINT,
                           p_scratch BIGINT, p_ttl_ms BIGINT)
RETURNS SETOF tasks
LANGUAGE plpgsql
SET enable_bitmapscan = off
SET enable_seqscan = off
SET enable_sort = off
AS $$
DECLARE
    v_worker TEXT;
    v_task   tasks;
BEGIN
    SELECT name INTO v_worker FROM workers WHERE id = p_worker;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'worker % not found', p_worker USING ERRCODE = 'SLW01';
    END IF;
    WITH c AS (
        SELECT id FROM tasks
        WHERE state = 'ready' AND ready_at <= now()
          AND cpus <= p_cpus AND memory <= p_memory AND gpus <= p_gpus AND scratch <= p_scratch
        ORDER BY priority DESC, ready_at, id
        LIMIT 1
        FOR UPDATE SKIP LOCKED)
    UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, lease_owner = p_worker,
        lease_token = t.lease_token + 1, leased_at = now(), heartbeat_at = now(), progress = NULL,
        updated_at = now(),
        lease_expires_at = now() + (CASE WHEN t.timeout_ms > 0 AND t.timeout_ms < p_ttl_ms
                                         THEN t.timeout_ms ELSE p_ttl_ms END) * interval '1 millisecond'
    FROM c WHERE t.id = c.id
    RETURNING t.* INTO v_task;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO attempts (task_id, token, attempt, run_id, worker_id, worker_name, started_at)
    VALUES (v_task.id, v_task.lease_token, v_task.attempt, v_task.run_id, p_worker, v_worker, now());
    INSERT INTO events (run_id, task_id, state, attempt)
    VALUES (v_task.run_id, v_task.id, 'leased', v_task.attempt);
    WITH r AS (
        UPDATE runs SET state = 'running', started_at = now(), updated_at = now()
        WHERE id = v_task.run_id AND state = 'queued' RETURNING id)
    INSERT INTO events (run_id, state) SELECT id, 'running' FROM r;
    RETURN NEXT v_task;
END
$$;

-- A leased task's success in one statement (`Store::complete`): the guarded update, the
-- attempt, the events, the dependents that became ready, and the run's end. Every statement
-- of a plpgsql function gets a fresh snapshot, so the readiness check runs after the
-- dependents' locks are granted. Rows are locked tasks first, the run's row last (as
-- everywhere), and the run's row only for the O(1) update of its counter, right before the
-- commit, so completions of one run queue for each other only that long.
CREATE FUNCTION complete_succeeded(p_task BIGINT, p_token BIGINT, p_output JSONB)
RETURNS TABLE (accepted BOOLEAN, promoted BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    v_run      BIGINT;
    v_attempt  BIGINT;
    v_promoted BIGINT := 0;
    v_open     BIGINT;
    v_state    TEXT;
BEGIN
    UPDATE tasks SET state = 'succeeded', output = p_output, error = NULL, finished_at = now(),
                     lease_expires_at = NULL, updated_at = now()
    WHERE id = p_task AND lease_token = p_token AND state = 'leased'
    RETURNING run_id, attempt INTO v_run, v_attempt;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, 0::BIGINT;
        RETURN;
    END IF;
    UPDATE attempts SET ended_at = now(), outcome = 'succeeded'
    WHERE task_id = p_task AND token = p_token;
    INSERT INTO events (run_id, task_id, state, attempt) VALUES (v_run, p_task, 'succeeded', v_attempt);

    -- Lock the blocked dependents, then read their needs afresh: a need completing at the same
    -- time has committed by then (or waits for us and then sees our success).
    PERFORM 1 FROM tasks t JOIN task_deps d ON d.task_id = t.id
    WHERE d.needs_id = p_task AND t.state = 'blocked'
    ORDER BY t.id FOR UPDATE OF t;
    IF FOUND THEN
        WITH p AS (
            UPDATE tasks SET state = 'ready', ready_at = now(), updated_at = now()
            WHERE state = 'blocked' AND id IN (SELECT task_id FROM task_deps WHERE needs_id = p_task)
              AND NOT EXISTS (SELECT 1 FROM task_deps d JOIN tasks n ON n.id = d.needs_id
                              WHERE d.task_id = tasks.id AND n.state <> 'succeeded')
            RETURNING id, run_id, attempt)
        INSERT INTO events (run_id, task_id, state, attempt)
        SELECT run_id, id, 'ready', attempt FROM p ORDER BY id;
        GET DIAGNOSTICS v_promoted = ROW_COUNT;
        IF v_promoted > 0 THEN
            PERFORM pg_notify('shardline_work', '');
        END IF;
    END IF;

    UPDATE runs SET open_tasks = open_tasks - 1, updated_at = now()
    WHERE id = v_run RETURNING open_tasks, state INTO v_open, v_state;
    IF v_open <= 0 AND v_state IN ('queued', 'running') THEN
        WITH r AS (
            UPDATE runs SET state = 'succeeded', finished_at = now(), updated_at = now()
            WHERE id = v_run
              AND NOT EXISTS (SELECT 1 FROM tasks WHERE run_id = v_run AND state <> 'succeeded')
            RETURNING id)
        INSERT INTO events (run_id, state) SELECT id, 'succeeded' FROM r;
    END IF;
    RETURN QUERY SELECT true, v_promoted;
END
$$;
