//! Direct access to the store's connection pool, for crates that keep tables of their own next
//! to the store's (the HTTP API's tokens): they run their own SQL on the same database.

use sqlx::{PgPool, SqlitePool};

use crate::db::Pool;
use crate::Store;

/// The store's pool, by backend. On PostgreSQL every connection's `search_path` is the store's
/// schema, so unqualified table names resolve to the store's tables.
#[derive(Debug, Clone, Copy)]
pub enum RawPool<'a> {
    Postgres(&'a PgPool),
    Sqlite(&'a SqlitePool),
}

impl Store {
    /// The pool the store runs its own queries on.
    pub fn raw_pool(&self) -> RawPool<'_> {
        match self.pool() {
            Pool::Pg(p) => RawPool::Postgres(p),
            Pool::Lite(p) => RawPool::Sqlite(p),
        }
    }
}
