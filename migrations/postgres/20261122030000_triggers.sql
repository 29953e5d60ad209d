-- Triggers: what starts runs without a submission (a pipeline spec's `triggers:`), and the
-- firings they made. A trigger is named by its pipeline and its position in the spec's list;
-- registering a changed spec for a position resets its state.
CREATE TABLE triggers (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pipeline       TEXT NOT NULL,
    position       BIGINT NOT NULL CHECK (position >= 0),
    kind           TEXT NOT NULL CHECK (kind IN ('schedule', 'watch')),
    -- The trigger as written (settings and params) and a one-line summary for listings.
    spec           JSONB NOT NULL,
    summary        TEXT NOT NULL,
    -- What the poller remembers between checks (ETags, the shas an author listing showed).
    state          JSONB NOT NULL DEFAULT '{}',
    last_check_at  TIMESTAMPTZ,
    next_at        TIMESTAMPTZ,
    last_sha       TEXT,
    last_fired_at  TIMESTAMPTZ,
    last_run_id    BIGINT REFERENCES runs (id) ON DELETE SET NULL,
    last_error     TEXT,
    last_error_at  TIMESTAMPTZ,
    -- Consecutive failed checks (the backoff exponent); 0 after a good one.
    errors         BIGINT NOT NULL DEFAULT 0,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (pipeline, position)
);

-- One row per dedupe key (`pipeline + repo + sha` for a watch, `pipeline + instant` for a
-- schedule), kept for ever: the first server to insert it starts the run, every other server
-- and every later check finds it. A claim without a run (its server died before submitting)
-- may be taken over once it is stale.
CREATE TABLE trigger_firings (
    dedupe_key  TEXT PRIMARY KEY,
    trigger_id  BIGINT NOT NULL,
    detail      JSONB NOT NULL,
    claimed_at  TIMESTAMPTZ NOT NULL,
    run_id      BIGINT REFERENCES runs (id) ON DELETE SET NULL,
    fired_at    TIMESTAMPTZ
);
CREATE INDEX trigger_firings_trigger ON trigger_firings (trigger_id, claimed_at);
