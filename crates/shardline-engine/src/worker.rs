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
use shardline_control::graph::{Payload, ReshardSource};
use shardline_control::{TaskOutput, TaskProgress};
use shardline_formats::execute::Progress;
use shardline_store::{
    Lease, LogLine, LogStream, Outcome, Resources, RunId, ScratchNeed, Store, TaskRow, TaskState, WorkerId, WorkerInfo,
};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::checkpoints;
use crate::disk::{self, DiskSettings};
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
    /// Where tasks stage what they read from an artifact store (a directory per task, removed
    /// when it ends) and the object cache of artifacts read back whole (`objects/`).
    pub scratch_dir: std::path::PathBuf,
    /// Where the worker measures its free disk before each claim, and what it keeps free; it
    /// then offers the smaller of its configured scratch and that (see [`crate::disk`]).
    /// `None` (the default): it offers its configured scratch, unmeasured.
    pub disk: Option<DiskSettings>,
    /// The work directory this worker's gc keeps within the store's retention policy, and how
    /// often (`None`: no gc).
    pub gc: Option<(std::path::PathBuf, Duration)>,
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
            scratch_dir: std::env::temp_dir().join("shardline-scratch"),
            disk: None,
            gc: None,
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
    let gc = config
        .gc
        .clone()
        .map(|(work, every)| tokio::spawn(crate::gc::gc_loop(store.clone(), work, every, shutdown.clone())));
    let mut beat = tokio::time::interval(config.lease_ttl / 3);
    let cap = config.info.scratch;
    let free_now = |pool: &Mutex<Pool>| pool.lock().map(|p| p.free).unwrap_or_default();
    // The disk is known to the store from the start, not from the first idle beat.
    disk::beat(&store, id, free_now(&pool), cap, config.disk.as_ref()).await;
    loop {
        if *shutdown.borrow() {
            break;
        }
        // Reap finished handlers.
        while running.try_join_next().is_some() {}
        // Measured before every claim: the disk fills and empties between them.
        let (free, _) = disk::offer(free_now(&pool), cap, config.disk.as_ref());
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
                    _ = beat.tick() => {
                        disk::beat(&store, id, free_now(&pool), cap, config.disk.as_ref()).await;
                    }
                    Some(_) = running.join_next(), if !running.is_empty() => {}
                }
            }
        }
    }
    while running.join_next().await.is_some() {}
    if let Some(gc) = gc {
        // It stops at the shutdown too; a pass in progress finishes its deletions first.
        let _ = gc.await;
    }
    if let Err(e) = store.stop_worker(id).await {
        // It only marks the worker stopped for listings; its leases are all settled by now.
        tracing::warn!("marking worker {id} stopped failed: {e}");
    }
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

/// Runs one leased task to its outcome: read what it builds on, serve it from the step cache
/// or execute it, report the outcome, and remember a cacheable output.
async fn handle(store: &Store, config: &WorkerConfig, lease: Lease, devices: Vec<u32>) {
    let task = &lease.task;
    let (log_tx, log_rx) = mpsc::channel::<LogLine>();
    let mut logs = LogBuffer::new(log_rx);
    let log = |stream: LogStream, line: String| send_log(&log_tx, stream, line);
    log(
        LogStream::System,
        format!(
            "attempt {} of `{}` on worker `{}` (lease token {})",
            task.attempt, task.name, config.info.name, lease.token
        ),
    );
    if !devices.is_empty() {
        let list = devices.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        log(LogStream::System, format!("assigned GPUs [{list}] (CUDA_VISIBLE_DEVICES={list})"));
    }
    let (payload, outputs) = match inputs(store, task).await {
        Ok(inputs) => inputs,
        Err(failure) => {
            if let Outcome::Failed { error, .. } = &failure {
                log(LogStream::Stderr, format!("error: {error}"));
            }
            report(store, &lease, &mut logs, failure, &[]).await;
            return;
        }
    };
    let cache_key = match check_cache(store, config, task.run, &payload, &outputs, &log).await {
        CacheCheck::Hit(output) => {
            report(store, &lease, &mut logs, Outcome::Succeeded { output: output.to_value() }, &[]).await;
            return;
        }
        CacheCheck::Miss { key } => key,
    };
    let started = tokio::time::Instant::now();
    let result = run_step(store, config, &lease, &mut logs, &log_tx, &payload, &outputs, &devices).await;
    match conclude(store, task, &payload, cache_key, started, result, &log).await {
        Ok(output) => {
            // A plan knows how large each rank file will be: its rank tasks need that much scratch.
            let needs = match &payload {
                Payload::Plan { job } => {
                    let mut needs = output.rank_scratch_needs(&task.name);
                    if job.remote.is_some() {
                        // Staged from an artifact store a section at a time: a section's source
                        // bytes and the section itself, or the whole rank's when it is smaller.
                        let section = match config.objects.rank_section_bytes {
                            0 => crate::objects::DEFAULT_RANK_SECTION_BYTES,
                            n => n,
                        };
                        let most = section.saturating_mul(3);
                        needs.iter_mut().for_each(|n| n.bytes = n.bytes.saturating_mul(2).min(most));
                    }
                    needs
                }
                // A checkpoint in an artifact store: the tasks that read it need room for it.
                Payload::Commit { .. } | Payload::Reshard { .. } | Payload::CheckpointFetch { .. } => {
                    let (options, dir) = (&config.objects.store_options, &config.scratch_dir);
                    crate::reader_needs::checkpoint_reader_needs(store, task.run, &task.name, &output, options, dir)
                        .await
                }
                _ => Vec::new(),
            };
            let success = Outcome::Succeeded { output: output.to_value() };
            let accepted = report(store, &lease, &mut logs, success, &needs).await;
            if accepted {
                remember(store, &payload, &outputs, &output).await;
            }
        }
        Err(failure) => {
            report(store, &lease, &mut logs, failure, &[]).await;
        }
    }
}

/// What a step's result means for its task: a success records its plan (a plan task) and its
/// cache key and is logged; a failure after the task's timeout is a timeout (retryable).
async fn conclude(
    store: &Store,
    task: &TaskRow,
    payload: &Payload,
    cache_key: Option<String>,
    started: tokio::time::Instant,
    result: Result<TaskOutput, StepError>,
    log: &(dyn Fn(LogStream, String) + Sync),
) -> Result<TaskOutput, Outcome> {
    let timed_out = !task.timeout.is_zero() && started.elapsed() > task.timeout;
    match result {
        Ok(mut output) => {
            if let Payload::Plan { .. } = payload {
                if let Err(e) = store.set_run_plan(task.run, output.to_value()).await {
                    // The plan is shown with the run; the tasks read it from the plan task's output.
                    tracing::warn!("storing the plan of run {} failed: {e}", task.run);
                }
            }
            if cache_key.is_some() {
                output.cache_key = cache_key;
            }
            log(LogStream::System, format!("succeeded in {:.2}s", started.elapsed().as_secs_f64()));
            Ok(output)
        }
        Err(e) if timed_out => {
            Err(Outcome::Failed { error: format!("timed out after {:?}: {e}", task.timeout), retryable: true })
        }
        Err(e) => {
            log(LogStream::Stderr, format!("error: {e}"));
            Err(Outcome::Failed { error: e.message, retryable: e.retryable })
        }
    }
}

/// What a task reads before it runs: its payload and the outputs of the run's succeeded tasks.
/// A failure is the outcome to report instead.
async fn inputs(store: &Store, task: &TaskRow) -> Result<(Payload, BTreeMap<String, TaskOutput>), Outcome> {
    let payload: Payload = serde_json::from_value(task.payload.clone())
        .map_err(|e| Outcome::Failed { error: format!("unreadable task payload: {e}"), retryable: false })?;
    let tasks = store
        .run_tasks(task.run)
        .await
        .map_err(|e| Outcome::Failed { error: format!("reading run state: {e}"), retryable: true })?;
    let outputs = tasks
        .into_iter()
        .filter(|t| t.state == TaskState::Succeeded)
        .filter_map(|t| Some((t.name, TaskOutput::from_value(t.output.as_ref()?))))
        .collect();
    Ok((payload, outputs))
}

/// What the step cache says about a task before any byte moves.
enum CacheCheck {
    /// Served from the cache: the output to report.
    Hit(Box<TaskOutput>),
    /// To run; a plan's `key` goes into its output, for its commit to remember the checkpoint by.
    Miss { key: Option<String> },
}

/// Looks a task up in the step cache: a shard plan by its job and source digest, a Hub download
/// by its commit (one API request resolves the revision), an object-store download by its
/// listing (names, sizes, ETags). A hit must still be complete on disk to be served.
async fn check_cache(
    store: &Store,
    config: &WorkerConfig,
    run: RunId,
    payload: &Payload,
    outputs: &BTreeMap<String, TaskOutput>,
    log: &(dyn Fn(LogStream, String) + Sync),
) -> CacheCheck {
    let miss = CacheCheck::Miss { key: None };
    let step_cache =
        |step_allows: bool| async move { step_allows && config.use_cache && run_uses_cache(store, run).await };
    match payload {
        Payload::Plan { job } => {
            let digest = outputs.get(&job.source_task).and_then(|o| o.digest.as_deref()).unwrap_or("");
            let key = steps::shard_cache_key(job, digest);
            // A run on an artifact store is served only from its own store, and only for a
            // source it can name by content.
            let remote = job.remote.is_some();
            if remote && digest.is_empty() {
                return miss;
            }
            if step_cache(job.cache).await {
                let hit = match remote {
                    false => cached(store, &key, steps::cached_checkpoint_usable).await,
                    true => cached_in_store(store, &key, config).await,
                };
                if let Some(hit) = hit {
                    let at = hit.artifact.clone().map_or_else(|| Value::from(path_text(&hit.dir)), Value::from);
                    log(LogStream::System, format!("cache hit {key}: {at}"));
                    return CacheCheck::Hit(Box::new(TaskOutput {
                        cached: Some(hit.to_value()),
                        cache_key: Some(key),
                        plan_digest: Some(String::new()),
                        ..TaskOutput::default()
                    }));
                }
            }
            CacheCheck::Miss { key: Some(key) }
        }
        Payload::HubDownload { repo, revision, allow, ignore, endpoint, cache, .. } if step_cache(*cache).await => {
            let req = HubRequest { repo, revision, allow, ignore, endpoint: endpoint.as_deref() };
            let sha = match hub::resolve_sha(&req, &config.hub).await {
                Ok(sha) => sha,
                Err(e) => return not_consulted(log, e),
            };
            let key = hub::cache_key(repo, &sha, allow, ignore);
            let Some(mut hit) = cached(store, &key, hub::cached_snapshot_usable).await else { return miss };
            log(
                LogStream::System,
                format!(
                    "cache hit {key}: `{repo}` at `{revision}` is commit {sha}, already in {}",
                    path_text(&hit.path).unwrap_or_default()
                ),
            );
            hit.cached = Some(json!(true));
            hit.rest.insert("revision".into(), json!(revision));
            if let Some(s) = hit.source.as_mut().and_then(Value::as_object_mut) {
                s.insert("revision".into(), json!(revision));
            }
            CacheCheck::Hit(Box::new(hit))
        }
        Payload::ObjectDownload { url, cache, .. } | Payload::CheckpointFetch { url, cache, .. }
            if step_cache(*cache).await =>
        {
            let listed = match objects::open(url, &config.objects) {
                Ok(src) => objects::list(&src).await,
                Err(e) => Err(e),
            };
            let listing = match listed {
                Ok(listing) => listing,
                Err(e) => return not_consulted(log, e),
            };
            let key = listing.cache_key();
            let Some(mut hit) = cached(store, &key, objects::cached_output_usable).await else { return miss };
            log(
                LogStream::System,
                format!(
                    "cache hit {key}: {} lists the same {} objects, already in {}",
                    listing.url,
                    listing.objects.len(),
                    path_text(&hit.path).unwrap_or_default()
                ),
            );
            hit.cached = Some(json!(true));
            CacheCheck::Hit(Box::new(hit))
        }
        Payload::Reshard { job } if job.remote.is_none() => {
            let digest = checkpoints::reshard_source_dir(job, outputs).and_then(|d| checkpoints::dir_digest(&d));
            let key = match digest {
                Ok(d) => checkpoints::reshard_cache_key(job, &d),
                Err(e) => return not_consulted(log, e),
            };
            if step_cache(job.cache).await {
                if let Some(mut hit) = cached(store, &key, steps::cached_checkpoint_usable).await {
                    log(
                        LogStream::System,
                        format!("cache hit {key}: already resharded in {}", path_text(&hit.dir).unwrap_or_default()),
                    );
                    hit.cached = Some(json!(true));
                    return CacheCheck::Hit(Box::new(hit));
                }
            }
            CacheCheck::Miss { key: Some(key) }
        }
        // A rank file of a reshard the step cache holds whole is not written again (its commit
        // finds the same entry).
        Payload::ReshardRank { job, rank } if job.remote.is_none() && step_cache(job.cache).await => {
            let digest = checkpoints::reshard_source_dir(job, outputs).and_then(|d| checkpoints::dir_digest(&d));
            let Ok(digest) = digest else { return miss };
            let key = checkpoints::reshard_cache_key(job, &digest);
            let Some(hit) = cached(store, &key, steps::cached_checkpoint_usable).await else { return miss };
            let at = path_text(&hit.dir).unwrap_or_default();
            log(LogStream::System, format!("cache hit {key}: already resharded in {at}; rank {rank} is not written"));
            let output = TaskOutput { cached: Some(json!(true)), ..TaskOutput::default() }.with("rank", json!(rank));
            CacheCheck::Hit(Box::new(output))
        }
        // On an artifact store likewise, the source named by its listing.
        Payload::ReshardRank { job, rank } if job.remote.is_some() && step_cache(job.cache).await => {
            let ReshardSource::Task { task } = &job.source else { return miss };
            let Some(url) = outputs.get(task).and_then(|o| o.artifact.as_deref()) else { return miss };
            let Some(digest) = crate::remote::checkpoint_digest(url, &config.objects).await else { return miss };
            let key = checkpoints::reshard_cache_key(job, &digest);
            let Some(hit) = cached_in_store(store, &key, config).await else { return miss };
            let at = hit.artifact.clone().unwrap_or_default();
            log(LogStream::System, format!("cache hit {key}: already resharded in {at}; rank {rank} is not written"));
            let output = TaskOutput { cached: Some(json!(true)), ..TaskOutput::default() }.with("rank", json!(rank));
            CacheCheck::Hit(Box::new(output))
        }
        Payload::Reshard { job } if job.remote.is_some() => {
            // On an artifact store the source is named by its listing (names, sizes, ETags).
            let ReshardSource::Task { task } = &job.source else { return miss };
            let Some(url) = outputs.get(task).and_then(|o| o.artifact.as_deref()) else { return miss };
            let Some(digest) = crate::remote::checkpoint_digest(url, &config.objects).await else { return miss };
            let key = checkpoints::reshard_cache_key(job, &digest);
            if step_cache(job.cache).await {
                if let Some(mut hit) = cached_in_store(store, &key, config).await {
                    let at = hit.artifact.clone().unwrap_or_default();
                    log(LogStream::System, format!("cache hit {key}: already resharded in {at}"));
                    hit.cached = Some(json!(true));
                    return CacheCheck::Hit(Box::new(hit));
                }
            }
            CacheCheck::Miss { key: Some(key) }
        }
        // The weight files of an export the step cache holds whole are not written again.
        Payload::ExportPart { job, part } if job.remote.is_none() && step_cache(job.cache).await => {
            let Ok(key) = checkpoints::local_export_cache_key(job, outputs) else { return miss };
            let Some(hit) = cached(store, &key, checkpoints::cached_export_usable).await else { return miss };
            let at = path_text(&hit.dir).unwrap_or_default();
            log(LogStream::System, format!("cache hit {key}: already exported in {at}; part {part} is not written"));
            let output = TaskOutput { cached: Some(json!(true)), ..TaskOutput::default() }.with("part", json!(part));
            CacheCheck::Hit(Box::new(output))
        }
        Payload::Export { job } if job.remote.is_none() => {
            let key = match checkpoints::local_export_cache_key(job, outputs) {
                Ok(key) => key,
                Err(e) => return not_consulted(log, e),
            };
            if step_cache(job.cache).await {
                if let Some(mut hit) = cached(store, &key, checkpoints::cached_export_usable).await {
                    log(
                        LogStream::System,
                        format!("cache hit {key}: already exported in {}", path_text(&hit.dir).unwrap_or_default()),
                    );
                    hit.cached = Some(json!(true));
                    return CacheCheck::Hit(Box::new(hit));
                }
            }
            CacheCheck::Miss { key: Some(key) }
        }
        _ => miss,
    }
}

/// The download reports the error (with its retries) if it persists.
fn not_consulted(log: &(dyn Fn(LogStream, String) + Sync), e: StepError) -> CacheCheck {
    log(LogStream::System, format!("step cache not consulted: {e}"));
    CacheCheck::Miss { key: None }
}

/// The cached output under `key`, when there is one and `usable` says it is still complete. An
/// unreadable cache is a miss: the task runs.
async fn cached(store: &Store, key: &str, usable: fn(&TaskOutput) -> bool) -> Option<TaskOutput> {
    let hit = store.cache_get(key).await.ok().flatten()?;
    Some(TaskOutput::from_value(&hit)).filter(usable)
}

/// The cached output under `key` of a checkpoint in an artifact store, while its prefix still
/// lists the checkpoint.
async fn cached_in_store(store: &Store, key: &str, config: &WorkerConfig) -> Option<TaskOutput> {
    let hit = cached(store, key, |o| o.artifact.is_some()).await?;
    crate::remote::checkpoint_listed(&hit, &config.objects).await.then_some(hit)
}

fn path_text(p: &Option<std::path::PathBuf>) -> Option<String> {
    p.as_ref().map(|p| p.display().to_string())
}

/// Executes the task on a blocking thread; meanwhile flushes its logs, heartbeats its lease with
/// progress, and stops it when the lease is lost or its timeout passed. A command's lease is also
/// read back every [`COMMAND_LEASE_CHECK`], so that its process group is stopped soon after a
/// cancel or a lost lease, however long the lease.
#[allow(clippy::too_many_arguments)]
async fn run_step(
    store: &Store,
    config: &WorkerConfig,
    lease: &Lease,
    logs: &mut LogBuffer,
    log_tx: &mpsc::Sender<LogLine>,
    payload: &Payload,
    outputs: &BTreeMap<String, TaskOutput>,
    gpus: &[u32],
) -> Result<TaskOutput, StepError> {
    let task = &lease.task;
    let progress = Arc::new(Progress::default());
    let bytes_total = Arc::new(AtomicU64::new(0));
    let exec = {
        let progress = progress.clone();
        let bytes_total = bytes_total.clone();
        let hub_settings = config.hub.clone();
        let object_settings = config.objects.clone();
        let log_tx = Mutex::new(log_tx.clone());
        let payload = payload.clone();
        let outputs = outputs.clone();
        let cpus = task.resources.cpus;
        let gpus = gpus.to_vec();
        let timeout = task.timeout;
        let runtime = tokio::runtime::Handle::current();
        let ledger = crate::remote::UploadLedger { store: store.clone(), lease: lease.clone() };
        let scratch_root = config.scratch_dir.clone();
        let scratch = scratch_root.join(format!("task-{}-{}", task.id, lease.token));
        tokio::task::spawn_blocking(move || {
            let line_to = |stream: LogStream| {
                let log_tx = &log_tx;
                move |line: String| {
                    if let Ok(tx) = log_tx.lock() {
                        send_log(&tx, stream, line);
                    }
                }
            };
            let log = line_to(LogStream::Stdout);
            let stderr = line_to(LogStream::Stderr);
            let ctx = StepContext {
                outputs: &outputs,
                progress: &progress,
                bytes_total: &bytes_total,
                log: &log,
                hub: &hub_settings,
                objects: &object_settings,
                cpus,
                gpus: &gpus,
                timeout,
                stderr: &stderr,
                runtime: &runtime,
                ledger: Some(&ledger),
                scratch: &scratch,
                scratch_root: &scratch_root,
            };
            let result = steps::execute(&payload, &ctx);
            crate::remote::clean(&scratch);
            result
        })
    };
    tokio::pin!(exec);
    let mut tick = tokio::time::interval(config.lease_ttl / 3);
    tick.tick().await;
    // Log lines reach the store at least every second, whatever the lease length.
    let mut log_tick = tokio::time::interval((config.lease_ttl / 3).min(LOG_FLUSH));
    log_tick.tick().await;
    let started = tokio::time::Instant::now();
    let is_command = matches!(payload, Payload::Command { .. });
    let mut lease_check = tokio::time::interval(COMMAND_LEASE_CHECK);
    let mut lease_lost = false;
    loop {
        tokio::select! {
            _ = lease_check.tick(), if is_command && !lease_lost => {
                match store.task(task.id).await {
                    Ok(Some(row)) if row.state == TaskState::Leased && row.lease_token == lease.token => {}
                    Ok(_) => {
                        lease_lost = true;
                        progress.cancel.store(true, Ordering::Relaxed);
                        send_log(log_tx, LogStream::System, "lease lost or task cancelled; stopping".into());
                    }
                    // The heartbeat finds out too, when the store is back.
                    Err(e) => tracing::warn!("reading the lease of `{}` failed (will retry): {e}", task.name),
                }
            }
            r = &mut exec => {
                return r.unwrap_or_else(|e| Err(StepError::transient(format!("task panicked: {e}"))));
            }
            _ = log_tick.tick() => {
                logs.flush(store, lease).await;
            }
            _ = tick.tick() => {
                logs.flush(store, lease).await;
                let total = bytes_total.load(Ordering::Relaxed);
                let p = TaskProgress {
                    bytes: progress.bytes_written.load(Ordering::Relaxed),
                    chunks: progress.chunks_written.load(Ordering::Relaxed),
                    files: progress.files_done.load(Ordering::Relaxed),
                    bytes_total: (total > 0).then_some(total),
                };
                match store.heartbeat(lease, config.lease_ttl, Some(p.to_value())).await {
                    Ok(true) => {}
                    Ok(false) => {
                        // Fenced out (expired, re-leased or cancelled): stop writing at once.
                        progress.cancel.store(true, Ordering::Relaxed);
                        send_log(log_tx, LogStream::System, "lease lost; stopping".into());
                    }
                    Err(e) => tracing::warn!("heartbeat failed (will retry): {e}"),
                }
                if !task.timeout.is_zero() && started.elapsed() > task.timeout {
                    progress.cancel.store(true, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Reports the outcome with the lease's token (a few tries while the store is unreachable), then
/// gives the log lines the store refused meanwhile a few more chances. Returns whether the store
/// accepted the outcome (false: the lease was lost, or the store stayed unreachable). A success
/// carries the scratch `needs` it learned for other tasks of the run.
async fn report(store: &Store, lease: &Lease, logs: &mut LogBuffer, outcome: Outcome, needs: &[ScratchNeed]) -> bool {
    logs.flush(store, lease).await;
    let mut accepted = false;
    for _ in 0..5 {
        match store.complete_with(lease, outcome.clone(), needs).await {
            Ok(a) => {
                accepted = a;
                break;
            }
            Err(e) => {
                tracing::warn!("reporting the outcome failed (will retry): {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                logs.flush(store, lease).await;
            }
        }
    }
    for _ in 0..5 {
        if logs.flush(store, lease).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    accepted
}

/// Remembers an accepted output in the step cache: a downloaded snapshot or prefix under the key
/// its download computed (from the commit, from the listing), a committed checkpoint under its
/// plan task's key; tagged so that live runs protect it from the gc before they know its key.
async fn remember(store: &Store, payload: &Payload, outputs: &BTreeMap<String, TaskOutput>, output: &TaskOutput) {
    let key = match payload {
        Payload::HubDownload { cache: true, .. }
        | Payload::ObjectDownload { cache: true, .. }
        | Payload::CheckpointFetch { cache: true, .. } => output.cache_key.as_deref(),
        Payload::Reshard { job } if job.cache => output.cache_key.as_deref(),
        Payload::Export { job } if job.cache => output.cache_key.as_deref(),
        Payload::Commit { plan_task, job } if job.cache && (output.dir.is_some() || output.artifact.is_some()) => {
            outputs.get(plan_task).and_then(|o| o.cache_key.as_deref())
        }
        _ => None,
    };
    if let Some(key) = key {
        let tags = crate::gc::tags::tags(payload);
        if let Err(e) = store.cache_put_tagged(key, &output.to_value(), &tags).await {
            // The cache only saves work: a later run recomputes what was not remembered.
            tracing::warn!("remembering the output under {key} failed: {e}");
        }
    }
}

async fn run_uses_cache(store: &Store, run: RunId) -> bool {
    match store.get_run(run).await {
        Ok(Some(r)) => !r.options.no_cache,
        _ => true,
    }
}

/// Queues a log line for the store. The receiver lives as long as the task's handler, which
/// outlives every sender, so a send cannot fail while anyone reads: a failure is ignored.
fn send_log(tx: &mpsc::Sender<LogLine>, stream: LogStream, line: String) {
    let _ = tx.send(stamped(stream, line));
}

/// How often a running command's lease is read back (a cancel or a lost lease stops it).
const COMMAND_LEASE_CHECK: Duration = Duration::from_millis(250);

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
