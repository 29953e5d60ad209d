//! Migrations are safe for existing databases: a database written by the previous schema is
//! migrated with its data. Run options kept in params (`__run_name`, `__no_cache`) by earlier
//! versions become the run's options.

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

shardline_testdb::on_both_databases!(run_options_move_out_of_params);

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

async fn run_options_move_out_of_params(db: &TestDb) {
    match db.kind {
        Kind::Sqlite => {
            let opts = SqliteConnectOptions::from_str(&db.url).expect("url").create_if_missing(true);
            let pool = sqlx::SqlitePool::connect_with(opts).await.expect("connect");
            migrations_before("sqlite", RUN_OPTIONS).await.run(&pool).await.expect("old migrations");
            pool.execute(sqlx::raw_sql(LEGACY)).await.expect("legacy rows");
            pool.close().await;
        }
        Kind::Postgres => {
            let opts = PgConnectOptions::from_str(&db.url).expect("url").options([("search_path", PG_SCHEMA)]);
            let pool = sqlx::PgPool::connect_with(opts).await.expect("connect");
            pool.execute(sqlx::raw_sql(&format!("CREATE SCHEMA {PG_SCHEMA}"))).await.expect("schema");
            migrations_before("postgres", RUN_OPTIONS).await.run(&pool).await.expect("old migrations");
            pool.execute(sqlx::raw_sql(LEGACY)).await.expect("legacy rows");
            pool.close().await;
        }
    }
    let store = db.store().await;
    let runs = store.list_runs(&RunFilter::default(), Page::default()).await.expect("list_runs").runs;
    let seen: Vec<(serde_json::Value, RunOptions)> = runs.into_iter().rev().map(|r| (r.params, r.options)).collect();
    assert_eq!(
        seen,
        vec![
            (json!({"repo": "a"}), RunOptions { name: Some("p-1".into()), no_cache: true }),
            (json!({"repo": "b"}), RunOptions { name: Some("p-2".into()), no_cache: false }),
            (json!({"x": 1}), RunOptions::default()),
        ]
    );
}
