//! Audit: a run's submitter and every cancel and retry with its actor, on both backends.

mod common;

use common::*;
use serde_json::json;
use shardline_store::*;

shardline_testdb::on_both_databases!(submitter_and_actions_are_recorded, cancel_previous_names_the_submitter);

async fn submitter_and_actions_are_recorded(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let (run, _) = store
        .create_run(NewRun { submitted_by: Some("token:ci".into()), ..new_run(p, json!({})) })
        .await
        .expect("create_run");
    store.add_tasks(run, vec![task("a", &[])]).await.expect("add_tasks");
    let row = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(row.submitted_by.as_deref(), Some("token:ci"));
    assert!(row.actions.is_empty());

    assert!(store.cancel_run(run, "token:ops").await.expect("cancel"));
    // A cancel of a finished run does nothing, so records nothing.
    assert!(!store.cancel_run(run, "token:late").await.expect("cancel again"));
    store.retry_run(run, None, "user:alice@host").await.expect("retry");
    assert!(store.cancel_run(run, "token:ops").await.expect("cancel"));
    store.retry_run(run, None, "token:ci").await.expect("retry twice");
    // A refused retry (the run is running again) records nothing.
    store.retry_run(run, None, "token:refused").await.expect_err("not finished");

    let row = store.get_run(run).await.expect("get_run").expect("run");
    let seen: Vec<(RunActionKind, &str)> = row.actions.iter().map(|a| (a.action, a.actor.as_str())).collect();
    assert_eq!(
        seen,
        [
            (RunActionKind::Cancel, "token:ops"),
            (RunActionKind::Retry, "user:alice@host"),
            (RunActionKind::Cancel, "token:ops"),
            (RunActionKind::Retry, "token:ci"),
        ]
    );
    assert!(row.actions.windows(2).all(|w| w[0].at <= w[1].at));

    // The listing carries the same, per run.
    let plain = common::run(&store).await;
    let page = store.list_runs(&RunFilter::default(), Page::default()).await.expect("list_runs");
    let listed = page.runs.iter().find(|r| r.id == run).expect("listed");
    assert_eq!(listed.submitted_by.as_deref(), Some("token:ci"));
    assert_eq!(listed.actions, row.actions);
    let other = page.runs.iter().find(|r| r.id == plain).expect("listed");
    assert_eq!(other.submitted_by, None);
    assert!(other.actions.is_empty());
}

async fn cancel_previous_names_the_submitter(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let options = RunOptions {
        concurrency: Some(Concurrency { key: "nightly".into(), limit: 1, overflow: Overflow::CancelPrevious }),
        ..RunOptions::default()
    };
    let new = |by: &str| NewRun { options: options.clone(), submitted_by: Some(by.into()), ..new_run(p, json!({})) };
    let (first, _) = store.create_run(new("trigger:nightly#0")).await.expect("first");
    let (second, _) = store.create_run(new("token:ci")).await.expect("second");
    assert_ne!(first, second);
    let row = store.get_run(first).await.expect("get_run").expect("run");
    assert_eq!(row.state, RunState::Cancelled);
    assert_eq!(row.actions.len(), 1);
    assert_eq!((row.actions[0].action, row.actions[0].actor.as_str()), (RunActionKind::Cancel, "token:ci"));
}
