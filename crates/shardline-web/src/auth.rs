//! API tokens: `shl_` followed by 64 hex digits (32 random bytes), sent as
//! `Authorization: Bearer shl_…`. Only their SHA-256 is stored (table `api_tokens`).
//!
//! Scopes are ordered `read` < `submit` < `admin`; a token grants its scope and every lower one.
//!
//! | endpoint | scope |
//! |---|---|
//! | every `GET`, `POST /lint` | `read` — only with [`AuthMode::ReadRequiresToken`]; open otherwise |
//! | `POST /runs` | `submit` |
//! | `POST /runs/{id}/cancel`, `POST /runs/{id}/retry` | `admin` |
//!
//! A token that is presented is always checked, also where none is needed: an unknown or
//! revoked token is refused with 401 rather than ignored.

use std::fmt;
use std::str::FromStr;

use axum::http::HeaderMap;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use shardline_store::{Store, StoreError, TokenRow};

use crate::error::ApiError;

/// The prefix of every API token.
pub const TOKEN_PREFIX: &str = "shl_";

/// Whether reads need a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AuthMode {
    /// Reads are open; mutations need a token.
    #[default]
    Open,
    /// Every request needs a token (reads: scope `read` or higher).
    ReadRequiresToken,
}

/// What a token may do. Ordered: `Read < Submit < Admin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Read,
    Submit,
    Admin,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Submit => "submit",
            Scope::Admin => "admin",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Scope, String> {
        match s {
            "read" => Ok(Scope::Read),
            "submit" => Ok(Scope::Submit),
            "admin" => Ok(Scope::Admin),
            other => Err(format!("unknown scope `{other}` (known: read, submit, admin)")),
        }
    }
}

/// A stored, unrevoked token (never its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    pub id: i64,
    pub name: String,
    pub scope: Scope,
}

/// A freshly created token: `secret` is shown once and never stored.
#[derive(Clone, PartialEq, Eq)]
pub struct NewToken {
    pub id: i64,
    pub secret: String,
}

impl fmt::Debug for NewToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewToken").field("id", &self.id).field("secret", &"[redacted]").finish()
    }
}

/// Hex SHA-256 of a token, as stored.
pub fn hash_token(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Creates a token named `name` (for people: who or what uses it) with `scope`.
pub async fn create_token(store: &Store, name: &str, scope: Scope) -> Result<NewToken, StoreError> {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let secret = format!("{TOKEN_PREFIX}{}", hex::encode(bytes));
    let id = store.insert_token(name, &hash_token(&secret), scope.as_str()).await?;
    Ok(NewToken { id, secret })
}

/// The unrevoked token with this secret, if any.
pub async fn find_token(store: &Store, secret: &str) -> Result<Option<TokenInfo>, StoreError> {
    let row = store.token_by_hash(&hash_token(secret)).await?;
    Ok(row.and_then(|t| Some(TokenInfo { id: t.id, name: t.name, scope: t.scope.parse().ok()? })))
}

/// Revokes a token; false when there is no such unrevoked token.
pub async fn revoke_token(store: &Store, id: i64) -> Result<bool, StoreError> {
    store.revoke_token(id).await
}

/// Every token, revoked ones included, by id (never a secret or a hash).
pub async fn list_tokens(store: &Store) -> Result<Vec<TokenRow>, StoreError> {
    store.list_tokens().await
}

/// Checks the request's bearer token against `needed`. Returns the token, or None for an open
/// read without one.
pub async fn authorize(
    store: &Store,
    mode: AuthMode,
    headers: &HeaderMap,
    needed: Scope,
) -> Result<Option<TokenInfo>, ApiError> {
    let presented = match headers.get(axum::http::header::AUTHORIZATION) {
        None => None,
        Some(value) => {
            let text = value.to_str().unwrap_or("");
            let secret = text
                .strip_prefix("Bearer ")
                .or_else(|| text.strip_prefix("bearer "))
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    ApiError::unauthorized("The Authorization header must be `Bearer shl_…` with an API token.")
                })?;
            Some(secret.to_string())
        }
    };
    let Some(secret) = presented else {
        if needed == Scope::Read && mode == AuthMode::Open {
            return Ok(None);
        }
        return Err(ApiError::unauthorized(format!(
            "This request needs an API token with scope `{needed}`; send it as `Authorization: Bearer shl_…`."
        )));
    };
    if !secret.starts_with(TOKEN_PREFIX) {
        return Err(ApiError::unauthorized("That is not an API token (they start with `shl_`)."));
    }
    let token =
        find_token(store, &secret).await.map_err(|e| ApiError::internal("check the API token", e))?.ok_or_else(
            || ApiError::unauthorized("The API token is unknown or revoked; ask an administrator for a new one."),
        )?;
    if token.scope < needed {
        return Err(ApiError::forbidden(format!(
            "The API token `{}` has scope `{}`, this request needs `{needed}`; use a token with that scope.",
            token.name, token.scope
        )));
    }
    Ok(Some(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_ordered() {
        assert!(Scope::Read < Scope::Submit && Scope::Submit < Scope::Admin);
        assert_eq!("admin".parse::<Scope>(), Ok(Scope::Admin));
        assert!("root".parse::<Scope>().is_err());
    }

    #[test]
    fn hash_is_sha256_hex() {
        assert_eq!(hash_token("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
