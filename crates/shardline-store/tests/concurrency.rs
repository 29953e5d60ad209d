//! Eight workers, each with its own claim loop, drain 500 tasks: no task is ever leased twice at
//! once, every task succeeds exactly once, and every attempt is recorded. Every 7th task fails
//! its first attempt (retryable, no backoff), so retries race with claims too.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use shardline_store::*;

const WORKERS: usize = 8;
const TASKS: usize = 500;

#[derive(Default)]
struct Tracker {
    in_flight: Mutex<HashSet<TaskId>>,
    succeeded: Mutex<HashMap<TaskId, u32>>,
    double_leases: AtomicU64,
    claims_by_worker: Mutex<HashMap<usize, u64>>,
}

impl Tracker {
    fn done(&self) -> usize {
        self.succeeded.lock().map(|m| m.len()).unwrap_or(0)
    }
}

fn fails_first(id: TaskId) -> bool {
    id.0 % 7 == 0
}

async fn worker(index: usize, store: Store, w: WorkerId, tracker: Arc<Tracker>) {
    let free = Resources { cpus: 4, memory: 1 << 34, gpus: 0, scratch: 0 };
    let deadline = Instant::now() + Duration::from_secs(120);
    while tracker.done() < TASKS {
        assert!(Instant::now() < deadline, "worker {index}: the swarm did not finish in time");
        let lease = match store.claim(w, &free, TTL).await {
            Ok(Some(lease)) => lease,
            Ok(None) => {
                store.wait_for_work(Duration::from_millis(100)).await;
                continue;
            }
            Err(e) => panic!("worker {index}: claim failed: {e}"),
        };
        *tracker.claims_by_worker.lock().expect("lock").entry(index).or_default() += 1;
        if !tracker.in_flight.lock().expect("lock").insert(lease.task.id) {
            tracker.double_leases.fetch_add(1, Ordering::Relaxed);
        }
        tokio::task::yield_now().await;
        // Still ours until the completion commits: nobody else can claim it before then.
        tracker.in_flight.lock().expect("lock").remove(&lease.task.id);
        let outcome = if fails_first(lease.task.id) && lease.task.attempt == 1 {
            Outcome::Failed { error: "first attempt fails".into(), retryable: true }
        } else {
            Outcome::Succeeded { output: json!({ "by": index }) }
        };
        let success = matches!(outcome, Outcome::Succeeded { .. });
        let accepted =
            store.complete(&lease, outcome).await.unwrap_or_else(|e| panic!("worker {index}: complete: {e}"));
        assert!(accepted, "worker {index}: completion of task {} refused", lease.task.id);
        if success {
            *tracker.succeeded.lock().expect("lock").entry(lease.task.id).or_default() += 1;
        }
    }
}

async fn swarm(stores: Vec<Store>, label: &str) {
    let store = stores[0].clone();
    let run = run(&store).await;
    let tasks: Vec<NewTask> =
        (0..TASKS).map(|i| NewTask { max_attempts: 3, ..task(&format!("rank.{i}"), &[]) }).collect();
    let ids = store.add_tasks(run, tasks).await.expect("add_tasks");
    assert_eq!(ids.len(), TASKS);
    let tracker = Arc::new(Tracker::default());
    let start = Instant::now();
    let mut handles = Vec::new();
    for (i, s) in stores.iter().cycle().take(WORKERS).enumerate() {
        let w = s.register_worker(cpu_worker(&format!("w{i}"))).await.expect("register");
        handles.push(tokio::spawn(worker(i, s.clone(), w, Arc::clone(&tracker))));
    }
    for h in handles {
        h.await.expect("worker panicked");
    }
    let elapsed = start.elapsed();
    let by_worker = tracker.claims_by_worker.lock().expect("lock").clone();
    eprintln!("{label}: {TASKS} tasks by {WORKERS} workers in {elapsed:?}; claims per worker {by_worker:?}");

    assert_eq!(tracker.double_leases.load(Ordering::Relaxed), 0, "a task was leased twice at once");
    let succeeded = tracker.succeeded.lock().expect("lock").clone();
    assert_eq!(succeeded.len(), TASKS, "every task succeeds");
    assert!(succeeded.values().all(|&n| n == 1), "every task succeeds exactly once");

    let r = store.get_run(run).await.expect("get_run").expect("run");
    assert_eq!(r.state, RunState::Succeeded);
    assert_eq!(r.tasks.succeeded, TASKS as i64);
    let rows = store.run_tasks(run).await.expect("run_tasks");
    for t in &rows {
        let expected = if fails_first(t.id) { 2 } else { 1 };
        assert_eq!(t.attempt, expected, "task {} attempts", t.name);
        assert_eq!(t.lease_token, i64::from(expected), "one token per lease");
        let attempts = store.task_attempts(t.id).await.expect("attempts");
        let outcomes: Vec<Option<AttemptOutcome>> = attempts.iter().map(|a| a.outcome).collect();
        let want = if fails_first(t.id) {
            vec![Some(AttemptOutcome::Failed), Some(AttemptOutcome::Succeeded)]
        } else {
            vec![Some(AttemptOutcome::Succeeded)]
        };
        assert_eq!(outcomes, want, "attempt history of {}", t.name);
    }
    // The event stream saw every lease, in order.
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let page = store.events_after(after, 5000).await.expect("events");
        let Some(last) = page.last() else { break };
        after = last.id;
        events.extend(page);
    }
    assert!(events.windows(2).all(|p| p[0].id < p[1].id));
    let leased = events.iter().filter(|e| matches!(e.change, Change::Task { state: TaskState::Leased, .. })).count();
    let expected_leases: usize = rows.iter().map(|t| t.attempt as usize).sum();
    assert_eq!(leased, expected_leases);
    assert!(matches!(events.last().map(|e| e.change), Some(Change::Run { state: RunState::Succeeded })));
    for s in &stores {
        s.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_8_workers_500_tasks() {
    let db = TestDb::new(Kind::Sqlite).await;
    let store = db.store().await;
    swarm(vec![store], "sqlite").await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_8_workers_500_tasks_shared_pool() {
    let db = TestDb::new(Kind::Postgres).await;
    let store = db.store_with(8).await;
    swarm(vec![store], "postgres, one pool").await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_8_workers_500_tasks_separate_pools() {
    let db = TestDb::new(Kind::Postgres).await;
    let mut stores = Vec::new();
    for _ in 0..WORKERS {
        stores.push(db.store_with(2).await);
    }
    swarm(stores, "postgres, eight pools").await;
    db.cleanup().await;
}

/// Reapers on several servers at once: every expired lease is handled exactly once.
async fn reapers_race(stores: Vec<Store>) {
    let store = stores[0].clone();
    let run = run(&store).await;
    let tasks: Vec<NewTask> = (0..60).map(|i| NewTask { max_attempts: 2, ..task(&format!("t{i}"), &[]) }).collect();
    store.add_tasks(run, tasks).await.expect("add_tasks");
    let w = store.register_worker(cpu_worker("doomed")).await.expect("register");
    let mut leases = Vec::new();
    while let Some(l) = store.claim(w, &big(), Duration::from_millis(100)).await.expect("claim") {
        leases.push(l);
    }
    assert_eq!(leases.len(), 60);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut handles = Vec::new();
    for s in stores.iter().cycle().take(4) {
        let s = s.clone();
        handles.push(tokio::spawn(async move { s.reap_expired().await.expect("reap") }));
    }
    let mut reaped = 0;
    for h in handles {
        reaped += h.await.expect("reaper");
    }
    assert_eq!(reaped, 60, "each expired lease is reaped once");
    for l in &leases {
        let attempts = store.task_attempts(l.task.id).await.expect("attempts");
        assert_eq!(attempts.len(), 1);
        assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Expired));
        let t = store.task(l.task.id).await.expect("task").expect("exists");
        assert_eq!(t.state, TaskState::Ready, "one attempt left: retried");
        assert!(!store.heartbeat(l, TTL, None).await.expect("hb"));
    }
    let events = store.events_after(0, 10_000).await.expect("events");
    let expired_events =
        events.iter().filter(|e| matches!(e.change, Change::Task { state: TaskState::Ready, attempt: 1, .. })).count();
    assert_eq!(expired_events, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_reapers_race() {
    let db = TestDb::new(Kind::Sqlite).await;
    let a = db.store().await;
    let b = db.store().await;
    reapers_race(vec![a, b]).await;
    db.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_reapers_race() {
    let db = TestDb::new(Kind::Postgres).await;
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(db.store_with(2).await);
    }
    reapers_race(stores).await;
    db.cleanup().await;
}
