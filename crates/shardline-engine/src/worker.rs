//! The worker loop: claim a task that fits the free resources, run it on a blocking thread,
//! heartbeat its lease with progress, stream its logs to the store, and report the outcome with
//! the lease's fencing token. A worker that loses its lease stops the task; its late completion
//! would be refused anyway. On shutdown (SIGTERM) it stops claiming and drains what it runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use serde_json::{json, Value};
use shardline_control::graph::Payload;
use shardline_formats::execute::Progress;
use shardline_store::{Lease, LogLine, LogStream, Outcome, Resources, Store, TaskState, WorkerId, WorkerInfo};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::hub::{self, HubRequest, HubSettings};
use crate::objects::{self, ObjectSourceSettings};
use crate::steps::{self, StepContext, StepError};

/// How a worker behaves.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub info: WorkerInfo,
    /// Lease length; heartbeats renew it every third of it.
    pub lease_ttl: Duration,
    /// Longest wait between claim attempts when no wake-up arrives.
    pub poll: Duration,
    /// Serve shard outputs and Hub snapshots from the step cache.
    pub use_cache: bool,
    /// How `hf.download` tasks reach the Hub (default: the environment).
    pub hub: HubSettings,
    /// How `hf.download` tasks reach object stores and where they cache what they download
    /// (default: the environment, `<work>/cache/objects`).
    pub objects: ObjectSourceSettings,
}

impl WorkerConfig {
    pub fn new(info: WorkerInfo) -> WorkerConfig {
        WorkerConfig {
            info,
            lease_ttl: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            use_cache: true,
            hub: HubSettings::default(),
            objects: ObjectSourceSettings::default(),
        }
    }
}

/// Free resources and GPU devices of a worker.
struct Pool {
    free: Resources,
    gpus: BTreeSet<u32>,
}

/// Runs a worker until `shutdown` turns true, then drains in-flight tasks.
pub async fn run_worker(
    store: Store,
    config: WorkerConfig,
    mut shutdown: watch::Receiver<bool>,
) -> Result<WorkerId, shardline_store::StoreError> {
    let id = store.register_worker(config.info.clone()).await?;
    let pool =
        Arc::new(Mutex::new(Pool { free: config.info.resources(), gpus: config.info.gpus.iter().copied().collect() }));
    let mut running: JoinSet<()> = JoinSet::new();
    let mut beat = tokio::time::interval(config.lease_ttl / 3);
    loop {
        if *shutdown.borrow() {
            break;
        }
        // Reap finished handlers.
        while running.try_join_next().is_some() {}
        let free = pool.lock().map(|p| p.free).unwrap_or_default();
        let claimed = if free.cpus > 0 || free.gpus > 0 {
            match store.claim(id, &free, config.lease_ttl).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("claim failed (will retry): {e}");
                    tokio::time::sleep(config.poll).await;
                    None
                }
            }
        } else {
            None
        };
        match claimed {
            Some(lease) => {
                let devices = reserve(&pool, &lease.task.resources);
                let store = store.clone();
                let pool = pool.clone();
                let config = config.clone();
                running.spawn(async move {
                    handle(&store, &config, lease.clone(), devices.clone()).await;
                    release(&pool, &lease.task.resources, &devices);
                });
            }
            None => {
                tokio::select! {
                    _ = store.wait_for_work(config.poll) => {}
                    _ = shutdown.changed() => {}
                    _ = beat.tick() => { let _ = store.worker_heartbeat(id).await; }
                    Some(_) = running.join_next(), if !running.is_empty() => {}
                }
            }
        }
    }
    while running.join_next().await.is_some() {}
    let _ = store.stop_worker(id).await;
    Ok(id)
}

fn reserve(pool: &Mutex<Pool>, need: &Resources) -> Vec<u32> {
    let Ok(mut p) = pool.lock() else { return Vec::new() };
    p.free.cpus = p.free.cpus.saturating_sub(need.cpus);
    p.free.memory = p.free.memory.saturating_sub(need.memory);
    p.free.scratch = p.free.scratch.saturating_sub(need.scratch);
    p.free.gpus = p.free.gpus.saturating_sub(need.gpus);
    let devices: Vec<u32> = p.gpus.iter().take(need.gpus as usize).copied().collect();
    for d in &devices {
        p.gpus.remove(d);
    }
    devices
}

fn release(pool: &Mutex<Pool>, need: &Resources, devices: &[u32]) {
    let Ok(mut p) = pool.lock() else { return };
    p.free.cpus += need.cpus;
    p.free.memory += need.memory;
    p.free.scratch += need.scratch;
    p.free.gpus += need.gpus;
    p.gpus.extend(devices.iter().copied());
}

/// Runs one leased task to its outcome.
async fn handle(store: &Store, config: &WorkerConfig, lease: Lease, devices: Vec<u32>) {
    let task = &lease.task;
    let (log_tx, log_rx) = mpsc::channel::<LogLine>();
    let mut logs = LogBuffer::new(log_rx);
    let sys = |line: String| stamped(LogStream::System, line);
    let _ = log_tx.send(sys(format!(
        "attempt {} of `{}` on worker `{}` (lease token {})",
        task.attempt, task.name, config.info.name, lease.token
    )));
    if !devices.is_empty() {
        let list = devices.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let _ = log_tx.send(sys(format!("assigned GPUs [{list}] (CUDA_VISIBLE_DEVICES={list})")));
    }
    let payload: Payload = match serde_json::from_value(task.payload.clone()) {
        Ok(p) => p,
        Err(e) => {
            let error = format!("unreadable task payload: {e}");
            let _ = log_tx.send(stamped(LogStream::Stderr, format!("error: {error}")));
            logs.flush(store, &lease).await;
            let _ = store.complete(&lease, Outcome::Failed { error, retryable: false }).await;
            return;
        }
    };
    // Outputs of the run's finished tasks: what this task builds on.
    let outputs: BTreeMap<String, Value> = match store.run_tasks(task.run).await {
        Ok(tasks) => tasks
            .into_iter()
            .filter(|t| t.state == TaskState::Succeeded)
            .filter_map(|t| t.output.map(|o| (t.name, o)))
            .collect(),
        Err(e) => {
            let error = format!("reading run state: {e}");
            let _ = log_tx.send(stamped(LogStream::Stderr, format!("error: {error}")));
            logs.flush(store, &lease).await;
            let _ = store.complete(&lease, Outcome::Failed { error, retryable: true }).await;
            return;
        }
    };

    // The step cache, checked before any byte moves.
    let mut cache_key = None;
    if let Payload::Plan { job } = &payload {
        let digest = outputs.get(&job.source_task).and_then(|o| o.get("digest")).and_then(Value::as_str).unwrap_or("");
        let key = steps::shard_cache_key(job, digest);
        if config.use_cache && job.cache && run_uses_cache(store, task.run).await {
            if let Ok(Some(hit)) = store.cache_get(&key).await {
                if steps::cached_checkpoint_usable(&hit) {
                    let _ =
                        log_tx.send(sys(format!("cache hit {key}: {}", hit.get("dir").cloned().unwrap_or_default())));
                    logs.flush(store, &lease).await;
                    let _ = store
                        .complete(
                            &lease,
                            Outcome::Succeeded { output: json!({"cached": hit, "cache_key": key, "plan_digest": ""}) },
                        )
                        .await;
                    return;
                }
            }
        }
        cache_key = Some(key);
    }
    // A Hub download: the revision is resolved to a commit (one API request); a snapshot of that
    // commit with the same patterns that is still complete on disk is reused without a download.
    if let Payload::HubDownload { repo, revision, allow, ignore, endpoint, cache, .. } = &payload {
        if config.use_cache && *cache && run_uses_cache(store, task.run).await {
            let req = HubRequest { repo, revision, allow, ignore, endpoint: endpoint.as_deref() };
            match hub::resolve_sha(&req, &config.hub).await {
                Ok(sha) => {
                    let key = hub::cache_key(repo, &sha, allow, ignore);
                    if let Ok(Some(hit)) = store.cache_get(&key).await {
                        if hub::cached_snapshot_usable(&hit) {
                            let _ = log_tx.send(sys(format!(
                                "cache hit {key}: `{repo}` at `{revision}` is commit {sha}, already in {}",
                                hit.get("path").and_then(Value::as_str).unwrap_or_default()
                            )));
                            let mut output = hit;
                            if let Some(o) = output.as_object_mut() {
                                o.insert("cached".into(), json!(true));
                                o.insert("revision".into(), json!(revision));
                                if let Some(s) = o.get_mut("source").and_then(Value::as_object_mut) {
                                    s.insert("revision".into(), json!(revision));
                                }
                            }
                            logs.flush(store, &lease).await;
                            let _ = store.complete(&lease, Outcome::Succeeded { output }).await;
                            return;
                        }
                    }
                }
                // The download reports the error (with its retries) if it persists.
                Err(e) => {
                    let _ = log_tx.send(sys(format!("step cache not consulted: {e}")));
                }
            }
        }
    }

    // An object-store prefix: listed (names, sizes, ETags); a directory downloaded before from the
    // same listing that is still complete on disk is reused without a byte downloaded.
    if let Payload::ObjectDownload { url, cache: true, .. } = &payload {
        if config.use_cache && run_uses_cache(store, task.run).await {
            let listed = match objects::open(url, &config.objects) {
                Ok(src) => objects::list(&src).await,
                Err(e) => Err(e),
            };
            match listed {
                Ok(listing) => {
                    let key = listing.cache_key();
                    if let Ok(Some(hit)) = store.cache_get(&key).await {
                        if objects::cached_output_usable(&hit) {
                            let _ = log_tx.send(sys(format!(
                                "cache hit {key}: {} lists the same {} objects, already in {}",
                                listing.url,
                                listing.objects.len(),
                                hit.get("path").and_then(Value::as_str).unwrap_or_default()
                            )));
                            let mut output = hit;
                            if let Some(o) = output.as_object_mut() {
                                o.insert("cached".into(), json!(true));
                            }
                            logs.flush(store, &lease).await;
                            let _ = store.complete(&lease, Outcome::Succeeded { output }).await;
                            return;
                        }
                    }
                }
                // The download reports the error (with its retries) if it persists.
                Err(e) => {
                    let _ = log_tx.send(sys(format!("step cache not consulted: {e}")));
                }
            }
        }
    }

    let progress = Arc::new(Progress::default());
    let bytes_total = Arc::new(AtomicU64::new(0));
    let exec = {
        let progress = progress.clone();
        let bytes_total = bytes_total.clone();
        let hub_settings = config.hub.clone();
        let object_settings = config.objects.clone();
        let log_tx = log_tx.clone();
        let payload = payload.clone();
        let outputs = outputs.clone();
        tokio::task::spawn_blocking(move || {
            let log_tx = Mutex::new(log_tx);
            let log = move |line: String| {
                if let Ok(tx) = log_tx.lock() {
                    let _ = tx.send(stamped(LogStream::Stdout, line));
                }
            };
            let ctx = StepContext {
                outputs: &outputs,
                progress: &progress,
                bytes_total: &bytes_total,
                log: &log,
                hub: &hub_settings,
                objects: &object_settings,
            };
            steps::execute(&payload, &ctx)
        })
    };
    tokio::pin!(exec);
    let mut tick = tokio::time::interval(config.lease_ttl / 3);
    tick.tick().await;
    // Log lines reach the store at least every second, whatever the lease length.
    let mut log_tick = tokio::time::interval((config.lease_ttl / 3).min(LOG_FLUSH));
    log_tick.tick().await;
    let started = tokio::time::Instant::now();
    let result: Result<Value, StepError> = loop {
        tokio::select! {
            r = &mut exec => {
                break r.unwrap_or_else(|e| Err(StepError::transient(format!("task panicked: {e}"))));
            }
            _ = log_tick.tick() => {
                logs.flush(store, &lease).await;
            }
            _ = tick.tick() => {
                logs.flush(store, &lease).await;
                let mut p = json!({
                    "bytes": progress.bytes_written.load(Ordering::Relaxed),
                    "chunks": progress.chunks_written.load(Ordering::Relaxed),
                    "files": progress.files_done.load(Ordering::Relaxed),
                });
                let total = bytes_total.load(Ordering::Relaxed);
                if total > 0 {
                    p["bytes_total"] = json!(total);
                }
                match store.heartbeat(&lease, config.lease_ttl, Some(p)).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Fenced out (expired, re-leased or cancelled): stop writing at once.
                        progress.cancel.store(true, Ordering::Relaxed);
                        let _ = log_tx.send(sys("lease lost; stopping".into()));
                    }
                    Err(e) => tracing::warn!("heartbeat failed (will retry): {e}"),
                }
                if !task.timeout.is_zero() && started.elapsed() > task.timeout {
                    progress.cancel.store(true, Ordering::Relaxed);
                }
            }
        }
    };
    let timed_out = !task.timeout.is_zero() && started.elapsed() > task.timeout;
    let outcome = match result {
        Ok(output) => {
            if let Payload::Plan { .. } = &payload {
                let _ = store.set_run_plan(task.run, output.clone()).await;
            }
            let mut output = output;
            if let (Some(key), Some(o)) = (&cache_key, output.as_object_mut()) {
                o.insert("cache_key".into(), json!(key));
            }
            let _ = log_tx.send(sys(format!("succeeded in {:.2}s", started.elapsed().as_secs_f64())));
            Outcome::Succeeded { output }
        }
        Err(e) if timed_out => {
            Outcome::Failed { error: format!("timed out after {:?}: {e}", task.timeout), retryable: true }
        }
        Err(e) => {
            let _ = log_tx.send(stamped(LogStream::Stderr, format!("error: {e}")));
            Outcome::Failed { error: e.message, retryable: e.retryable }
        }
    };
    logs.flush(store, &lease).await;
    let succeeded_commit = matches!((&payload, &outcome), (Payload::Commit { .. }, Outcome::Succeeded { .. }));
    let succeeded_hub_download = matches!(
        (&payload, &outcome),
        (
            Payload::HubDownload { cache: true, .. } | Payload::ObjectDownload { cache: true, .. },
            Outcome::Succeeded { .. }
        )
    );
    let output_for_cache = match &outcome {
        Outcome::Succeeded { output } => Some(output.clone()),
        _ => None,
    };
    let mut accepted = false;
    for _ in 0..5 {
        match store.complete(&lease, outcome.clone()).await {
            Ok(a) => {
                accepted = a;
                break;
            }
            Err(e) => {
                tracing::warn!("reporting the outcome failed (will retry): {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                logs.flush(store, &lease).await;
            }
        }
    }
    // Lines the store refused while the outcome was pending get a few more chances.
    for _ in 0..5 {
        if logs.flush(store, &lease).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if accepted && succeeded_hub_download {
        // Remember the snapshot under its commit's key (computed by the download from the sha it
        // got), a downloaded prefix under its listing's key.
        if let Some(output) = &output_for_cache {
            if let Some(key) = output.get("cache_key").and_then(Value::as_str) {
                let _ = store.cache_put(key, output).await;
            }
        }
    }
    if accepted && succeeded_commit {
        // Remember the committed checkpoint under its plan task's cache key.
        if let (Payload::Commit { plan_task, job }, Some(output)) = (&payload, output_for_cache) {
            let key = outputs.get(plan_task).and_then(|o| o.get("cache_key")).and_then(Value::as_str);
            if let Some(key) = key.filter(|_| job.cache && output.get("dir").is_some()) {
                let _ = store.cache_put(key, &output).await;
            }
        }
    }
}

async fn run_uses_cache(store: &Store, run: shardline_store::RunId) -> bool {
    match store.get_run(run).await {
        Ok(Some(r)) => !r.options.no_cache,
        _ => true,
    }
}

/// Longest a log line waits before it is sent to the store.
const LOG_FLUSH: Duration = Duration::from_secs(1);
/// Lines kept for a store that refuses them (unreachable); beyond this the oldest are dropped.
const MAX_PENDING_LOG_LINES: usize = 100_000;

/// A log line, stamped when it is written (not when it reaches the store).
fn stamped(stream: LogStream, line: String) -> LogLine {
    LogLine { ts: Utc::now(), stream, line }
}

/// An attempt's log lines on their way to the store. Lines the store could not take (a dropped
/// connection, a restarting server) stay queued for the next flush instead of being lost.
struct LogBuffer {
    rx: mpsc::Receiver<LogLine>,
    pending: Vec<LogLine>,
    dropped: usize,
}

impl LogBuffer {
    fn new(rx: mpsc::Receiver<LogLine>) -> LogBuffer {
        LogBuffer { rx, pending: Vec::new(), dropped: 0 }
    }

    /// Sends what is queued; `true` when nothing is left over.
    async fn flush(&mut self, store: &Store, lease: &Lease) -> bool {
        self.pending.extend(self.rx.try_iter());
        if self.pending.is_empty() {
            return true;
        }
        if self.dropped > 0 {
            let note = format!("{} earlier log lines were lost: the job store was unreachable", self.dropped);
            let ts = self.pending[0].ts;
            self.pending.insert(0, LogLine { ts, stream: LogStream::System, line: note });
        }
        match store.append_logs(lease.task.id, lease.task.attempt, &self.pending).await {
            Ok(()) => {
                self.pending.clear();
                self.dropped = 0;
                true
            }
            Err(e) => {
                tracing::warn!("storing {} log lines failed (will retry): {e}", self.pending.len());
                if self.dropped > 0 {
                    self.pending.remove(0);
                }
                if self.pending.len() > MAX_PENDING_LOG_LINES {
                    let excess = self.pending.len() - MAX_PENDING_LOG_LINES;
                    self.pending.drain(..excess);
                    self.dropped += excess;
                }
                false
            }
        }
    }
}
