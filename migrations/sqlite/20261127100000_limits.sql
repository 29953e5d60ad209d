-- Concurrency limits, pools and priorities. A run carries what its spec (and its submission)
-- asked for: its tasks' priority, the key and limit of its pipeline's `concurrency:`, and the
-- pool it takes a slot of. A run holds its concurrency place and its pool slot while it is
-- `running`: from its first claim until it ends. The claim starts a queued run only while both
-- have room (writers are serialized, so the check and the start are one step).
ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN concurrency_key TEXT;
ALTER TABLE runs ADD COLUMN concurrency_limit INTEGER CHECK (concurrency_limit >= 1);
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
    slots       INTEGER NOT NULL CHECK (slots >= 0),
    updated_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);

-- A firing that started no run because its pipeline was at its limit (`overflow: skip`):
-- why, e.g. "skipped: pipeline nightly at its limit 1 (live: run 12)". Such a firing is done.
ALTER TABLE trigger_firings ADD COLUMN skipped TEXT;
