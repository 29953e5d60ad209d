//! Test support (feature `testing`): the SQL the tests' databases need outside the store's own
//! tables, so that every SQL statement of the workspace stays in this crate. `shardline-testdb`
//! builds its per-test databases on it; nothing in a release build enables the feature.
//!
//! * [`AdminConnection`]: creating, listing and dropping the tests' PostgreSQL databases on a
//!   server's maintenance database.
//! * [`execute`]: a test's own statements (seeding, fault injection) on a connection of their own.

use sqlx::{Connection, PgConnection, SqliteConnection};

use crate::Backend;

/// The prefix of every test database's name (`shardline_t_{unix secs}_{pid}_{seq}`).
pub const TEST_DATABASE_PREFIX: &str = "shardline_t_";

/// A connection to a PostgreSQL server's maintenance database, to create and drop the tests'
/// databases.
pub struct AdminConnection {
    conn: PgConnection,
}

impl std::fmt::Debug for AdminConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConnection").finish_non_exhaustive()
    }
}

impl AdminConnection {
    /// Connects to `url` (`postgres://…`).
    pub async fn connect(url: &str) -> Result<AdminConnection, sqlx::Error> {
        Ok(AdminConnection { conn: PgConnection::connect(url).await? })
    }

    /// The databases whose name starts with [`TEST_DATABASE_PREFIX`]; none when they cannot be
    /// listed.
    pub async fn test_databases(&mut self) -> Vec<String> {
        let names: Vec<(String,)> =
            sqlx::query_as("SELECT datname FROM pg_database WHERE datname LIKE 'shardline\\_t\\_%'")
                .fetch_all(&mut self.conn)
                .await
                .unwrap_or_default();
        names.into_iter().map(|(name,)| name).collect()
    }

    /// `CREATE DATABASE "{name}"`.
    pub async fn create_database(&mut self, name: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut self.conn).await?;
        Ok(())
    }

    /// Drops the database if it exists, closing its connections.
    pub async fn drop_database(&mut self, name: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut self.conn).await?;
        Ok(())
    }

    /// Closes the connection (errors ignored).
    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}

/// Runs SQL statements on a connection of their own to the database at `url`, outside the store
/// (on PostgreSQL in the store's schema). Panics on any error: it is for tests.
pub async fn execute(backend: Backend, url: &str, statements: &[&str]) {
    match backend {
        Backend::Sqlite => {
            let mut c = SqliteConnection::connect(url).await.expect("sqlite connection");
            for s in statements {
                sqlx::query(s).execute(&mut c).await.unwrap_or_else(|e| panic!("{s}: {e}"));
            }
            let _ = c.close().await;
        }
        Backend::Postgres => {
            let mut c = PgConnection::connect(url).await.expect("postgres connection");
            sqlx::query("SET search_path = shardline").execute(&mut c).await.expect("search_path");
            for s in statements {
                sqlx::query(s).execute(&mut c).await.unwrap_or_else(|e| panic!("{s}: {e}"));
            }
            let _ = c.close().await;
        }
    }
}
