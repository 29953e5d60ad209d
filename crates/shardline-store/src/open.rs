//! Opening a store: connecting, creating the schema and applying the embedded migrations, by one
//! process at a time.
//!
//! Any number of servers, workers and commands may open a new or an old store at the same moment.
//! The whole sequence that can change the schema runs under a lock that works across processes,
//! and an opener that finds it taken waits (at most [`StoreOptions::migrate_wait`]) and then finds
//! the migrations applied:
//!
//! - **SQLite:** an exclusive `flock` on `<database>.lock`, a file next to the database that is
//!   created once and never removed (removing a lock file races its next user). The lock covers
//!   creating the database file, switching it to WAL and migrating. The operating system releases
//!   it when its holder exits, killed or not; a killed migration's transaction is rolled back by
//!   SQLite. sqlx's migrator takes no lock of its own on SQLite.
//! - **PostgreSQL:** a session-level advisory lock ([`MIGRATE_LOCK`], per database) on a dedicated
//!   connection, under `lock_timeout`, held while the schema is created and migrated. sqlx's
//!   migrator takes an advisory lock of its own too, but only around the migrations, not the
//!   `CREATE SCHEMA` before them, and it waits for it without a bound; here it is taken under
//!   ours, with the same `lock_timeout`. The server releases a session lock when its connection
//!   ends.
//!
//! The pool is opened after the lock is released: its connections never see a half-migrated
//! schema.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, PgConnection, PgPool, SqlitePool};

use crate::error::{Result, StoreError};
use crate::types::Backend;
use crate::{redact_url, StoreOptions, PG_MIGRATOR, PG_SCHEMA, SQLITE_MIGRATOR};

/// Key of the session-level advisory lock held while a PostgreSQL store's schema is created and
/// migrated (the reaper's is `…0001`).
pub const MIGRATE_LOCK: i64 = 0x5348_4152_4450_0002;

/// What is appended to a SQLite database's path to name its migration lock file.
pub const SQLITE_LOCK_SUFFIX: &str = ".lock";

/// How often a waiting SQLite opener tries the lock again.
const POLL: Duration = Duration::from_millis(20);

/// After this long, a waiting opener says on stderr (through `tracing`) what it waits for.
const ANNOUNCE_AFTER: Duration = Duration::from_secs(2);

pub(crate) async fn connect_pg(url: &str, options: &StoreOptions) -> Result<(PgPool, PgConnectOptions)> {
    let connect_err = |source| StoreError::Connect { backend: Backend::Postgres, url: redact_url(url), source };
    let opts = PgConnectOptions::from_str(url).map_err(connect_err)?.options([
        ("search_path", PG_SCHEMA),
        // A leaked transaction would hold back vacuum and event publication: end it.
        ("idle_in_transaction_session_timeout", "60000"),
    ]);
    // A connection of its own for the lock and the migrations. It is also the first attempt to
    // reach the server: an unreachable one fails the connect at once, not after the pool's acquire
    // timeout of retries.
    let mut conn = PgConnection::connect_with(&opts).await.map_err(connect_err)?;
    let migrated = migrate_pg(&mut conn, url, options.migrate_wait).await;
    // Closing the connection releases the lock even where unlocking failed.
    let _ = conn.close().await;
    migrated?;
    let pool = PgPoolOptions::new()
        // sqlx pings every connection it takes back; a second ping on every acquire would add
        // a round trip to each call. A connection that died idle (server restart) fails on first
        // use instead, and idempotent operations are retried on a fresh one (`retrying`).
        .test_before_acquire(false)
        .max_connections(options.max_connections.unwrap_or(10).max(1))
        .acquire_timeout(options.acquire_timeout)
        .connect_with(opts.clone())
        .await
        .map_err(connect_err)?;
    Ok((pool, opts))
}

/// Takes [`MIGRATE_LOCK`] on `conn` (waiting at most `wait`), creates the schema when missing,
/// applies the migrations, and releases the lock.
async fn migrate_pg(conn: &mut PgConnection, url: &str, wait: Duration) -> Result<()> {
    let db_err = |source| StoreError::Connect { backend: Backend::Postgres, url: redact_url(url), source };
    let migrate_err = |source| StoreError::Migrate { backend: Backend::Postgres, source };
    // Every lock this session waits for from here on — ours, sqlx's, the tables' — waits at most
    // `wait` (PostgreSQL rounds to milliseconds; 0 would mean no limit).
    let ms = wait.as_millis().clamp(1, i32::MAX as u128);
    sqlx::query(&format!("SET lock_timeout = {ms}")).execute(&mut *conn).await.map_err(db_err)?;
    let started = Instant::now();
    if let Err(e) = sqlx::query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK).execute(&mut *conn).await {
        return Err(if is_lock_timeout(&e) { locked(url, started.elapsed()) } else { db_err(e) });
    }
    if started.elapsed() > ANNOUNCE_AFTER {
        tracing::info!("waited {:?} for another process to migrate the job store", started.elapsed());
    }
    let result = async {
        let exists: Option<(i64,)> = sqlx::query_as("SELECT 1::bigint FROM pg_namespace WHERE nspname = $1")
            .bind(PG_SCHEMA)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_err)?;
        if exists.is_none() {
            sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {PG_SCHEMA}"))
                .execute(&mut *conn)
                .await
                .map_err(db_err)?;
        }
        PG_MIGRATOR.run_direct(&mut *conn).await.map_err(|e| match &e {
            sqlx::migrate::MigrateError::Execute(source) if is_lock_timeout(source) => locked(url, started.elapsed()),
            _ => migrate_err(e),
        })
    }
    .await;
    let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)").bind(MIGRATE_LOCK).execute(&mut *conn).await;
    result?;
    unlocked.map_err(db_err)?;
    Ok(())
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some("55P03")
}

fn locked(url: &str, waited: Duration) -> StoreError {
    StoreError::MigrationLocked {
        backend: Backend::Postgres,
        url: redact_url(url),
        holder: format!("advisory lock {MIGRATE_LOCK:#x}"),
        waited,
    }
}

pub(crate) async fn connect_sqlite(url: &str, options: &StoreOptions) -> Result<SqlitePool> {
    let connect_err = |source| StoreError::Connect { backend: Backend::Sqlite, url: url.to_string(), source };
    let opts = SqliteConnectOptions::from_str(url)
        .map_err(connect_err)?
        .create_if_missing(true)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(30));
    let in_memory = url.contains(":memory:") || url.contains("mode=memory");
    if in_memory {
        // The database lives as long as its one connection, which no other opener shares.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(opts)
            .await
            .map_err(connect_err)?;
        migrate_sqlite(&pool).await?;
        return Ok(pool);
    }
    let path = opts.get_filename().to_path_buf();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| connect_err(sqlx::Error::Io(e)))?;
    }
    let lock = SqliteLock::acquire(&path, options.migrate_wait)
        .await
        .map_err(|e| e.into_store_error(url, &path, connect_err))?;
    // One connection by default: SQLite has one writer at a time anyway, and queueing for the
    // pool is fair where SQLite's busy handler sleeps and retries (seconds-long outliers with a
    // few writers).
    let pool = SqlitePoolOptions::new()
        .max_connections(options.max_connections.unwrap_or(1).max(1))
        .acquire_timeout(options.acquire_timeout)
        .connect_with(opts.journal_mode(SqliteJournalMode::Wal).synchronous(SqliteSynchronous::Normal))
        .await
        .map_err(connect_err)?;
    let migrated = migrate_sqlite(&pool).await;
    drop(lock);
    if migrated.is_err() {
        pool.close().await;
    }
    migrated.map(|()| pool)
}

async fn migrate_sqlite(pool: &SqlitePool) -> Result<()> {
    SQLITE_MIGRATOR.run(pool).await.map_err(|source| StoreError::Migrate { backend: Backend::Sqlite, source })
}

/// The migration lock file of the SQLite database at `db`.
pub fn sqlite_lock_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(SQLITE_LOCK_SUFFIX);
    PathBuf::from(name)
}

/// An exclusive `flock` on a database's lock file, released when dropped (or when the process
/// ends). Locks of separately opened files exclude each other within one process too.
struct SqliteLock {
    file: File,
}

enum LockError {
    Io(PathBuf, std::io::Error),
    TimedOut(Duration),
}

impl LockError {
    fn into_store_error(self, url: &str, db: &Path, connect_err: impl Fn(sqlx::Error) -> StoreError) -> StoreError {
        match self {
            LockError::Io(path, e) => connect_err(sqlx::Error::Io(std::io::Error::new(
                e.kind(),
                format!("cannot lock {}: {e}", path.display()),
            ))),
            LockError::TimedOut(waited) => StoreError::MigrationLocked {
                backend: Backend::Sqlite,
                url: url.to_string(),
                holder: format!("lock file `{}`", sqlite_lock_path(db).display()),
                waited,
            },
        }
    }
}

impl SqliteLock {
    async fn acquire(db: &Path, wait: Duration) -> Result<SqliteLock, LockError> {
        let path = sqlite_lock_path(db);
        let file = File::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| LockError::Io(path.clone(), e))?;
        let started = Instant::now();
        let mut announced = false;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(SqliteLock { file }),
                Err(TryLockError::WouldBlock) => {
                    let waited = started.elapsed();
                    if waited >= wait {
                        return Err(LockError::TimedOut(waited));
                    }
                    if !announced && waited >= ANNOUNCE_AFTER {
                        announced = true;
                        tracing::info!("waiting for another process to migrate the job store ({})", path.display());
                    }
                    tokio::time::sleep(POLL.min(wait - waited)).await;
                }
                Err(TryLockError::Error(e)) => return Err(LockError::Io(path, e)),
            }
        }
    }
}

impl Drop for SqliteLock {
    fn drop(&mut self) {
        // Closing the file would release it too; unlocking first says what is meant.
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_file_sits_next_to_the_database() {
        assert_eq!(sqlite_lock_path(Path::new("/s/state.db")), PathBuf::from("/s/state.db.lock"));
        assert_eq!(sqlite_lock_path(Path::new("state.db")), PathBuf::from("state.db.lock"));
    }
}
