//! The orchestrator's commands: `run`, `lint`, `plan`, `submit`, `server`, `worker`, `runs`,
//! `logs`, `cancel`, `retry` (`gc` is in `gc.rs`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use shardline_control::graph::{kinds, Payload};
use shardline_control::{submit, Submission, TaskOutput};
use shardline_engine::{reaper, run_worker, steps, DiskSettings, WorkerConfig, DEFAULT_SCRATCH_RESERVE};
use shardline_spec::{lint, parse_size, render_all, Severity};
use shardline_store::{redact_url, LogFilter, Page, RunFilter, RunId, RunState, Store, WorkerInfo};
use tokio::sync::watch;

use crate::report::bytes;

/// Where the state lives: `--database-url`, `SHARDLINE_DATABASE_URL`, or the embedded SQLite
/// database under `--state-dir`.
#[derive(Args, Clone, Debug)]
pub struct StateArgs {
    /// PostgreSQL (`postgres://…`) or SQLite (`sqlite://PATH`) URL of the job store.
    #[arg(long, env = "SHARDLINE_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Directory of the embedded state (SQLite database and run work directories).
    #[arg(long, default_value = ".shardline")]
    pub state_dir: PathBuf,
    /// Where runs keep their step outputs: a directory every worker shares (a path or
    /// `file:///…`, used as the work directory), or an object store (`s3://bucket/prefix`,
    /// `gs://…`, `az://…`) for workers that share no disk. Default: `<state-dir>/work`.
    #[arg(long, env = "SHARDLINE_ARTIFACTS")]
    pub artifacts: Option<String>,
}

impl StateArgs {
    pub(crate) fn url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| format!("sqlite://{}", self.state_dir.join("state.db").display()))
    }
    pub(crate) fn work_dir(&self) -> PathBuf {
        match self.artifacts.as_deref().map(|a| a.strip_prefix("file://").unwrap_or(a)) {
            Some(dir) if dir.starts_with('/') => PathBuf::from(dir),
            _ => self.state_dir.join("work"),
        }
    }
    /// The object-store artifact store runs submitted from here use, if any.
    pub(crate) fn artifact_store(&self) -> Option<&str> {
        self.artifacts.as_deref().filter(|a| a.contains("://") && !a.starts_with("file://"))
    }
    /// Where a worker keeps what it stages for one task (deleted when the task ends).
    pub(crate) fn scratch_dir(&self) -> PathBuf {
        self.state_dir.join("scratch")
    }
    pub(crate) async fn store(&self) -> Result<Store> {
        let url = self.url();
        Store::connect(&url).await.with_context(|| format!("connecting to the job store ({})", redact_url(&url)))
    }
}

fn parse_set(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
        .ok_or_else(|| format!("`{s}` is not key=value"))
}

/// `--pool NAME=SLOTS`.
fn parse_pool(s: &str) -> Result<(String, u32), String> {
    let (name, slots) = s.split_once('=').ok_or_else(|| format!("`{s}` is not NAME=SLOTS (e.g. `gpu-big=2`)"))?;
    if !shardline_spec::is_pool_name(name) {
        return Err(format!("invalid pool name `{name}`: use lowercase letters, digits, `-` and `_`"));
    }
    let slots = slots.trim().parse::<u32>().map_err(|_| format!("`{slots}` is not a number of slots"))?;
    Ok((name.to_string(), slots))
}

/// What `submit` and `run` print when no run was created: the pipeline is at its concurrency
/// limit and its overflow is `skip`. Exit code 3.
fn skipped(s: &shardline_store::Skipped) -> ExitCode {
    eprintln!("{s}");
    ExitCode::from(3)
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

fn read_spec(file: &Path) -> Result<String> {
    std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))
}

#[derive(Args, Debug)]
pub struct LintArgs {
    /// Pipeline spec files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

pub fn run_lint(args: LintArgs) -> Result<ExitCode> {
    let base = std::env::current_dir()?;
    let mut failed = false;
    for f in &args.files {
        let text = read_spec(f)?;
        let (_, diags) = lint(&f.display().to_string(), &text, &shardline_control::lint_context(&base));
        if diags.is_empty() {
            println!("{}: ok", f.display());
        } else {
            print!("{}", render_all(&diags, &text));
            failed |= diags.iter().any(|d| d.severity == Severity::Error);
        }
    }
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Pipeline spec file.
    pub file: PathBuf,
    /// Override a param: --set tp=4 (repeatable).
    #[arg(long = "set", value_parser = parse_set)]
    pub set: Vec<(String, String)>,
    /// Recompute every step instead of serving finished ones from the cache.
    #[arg(long)]
    pub no_cache: bool,
    /// In-process workers.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Disk space the in-process workers never offer as scratch, e.g. 10GiB (default: 1GiB).
    #[arg(long, env = "SHARDLINE_SCRATCH_RESERVE")]
    pub scratch_reserve: Option<String>,
    #[command(flatten)]
    pub state: StateArgs,
}

/// Resources of an in-process or standalone worker.
#[derive(Args, Clone, Debug)]
pub struct WorkerResources {
    /// CPU slots (default: the machine's cores).
    #[arg(long)]
    pub cpus: Option<u32>,
    /// Memory it may use, e.g. 64GiB (default: the machine's).
    #[arg(long)]
    pub memory: Option<String>,
    /// GPU device indices, e.g. 0,1 (default: discovered with the `cuda` feature, else none).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Option<Vec<u32>>,
    /// Scratch disk it may offer at most, e.g. 500GiB (default: no cap: the free space of the
    /// work directory's file system, measured before each claim, less --scratch-reserve).
    #[arg(long)]
    pub scratch: Option<String>,
    /// Disk space never offered as scratch, e.g. 10GiB: what tasks leave free on the work
    /// directory's file system (default: 1GiB).
    #[arg(long, env = "SHARDLINE_SCRATCH_RESERVE")]
    pub scratch_reserve: Option<String>,
    /// On an artifact store, how much of a rank file a task stages at a time, e.g. 64MiB: the
    /// release bytes a section is written from are fetched, the section is written and uploaded,
    /// and its disk freed before the next (default: 256MiB).
    #[arg(long)]
    pub rank_section: Option<String>,
    /// Worker name (default: host name and process id).
    #[arg(long)]
    pub name: Option<String>,
}

fn machine_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(8 << 30)
}

fn worker_info(r: &WorkerResources, suffix: &str) -> Result<WorkerInfo> {
    let host =
        std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into());
    let size = |s: &Option<String>, default: u64| -> Result<u64> {
        match s {
            Some(s) => parse_size(s).map_err(|e| anyhow::anyhow!("{s}: {e}")),
            None => Ok(default),
        }
    };
    let gpus = match &r.gpus {
        Some(g) => g.clone(),
        None => crate::gpu::discover(),
    };
    Ok(WorkerInfo {
        name: r.name.clone().unwrap_or_else(|| format!("{host}-{}{suffix}", std::process::id())),
        cpus: r.cpus.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(2)),
        memory: size(&r.memory, machine_memory())?,
        gpus,
        scratch: size(&r.scratch, u64::MAX / 4)?,
    })
}

/// Where a worker measures its disk (the work directory's file system) and what it keeps free.
fn disk_settings(r: &WorkerResources, state: &StateArgs) -> Result<DiskSettings> {
    let reserve = match &r.scratch_reserve {
        Some(s) => parse_size(s).map_err(|e| anyhow::anyhow!("--scratch-reserve {s}: {e}"))?,
        None => DEFAULT_SCRATCH_RESERVE,
    };
    Ok(DiskSettings { dir: state.work_dir(), reserve })
}

pub fn run_run(args: RunArgs) -> Result<ExitCode> {
    let text = read_spec(&args.file)?;
    let base = std::env::current_dir()?;
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let work = args.state.work_dir();
        let submitted = match submit(
            &store,
            Submission {
                file: &args.file.display().to_string(),
                text: &text,
                overrides: &args.set,
                base_dir: &base,
                work_dir: &work,
                dedupe_key: None,
                no_cache: args.no_cache,
                policy: None,
                priority: None,
                submitted_by: Some(shardline_control::actor::local_user()),
                artifacts: args.state.artifact_store(),
            },
        )
        .await
        {
            Ok(s) => s,
            Err(shardline_control::SubmitError::Invalid(msg)) => {
                eprint!("{msg}");
                return Ok(ExitCode::from(2));
            }
            Err(shardline_control::SubmitError::Skipped(s)) => return Ok(skipped(&s)),
            Err(e) => return Err(e.into()),
        };
        eprintln!("run {} ({}) submitted", submitted.run.0, submitted.name);
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut handles = Vec::new();
        handles.push(tokio::spawn(reaper(store.clone(), Duration::from_secs(1), stop_rx.clone())));
        for i in 0..args.workers.max(1) {
            let resources = WorkerResources {
                cpus: None,
                memory: None,
                gpus: None,
                scratch: None,
                scratch_reserve: args.scratch_reserve.clone(),
                rank_section: None,
                name: None,
            };
            let info = worker_info(&resources, &format!("-w{i}"))?;
            let mut config = WorkerConfig::new(info);
            config.lease_ttl = Duration::from_secs(10);
            config.disk = Some(disk_settings(&resources, &args.state)?);
            config.scratch_dir = args.state.scratch_dir();
            config.objects.cache_dir = Some(args.state.work_dir().join("cache").join("objects"));
            let store = store.clone();
            let rx = stop_rx.clone();
            handles.push(tokio::spawn(async move {
                if let Err(e) = run_worker(store, config, rx).await {
                    eprintln!("worker stopped: {e}");
                }
            }));
        }
        let state = crate::follow::follow_run(&store, submitted.run).await?;
        let _ = stop_tx.send(true);
        for h in handles {
            let _ = h.await;
        }
        Ok(if state == RunState::Succeeded { ExitCode::SUCCESS } else { ExitCode::from(1) })
    })
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    pub file: PathBuf,
    #[arg(long = "set", value_parser = parse_set)]
    pub set: Vec<(String, String)>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub state: StateArgs,
}

/// Dry run: the task graph with resources, and which shard steps the cache would serve.
pub fn run_plan(args: PlanArgs) -> Result<ExitCode> {
    let text = read_spec(&args.file)?;
    let base = std::env::current_dir()?;
    let pipeline = match shardline_control::parse_pipeline(&args.file.display().to_string(), &text, &base) {
        Ok(p) => p,
        Err(e) => {
            eprint!("{e}");
            return Ok(ExitCode::from(2));
        }
    };
    let resolved =
        pipeline.instantiate(&args.set, "plan-preview").map_err(|d| anyhow::anyhow!(render_all(&d, &text)))?;
    let work = args.state.work_dir();
    let tasks = shardline_control::graph::tasks_for(&resolved, &work.join("runs").join("plan-preview"), &base, None)
        .map_err(|e| anyhow::anyhow!(e))?;
    // One runtime for every store call: a pool must not outlive the runtime it was made on.
    let rt = runtime()?;
    let store = if args.state.database_url.is_some() || args.state.state_dir.join("state.db").exists() {
        rt.block_on(args.state.store()).ok()
    } else {
        None
    };
    let mut rows = Vec::new();
    for t in &tasks {
        let payload: Option<Payload> = serde_json::from_value(t.payload.clone()).ok();
        let mut cached = None;
        if let Some(Payload::Plan { job }) = &payload {
            // The cache key needs the source's digest; read it now (headers only).
            if let Some(Payload::Download { path, .. }) = tasks
                .iter()
                .find(|x| x.name == job.source_task)
                .and_then(|x| serde_json::from_value::<Payload>(x.payload.clone()).ok())
            {
                if let Ok(release) = shardline_formats::safetensors::Release::open(&path) {
                    if let Ok(digest) = steps::release_digest(&release) {
                        let key = steps::shard_cache_key(job, &digest);
                        // A `cache: false` step always runs; an unreadable store says nothing.
                        let usable = steps::cached_checkpoint_usable;
                        cached = match &store {
                            _ if !job.cache => Some(false),
                            Some(s) => rt
                                .block_on(s.cache_peek(&key))
                                .ok()
                                .map(|hit| hit.is_some_and(|v| usable(&TaskOutput::from_value(&v)))),
                            None => Some(false),
                        };
                    }
                }
            }
        }
        rows.push(json!({
            "task": t.name, "step": t.step_id, "kind": t.kind, "needs": t.needs,
            "cpus": t.resources.cpus, "memory": t.resources.memory, "gpus": t.resources.gpus, "scratch": t.resources.scratch,
            "cached": cached,
        }));
    }
    if args.json {
        println!("{}", json!({"pipeline": resolved.name, "spec_hash": resolved.spec_hash, "tasks": rows}));
    } else {
        println!("pipeline `{}` ({} tasks, spec {})", resolved.name, rows.len(), &resolved.spec_hash[..12]);
        for r in &rows {
            let cached = match r["cached"].as_bool() {
                Some(true) => "  [cached]",
                Some(false) => "  [will run]",
                None => "",
            };
            println!(
                "  {:<28} {:<22} cpus {} mem {} gpus {}{cached}",
                r["task"].as_str().unwrap_or(""),
                r["kind"].as_str().unwrap_or(""),
                r["cpus"],
                bytes(r["memory"].as_u64().unwrap_or(0)),
                r["gpus"]
            );
        }
    }
    let _ = kinds::PLAN;
    Ok(ExitCode::SUCCESS)
}

#[derive(Args, Debug)]
pub struct SubmitArgs {
    pub file: PathBuf,
    #[arg(long = "set", value_parser = parse_set)]
    pub set: Vec<(String, String)>,
    /// Idempotency key: resubmitting with it returns the existing run unless that one failed.
    #[arg(long)]
    pub dedupe_key: Option<String>,
    #[arg(long)]
    pub no_cache: bool,
    /// The run's priority: its tasks are claimed before those of runs with a lower one
    /// (default: the spec's `priority:`, else 0).
    #[arg(long, allow_hyphen_values = true)]
    pub priority: Option<i64>,
    #[command(flatten)]
    pub state: StateArgs,
}

/// Prints the run id. Exit codes: 2 when the spec is invalid, 3 when no run was created because
/// the pipeline is at its concurrency limit with `overflow: skip`.
pub fn run_submit(args: SubmitArgs) -> Result<ExitCode> {
    let text = read_spec(&args.file)?;
    let base = std::env::current_dir()?;
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let work = args.state.work_dir();
        match submit(
            &store,
            Submission {
                file: &args.file.display().to_string(),
                text: &text,
                overrides: &args.set,
                base_dir: &base,
                work_dir: &work,
                dedupe_key: args.dedupe_key.clone(),
                no_cache: args.no_cache,
                policy: None,
                priority: args.priority,
                submitted_by: Some(shardline_control::actor::local_user()),
                artifacts: args.state.artifact_store(),
            },
        )
        .await
        {
            Ok(s) => {
                println!("{}", s.run.0);
                if !s.created {
                    eprintln!("an identical submission exists: run {}", s.run.0);
                }
                for c in &s.cancelled {
                    eprintln!("cancelled run {c}: replaced by run {} (concurrency overflow: cancel-previous)", s.run.0);
                }
                Ok(ExitCode::SUCCESS)
            }
            Err(shardline_control::SubmitError::Skipped(s)) => Ok(skipped(&s)),
            Err(shardline_control::SubmitError::Invalid(msg)) => {
                eprint!("{msg}");
                Ok(ExitCode::from(2))
            }
            Err(e) => Err(e.into()),
        }
    })
}

async fn shutdown_signal(tx: watch::Sender<bool>) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    eprintln!("shutting down: draining running tasks");
    let _ = tx.send(true);
}

#[derive(Args, Debug)]
pub struct ServerArgs {
    #[command(flatten)]
    pub http: crate::serve::HttpArgs,
    #[command(flatten)]
    pub triggers: crate::triggers::TriggerServeArgs,
    /// A pool of run slots, `NAME=SLOTS` (repeatable): runs of a pipeline with `pool: NAME`
    /// take one slot each while they run. Stored in the job store for every server and worker.
    #[arg(long = "pool", value_parser = parse_pool)]
    pub pools: Vec<(String, u32)>,
    #[command(flatten)]
    pub notify: crate::notify::NotifyArgs,
    #[command(flatten)]
    pub policy: crate::serve::PolicyArgs,
    #[command(flatten)]
    pub retention: crate::gc::RetentionArgs,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_server(args: ServerArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        if !args.pools.is_empty() {
            store.set_pools(&args.pools).await.context("defining the pools")?;
            for (name, slots) in &args.pools {
                eprintln!("server: pool {name} has {slots} slot(s)");
            }
        }
        crate::gc::record_policy(&store, &args.retention).await?;
        let (tx, rx) = watch::channel(false);
        tokio::spawn(shutdown_signal(tx));
        // One set of metrics: the HTTP server shows what the trigger loop counts.
        let metrics = shardline_metrics::Metrics::new(store.clone());
        let policy = args.policy.policy()?;
        let artifacts = args.state.artifact_store().map(str::to_string);
        if let Some(url) = &artifacts {
            // Refuse a store that cannot be opened now rather than fail every run later.
            shardline_artifacts::Artifacts::open(url, &[]).context("the artifact store (--artifacts)")?;
            eprintln!("server: runs keep their step outputs in {url}; workers need no shared disk");
        }
        let (http, bound) = match crate::serve::start_http(
            &args.http,
            &store,
            &metrics,
            policy.clone(),
            args.state.work_dir(),
            artifacts.clone(),
            rx.clone(),
        )
        .await?
        {
            Some((h, a)) => (Some(h), Some(a)),
            None => (None, None),
        };
        let triggers = crate::triggers::start(
            &args.triggers,
            &store,
            &metrics,
            policy,
            args.state.work_dir(),
            artifacts.clone(),
            rx.clone(),
        )
        .await?;
        let notifier = crate::notify::start(&args.notify, &store, bound, rx.clone()).await?;
        if let Some(url) = &artifacts {
            tokio::spawn(crate::gc::artifact_gc(store.clone(), url.clone(), rx.clone()));
        }
        eprintln!("server: reaping expired leases on {}", redact_url(&args.state.url()));
        reaper(store, Duration::from_secs(1), rx).await;
        if let Some(h) = http {
            let _ = h.await;
        }
        if let Some(h) = triggers {
            let _ = h.await;
        }
        let _ = tokio::time::timeout(crate::notify::DRAIN, notifier).await;
        Ok(ExitCode::SUCCESS)
    })
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub resources: WorkerResources,
    /// Lease length in seconds (heartbeats renew it every third).
    #[arg(long, default_value_t = 30)]
    pub lease_seconds: u64,
    #[command(flatten)]
    pub gc: crate::gc::WorkerGcArgs,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_worker_cmd(args: WorkerArgs) -> Result<ExitCode> {
    let info = worker_info(&args.resources, "")?;
    let disk = disk_settings(&args.resources, &args.state)?;
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let (tx, rx) = watch::channel(false);
        tokio::spawn(shutdown_signal(tx));
        eprintln!("worker `{}`: {} cpus, {} memory, gpus {:?}", info.name, info.cpus, bytes(info.memory), info.gpus);
        match shardline_engine::disk::measure(&disk.dir) {
            Ok(space) => eprintln!(
                "worker `{}`: {} free of {} on the file system of {}, {} kept free",
                info.name,
                bytes(space.free),
                bytes(space.total),
                disk.dir.display(),
                bytes(disk.reserve)
            ),
            Err(e) => {
                eprintln!("worker `{}`: cannot measure {}: {e}; no scratch offered", info.name, disk.dir.display())
            }
        }
        let mut config = WorkerConfig::new(info);
        config.lease_ttl = Duration::from_secs(args.lease_seconds.max(1));
        config.scratch_dir = args.state.scratch_dir();
        // Its own object cache (artifacts read back, release files read whole), where its gc
        // looks after it, whatever directory a run's payload names.
        config.objects.cache_dir = Some(args.state.work_dir().join("cache").join("objects"));
        if let Some(s) = &args.resources.rank_section {
            config.objects.rank_section_bytes =
                parse_size(s).map_err(|e| anyhow::anyhow!("--rank-section {s}: {e}"))?.max(1);
        }
        config.disk = Some(disk);
        config.gc = args.gc.setting(&args.state);
        run_worker(store, config, rx).await.context("worker")?;
        Ok(ExitCode::SUCCESS)
    })
}

#[derive(Args, Debug)]
pub struct RunsArgs {
    /// Only runs in this state (queued, running, succeeded, failed, cancelled).
    #[arg(long)]
    pub state_filter: Option<String>,
    #[arg(long, default_value_t = 20)]
    pub limit: i64,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_runs(args: RunsArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let state = match &args.state_filter {
            Some(s) => Some(s.parse::<RunState>().map_err(|_| anyhow::anyhow!("unknown state `{s}`"))?),
            None => None,
        };
        let page =
            store.list_runs(&RunFilter { state, pipeline: None }, Page { limit: args.limit, before: None }).await?;
        if args.json {
            println!("{}", serde_json::to_string(&page.runs)?);
        } else {
            println!(
                "{:>6}  {:<24} {:<10} {:>9}  {:<19}  submitted by",
                "run", "pipeline", "state", "tasks", "created"
            );
            for r in page.runs {
                // The latest cancel or retry says who last touched the run.
                let last = r.actions.last().map(|a| format!("  ({} by {})", a.action, a.actor)).unwrap_or_default();
                println!(
                    "{:>6}  {:<24} {:<10} {:>4}/{:<4}  {}  {}{last}",
                    r.id.0,
                    r.pipeline_name,
                    r.state.as_str(),
                    r.tasks.succeeded,
                    r.tasks.total(),
                    r.created_at.format("%Y-%m-%d %H:%M:%S"),
                    r.submitted_by.as_deref().unwrap_or("-")
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

#[derive(Args, Debug)]
pub struct LogsArgs {
    pub run: i64,
    /// Only this task (by name).
    #[arg(long)]
    pub task: Option<String>,
    /// Keep printing new lines until the run ends.
    #[arg(long)]
    pub follow: bool,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_logs(args: LogsArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let run = RunId(args.run);
        let tasks = store.run_tasks(run).await?;
        let names: BTreeMap<i64, String> = tasks.iter().map(|t| (t.id.0, t.name.clone())).collect();
        let filter = match &args.task {
            Some(name) => {
                let t = tasks
                    .iter()
                    .find(|t| &t.name == name)
                    .ok_or_else(|| anyhow::anyhow!("run {} has no task `{name}`", args.run))?;
                LogFilter::Task(t.id)
            }
            None => LogFilter::Run(run),
        };
        let mut after = 0;
        loop {
            let rows = store.logs(filter, after, 1000).await?;
            for l in &rows {
                println!(
                    "{} {} #{} [{}] {}",
                    l.ts.format("%H:%M:%S%.3f"),
                    names.get(&l.task.0).map(String::as_str).unwrap_or("?"),
                    l.attempt,
                    l.stream.as_str(),
                    l.line
                );
                after = l.id;
            }
            if !args.follow {
                break;
            }
            if rows.is_empty() {
                let done = store.get_run(run).await?.is_none_or(|r| r.state.is_terminal());
                if done {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

#[derive(Args, Debug)]
pub struct CancelArgs {
    pub run: i64,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_cancel(args: CancelArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        if store.cancel_run(RunId(args.run), &shardline_control::actor::local_user()).await? {
            println!("run {} cancelled", args.run);
            Ok(ExitCode::SUCCESS)
        } else {
            eprintln!("run {} was already finished", args.run);
            Ok(ExitCode::from(1))
        }
    })
}

#[derive(Args, Debug)]
pub struct RetryArgs {
    pub run: i64,
    /// Re-run this step and everything downstream of it.
    #[arg(long)]
    pub from: Option<String>,
    #[command(flatten)]
    pub state: StateArgs,
}

pub fn run_retry(args: RetryArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        store.retry_run(RunId(args.run), args.from.as_deref(), &shardline_control::actor::local_user()).await?;
        println!("run {} re-queued{}", args.run, args.from.map(|s| format!(" from step `{s}`")).unwrap_or_default());
        Ok(ExitCode::SUCCESS)
    })
}
