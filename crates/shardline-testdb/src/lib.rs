//! Test databases: a fresh SQLite file or a fresh PostgreSQL database per test, so tests run in
//! parallel. PostgreSQL tests need `SHARDLINE_TEST_DATABASE_URL` (`scripts/setup-postgres`
//! prints it) and fail, never skip, without it.
//!
//! A dev-dependency of every crate whose tests need a job store; not part of the binary. Its SQL
//! (creating and dropping databases, a test's own statements) is the store's
//! (`shardline_store::testing`), as every SQL statement of the workspace is.
//! **Must not depend on:** any workspace crate but `shardline-store`.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use shardline_store::testing::{self, AdminConnection, TEST_DATABASE_PREFIX};
use shardline_store::{Backend, Store, StoreOptions};

/// The variable naming the PostgreSQL server the tests create their databases on.
pub const ENV: &str = "SHARDLINE_TEST_DATABASE_URL";

/// Which backend a test database uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
}

/// A database of the test's own; PostgreSQL ones are dropped by [`TestDb::cleanup`], or by a
/// later run once they are an hour old.
pub struct TestDb {
    pub kind: Kind,
    pub url: String,
    admin_url: Option<String>,
    name: Option<String>,
    _dir: Option<tempfile::TempDir>,
    _lock: Option<File>,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// The PostgreSQL restart tests take this lock exclusively; every other PostgreSQL test holds it
/// shared, so no test sees the cluster go down under it.
pub fn cluster_lock(exclusive: bool) -> File {
    let path = std::env::temp_dir().join("shardline-store-postgres-cluster.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    // Wait (bounded) for a restart test elsewhere on this machine to finish.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let attempt = if exclusive { file.try_lock() } else { file.try_lock_shared() };
        match attempt {
            Ok(()) => return file,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!(
                "cannot lock {} ({}) within 10 minutes: {e:?} (a PostgreSQL restart test elsewhere \
                 holds it, or hangs)",
                path.display(),
                if exclusive { "exclusive" } else { "shared" }
            ),
        }
    }
}

/// The server's URL from [`ENV`]; panics with what to do when it is not set.
pub fn admin_url() -> String {
    match std::env::var(ENV) {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "{ENV} is not set: PostgreSQL tests need a server. Run `scripts/setup-postgres` and \
             export {ENV}=<the URL it prints> (scripts/test does both)."
        ),
    }
}

/// `url` with its database name replaced.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{db}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

impl TestDb {
    pub async fn new(kind: Kind) -> TestDb {
        match kind {
            Kind::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("state.db").display());
                TestDb { kind, url, admin_url: None, name: None, _dir: Some(dir), _lock: None }
            }
            Kind::Postgres => TestDb::postgres(false).await,
        }
    }

    /// A fresh PostgreSQL database; `exclusive` takes the cluster lock exclusively (for tests
    /// that restart the server).
    pub async fn postgres(exclusive: bool) -> TestDb {
        let admin = admin_url();
        let lock = cluster_lock(exclusive);
        let mut conn = AdminConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!("{ENV}: cannot connect to PostgreSQL at {admin}: {e} (run scripts/setup-postgres)")
        });
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        drop_stale(&mut conn, now).await;
        let name =
            format!("{TEST_DATABASE_PREFIX}{now}_{}_{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        conn.create_database(&name).await.unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
        conn.close().await;
        TestDb {
            kind: Kind::Postgres,
            url: with_database(&admin, &name),
            admin_url: Some(admin),
            name: Some(name),
            _dir: None,
            _lock: Some(lock),
        }
    }

    pub async fn store(&self) -> Store {
        Store::connect(&self.url).await.unwrap_or_else(|e| panic!("connect to {}: {e}", self.url))
    }

    pub async fn store_with(&self, max_connections: u32) -> Store {
        let options = StoreOptions { max_connections: Some(max_connections), ..StoreOptions::default() };
        Store::connect_with(&self.url, options).await.unwrap_or_else(|e| panic!("connect to {}: {e}", self.url))
    }

    /// Runs SQL statements on a connection of their own, outside the store (fault injection).
    pub async fn execute(&self, statements: &[&str]) {
        let backend = match self.kind {
            Kind::Sqlite => Backend::Sqlite,
            Kind::Postgres => Backend::Postgres,
        };
        testing::execute(backend, &self.url, statements).await;
    }

    /// Drops the PostgreSQL database (a test that panics leaves it; later runs drop it).
    pub async fn cleanup(&self) {
        if let (Some(admin), Some(name)) = (&self.admin_url, &self.name) {
            if let Ok(mut conn) = AdminConnection::connect(admin).await {
                let _ = conn.drop_database(name).await;
                conn.close().await;
            }
        }
    }
}

/// Instantiates each `async fn(Kind)` as a test once per backend, in modules `sqlite` and
/// `postgres` (the function makes its own database or harness).
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::Kind::Sqlite).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name($crate::Kind::Postgres).await;
                }
            )*
        }
    };
}

/// Instantiates each `async fn(&TestDb)` as a test once per backend, in modules `sqlite` and
/// `postgres`, on a fresh database dropped afterwards.
#[macro_export]
macro_rules! on_both_databases {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = $crate::TestDb::new($crate::Kind::Sqlite).await;
                    super::$name(&db).await;
                    db.cleanup().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = $crate::TestDb::new($crate::Kind::Postgres).await;
                    super::$name(&db).await;
                    db.cleanup().await;
                }
            )*
        }
    };
}

/// Drops test databases more than an hour old (left by crashed or interrupted runs).
async fn drop_stale(conn: &mut AdminConnection, now: u64) {
    for name in conn.test_databases().await {
        let created: u64 = name.split('_').nth(2).and_then(|s| s.parse().ok()).unwrap_or(now);
        if now.saturating_sub(created) > 3600 {
            let _ = conn.drop_database(&name).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_name() {
        assert_eq!(with_database("postgres://u:p@h:5432/db", "x"), "postgres://u:p@h:5432/x");
        assert_eq!(
            with_database("postgres://u:p@h:5432/db?sslmode=disable", "x"),
            "postgres://u:p@h:5432/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    }
}
