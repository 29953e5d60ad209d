-- See the PostgreSQL migration.
CREATE INDEX uploads_by_id ON uploads (upload_id);
