//! Test databases (shared with the other crates' tests through `shardline-testdb`) and small
//! builders of runs, tasks and workers.
#![allow(dead_code)]

use std::time::Duration;

use serde_json::json;
use shardline_store::*;
#[allow(unused_imports)] // not every test binary uses both
pub use shardline_testdb::{Kind, TestDb};

// ---- small builders ----

pub async fn pipeline(store: &Store) -> i64 {
    store.upsert_pipeline("convert", "steps: []", "sha256:0").await.expect("upsert_pipeline")
}

/// A run of pipeline `pipeline_id` with `params`, no dedupe key, an empty spec, default options.
pub fn new_run(pipeline_id: i64, params: serde_json::Value) -> NewRun {
    NewRun {
        pipeline_id,
        dedupe_key: None,
        params,
        spec: json!({}),
        options: RunOptions::default(),
        notify: Vec::new(),
        submitted_by: None,
    }
}

pub async fn run(store: &Store) -> RunId {
    let p = pipeline(store).await;
    store.create_run(new_run(p, json!({}))).await.expect("create_run").0
}

pub fn task(name: &str, needs: &[&str]) -> NewTask {
    NewTask {
        name: name.into(),
        step_id: name.split('.').next().unwrap_or(name).into(),
        kind: "test".into(),
        needs: needs.iter().map(|s| s.to_string()).collect(),
        resources: Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 },
        payload: json!({ "name": name }),
        max_attempts: 3,
        max_lost: DEFAULT_MAX_LOST,
        backoff: Duration::ZERO,
        timeout: Duration::ZERO,
        cache_key: None,
    }
}

pub fn cpu_worker(name: &str) -> WorkerInfo {
    WorkerInfo { name: name.into(), cpus: 8, memory: 32 << 30, gpus: vec![], scratch: 1 << 40 }
}

pub fn big() -> Resources {
    Resources { cpus: 64, memory: 1 << 40, gpus: 8, scratch: 1 << 44 }
}

pub const TTL: Duration = Duration::from_secs(30);

pub async fn succeed(store: &Store, lease: &Lease) {
    let ok = store
        .complete(lease, Outcome::Succeeded { output: json!({ "done": lease.task.name }) })
        .await
        .expect("complete");
    assert!(ok, "completion of `{}` refused", lease.task.name);
}

pub async fn claim_named(store: &Store, w: WorkerId, name: &str) -> Lease {
    let lease = store
        .claim(w, &big(), TTL)
        .await
        .expect("claim")
        .unwrap_or_else(|| panic!("nothing to claim, expected `{name}`"));
    assert_eq!(lease.task.name, name, "claimed the wrong task");
    lease
}

pub async fn state_of(store: &Store, run: RunId, name: &str) -> TaskState {
    store
        .run_tasks(run)
        .await
        .expect("run_tasks")
        .into_iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no task `{name}`"))
        .state
}

pub async fn run_state(store: &Store, run: RunId) -> RunState {
    store.get_run(run).await.expect("get_run").expect("run exists").state
}
