-- Concurrency limits, pools and priorities. A run carries what its spec (and its submission)
-- asked for: its tasks' priority, the key and limit of its pipeline's `concurrency:`, and the
-- pool it takes a slot of. A run holds its concurrency place and its pool slot while it is
-- `running`: from its first claim until it ends. The claim starts a queued run only while both
-- have room (`claim_task` below).
ALTER TABLE runs ADD COLUMN priority BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN concurrency_key TEXT;
ALTER TABLE runs ADD COLUMN concurrency_limit BIGINT CHECK (concurrency_limit >= 1);
ALTER TABLE runs ADD COLUMN concurrency_overflow TEXT
    CHECK (concurrency_overflow IN ('queue', 'skip', 'cancel-previous'));
ALTER TABLE runs ADD COLUMN pool TEXT;
-- "How many runs of this pipeline / this pool are running?" without scanning finished runs.
CREATE INDEX runs_concurrency_running ON runs (concurrency_key) WHERE state = 'running';
CREATE INDEX runs_pool_running ON runs (pool) WHERE state = 'running';
-- The live runs of a pipeline, for `skip` and `cancel-previous` at submission.
CREATE INDEX runs_concurrency_live ON runs (concurrency_key, id) WHERE state IN ('queued', 'running');

-- Named pools of run slots shared across pipelines, defined by the server
-- (`shardline server --pool NAME=SLOTS`). A pool without a row has no slots.
CREATE TABLE pools (
    name        TEXT PRIMARY KEY,
    slots       BIGINT NOT NULL CHECK (slots >= 0),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- A firing that started no run because its pipeline was at its limit (`overflow: skip`):
-- why, e.g. "skipped: pipeline nightly at its limit 1 (live: run 12)". Such a firing is done.
ALTER TABLE trigger_firings ADD COLUMN skipped TEXT;

-- The claim, as before, except that a task of a queued run is leased only if the run may start:
-- fewer running runs of its pipeline than its limit, and a free slot in its pool. The walk over
-- `tasks_claimable` checks that on the snapshot; a run that would start is then checked again
-- under transaction-scoped advisory locks on its pipeline and its pool (taken in that order
-- by every claimer), each check a statement of its own and so seeing every start committed
-- before the lock was granted: two claimers never both start a run past a limit. A run that
-- fails the check is left out and the walk goes on.
CREATE OR REPLACE FUNCTION claim_task(p_worker BIGINT, p_cpus BIGINT, p_memory BIGINT, p_gpus BIGINT,
                                      p_scratch BIGINT, p_ttl_ms BIGINT)
RETURNS SETOF tasks
LANGUAGE plpgsql
SET enable_bitmapscan = off
SET enable_seqscan = off
SET enable_sort = off
AS $$
DECLARE
    v_worker  TEXT;
    v_task    tasks;
    v_id      BIGINT;
    v_run_id  BIGINT;
    v_run     runs;
    v_skip    BIGINT[] := '{}';
    v_ok      BOOLEAN;
    v_now     TIMESTAMPTZ;
BEGIN
    SELECT name INTO v_worker FROM workers WHERE id = p_worker;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'worker % not found', p_worker USING ERRCODE = 'SLW01';
    END IF;
    LOOP
        SELECT t.id, t.run_id INTO v_id, v_run_id FROM tasks t JOIN runs r ON r.id = t.run_id
        WHERE t.state = 'ready' AND t.ready_at <= now()
          AND t.cpus <= p_cpus AND t.memory <= p_memory AND t.gpus <= p_gpus AND t.scratch <= p_scratch
          AND NOT (t.run_id = ANY (v_skip))
          AND (r.state = 'running'
               OR ((r.concurrency_limit IS NULL
                    OR (SELECT count(*) FROM runs x
                        WHERE x.concurrency_key = r.concurrency_key AND x.state = 'running') < r.concurrency_limit)
                   AND (r.pool IS NULL
                    OR (SELECT count(*) FROM runs x WHERE x.pool = r.pool AND x.state = 'running')
                       < COALESCE((SELECT slots FROM pools WHERE name = r.pool), 0))))
        ORDER BY t.priority DESC, t.ready_at, t.id
        LIMIT 1
        FOR UPDATE OF t SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        SELECT * INTO v_run FROM runs WHERE id = v_run_id;
        IF v_run.state = 'queued' AND (v_run.concurrency_limit IS NOT NULL OR v_run.pool IS NOT NULL) THEN
            IF v_run.concurrency_limit IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(hashtext('shardline.concurrency:' || v_run.concurrency_key));
            END IF;
            IF v_run.pool IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(hashtext('shardline.pool:' || v_run.pool));
            END IF;
            SELECT (v_run.concurrency_limit IS NULL
                    OR (SELECT count(*) FROM runs x
                        WHERE x.concurrency_key = v_run.concurrency_key AND x.state = 'running')
                       < v_run.concurrency_limit)
               AND (v_run.pool IS NULL
                    OR (SELECT count(*) FROM runs x WHERE x.pool = v_run.pool AND x.state = 'running')
                       < COALESCE((SELECT slots FROM pools WHERE name = v_run.pool), 0))
               -- Started (or ended) meanwhile by another claimer: then it needs no room of its own.
               OR (SELECT state FROM runs WHERE id = v_run.id) <> 'queued'
            INTO v_ok;
            IF NOT v_ok THEN
                v_skip := v_skip || v_run.id;
                CONTINUE;
            END IF;
        END IF;
        EXIT;
    END LOOP;
    -- The grant's time is read now, not at the statement's start (`now()`): a run started here
    -- after waiting for a lock, or after seeing another run end, never appears to have started
    -- before that run ended.
    v_now := clock_timestamp();
    UPDATE tasks t SET state = 'leased', attempt = t.attempt + 1, lease_owner = p_worker,
        lease_token = t.lease_token + 1, leased_at = v_now, heartbeat_at = v_now, progress = NULL,
        updated_at = v_now,
        lease_expires_at = v_now + (CASE WHEN t.timeout_ms > 0 AND t.timeout_ms < p_ttl_ms
                                         THEN t.timeout_ms ELSE p_ttl_ms END) * interval '1 millisecond'
    WHERE t.id = v_id AND t.state = 'ready'
    RETURNING t.* INTO v_task;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO attempts (task_id, token, attempt, run_id, worker_id, worker_name, started_at, ready_at)
    VALUES (v_task.id, v_task.lease_token, v_task.attempt, v_task.run_id, p_worker, v_worker, v_now,
            v_task.ready_at);
    INSERT INTO events (run_id, task_id, state, attempt)
    VALUES (v_task.run_id, v_task.id, 'leased', v_task.attempt);
    WITH r AS (
        UPDATE runs SET state = 'running', started_at = v_now, updated_at = v_now
        WHERE id = v_task.run_id AND state = 'queued' RETURNING id)
    INSERT INTO events (run_id, state) SELECT id, 'running' FROM r;
    RETURN NEXT v_task;
END
$$;

-- A run that stops running frees its pipeline's place and its pool slot: wake idle claimers,
-- whatever path ended it (a success, a failure, a cancel), as tasks becoming ready do.
CREATE FUNCTION notify_run_ended() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('shardline_work', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_limit_freed AFTER UPDATE OF state ON runs
    FOR EACH ROW
    WHEN (OLD.state = 'running' AND NEW.state <> 'running'
          AND (NEW.concurrency_key IS NOT NULL OR NEW.pool IS NOT NULL))
    EXECUTE FUNCTION notify_run_ended();
