-- Multipart uploads a task opened in an object store (the artifact store): registered, under the
-- task's live lease, right after the store gave the upload its id; completed by the commit task or
-- aborted by the worker or the reaper once its attempt has ended without success, so no upload
-- stays open and nothing partial becomes an object.
CREATE TABLE uploads (
    id          BIGSERIAL PRIMARY KEY,
    run_id      BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    task_id     BIGINT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    token       BIGINT NOT NULL,
    store_url   TEXT NOT NULL,
    object_key  TEXT NOT NULL,
    upload_id   TEXT NOT NULL,
    state       TEXT NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'completed', 'aborted')),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    ended_at    TIMESTAMPTZ
);
CREATE INDEX uploads_open ON uploads (run_id) WHERE state = 'open';
