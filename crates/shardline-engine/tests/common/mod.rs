//! Test harness: a fresh job store per test (a SQLite file, or a PostgreSQL database of its own),
//! in-process workers and a reaper, and helpers to submit pipelines and wait for their runs.
//! PostgreSQL tests need `SHARDLINE_TEST_DATABASE_URL` (`scripts/setup-postgres` prints it) and
//! fail, never skip, without it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_control::{submit, Submission, Submitted};
use shardline_engine::{reaper, run_worker, HubSettings, WorkerConfig};
use shardline_formats::execute::Progress;
use shardline_formats::safetensors::Release;
use shardline_formats::verify::{verify_checkpoint, VerifyOptions};
use shardline_layout::{build_plan, Mesh, ModelConfig, PlanOptions, SourceTensor};
use shardline_store::{AttemptRow, Lease, RunId, RunRow, Store, TaskRow, WorkerInfo};
#[allow(unused_imports)] // not every test binary uses both
pub use shardline_testdb::{Kind, TestDb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

pub fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures/hf-tiny").join(name)
}

/// A pipeline of `pipelines/`.
pub fn pipeline_text(name: &str) -> String {
    let path = repo().join("pipelines").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A synthetic release of `arch` with about `size` of tensors, generated once and kept under the
/// target directory between test runs (written aside and renamed into place, so concurrent
/// tests never see a half-written one).
pub fn synth_release(arch: &str, size: &str) -> PathBuf {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shardline-synth");
    let dir = cache.join(format!("{arch}-{size}"));
    if dir.join("config.json").is_file() {
        return dir;
    }
    std::fs::create_dir_all(&cache).expect("synth cache dir");
    let tmp = tempfile::tempdir_in(&cache).expect("synth temp dir");
    let bytes = shardline_units::parse_size(size).expect("size");
    shardline_synth::synth(arch, bytes, tmp.path(), 0, &Default::default())
        .unwrap_or_else(|e| panic!("synth {arch} {size}: {e}"));
    let staged = tmp.keep();
    if std::fs::rename(&staged, &dir).is_err() {
        // Another test won the race: use its copy.
        let _ = std::fs::remove_dir_all(&staged);
    }
    assert!(dir.join("config.json").is_file(), "synthetic release {} missing", dir.display());
    dir
}

/// A store with in-process workers and a reaper; specs are submitted from `base` (relative paths
/// of a spec resolve there) and runs work under `base/work`.
pub struct Harness {
    pub db: TestDb,
    pub store: Store,
    pub base: tempfile::TempDir,
    stop: watch::Sender<bool>,
    handles: Vec<JoinHandle<()>>,
    workers: usize,
    /// The object-store artifact store runs are submitted with (`None`: the work directory).
    pub artifacts: Option<String>,
}

impl Harness {
    pub async fn new(kind: Kind) -> Harness {
        let db = TestDb::new(kind).await;
        let store = db.store().await;
        let (stop, rx) = watch::channel(false);
        let handles = vec![tokio::spawn(reaper(store.clone(), Duration::from_millis(200), rx))];
        Harness { db, store, base: tempfile::tempdir().expect("temp dir"), stop, handles, workers: 0, artifacts: None }
    }

    pub fn work_dir(&self) -> PathBuf {
        self.base.path().join("work")
    }

    /// Starts `n` in-process workers (`w0`, `w1`, …) with `lease` leases.
    pub fn start_workers(&mut self, n: usize, lease: Duration) {
        self.start_workers_with(n, lease, HubSettings::default());
    }

    /// As [`Harness::start_workers`], with Hub settings (a cache directory of the test's own).
    pub fn start_workers_with(&mut self, n: usize, lease: Duration, hub: HubSettings) {
        self.start_workers_configured(n, lease, |c| c.hub = hub.clone());
    }

    /// As [`Harness::start_workers`], each worker's configuration adjusted by `configure`.
    pub fn start_workers_configured(&mut self, n: usize, lease: Duration, configure: impl Fn(&mut WorkerConfig)) {
        for _ in 0..n {
            let info = WorkerInfo {
                name: format!("w{}", self.workers),
                cpus: 2,
                memory: 16 << 30,
                gpus: vec![],
                scratch: 1 << 40,
            };
            self.workers += 1;
            let mut config = WorkerConfig::new(info);
            config.lease_ttl = lease;
            config.poll = Duration::from_millis(100);
            configure(&mut config);
            let store = self.store.clone();
            let rx = self.stop.subscribe();
            self.handles.push(tokio::spawn(async move {
                run_worker(store, config, rx).await.expect("worker");
            }));
        }
    }

    pub async fn submit(&self, text: &str, set: &[(&str, String)], no_cache: bool) -> Submitted {
        let overrides: Vec<(String, String)> = set.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        let work = self.work_dir();
        submit(
            &self.store,
            Submission {
                file: "pipeline.yaml",
                text,
                overrides: &overrides,
                base_dir: self.base.path(),
                work_dir: &work,
                dedupe_key: None,
                no_cache,
                policy: None,
                priority: None,
                submitted_by: Some("user:test".into()),
                artifacts: self.artifacts.as_deref(),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("submit: {e}"))
    }

    pub async fn run(&self, run: RunId) -> RunRow {
        self.store.get_run(run).await.expect("get_run").expect("run exists")
    }

    /// Waits until the run is finished; panics after `timeout`.
    pub async fn wait_finished(&self, run: RunId, timeout: Duration) -> RunRow {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.run(run).await;
            if r.state.is_terminal() {
                return r;
            }
            assert!(Instant::now() < deadline, "run {run} still {} after {timeout:?}: {:?}", r.state, r.tasks);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn tasks(&self, run: RunId) -> Vec<TaskRow> {
        self.store.run_tasks(run).await.expect("run_tasks")
    }

    pub async fn task(&self, run: RunId, name: &str) -> TaskRow {
        self.tasks(run).await.into_iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no task `{name}`"))
    }

    pub async fn attempts(&self, run: RunId, name: &str) -> Vec<AttemptRow> {
        let t = self.task(run, name).await;
        self.store.task_attempts(t.id).await.expect("task_attempts")
    }

    /// Waits until `cond` holds for the task `name`; panics after `timeout`.
    pub async fn wait_task(
        &self,
        run: RunId,
        name: &str,
        timeout: Duration,
        cond: impl Fn(&TaskRow) -> bool,
    ) -> TaskRow {
        let deadline = Instant::now() + timeout;
        loop {
            let t = self.task(run, name).await;
            if cond(&t) {
                return t;
            }
            let r = self.run(run).await;
            assert!(
                Instant::now() < deadline && !r.state.is_terminal(),
                "task `{name}` of run {run} is {} (run {}: {:?})",
                t.state,
                r.state,
                r.error
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The log lines of a task, every attempt.
    pub async fn logs(&self, run: RunId, name: &str) -> Vec<String> {
        self.log_rows(run, name).await.into_iter().map(|l| l.line).collect()
    }

    pub async fn log_rows(&self, run: RunId, name: &str) -> Vec<shardline_store::LogRow> {
        let t = self.task(run, name).await;
        self.store.logs(shardline_store::LogFilter::Task(t.id), 0, 10_000).await.expect("logs")
    }

    /// Stops the workers and the reaper (in-flight tasks drain), then drops the database.
    pub async fn finish(mut self) {
        let _ = self.stop.send(true);
        for h in self.handles.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(60), h).await;
        }
        self.store.close().await;
        self.db.cleanup().await;
    }
}

/// The lease a task's current attempt holds, as its worker saw it (for late-completion checks).
pub fn lease_of(task: &TaskRow) -> Lease {
    Lease {
        task: task.clone(),
        worker: task.lease_owner.expect("leased task has an owner"),
        token: task.lease_token,
        expires_at: task.lease_expires_at.unwrap_or_else(chrono::Utc::now),
    }
}

pub fn output(t: &TaskRow) -> &Value {
    t.output.as_ref().unwrap_or_else(|| panic!("task `{}` has no output", t.name))
}

/// Rebuilds every tensor of `ckpt_dir` from `source` and compares bit for bit (independently of
/// the pipeline's own validate step).
pub fn assert_bit_exact(ckpt_dir: &Path, source: &Path) {
    let release = Release::open(source).expect("release");
    let config = ModelConfig::from_json(release.config_json()).expect("config");
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let options = PlanOptions { vocab_divisible_by: 1, split_fused: true, ..PlanOptions::default() };
    let reference = build_plan(&config, sources, Mesh::new(1, 1, 1, 1), &options).expect("reference plan");
    let report = verify_checkpoint(ckpt_dir, &release, &reference, &VerifyOptions::default(), &Progress::default())
        .expect("verify");
    assert!(report.ok(), "{} differs from {}: {:?}", ckpt_dir.display(), source.display(), &report.findings[..1]);
    assert!(report.bytes_checked > 0 && report.tensors > 0);
}
