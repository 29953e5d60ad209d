//! Run options (name, no-cache) are columns of their own, never part of a run's params.

mod common;

use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(options_round_trip_apart_from_params);

async fn options_round_trip_apart_from_params(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let options =
        RunOptions { name: Some("convert-20261124-000000-000001".into()), no_cache: true, ..RunOptions::default() };
    let (run, _) = store
        .create_run(NewRun {
            pipeline_id: p,
            dedupe_key: None,
            params: json!({"repo": "org/model"}),
            spec: json!({}),
            options: options.clone(),
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run");
    let row = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(row.options, options);
    assert_eq!(row.params, json!({"repo": "org/model"}), "options stay out of the params");
    let plain = common::run(&store).await;
    let row = store.get_run(plain).await.expect("get_run").expect("run");
    assert_eq!(row.options, RunOptions::default());
    let listed = store.list_runs(&RunFilter::default(), Page::default()).await.expect("list_runs");
    assert!(listed.runs.iter().any(|r| r.options.no_cache && r.options.name == options.name));
}
