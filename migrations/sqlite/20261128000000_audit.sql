-- Audit: who submitted a run, and who cancelled or retried it. Actors are strings:
-- `token:<name>` (the HTTP API token that authorized the request), `user:<login>@<host>` (the
-- local CLI), `trigger:<pipeline>#<position>` (a trigger's firing). Runs made before this
-- migration have no submitter (NULL) and no recorded actions.
ALTER TABLE runs ADD COLUMN submitted_by TEXT;

-- One row per cancel or retry, in the transaction that did it: a run retried twice has two.
CREATE TABLE run_actions (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id  INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    action  TEXT NOT NULL CHECK (action IN ('cancel', 'retry')),
    actor   TEXT NOT NULL,
    at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
) STRICT;
CREATE INDEX run_actions_run ON run_actions (run_id, id);

-- A run's attempts for its page (timeline, attempts table), without scanning every attempt.
CREATE INDEX attempts_run ON attempts (run_id, task_id, token);
