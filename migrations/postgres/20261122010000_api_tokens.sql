-- API tokens of the HTTP API. Only the SHA-256 of a token is kept (hex); the token itself is
-- shown once, when it is created. Scopes: read < submit < admin.
CREATE TABLE api_tokens (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    scope       TEXT NOT NULL CHECK (scope IN ('read', 'submit', 'admin')),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at  TIMESTAMPTZ
);
