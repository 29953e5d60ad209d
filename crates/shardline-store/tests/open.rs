//! Opening one new (or old) store from many threads and processes at once: the migrations run
//! once, every opener comes up and sees the same store; an opener that finds the migration lock taken waits
//! for it, and gives up with a clear error once its wait is over.

mod common;

use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use shardline_store::*;
use sqlx::{Connection, Executor};

/// Threads (and processes) opening one new store at once, per round.
const OPENERS: usize = 8;
const ROUNDS: usize = 4;

/// The embedded migrations: one row each in `_sqlx_migrations`, applied once.
fn migration_count(kind: Kind) -> i64 {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations").join(match kind {
        Kind::Sqlite => "sqlite",
        Kind::Postgres => "postgres",
    });
    std::fs::read_dir(dir).expect("migrations").filter(|e| e.as_ref().is_ok_and(|e| e.path().is_file())).count() as i64
}

/// (rows, successful rows) of `_sqlx_migrations`.
async fn applied(db: &TestDb) -> (i64, i64) {
    let q = "SELECT count(*), CAST(COALESCE(sum(CASE WHEN success THEN 1 ELSE 0 END), 0) AS BIGINT) \
             FROM _sqlx_migrations";
    match db.kind {
        Kind::Sqlite => {
            let mut c = sqlx::SqliteConnection::connect(&db.url).await.expect("connect");
            sqlx::query_as(q).fetch_one(&mut c).await.expect("migrations table")
        }
        Kind::Postgres => {
            let opts =
                sqlx::postgres::PgConnectOptions::from_str(&db.url).expect("url").options([("search_path", PG_SCHEMA)]);
            let mut c = sqlx::PgConnection::connect_with(&opts).await.expect("connect");
            sqlx::query_as(q).fetch_one(&mut c).await.expect("migrations table")
        }
    }
}

/// `OPENERS` threads, each with a runtime of its own, open the store at the same instant and
/// register a worker through it; all must succeed, and every one sees every worker.
fn threads_open_at_once(db: &TestDb) {
    let barrier = Arc::new(Barrier::new(OPENERS));
    let handles: Vec<_> = (0..OPENERS)
        .map(|i| {
            let (url, barrier) = (db.url.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                barrier.wait();
                rt.block_on(async {
                    let store = Store::connect(&url).await.map_err(|e| format!("opener {i}: {e}"))?;
                    store
                        .register_worker(cpu_worker(&format!("t{i}")))
                        .await
                        .map_err(|e| format!("opener {i}: {e}"))?;
                    store.close().await;
                    Ok::<(), String>(())
                })
            })
        })
        .collect();
    let failures: Vec<String> = handles.into_iter().filter_map(|h| h.join().expect("opener thread").err()).collect();
    assert!(failures.is_empty(), "{} of {OPENERS} openers failed: {failures:#?}", failures.len());
}

async fn check_opened(db: &TestDb, prefix: &str) {
    let store = db.store().await;
    let mut names: Vec<String> = store.list_workers().await.expect("workers").into_iter().map(|w| w.name).collect();
    names.sort();
    let mut want: Vec<String> = (0..OPENERS).map(|i| format!("{prefix}{i}")).collect();
    want.sort();
    assert_eq!(names, want);
    let n = migration_count(db.kind);
    assert_eq!(applied(db).await, (n, n), "every migration applied once, successfully");
    store.close().await;
}

#[test]
fn sqlite_threads_open_a_new_file_at_once() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for _ in 0..ROUNDS {
        let db = rt.block_on(TestDb::new(Kind::Sqlite));
        threads_open_at_once(&db);
        rt.block_on(check_opened(&db, "t"));
        assert!(
            sqlite_lock_path(&db_file(&db)).is_file(),
            "the lock file stays next to the database for the next opener"
        );
    }
}

#[test]
fn postgres_threads_open_a_new_database_at_once() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for _ in 0..ROUNDS {
        let db = rt.block_on(TestDb::new(Kind::Postgres));
        threads_open_at_once(&db);
        rt.block_on(check_opened(&db, "t"));
        rt.block_on(db.cleanup());
    }
}

/// Migrates `db` as the previous release did: every migration before the newest one.
async fn old_store(db: &TestDb) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations").join(match db.kind {
        Kind::Sqlite => "sqlite",
        Kind::Postgres => "postgres",
    });
    let mut m = sqlx::migrate::Migrator::new(dir).await.expect("read the migrations");
    let newest = m.migrations.iter().map(|m| m.version).max().expect("a migration");
    m.migrations = m.migrations.iter().filter(|m| m.version < newest).cloned().collect::<Vec<_>>().into();
    match db.kind {
        Kind::Sqlite => {
            let opts = sqlx::sqlite::SqliteConnectOptions::from_str(&db.url).expect("url").create_if_missing(true);
            let pool = sqlx::SqlitePool::connect_with(opts).await.expect("connect");
            m.run(&pool).await.expect("old migrations");
            pool.close().await;
        }
        Kind::Postgres => {
            let opts =
                sqlx::postgres::PgConnectOptions::from_str(&db.url).expect("url").options([("search_path", PG_SCHEMA)]);
            let pool = sqlx::PgPool::connect_with(opts).await.expect("connect");
            pool.execute(sqlx::raw_sql(&format!("CREATE SCHEMA {PG_SCHEMA}"))).await.expect("schema");
            m.run(&pool).await.expect("old migrations");
            pool.close().await;
        }
    }
    assert_eq!(applied(db).await.0, migration_count(db.kind) - 1);
}

/// A store the previous release created: the openers migrate it once, together.
#[test]
fn threads_open_an_old_store_at_once() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for kind in [Kind::Sqlite, Kind::Postgres] {
        let db = rt.block_on(TestDb::new(kind));
        rt.block_on(old_store(&db));
        threads_open_at_once(&db);
        rt.block_on(check_opened(&db, "t"));
        rt.block_on(db.cleanup());
    }
}

fn db_file(db: &TestDb) -> std::path::PathBuf {
    std::path::PathBuf::from(db.url.strip_prefix("sqlite://").expect("a SQLite file URL"))
}

/// The variables that make [`child_opener`] open a store: its URL, the worker name to register,
/// and the instant (ms since the epoch) to open it at.
const CHILD_URL: &str = "SHARDLINE_OPEN_TEST_URL";
const CHILD_NAME: &str = "SHARDLINE_OPEN_TEST_NAME";
const CHILD_AT: &str = "SHARDLINE_OPEN_TEST_AT";

/// Not a test of its own: run as a child process by [`sqlite_processes_open_a_new_file_at_once`]
/// (it does nothing without the variables).
#[test]
fn child_opener() {
    let (Ok(url), Ok(name), Ok(at)) = (std::env::var(CHILD_URL), std::env::var(CHILD_NAME), std::env::var(CHILD_AT))
    else {
        return;
    };
    let at: u64 = at.parse().expect("start instant");
    let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as u64;
    std::thread::sleep(Duration::from_millis(at.saturating_sub(now)));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        store.register_worker(cpu_worker(&name)).await.unwrap_or_else(|e| panic!("{name}: {e}"));
        store.close().await;
    });
}

fn processes_open_at_once(db: &TestDb) {
    let exe = std::env::current_exe().expect("test binary");
    // Far enough ahead for every child to be started and waiting.
    let at = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() + 1500;
    let children: Vec<_> = (0..OPENERS)
        .map(|i| {
            Command::new(&exe)
                .args(["child_opener", "--exact", "--nocapture", "--test-threads", "1"])
                .env(CHILD_URL, &db.url)
                .env(CHILD_NAME, format!("p{i}"))
                .env(CHILD_AT, at.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn an opener process")
        })
        .collect();
    let mut failures = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("opener process");
        if !out.status.success() {
            failures.push(format!(
                "process p{i} ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    assert!(failures.is_empty(), "{} of {OPENERS} opener processes failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn sqlite_processes_open_a_new_file_at_once() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for _ in 0..ROUNDS {
        let db = rt.block_on(TestDb::new(Kind::Sqlite));
        processes_open_at_once(&db);
        rt.block_on(check_opened(&db, "p"));
    }
}

/// An opener that finds the lock taken waits for it, then opens; one whose wait runs out fails
/// with an error naming the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_opener_waits_for_the_lock_and_gives_up_after_its_wait() {
    let db = TestDb::new(Kind::Sqlite).await;
    db.store().await.close().await;
    let lock_path = sqlite_lock_path(&db_file(&db));
    let held = std::fs::File::options().read(true).write(true).open(&lock_path).expect("lock file");
    held.lock().expect("take the lock");

    let short = StoreOptions { migrate_wait: Duration::from_millis(300), ..StoreOptions::default() };
    let started = Instant::now();
    let err = Store::connect_with(&db.url, short).await.expect_err("opened while the lock was held");
    assert!(started.elapsed() >= Duration::from_millis(300), "gave up after {:?}", started.elapsed());
    assert!(matches!(err, StoreError::MigrationLocked { backend: Backend::Sqlite, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&lock_path.display().to_string()) && msg.contains("gave up after 3"), "{msg}");

    // Released a second later: a waiting opener comes up then, not before.
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        held.unlock().expect("unlock");
    });
    let started = Instant::now();
    let store = Store::connect(&db.url).await.expect("opened once the lock was free");
    assert!(started.elapsed() >= Duration::from_millis(900), "did not wait: {:?}", started.elapsed());
    release.join().expect("release thread");
    store.register_worker(cpu_worker("after")).await.expect("register");
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_opener_waits_for_the_lock_and_gives_up_after_its_wait() {
    let db = TestDb::new(Kind::Postgres).await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    holder.execute(sqlx::query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK)).await.expect("take the lock");

    let short = StoreOptions { migrate_wait: Duration::from_millis(300), ..StoreOptions::default() };
    let started = Instant::now();
    let err = Store::connect_with(&db.url, short).await.expect_err("opened while the lock was held");
    assert!(started.elapsed() >= Duration::from_millis(300), "gave up after {:?}", started.elapsed());
    assert!(matches!(err, StoreError::MigrationLocked { backend: Backend::Postgres, .. }), "{err:?}");
    assert!(err.to_string().contains("advisory lock 0x5348415244500002"), "{err}");

    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        holder.execute(sqlx::query("SELECT pg_advisory_unlock($1)").bind(MIGRATE_LOCK)).await.expect("unlock");
        holder.close().await.expect("close");
    });
    let started = Instant::now();
    let store = Store::connect(&db.url).await.expect("opened once the lock was free");
    assert!(started.elapsed() >= Duration::from_millis(900), "did not wait: {:?}", started.elapsed());
    release.await.expect("release task");
    store.register_worker(cpu_worker("after")).await.expect("register");
    store.close().await;
    db.cleanup().await;
}
