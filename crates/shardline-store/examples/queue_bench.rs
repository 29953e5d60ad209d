//! Queue benchmark: claims + completions per second with 8 workers, and pickup latency (a task
//! becoming ready → its claim, both by the database clock).
//!
//! ```sh
//! scripts/setup-postgres
//! SHARDLINE_TEST_DATABASE_URL=postgres://postgres:postgres@127.0.0.1:5432/shardline_test \
//!     cargo run -p shardline-store --example queue_bench --release
//! cargo run -p shardline-store --example queue_bench --release -- sqlite://target/queue_bench.db
//! ```
//!
//! With a `postgres://` URL (the argument, else `SHARDLINE_BENCH_DATABASE_URL`, else
//! `SHARDLINE_TEST_DATABASE_URL`) it creates a scratch database `shardline_bench_<pid>` next to the
//! named one and drops it at the end. `BENCH_TASKS` sets the throughput phase's size (20000).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use shardline_store::*;
use sqlx::{Connection, PgConnection};

const WORKERS: usize = 8;

fn task(name: String) -> NewTask {
    NewTask {
        name,
        step_id: "bench".into(),
        kind: "noop".into(),
        resources: Resources { cpus: 1, memory: 1 << 20, gpus: 0, scratch: 0 },
        payload: json!({}),
        max_attempts: 3,
        ..NewTask::default()
    }
}

fn free() -> Resources {
    Resources { cpus: 64, memory: 1 << 40, gpus: 0, scratch: 0 }
}

/// CPU seconds used so far by this process and by the PostgreSQL backends serving the bench
/// database (from /proc; clock ticks of 10 ms). Wall-clock rates on a shared machine depend on
/// its load; CPU per task does not, and gives the capacity of an otherwise idle machine.
async fn cpu_seconds(bench_url: &str) -> Option<(f64, f64)> {
    fn ticks(pid: &str) -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let after = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = after.split_whitespace().collect();
        Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
    }
    let own = ticks("self")? as f64 / 100.0;
    if !bench_url.starts_with("postgres") {
        return Some((own, 0.0));
    }
    let mut conn = PgConnection::connect(bench_url).await.ok()?;
    let pids: Vec<(i32,)> = sqlx::query_as(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut conn)
    .await
    .ok()?;
    let _ = conn.close().await;
    let server: u64 = pids.iter().filter_map(|(p,)| ticks(&p.to_string())).sum();
    Some((own, server as f64 / 100.0))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summary(label: &str, mut ms: Vec<f64>) {
    ms.sort_by(|a, b| a.total_cmp(b));
    println!(
        "  {label:<28} n={:<6} p50={:>7.2} ms  p99={:>7.2} ms  max={:>7.2} ms",
        ms.len(),
        pct(&ms, 0.50),
        pct(&ms, 0.99),
        ms.last().copied().unwrap_or(f64::NAN)
    );
}

async fn new_run(store: &Store, label: &str) -> RunId {
    let p = store.upsert_pipeline("bench", "bench", "bench").await.expect("pipeline");
    store
        .create_run(NewRun {
            pipeline_id: p,
            dedupe_key: None,
            params: json!({ "phase": label }),
            spec: json!({}),
            options: Default::default(),
            notify: Vec::new(),
            submitted_by: None,
        })
        .await
        .expect("create_run")
        .0
}

/// Phase 1: `n` ready tasks in `runs` runs, 8 workers claim and complete as fast as they can.
async fn throughput(stores: &[Store], bench_url: &str, n: usize, runs: usize, label: &str) {
    let store = &stores[0];
    let mut run_ids = Vec::new();
    for _ in 0..runs {
        run_ids.push(new_run(store, label).await);
    }
    // With several runs, small chunks round-robin so that workers hit every run at once.
    let chunk_size = if runs == 1 { 1000 } else { 25 };
    for (k, chunk) in (0..n).collect::<Vec<_>>().chunks(chunk_size).enumerate() {
        let tasks = chunk.iter().map(|i| task(format!("t{i}"))).collect();
        store.add_tasks(run_ids[k % runs], tasks).await.expect("add_tasks");
    }
    let run = run_ids[0];
    let mut workers = Vec::new();
    for (i, s) in stores.iter().cycle().take(WORKERS).enumerate() {
        let info = WorkerInfo { name: format!("bench-{i}"), cpus: 64, memory: 1 << 40, gpus: vec![], scratch: 0 };
        let w = s.register_worker(info).await.expect("register");
        workers.push((s.clone(), w));
    }
    // Open the pools' connections before measuring, so that the CPU counts cover them.
    for s in stores {
        let _ = s.get_run(run).await;
    }
    let done = Arc::new(AtomicU64::new(0));
    let claims = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let completes = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let cpu_before = cpu_seconds(bench_url).await;
    let start = Instant::now();
    let mut handles = Vec::new();
    for (s, w) in workers {
        let (done, claims, completes) = (Arc::clone(&done), Arc::clone(&claims), Arc::clone(&completes));
        handles.push(tokio::spawn(async move {
            let (mut my_claims, mut my_completes) = (Vec::new(), Vec::new());
            loop {
                let t0 = Instant::now();
                let Some(lease) = s.claim(w, &free(), Duration::from_secs(60)).await.expect("claim") else {
                    break;
                };
                my_claims.push(t0.elapsed().as_secs_f64() * 1e3);
                let t1 = Instant::now();
                let ok = s.complete(&lease, Outcome::Succeeded { output: json!(null) }).await.expect("complete");
                my_completes.push(t1.elapsed().as_secs_f64() * 1e3);
                assert!(ok);
                done.fetch_add(1, Ordering::Relaxed);
            }
            claims.lock().expect("lock").extend(my_claims);
            completes.lock().expect("lock").extend(my_completes);
        }));
    }
    for h in handles {
        h.await.expect("worker");
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(bench_url).await;
    let done = done.load(Ordering::Relaxed);
    let mut states = Vec::new();
    for r in &run_ids {
        states.push(store.get_run(*r).await.expect("get_run").map(|r| r.state));
    }
    let all_done = states.iter().all(|s| *s == Some(RunState::Succeeded));
    println!(
        "{label}: {done} tasks in {secs:.2} s = {:.0} tasks/s = {:.0} claims+completions/s (runs succeeded: {all_done})",
        done as f64 / secs,
        2.0 * done as f64 / secs
    );
    if let (Some((c0, s0)), Some((c1, s1))) = (cpu_before, cpu_after) {
        let per_task_us = ((c1 - c0) + (s1 - s0)) * 1e6 / done as f64;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        println!(
            "  CPU per task (claim + complete): {per_task_us:.0} us = client {:.0} + server {:.0}; \
             on {cores} idle cores: ~{:.0} tasks/s = ~{:.0} claims+completions/s",
            (c1 - c0) * 1e6 / done as f64,
            (s1 - s0) * 1e6 / done as f64,
            cores * 1e6 / per_task_us,
            2.0 * cores * 1e6 / per_task_us
        );
    }
    summary("claim call", claims.lock().expect("lock").clone());
    summary("complete call", completes.lock().expect("lock").clone());
}

/// Phase 2: workers idle in `wait_for_work`; a producer makes `per_batch` tasks ready every
/// `every`, for `secs` seconds. Pickup latency = lease time − ready time (database clock).
async fn pickup(stores: &[Store], per_batch: usize, every: Duration, secs: u64, label: &str) {
    let store = &stores[0];
    let run = new_run(store, label).await;
    // A task no worker can take keeps the run open between bursts; cancelled at the end.
    let holder = NewTask { resources: Resources { gpus: 1, ..free() }, ..task("hold-open".into()) };
    store.add_tasks(run, vec![holder]).await.expect("add_tasks");
    let total = (secs * 1000 / every.as_millis().max(1) as u64) as usize * per_batch;
    let picked = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut handles = Vec::new();
    for (i, s) in stores.iter().cycle().take(WORKERS).enumerate() {
        let s = s.clone();
        let w = s
            .register_worker(WorkerInfo {
                name: format!("idle-{i}"),
                cpus: 64,
                memory: 1 << 40,
                gpus: vec![],
                scratch: 0,
            })
            .await
            .expect("register");
        let (picked, latencies) = (Arc::clone(&picked), Arc::clone(&latencies));
        handles.push(tokio::spawn(async move {
            while (picked.load(Ordering::Relaxed) as usize) < total {
                match s.claim(w, &free(), Duration::from_secs(60)).await.expect("claim") {
                    Some(lease) => {
                        let t = &lease.task;
                        if let (Some(ready), Some(leased)) = (t.ready_at, t.leased_at) {
                            let ms = (leased - ready).num_microseconds().unwrap_or(0) as f64 / 1e3;
                            latencies.lock().expect("lock").push(ms);
                        }
                        picked.fetch_add(1, Ordering::Relaxed);
                        s.complete(&lease, Outcome::Succeeded { output: json!(null) }).await.expect("complete");
                    }
                    None => s.wait_for_work(Duration::from_secs(1)).await,
                }
            }
        }));
    }
    // Let every worker reach its first wait (and open its LISTEN connection).
    for s in stores {
        s.wait_for_work(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tick = tokio::time::interval(every);
    let mut produced = 0;
    let start = Instant::now();
    while produced < total {
        tick.tick().await;
        let tasks = (0..per_batch).map(|k| task(format!("p{}", produced + k))).collect();
        store.add_tasks(run, tasks).await.expect("add_tasks");
        produced += per_batch;
    }
    for h in handles {
        h.await.expect("worker");
    }
    store.cancel_run(run, "user:test").await.expect("cancel_run");
    let rate = produced as f64 / start.elapsed().as_secs_f64();
    println!(
        "{label}: {produced} tasks made ready at {rate:.0}/s ({per_batch} every {every:?}), {WORKERS} idle workers"
    );
    summary("pickup (ready -> leased)", latencies.lock().expect("lock").clone());
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("SHARDLINE_BENCH_DATABASE_URL").ok())
        .or_else(|| std::env::var("SHARDLINE_TEST_DATABASE_URL").ok())
        .expect("give a database URL (argument, SHARDLINE_BENCH_DATABASE_URL or SHARDLINE_TEST_DATABASE_URL)");
    let n: usize = std::env::var("BENCH_TASKS").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);

    // The restart test takes this lock exclusively before restarting the shared cluster.
    let lock_path = std::env::temp_dir().join("shardline-store-postgres-cluster.lock");
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&lock_path)
        .expect("open the cluster lock");
    lock.lock_shared().expect("take the cluster lock");

    let (bench_url, scratch) = if url.starts_with("postgres") {
        let name = format!("shardline_bench_{}", std::process::id());
        let mut admin = PgConnection::connect(&url).await.expect("connect to PostgreSQL");
        sqlx::query(&format!("CREATE DATABASE \"{name}\"")).execute(&mut admin).await.expect("create database");
        let base = url.split('?').next().unwrap_or(&url);
        let cut = base.rfind('/').unwrap_or(base.len());
        (format!("{}/{name}", &base[..cut]), Some((admin, name)))
    } else {
        (url.clone(), None)
    };

    // PostgreSQL: a pool of 16 for the 8 workers; SQLite: its default (one connection).
    let pg = bench_url.starts_with("postgres");
    let options = StoreOptions { max_connections: pg.then_some(16), ..StoreOptions::default() };
    let shared = Store::connect_with(&bench_url, options).await.expect("connect");
    println!(
        "backend: {}, {} workers, {} cores",
        shared.backend(),
        WORKERS,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let label = if pg { "throughput, one run, one pool of 16" } else { "throughput, one run" };
    throughput(std::slice::from_ref(&shared), &bench_url, n, 1, label).await;
    if shared.backend() == Backend::Postgres {
        let mut pools = Vec::new();
        for _ in 0..WORKERS {
            let o = StoreOptions { max_connections: Some(2), ..StoreOptions::default() };
            pools.push(Store::connect_with(&bench_url, o).await.expect("connect"));
        }
        throughput(&pools, &bench_url, n, 1, "throughput, one run, 8 pools of 2").await;
        throughput(&pools, &bench_url, n, 8, "throughput, 8 runs, 8 pools of 2").await;
        pickup(&pools, 1, Duration::from_millis(5), 5, "pickup, 8 pools").await;
        pickup(&pools, 10, Duration::from_millis(10), 5, "pickup, 8 pools, bursts").await;
        for p in &pools {
            p.close().await;
        }
    }
    pickup(std::slice::from_ref(&shared), 1, Duration::from_millis(5), 5, "pickup, one pool").await;
    shared.close().await;
    if let Some((mut admin, name)) = scratch {
        sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
            .execute(&mut admin)
            .await
            .expect("drop database");
    }
}
