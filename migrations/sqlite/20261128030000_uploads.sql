-- Multipart uploads a task opened in an object store (see the PostgreSQL migration).
CREATE TABLE uploads (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    task_id     INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    token       INTEGER NOT NULL,
    store_url   TEXT NOT NULL,
    object_key  TEXT NOT NULL,
    upload_id   TEXT NOT NULL,
    state       TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'completed', 'aborted')),
    created_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    ended_at    INTEGER
);
CREATE INDEX uploads_open ON uploads (run_id) WHERE state = 'open';
