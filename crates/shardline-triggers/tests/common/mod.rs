//! Test databases: a fresh SQLite file or a fresh PostgreSQL database per test. PostgreSQL
//! tests need `SHARDLINE_TEST_DATABASE_URL` (`scripts/setup-postgres` prints it) and fail,
//! never skip, without it.
#![allow(dead_code)]

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shardline_store::Store;
use sqlx::{Connection, PgConnection};

pub const ENV: &str = "SHARDLINE_TEST_DATABASE_URL";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
}

pub struct TestDb {
    pub url: String,
    admin_url: Option<String>,
    name: Option<String>,
    _dir: Option<tempfile::TempDir>,
    _lock: Option<File>,
}

/// The store's PostgreSQL restart test takes this lock exclusively; every other PostgreSQL test
/// holds it shared, so no test sees the cluster go down under it.
fn cluster_lock() -> File {
    let path = std::env::temp_dir().join("shardline-store-postgres-cluster.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        match file.try_lock_shared() {
            Ok(()) => return file,
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("cannot lock {} (shared) within 10 minutes: {e:?}", path.display()),
        }
    }
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn with_database(url: &str, db: &str) -> String {
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
                let url = format!("sqlite://{}", dir.path().join("store.db").display());
                TestDb { url, admin_url: None, name: None, _dir: Some(dir), _lock: None }
            }
            Kind::Postgres => {
                let admin = match std::env::var(ENV) {
                    Ok(url) if !url.is_empty() => url,
                    _ => panic!(
                        "{ENV} is not set: PostgreSQL tests need a server. Run `scripts/setup-postgres` and \
                         export {ENV}=<the URL it prints> (scripts/test does both)."
                    ),
                };
                let lock = cluster_lock();
                let mut conn = PgConnection::connect(&admin)
                    .await
                    .unwrap_or_else(|e| panic!("{ENV}: cannot connect to PostgreSQL at {admin}: {e}"));
                let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
                let name = format!("shardline_t_{now}_{}_{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
                sqlx::query(&format!("CREATE DATABASE \"{name}\""))
                    .execute(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
                let _ = conn.close().await;
                TestDb {
                    url: with_database(&admin, &name),
                    admin_url: Some(admin),
                    name: Some(name),
                    _dir: None,
                    _lock: Some(lock),
                }
            }
        }
    }

    pub async fn store(&self) -> Store {
        Store::connect(&self.url).await.unwrap_or_else(|e| panic!("connect to {}: {e}", self.url))
    }

    pub async fn cleanup(self) {
        if let (Some(admin), Some(name)) = (&self.admin_url, &self.name) {
            if let Ok(mut conn) = PgConnection::connect(admin).await {
                let _ =
                    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut conn).await;
                let _ = conn.close().await;
            }
        }
    }
}
