//! PostgreSQL restarted in the middle of a run: the pool reconnects, the LISTEN connection
//! reconnects, workers ride out the errors, and every task finishes exactly once.
//!
//! Restarts the shared cluster (`pg_ctlcluster`), so it holds the cluster lock exclusively:
//! the other PostgreSQL tests hold it shared and never see the server go down.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shardline_store::*;

const TASKS: usize = 300;
const WORKERS: usize = 4;
const LEASE: Duration = Duration::from_secs(3);
/// Long enough that the run spans the restart (300 × 60 ms / 4 workers ≈ 4.5 s).
const WORK: Duration = Duration::from_millis(60);

fn restart_cluster() {
    let cluster = std::env::var("SHARDLINE_PG_CLUSTER").unwrap_or_else(|_| "15 main".to_string());
    let args: Vec<&str> = cluster.split_whitespace().collect();
    let status = std::process::Command::new("pg_ctlcluster")
        .args(&args)
        .arg("restart")
        .status()
        .unwrap_or_else(|e| panic!("cannot run `pg_ctlcluster {cluster} restart`: {e}"));
    assert!(status.success(), "`pg_ctlcluster {cluster} restart` failed: {status}");
}

static RETRIED: AtomicU64 = AtomicU64::new(0);

/// Retries `f` while the store reports transient errors (the server is restarting).
async fn patiently<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if e.is_transient() && Instant::now() < deadline => {
                RETRIED.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restart_mid_run() {
    let db = TestDb::postgres(true).await;
    // Never hold the cluster lock for long: every other PostgreSQL test waits for it.
    let name = db.url.clone();
    let body = tokio::time::timeout(Duration::from_secs(180), restart_mid_run(&db)).await;
    db.cleanup().await;
    body.unwrap_or_else(|_| panic!("the restart test on {name} did not finish within 3 minutes"));
}

async fn restart_mid_run(db: &TestDb) {
    let store = db.store_with(8).await;
    let run = run(&store).await;
    let tasks: Vec<NewTask> = (0..TASKS).map(|i| NewTask { max_attempts: 5, ..task(&format!("t{i}"), &[]) }).collect();
    store.add_tasks(run, tasks).await.expect("add_tasks");

    // Open the LISTEN connection (the first wait does) before the run starts.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.listener_connects() == 0 {
        assert!(Instant::now() < deadline, "the LISTEN connection did not open");
        store.wait_for_work(Duration::from_millis(50)).await;
    }

    let completed: Arc<Mutex<HashMap<TaskId, u32>>> = Arc::default();
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for i in 0..WORKERS {
        let s = store.clone();
        let completed = Arc::clone(&completed);
        let errors = Arc::clone(&errors);
        let w = s.register_worker(cpu_worker(&format!("w{i}"))).await.expect("register");
        handles.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            while completed.lock().expect("lock").len() < TASKS {
                assert!(Instant::now() < deadline, "worker {i} did not finish");
                let lease = match s.claim(w, &big(), LEASE).await {
                    Ok(Some(l)) => l,
                    Ok(None) => {
                        s.wait_for_work(Duration::from_millis(200)).await;
                        continue;
                    }
                    Err(e) if e.is_transient() => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    Err(e) => panic!("worker {i}: claim: {e}"),
                };
                tokio::time::sleep(WORK).await;
                let accepted =
                    patiently("complete", || s.complete(&lease, Outcome::Succeeded { output: json!(i) })).await;
                if accepted {
                    *completed.lock().expect("lock").entry(lease.task.id).or_default() += 1;
                }
            }
        }));
    }
    // A reaper, as every server runs: claims whose reply was lost in the restart expire and retry.
    let reaper = {
        let s = store.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = s.reap_expired().await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };

    let wait_until = |n: usize| {
        let completed = Arc::clone(&completed);
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while completed.lock().expect("lock").len() < n {
                assert!(Instant::now() < deadline, "stuck before {n} completions");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_until(TASKS / 5).await;
    let connects_before = store.listener_connects();
    assert!(connects_before >= 1, "workers listen before the restart");
    let restart_started = Instant::now();
    tokio::task::spawn_blocking(restart_cluster).await.expect("restart");
    let done_at_restart = completed.lock().expect("lock").len();
    eprintln!("restart took {:?}; {done_at_restart} of {TASKS} tasks done by then", restart_started.elapsed());
    assert!(done_at_restart < TASKS, "the run must span the restart");
    for h in handles {
        h.await.expect("worker panicked");
    }
    stop.store(true, Ordering::Relaxed);
    reaper.await.expect("reaper");

    let completed = completed.lock().expect("lock").clone();
    assert_eq!(completed.len(), TASKS);
    assert!(completed.values().all(|&n| n == 1), "each task completed exactly once");
    eprintln!(
        "transient errors during the restart: {} claims, {} other calls (retried)",
        errors.load(Ordering::Relaxed),
        RETRIED.load(Ordering::Relaxed)
    );

    // The run finishes (by the last completion, or by the reaper's sweep).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = patiently("get_run", || store.get_run(run)).await.expect("run").state;
        if state == RunState::Succeeded {
            break;
        }
        assert!(Instant::now() < deadline, "run stuck in {state}");
        patiently("reap", || store.reap_expired()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows = store.run_tasks(run).await.expect("tasks");
    assert!(rows.iter().all(|t| t.state == TaskState::Succeeded));

    // The LISTEN connection came back: an idle worker is woken by a new task, not by its poll.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.listener_connects() <= connects_before {
        assert!(Instant::now() < deadline, "the LISTEN connection did not reconnect");
        store.wait_for_work(Duration::from_millis(100)).await;
    }
    let run2 = common::run(&store).await;
    let w = store.register_worker(cpu_worker("idle")).await.expect("register");
    let waiter = store.clone();
    let handle = tokio::spawn(async move {
        loop {
            if let Some(l) = waiter.claim(w, &big(), LEASE).await.expect("claim") {
                return (Instant::now(), l.task.name);
            }
            waiter.wait_for_work(Duration::from_secs(30)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let added = Instant::now();
    store.add_tasks(run2, vec![task("after-restart", &[])]).await.expect("add_tasks");
    let (claimed, name) = handle.await.expect("waiter");
    assert_eq!(name, "after-restart");
    let latency = claimed.duration_since(added);
    assert!(latency < Duration::from_secs(5), "woken by NOTIFY after the restart ({latency:?})");
    eprintln!("pickup after the restart: {latency:?}; LISTEN connects: {}", store.listener_connects());
    store.close().await;
}
