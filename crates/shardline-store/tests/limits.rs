//! Concurrency limits, pools and priorities as the claim and admission enforce them: a run
//! holds its pipeline's place and its pool's slot from its first claim until it ends; a run of
//! higher priority is claimed first; `skip` and `cancel-previous` at admission; concurrent
//! claimers never start two runs of a limit-1 pipeline.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::*;
use serde_json::json;
use shardline_store::*;
use tokio::sync::Barrier;

const CLAIMERS: usize = 8;

shardline_testdb::on_both_databases!(
    a_limit_of_one_runs_one_run_at_a_time,
    a_higher_priority_run_is_claimed_first,
    a_pool_is_shared_across_pipelines,
    skip_creates_no_run_and_cancel_previous_cancels,
    concurrent_claimers_start_one_run,
    a_retried_limited_run_waits_for_room,
);

fn limited(key: &str, limit: u32, overflow: Overflow) -> RunOptions {
    RunOptions { concurrency: Some(Concurrency { key: key.into(), limit, overflow }), ..RunOptions::default() }
}

/// A run with `options` and one task named `name`, or with tasks `a` then `b` (b needs a).
async fn run_with(store: &Store, pipeline: i64, options: RunOptions, names: &[&str]) -> RunId {
    let (run, created) = store
        .create_run(NewRun {
            pipeline_id: pipeline,
            dedupe_key: None,
            params: json!({}),
            spec: json!({}),
            options,
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run");
    assert!(created);
    let mut tasks = Vec::new();
    for (i, n) in names.iter().enumerate() {
        let needs: Vec<&str> = if i == 0 { vec![] } else { vec![names[i - 1]] };
        tasks.push(task(n, &needs));
    }
    store.add_tasks(run, tasks).await.expect("add_tasks");
    run
}

async fn state(store: &Store, run: RunId) -> RunState {
    store.get_run(run).await.expect("get_run").expect("run").state
}

async fn a_limit_of_one_runs_one_run_at_a_time(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let opts = limited("nightly", 1, Overflow::Queue);
    let first = run_with(&store, p, opts.clone(), &["a", "b"]).await;
    let second = run_with(&store, p, opts.clone(), &["a", "b"]).await;
    let a = claim_named(&store, w, "a").await;
    assert_eq!(a.task.run, first);
    // The second run's `a` is ready but its pipeline is at its limit.
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
    assert_eq!(
        store.held_back(second).await.expect("held_back"),
        Some(HeldBack::Concurrency { key: "nightly".into(), running: 1, limit: 1 })
    );
    assert_eq!(
        store.held_back(second).await.expect("held_back").map(|h| h.to_string()).as_deref(),
        Some("pipeline nightly: 1 of 1 running")
    );
    assert_eq!(store.held_back(first).await.expect("held_back"), None, "a running run is not held back");
    // Between two tasks of the running run its place stays taken.
    succeed(&store, &a).await;
    let b = claim_named(&store, w, "b").await;
    assert_eq!(b.task.run, first);
    succeed(&store, &b).await;
    assert_eq!(state(&store, first).await, RunState::Succeeded);
    // Its end frees the place.
    let a2 = claim_named(&store, w, "a").await;
    assert_eq!(a2.task.run, second);
    assert_eq!(state(&store, second).await, RunState::Running);
    // Runs without a limit are not held back by anything.
    let free = run_with(&store, p, RunOptions::default(), &["x"]).await;
    let x = claim_named(&store, w, "x").await;
    assert_eq!(x.task.run, free);
}

async fn a_higher_priority_run_is_claimed_first(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let low = run_with(&store, p, RunOptions::default(), &["low"]).await;
    let high = run_with(&store, p, RunOptions { priority: 10, ..RunOptions::default() }, &["high"]).await;
    let tasks = store.run_tasks(high).await.expect("run_tasks");
    assert_eq!(tasks[0].priority, 10, "a task takes its run's priority");
    let first = claim_named(&store, w, "high").await;
    assert_eq!(first.task.run, high);
    let second = claim_named(&store, w, "low").await;
    assert_eq!(second.task.run, low);
    // Priority within a limit: of two queued runs of a pipeline, the higher one starts first.
    let opts = limited("nightly", 1, Overflow::Queue);
    let _q1 = run_with(&store, p, opts.clone(), &["q1"]).await;
    let q2 = run_with(&store, p, RunOptions { priority: 3, ..opts }, &["q2"]).await;
    let lease = claim_named(&store, w, "q2").await;
    assert_eq!(lease.task.run, q2);
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
}

async fn a_pool_is_shared_across_pipelines(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    store.set_pools(&[("gpu-big".into(), 1)]).await.expect("set_pools");
    let in_pool = |key: &str| RunOptions { pool: Some("gpu-big".into()), ..limited(key, 5, Overflow::Queue) };
    let a = run_with(&store, p, in_pool("convert"), &["a"]).await;
    let b = run_with(&store, p, in_pool("reshard"), &["b"]).await;
    let lease = claim_named(&store, w, "a").await;
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none(), "the pool's one slot is taken");
    let held = store.held_back(b).await.expect("held_back").expect("held back");
    assert_eq!(held.to_string(), "pool gpu-big: 1 of 1 slots in use");
    assert_eq!(
        store.list_pools().await.expect("list_pools"),
        vec![PoolRow { name: "gpu-big".into(), slots: 1, in_use: 1 }]
    );
    succeed(&store, &lease).await;
    assert_eq!(state(&store, a).await, RunState::Succeeded);
    claim_named(&store, w, "b").await;
    // A pool the server does not define has no slots: its runs wait and say why.
    let c = run_with(&store, p, RunOptions { pool: Some("tpu".into()), ..RunOptions::default() }, &["c"]).await;
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
    let held = store.held_back(c).await.expect("held_back").expect("held back");
    assert_eq!(held, HeldBack::Pool { name: "tpu".into(), in_use: 0, slots: None });
    assert!(held.to_string().contains("--pool tpu=SLOTS"), "{held}");
    store.set_pools(&[("tpu".into(), 2)]).await.expect("set_pools");
    claim_named(&store, w, "c").await;
}

async fn skip_creates_no_run_and_cancel_previous_cancels(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let new = |options: RunOptions, key: Option<&str>| NewRun {
        pipeline_id: p,
        dedupe_key: key.map(str::to_string),
        params: json!({}),
        spec: json!({}),
        options,
        notify: Vec::new(),
        submitted_by: None,
    };
    // skip: one live run is the limit; a second submission creates nothing and says why.
    let skip = limited("nightly", 1, Overflow::Skip);
    let Admission::Created { run: first, cancelled } =
        store.admit_run(new(skip.clone(), Some("k1"))).await.expect("admit")
    else {
        panic!("the first run is created")
    };
    assert!(cancelled.is_empty());
    let skipped = store.admit_run(new(skip.clone(), None)).await.expect("admit");
    let Admission::Skipped(s) = skipped else { panic!("expected a skip, got {skipped:?}") };
    assert_eq!(s, Skipped { key: "nightly".into(), limit: 1, live: vec![first] });
    assert_eq!(s.to_string(), format!("skipped: pipeline nightly at its limit 1 (live: run {first})"));
    assert!(matches!(store.create_run(new(skip.clone(), None)).await, Err(StoreError::Skipped(_))));
    // The same dedupe key still finds its run (a repeated trigger firing is not a skip).
    assert_eq!(store.admit_run(new(skip.clone(), Some("k1"))).await.expect("admit"), Admission::Existing(first));
    // cancel-previous: the live run (running, its task leased) is cancelled, the new one queued.
    store.add_tasks(first, vec![task("a", &[])]).await.expect("add_tasks");
    let lease = claim_named(&store, w, "a").await;
    let replace = limited("nightly", 1, Overflow::CancelPrevious);
    let Admission::Created { run: second, cancelled } = store.admit_run(new(replace, None)).await.expect("admit")
    else {
        panic!("the replacing run is created")
    };
    assert_eq!(cancelled, vec![first]);
    let row = store.get_run(first).await.expect("get_run").expect("run");
    assert_eq!(row.state, RunState::Cancelled);
    assert!(row.error.as_deref().is_some_and(|e| e.contains("cancel-previous")), "{:?}", row.error);
    assert!(!store.heartbeat(&lease, TTL, None).await.expect("heartbeat"), "the cancelled lease is lost");
    assert_eq!(state(&store, second).await, RunState::Queued);
    store.add_tasks(second, vec![task("a", &[])]).await.expect("add_tasks");
    let lease = claim_named(&store, w, "a").await;
    assert_eq!(lease.task.run, second);
}

async fn concurrent_claimers_start_one_run(db: &TestDb) {
    let p = {
        let store = db.store().await;
        pipeline(&store).await
    };
    let setup = db.store().await;
    let opts = limited("nightly", 1, Overflow::Queue);
    // Claimers with stores of their own (connections of their own on PostgreSQL), released at
    // once.
    let mut claimers = Vec::new();
    for i in 0..CLAIMERS {
        let store = db.store().await;
        let w = store.register_worker(cpu_worker(&format!("w{i}"))).await.expect("register");
        claimers.push((store, w));
    }
    for round in 0..5 {
        let mut runs = Vec::new();
        for i in 0..CLAIMERS {
            runs.push(run_with(&setup, p, opts.clone(), &[&format!("r{round}-{i}")]).await);
        }
        let barrier = Arc::new(Barrier::new(CLAIMERS));
        let mut handles = Vec::new();
        for (store, w) in &claimers {
            let (store, w, barrier) = (store.clone(), *w, Arc::clone(&barrier));
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                store.claim(w, &big(), TTL).await.expect("claim")
            }));
        }
        let mut leases = Vec::new();
        for h in handles {
            if let Some(lease) = h.await.expect("join") {
                leases.push(lease);
            }
        }
        let names: Vec<&str> = leases.iter().map(|l| l.task.name.as_str()).collect();
        assert_eq!(leases.len(), 1, "round {round}: exactly one run may start, got {names:?}");
        let started: HashSet<RunId> = leases.iter().map(|l| l.task.run).collect();
        let mut running = 0;
        for r in &runs {
            if state(&setup, *r).await == RunState::Running {
                running += 1;
            }
        }
        assert_eq!((started.len(), running), (1, 1), "round {round}");
        // Drain the round: each run in turn.
        let w = setup.register_worker(cpu_worker("drain")).await.expect("register");
        succeed(&setup, &leases[0]).await;
        for _ in 1..runs.len() {
            let lease = setup.claim(w, &big(), TTL).await.expect("claim").expect("the next run starts");
            assert!(setup.claim(w, &big(), TTL).await.expect("claim").is_none());
            succeed(&setup, &lease).await;
        }
    }
}

async fn a_retried_limited_run_waits_for_room(db: &TestDb) {
    let store = db.store().await;
    let p = pipeline(&store).await;
    let w = store.register_worker(cpu_worker("w")).await.expect("register");
    let opts = limited("nightly", 1, Overflow::Queue);
    let first = run_with(&store, p, opts.clone(), &["a"]).await;
    let lease = claim_named(&store, w, "a").await;
    store.complete(&lease, Outcome::Failed { error: "boom".into(), retryable: false }).await.expect("complete");
    assert_eq!(state(&store, first).await, RunState::Failed);
    let second = run_with(&store, p, opts, &["b"]).await;
    let b = claim_named(&store, w, "b").await;
    store.retry_run(first, None, "user:test").await.expect("retry_run");
    assert_eq!(state(&store, first).await, RunState::Queued, "a retried limited run queues again");
    assert!(store.claim(w, &big(), TTL).await.expect("claim").is_none());
    succeed(&store, &b).await;
    assert_eq!(state(&store, second).await, RunState::Succeeded);
    let a = claim_named(&store, w, "a").await;
    assert_eq!(a.task.run, first);
}
