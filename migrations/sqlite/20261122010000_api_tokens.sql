-- API tokens of the HTTP API. Only the SHA-256 of a token is kept (hex); the token itself is
-- shown once, when it is created. Scopes: read < submit < admin. Times in milliseconds.
CREATE TABLE api_tokens (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    scope       TEXT NOT NULL CHECK (scope IN ('read', 'submit', 'admin')),
    created_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    revoked_at  INTEGER
) STRICT;
