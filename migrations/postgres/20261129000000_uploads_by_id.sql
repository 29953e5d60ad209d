-- The reaper asks whether any task recorded an upload the object store lists as open.
CREATE INDEX uploads_by_id ON uploads (upload_id);
