-- Retention: what the gc of a state directory (`shardline gc`, and every worker between its
-- tasks) reads and writes. Additive: old rows keep working, nothing is dropped.

-- A run's own retention in milliseconds (its spec's `retention.runs`); NULL: the server's
-- `--retain-runs` alone.
ALTER TABLE runs ADD COLUMN retain_ms INTEGER CHECK (retain_ms >= 0);

-- The step cache's use: when an entry was last served or written (least recently used goes
-- first beyond `--cache-max`); `uses`, bumped by every hit and every write, so that a gc deletes
-- a row only if nobody used it since the gc looked; `tags`, a JSON array saying which runs may
-- hit it before they know its key (`step:<step hash>`, `url:<object-store URL>`,
-- `hub:<repository>`), so that a queued run protects what it will read.
ALTER TABLE cache ADD COLUMN last_used_at INTEGER;
ALTER TABLE cache ADD COLUMN uses INTEGER NOT NULL DEFAULT 0;
ALTER TABLE cache ADD COLUMN tags TEXT NOT NULL DEFAULT '[]';
UPDATE cache SET last_used_at = created_at;

-- The retention policy, one row, written by `shardline server` at its start from
-- `--retain-runs` and `--cache-max` (NULL: keep for ever / no limit) and read by every gc.
CREATE TABLE retention_policy (
    id               INTEGER PRIMARY KEY CHECK (id = 1),
    retain_runs_ms   INTEGER CHECK (retain_runs_ms >= 0),
    cache_max_bytes  INTEGER CHECK (cache_max_bytes >= 0),
    updated_at       INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;

-- What each state directory holds, as its last gc measured it (`reporter`: `<host>:<work dir>`;
-- each report replaces that reporter's rows): a run's work directory (`run`), a step cache
-- entry's directory (`cache`), an object-store download no cache row names (`download`).
CREATE TABLE disk_usage (
    reporter      TEXT NOT NULL,
    path          TEXT NOT NULL,
    kind          TEXT NOT NULL CHECK (kind IN ('run', 'cache', 'download')),
    run_id        INTEGER,
    cache_key     TEXT,
    bytes         INTEGER NOT NULL CHECK (bytes >= 0),
    last_used_at  INTEGER,
    measured_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (reporter, path)
) STRICT;
CREATE INDEX disk_usage_run ON disk_usage (run_id) WHERE run_id IS NOT NULL;
