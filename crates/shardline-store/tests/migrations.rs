//! Migrations are safe for existing databases: a database written by the previous schema is
//! migrated with its data. Run options kept in params (`__run_name`, `__no_cache`) by earlier
//! versions become the run's options; tasks get the default lost-lease budget and count the
//! expired leases they had since their last retry against it, and ended attempts get the kind
//! of budget they drew on.

mod common;

use std::path::Path;
use std::str::FromStr;

use common::*;
use serde_json::json;
use shardline_store::*;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::Executor;

/// The first migration that is not applied before the legacy rows are written.
const RUN_OPTIONS: i64 = 20261124000000;
const RETRY_BUDGETS: i64 = 20261126000000;
const RETENTION: i64 = 20261128020000;

shardline_testdb::on_both_databases!(
    run_options_move_out_of_params,
    lost_leases_are_counted_apart,
    cache_rows_from_before_retention_count_as_used_when_written
);

/// The migrations of `dir` older than `before`.
async fn migrations_before(dir: &str, before: i64) -> Migrator {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations").join(dir);
    let mut m = Migrator::new(path).await.expect("read the migrations");
    m.migrations = m.migrations.iter().filter(|m| m.version < before).cloned().collect::<Vec<_>>().into();
    m
}

const LEGACY: &str = "INSERT INTO pipelines (name, spec_text, spec_hash) VALUES ('p', 'steps: []', 'h'); \
     INSERT INTO runs (pipeline_id, params, spec) VALUES \
     (1, '{\"repo\": \"a\", \"__run_name\": \"p-1\", \"__no_cache\": true}', '{}'), \
     (1, '{\"repo\": \"b\", \"__run_name\": \"p-2\", \"__no_cache\": false}', '{}'), \
     (1, '{\"x\": 1}', '{}')";

/// Writes `rows` into a database migrated up to (not including) `before`.
async fn legacy_database(db: &TestDb, before: i64, rows: &str) {
    match db.kind {
        Kind::Sqlite => {
            let opts = SqliteConnectOptions::from_str(&db.url).expect("url").create_if_missing(true);
            let pool = sqlx::SqlitePool::connect_with(opts).await.expect("connect");
            migrations_before("sqlite", before).await.run(&pool).await.expect("old migrations");
            pool.execute(sqlx::raw_sql(rows)).await.expect("legacy rows");
            pool.close().await;
        }
        Kind::Postgres => {
            let opts = PgConnectOptions::from_str(&db.url).expect("url").options([("search_path", PG_SCHEMA)]);
            let pool = sqlx::PgPool::connect_with(opts).await.expect("connect");
            pool.execute(sqlx::raw_sql(&format!("CREATE SCHEMA {PG_SCHEMA}"))).await.expect("schema");
            migrations_before("postgres", before).await.run(&pool).await.expect("old migrations");
            pool.execute(sqlx::raw_sql(rows)).await.expect("legacy rows");
            pool.close().await;
        }
    }
}

async fn run_options_move_out_of_params(db: &TestDb) {
    legacy_database(db, RUN_OPTIONS, LEGACY).await;
    let store = db.store().await;
    let runs = store.list_runs(&RunFilter::default(), Page::default()).await.expect("list_runs").runs;
    let seen: Vec<(serde_json::Value, RunOptions)> = runs.into_iter().rev().map(|r| (r.params, r.options)).collect();
    assert_eq!(
        seen,
        vec![
            (json!({"repo": "a"}), RunOptions { name: Some("p-1".into()), no_cache: true, ..RunOptions::default() }),
            (json!({"repo": "b"}), RunOptions { name: Some("p-2".into()), no_cache: false, ..RunOptions::default() }),
            (json!({"x": 1}), RunOptions::default()),
        ]
    );
}

/// Task `a`: attempts 1 expired, 2 failed, 3 expired, all since its last retry. Task `b`:
/// attempts 1 and 2 expired before a retry (`attempt_base` 2), 3 timed out, 4 still running.
const LEGACY_ATTEMPTS: &str = "INSERT INTO pipelines (name, spec_text, spec_hash) VALUES ('p', 'steps: []', 'h'); \
     INSERT INTO runs (pipeline_id, params, spec) VALUES (1, '{}', '{}'); \
     INSERT INTO tasks (run_id, name, step_id, kind, state, cpus, memory, gpus, scratch, payload, \
         attempt, attempt_base, max_attempts, backoff_ms, timeout_ms) VALUES \
     (1, 'a', 'a', 'test', 'ready', 1, 1, 0, 0, '{}', 3, 0, 5, 0, 0), \
     (1, 'b', 'b', 'test', 'leased', 1, 1, 0, 0, '{}', 4, 2, 5, 0, 0); \
     INSERT INTO attempts (task_id, token, attempt, run_id, worker_name, outcome) VALUES \
     (1, 1, 1, 1, 'w', 'expired'), (1, 2, 2, 1, 'w', 'failed'), (1, 3, 3, 1, 'w', 'expired'), \
     (2, 1, 1, 1, 'w', 'expired'), (2, 2, 2, 1, 'w', 'expired'), (2, 3, 3, 1, 'w', 'timed_out'), \
     (2, 4, 4, 1, 'w', NULL)";

async fn lost_leases_are_counted_apart(db: &TestDb) {
    legacy_database(db, RETRY_BUDGETS, LEGACY_ATTEMPTS).await;
    let store = db.store().await;
    let tasks = store.run_tasks(RunId(1)).await.expect("run_tasks");
    let seen: Vec<(&str, i32, i32, i32, i32)> =
        tasks.iter().map(|t| (t.name.as_str(), t.max_attempts, t.max_lost, t.lost, t.attempts_used())).collect();
    assert_eq!(seen, vec![("a", 5, 10, 2, 1), ("b", 5, 10, 0, 2)]);
    let kinds = |t: usize| {
        let store = store.clone();
        let id = tasks[t].id;
        async move {
            let attempts = store.task_attempts(id).await.expect("attempts");
            attempts.iter().map(|a| a.kind.map(AttemptKind::as_str)).collect::<Vec<_>>()
        }
    };
    assert_eq!(kinds(0).await, vec![Some("lost"), Some("error"), Some("lost")]);
    assert_eq!(kinds(1).await, vec![Some("lost"), Some("lost"), Some("error"), None]);
}

/// A step cache row written before retention: used when it was written, never since, no tags;
/// a run of then has no retention of its own.
async fn cache_rows_from_before_retention_count_as_used_when_written(db: &TestDb) {
    let rows = "INSERT INTO cache (key, output) VALUES ('old', '{\"dir\": \"/w/runs/a/shard/checkpoint\"}'); \
         INSERT INTO pipelines (name, spec_text, spec_hash) VALUES ('p', 'steps: []', 'h'); \
         INSERT INTO runs (pipeline_id, params, spec, name) VALUES (1, '{}', '{}', 'p-1')";
    legacy_database(db, RETENTION, rows).await;
    let store = db.store().await;
    let entries = store.cache_entries().await.expect("entries");
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!((e.key.as_str(), e.uses, e.tags.len()), ("old", 0, 0));
    assert_eq!(e.output, json!({"dir": "/w/runs/a/shard/checkpoint"}));
    let age = chrono::Utc::now() - e.last_used_at;
    assert!(age.num_seconds().abs() < 600, "last used when written: {}", e.last_used_at);
    let runs = store.runs_named(&["p-1".to_string()]).await.expect("runs");
    assert_eq!((runs.len(), runs[0].retention), (1, None));
    assert!(store.cache_get("old").await.expect("get").is_some());
    assert!(!store.cache_forget("old", 0).await.expect("forget"), "used since");
    assert!(store.cache_forget("old", 1).await.expect("forget"));
}
