//! API tokens of the HTTP API (table `api_tokens`). The store keeps only a token's hash; minting
//! secrets, hashing them and checking scopes is the HTTP API's business.

use chrono::{DateTime, Utc};

use crate::db::{args, sql, DbTime};
use crate::error::StoreError;
use crate::Store;

/// A stored token (never its secret; its hash only through [`Store::token_by_hash`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRow {
    pub id: i64,
    /// Who or what uses it, for people.
    pub name: String,
    /// `read`, `submit` or `admin`.
    pub scope: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct TokenRecord {
    id: i64,
    name: String,
    scope: String,
    created_at: DbTime,
    revoked_at: Option<DbTime>,
}

impl From<TokenRecord> for TokenRow {
    fn from(r: TokenRecord) -> TokenRow {
        TokenRow {
            id: r.id,
            name: r.name,
            scope: r.scope,
            created_at: r.created_at.0,
            revoked_at: r.revoked_at.map(|t| t.0),
        }
    }
}

impl Store {
    /// Stores a token by its hash (hex SHA-256) with a scope (`read`, `submit` or `admin`);
    /// returns its id.
    pub async fn insert_token(&self, name: &str, hash: &str, scope: &str) -> Result<i64, StoreError> {
        // Not repeated once it may have committed: a second row would hold the same hash.
        self.retrying_conflicts("insert_token", || async {
            let mut c = self.pool().acquire().await?;
            let (id,): (i64,) = c
                .conn()
                .one(
                    sql!("INSERT INTO api_tokens (name, hash, scope) VALUES ($1, $2, $3) RETURNING id"),
                    args![name, hash, scope],
                )
                .await?;
            Ok(id)
        })
        .await
    }

    /// The unrevoked token with this hash, if any.
    pub async fn token_by_hash(&self, hash: &str) -> Result<Option<TokenRow>, StoreError> {
        self.retrying("token_by_hash", || async {
            let mut c = self.pool().acquire().await?;
            let row: Option<TokenRecord> = c
                .conn()
                .opt(
                    sql!(
                        "SELECT id, name, scope, created_at, revoked_at FROM api_tokens \
                         WHERE hash = $1 AND revoked_at IS NULL"
                    ),
                    args![hash],
                )
                .await?;
            Ok(row.map(TokenRow::from))
        })
        .await
    }

    /// Revokes a token at once; false when there is no such unrevoked token.
    pub async fn revoke_token(&self, id: i64) -> Result<bool, StoreError> {
        self.retrying("revoke_token", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(sql!("UPDATE api_tokens SET revoked_at = {now} WHERE id = $1 AND revoked_at IS NULL"), args![id])
                .await?;
            Ok(n > 0)
        })
        .await
    }

    /// Every token, revoked ones included, by id.
    pub async fn list_tokens(&self) -> Result<Vec<TokenRow>, StoreError> {
        self.retrying("list_tokens", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<TokenRecord> = c
                .conn()
                .all(sql!("SELECT id, name, scope, created_at, revoked_at FROM api_tokens ORDER BY id"), args![])
                .await?;
            Ok(rows.into_iter().map(TokenRow::from).collect())
        })
        .await
    }
}
