//! Process-level faults of a shared deployment on PostgreSQL, with the real binary: `shardline
//! server` and `shardline worker` processes on a database of their own per test, killed, stopped,
//! restarted and signalled while a run is under way.
//!
//! Every wait is bounded, and every child process is killed when its test ends (panics included),
//! so a failing test never hangs. The test that restarts the PostgreSQL cluster takes the cluster
//! lock (the file the store's tests use) exclusively; the others hold it shared.

use std::collections::BTreeSet;
use std::fs::File;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use shardline_store::{AttemptOutcome, AttemptRow, RunId, RunRow, RunState, Store, StoreError, TaskRow, TaskState};
use shardline_testdb::TestDb;

use crate::{bin, fixture, run, stderr, stdout};

mod limits;
mod split_steps;

/// The longest any single wait of these tests may take.
const WAIT: Duration = Duration::from_secs(90);

// ---- the deployment under test ------------------------------------------------------------------

/// A synthetic release made with `shardline synth`, kept under the target directory between runs.
pub(crate) fn synth(arch: &str, size: &str) -> PathBuf {
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shardline-synth");
    let dir = cache.join(format!("{arch}-{size}"));
    if dir.join("config.json").is_file() {
        return dir;
    }
    std::fs::create_dir_all(&cache).expect("synth cache");
    let tmp = tempfile::tempdir_in(&cache).expect("synth temp dir");
    let o = run(bin().args(["synth", "--arch", arch, "--size", size]).arg(tmp.path()));
    assert!(o.status.success(), "synth: {}", stderr(&o));
    let staged = tmp.keep();
    if std::fs::rename(&staged, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&staged); // another test made it meanwhile
    }
    assert!(dir.join("config.json").is_file());
    dir
}

pub(crate) struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A database of its own, a state directory, the `server`/`worker` processes started on them, and
/// a store handle for looking at the run. Dropping it kills every process and drops the database.
pub(crate) struct Deployment {
    url: String,
    db: Option<TestDb>,
    dir: tempfile::TempDir,
    procs: Vec<Proc>,
    rt: tokio::runtime::Runtime,
    store: Option<Store>,
}

impl Deployment {
    pub(crate) fn new(exclusive: bool) -> Deployment {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let db = rt.block_on(TestDb::postgres(exclusive));
        let url = db.url.clone();
        let store = rt.block_on(db.store());
        Deployment {
            url,
            db: Some(db),
            dir: tempfile::tempdir().expect("temp dir"),
            procs: Vec::new(),
            rt,
            store: Some(store),
        }
    }

    pub(crate) fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = bin();
        c.args(args).arg("--database-url").arg(&self.url).arg("--state-dir").arg(self.state_dir());
        c.current_dir(self.dir.path());
        c
    }

    pub(crate) fn spawn(&mut self, name: &str, args: &[&str]) {
        let log = self.dir.path().join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let child = self
            .cmd(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        self.procs.push(Proc { name: name.to_string(), child, log });
    }

    pub(crate) fn server(&mut self, name: &str) {
        self.spawn(name, &["server"]);
    }

    pub(crate) fn worker(&mut self, name: &str, extra: &[&str]) {
        let mut args = vec!["worker", "--name", name];
        args.extend_from_slice(extra);
        self.spawn(name, &args);
    }

    pub(crate) fn proc(&mut self, name: &str) -> &mut Proc {
        self.procs.iter_mut().find(|p| p.name == name).unwrap_or_else(|| panic!("no process `{name}`"))
    }

    pub(crate) fn pid(&mut self, name: &str) -> u32 {
        self.proc(name).child.id()
    }

    pub(crate) fn signal(&mut self, name: &str, signal: &str) {
        let pid = self.pid(name);
        let s = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().expect("kill");
        assert!(s.success(), "kill -{signal} {name} ({pid})");
    }

    /// `kill -9`, reaps the process and forgets it, so `name` can be started again.
    pub(crate) fn kill9_and_forget(&mut self, name: &str) {
        self.kill9(name);
        self.procs.retain(|p| p.name != name);
    }

    /// `kill -9`, and reaps the process.
    pub(crate) fn kill9(&mut self, name: &str) {
        let p = self.proc(name);
        p.child.kill().unwrap_or_else(|e| panic!("kill -9 {name}: {e}"));
        let _ = p.child.wait();
    }

    pub(crate) fn wait_exit(&mut self, name: &str, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let p = self.proc(name);
        loop {
            if let Some(s) = p.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "`{}` did not exit within {timeout:?}", p.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn alive(&mut self, name: &str) -> bool {
        self.proc(name).child.try_wait().expect("try_wait").is_none()
    }

    pub(crate) fn log(&mut self, name: &str) -> String {
        std::fs::read_to_string(&self.proc(name).log).unwrap_or_default()
    }

    /// Writes the spec into the test directory and submits it with `shardline submit`.
    pub(crate) fn submit(&self, spec: &str) -> RunId {
        let file = self.dir.path().join(format!("pipeline-{}.yaml", SEQ.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&file, spec).expect("write spec");
        let o = run(self.cmd(&["submit"]).arg(&file));
        assert!(o.status.success(), "submit: {}", stderr(&o));
        RunId(stdout(&o).trim().parse().unwrap_or_else(|e| panic!("run id `{}`: {e}", stdout(&o))))
    }

    /// A store call, retried while the database is unreachable (it may be restarting).
    pub(crate) fn q<T, F, Fut>(&self, f: F) -> T
    where
        F: Fn(Store) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let store = self.store.clone().expect("store");
        let deadline = Instant::now() + WAIT;
        loop {
            match self.rt.block_on(f(store.clone())) {
                Ok(v) => return v,
                Err(e) if e.is_transient() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => panic!("store: {e}"),
            }
        }
    }

    pub(crate) fn run_row(&self, run: RunId) -> RunRow {
        self.q(|s| async move { s.get_run(run).await }).expect("run exists")
    }

    pub(crate) fn run_name(&self, run: RunId) -> String {
        self.run_row(run).options.name.expect("run name")
    }

    pub(crate) fn run_dir(&self, run: RunId) -> PathBuf {
        self.state_dir().join("work/runs").join(self.run_name(run))
    }

    pub(crate) fn task(&self, run: RunId, name: &str) -> TaskRow {
        let tasks = self.q(|s| async move { s.run_tasks(run).await });
        tasks.into_iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no task `{name}`"))
    }

    pub(crate) fn attempts(&self, run: RunId, name: &str) -> Vec<AttemptRow> {
        let id = self.task(run, name).id;
        self.q(|s| async move { s.task_attempts(id).await })
    }

    /// What `shardline logs <run> --task <name>` prints.
    pub(crate) fn task_log(&self, run: RunId, name: &str) -> String {
        let o = crate::run(&mut self.cmd(&["logs", &run.0.to_string(), "--task", name]));
        assert!(o.status.success(), "logs: {}", stderr(&o));
        stdout(&o)
    }

    /// The task's log once it holds every one of `needles` (or `WAIT` passed). A worker ships log
    /// lines every second and once more after it reports, so a line may reach the store after
    /// the state a test waited for.
    pub(crate) fn task_log_holding(&self, run: RunId, name: &str, needles: &[&str]) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let log = self.task_log(run, name);
            if needles.iter().all(|n| log.contains(n)) || Instant::now() > deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub(crate) fn worker_name(&self, id: shardline_store::WorkerId) -> String {
        let workers = self.q(|s| async move { s.list_workers().await });
        workers.into_iter().find(|w| w.id == id).map(|w| w.name).unwrap_or_else(|| panic!("no worker {id}"))
    }

    /// Polls until `cond` holds for task `name`; panics on timeout or if the run ends first.
    pub(crate) fn wait_task(&self, run: RunId, name: &str, cond: impl Fn(&TaskRow) -> bool) -> TaskRow {
        let deadline = Instant::now() + WAIT;
        loop {
            let t = self.task(run, name);
            if cond(&t) {
                return t;
            }
            let r = self.run_row(run);
            assert!(!r.state.is_terminal(), "run {run} ended ({}: {:?}) while waiting on `{name}`", r.state, r.error);
            assert!(
                Instant::now() < deadline,
                "task `{name}` still {} (attempt {}) after {WAIT:?}",
                t.state,
                t.attempt
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until the run ends, calling `each` on every round.
    pub(crate) fn wait_run_with(&self, run: RunId, mut each: impl FnMut()) -> RunRow {
        let deadline = Instant::now() + WAIT;
        loop {
            each();
            let r = self.run_row(run);
            if r.state.is_terminal() {
                return r;
            }
            assert!(Instant::now() < deadline, "run {run} still {} after {WAIT:?}: {:?}", r.state, r.tasks);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn wait_run(&self, run: RunId) -> RunRow {
        self.wait_run_with(run, || {})
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        if std::thread::panicking() {
            for p in &self.procs {
                let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                eprintln!("---- {} ({}) ----", p.name, p.log.display());
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        if let Some(store) = self.store.take() {
            self.rt.block_on(store.close());
        }
        if let Some(db) = self.db.take() {
            self.rt.block_on(db.cleanup());
        }
    }
}

/// Restarts the PostgreSQL cluster the tests use (`SHARDLINE_PG_CLUSTER`, default `15 main`).
/// Only a test holding the cluster lock exclusively (`Deployment::new(true)`) may call it.
pub(crate) fn restart_postgres() {
    let cluster = std::env::var("SHARDLINE_PG_CLUSTER").unwrap_or_else(|_| "15 main".to_string());
    let restarting = Instant::now();
    let status = Command::new("pg_ctlcluster")
        .args(cluster.split_whitespace())
        .arg("restart")
        .status()
        .unwrap_or_else(|e| panic!("cannot run `pg_ctlcluster {cluster} restart`: {e}"));
    assert!(status.success(), "`pg_ctlcluster {cluster} restart` failed: {status}");
    eprintln!("pg_ctlcluster restart took {:?}", restarting.elapsed());
}

pub(crate) fn spec(name: &str, source: &Path, tp: u64, dp: u64, tail: &str) -> String {
    format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: {name}
steps:
  - id: download
    uses: hf.download
    with: {{path: "{}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: {tp}, dp: {dp}}}
    retry: {{attempts: 3, backoff: 1s}}
  - id: split
    uses: megatron.split_fused
    needs: [shard]
  - id: validate
    uses: checkpoint.validate
    needs: [split]
    retry: {{attempts: 3, backoff: 1s}}
{tail}"#,
        source.display()
    )
}

fn sorted_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn assert_validates(ckpt: &Path, source: &Path) {
    let o = run(bin().arg("validate").arg(ckpt).arg("--against").arg(source).arg("--json"));
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("validate output: {e}: {}", stderr(&o)));
    assert!(o.status.success() && v["ok"] == true, "validate: {v:#}");
}

// ---- the tests ------------------------------------------------------------------------------

/// `kill -9` of a worker in the middle of a rank-file write: its lease expires, the task is
/// leased again, the run completes, and nothing partial is ever published.
#[test]
fn killed_worker_mid_write_is_recovered_and_nothing_partial_is_published() {
    let source = synth("qwen3_moe", "600MB");
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "2"]);
    d.worker("w2", &["--cpus", "1", "--lease-seconds", "2"]);
    let run = d.submit(&spec("kill-mid-write", &source, 1, 2, ""));
    let run_dir = d.run_dir(run);
    let staging = run_dir.join("shard/checkpoint.partial");
    let committed = run_dir.join("shard/checkpoint");

    // Catch a rank file under its temporary name and freeze both workers; if that write finished
    // in the moment before the freeze, let them go on and catch the next one.
    let started = Instant::now();
    let (rank, partial) = 'found: loop {
        if let Ok(entries) = std::fs::read_dir(&staging) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let rank = name.strip_prefix(".__").and_then(|s| s.strip_suffix("_0.distcp.partial"));
                let Some(r) = rank.and_then(|r| r.parse::<u64>().ok()) else { continue };
                d.signal("w1", "STOP");
                d.signal("w2", "STOP");
                if e.path().exists() && !staging.join(format!("__{r}_0.distcp")).exists() {
                    break 'found (r, e.path());
                }
                d.signal("w1", "CONT");
                d.signal("w2", "CONT");
            }
        }
        assert!(!committed.exists(), "the checkpoint was committed before a rank file was caught mid-write");
        assert!(started.elapsed() < WAIT, "no rank file was caught mid-write under {}", staging.display());
        std::thread::sleep(Duration::from_millis(1));
    };
    // Kill the worker whose lease holds that rank; the other one goes on.
    let task_name = format!("shard/rank-{rank}");
    let leased = d.task(run, &task_name);
    assert_eq!((leased.state, leased.attempt), (TaskState::Leased, 1), "{task_name}");
    let victim = d.worker_name(leased.lease_owner.expect("lease owner"));
    let survivor = if victim == "w1" { "w2" } else { "w1" };
    d.kill9(&victim);
    d.signal(survivor, "CONT");
    assert!(partial.exists(), "the killed writer's partial file is gone");

    // Re-leased after the lease expires; the run completes. Meanwhile the committed directory
    // never shows a partial file.
    let mut seen = BTreeSet::new();
    let r = d.wait_run_with(run, || {
        if let Ok(entries) = std::fs::read_dir(&committed) {
            for e in entries.flatten() {
                seen.insert(e.file_name().to_string_lossy().into_owned());
            }
        }
    });
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    let attempts = d.attempts(run, &task_name);
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(
        (attempts[0].worker_name.as_str(), attempts[0].outcome),
        (victim.as_str(), Some(AttemptOutcome::Expired))
    );
    assert_eq!((attempts[1].worker_name.as_str(), attempts[1].outcome), (survivor, Some(AttemptOutcome::Succeeded)));
    assert_eq!(d.task(run, &task_name).attempt, 2);

    let want = vec![".metadata".to_string(), "__0_0.distcp".to_string(), "__1_0.distcp".to_string()];
    assert_eq!(sorted_names(&committed), want, "the committed checkpoint holds complete rank files only");
    assert!(
        seen.iter().all(|n| !n.contains("partial")),
        "a partial file appeared in the committed directory: {seen:?}"
    );
    assert!(!staging.exists(), "the staging directory outlived the commit");
    assert_eq!(d.task(run, "validate").output.expect("validate output")["ok"], true);
    assert_validates(&committed, &source);
}

/// The server (the reaper) killed mid-run: a dead worker's lease stays unreaped while it is
/// down; restarted, it returns the lease to the queue and the run completes.
#[test]
fn server_restart_mid_run_resumes() {
    let source = synth("qwen3_moe", "200MB");
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "2"]);
    d.worker("w2", &["--cpus", "1", "--lease-seconds", "2"]);
    // 32 ranks: validate reads enough items to still be running when the server is killed.
    let run = d.submit(&spec("server-restart", &source, 1, 32, ""));
    let leased = d.wait_task(run, "validate", |t| t.state == TaskState::Leased);

    d.kill9("server");
    let victim = d.worker_name(leased.lease_owner.expect("owner"));
    d.kill9(&victim);
    // Twice the lease: expired long ago, and nobody has reaped it.
    std::thread::sleep(Duration::from_secs(4));
    let t = d.task(run, "validate");
    assert_eq!((t.state, t.attempt), (TaskState::Leased, 1), "reaped without a server?");
    assert!(SystemTime::from(t.lease_expires_at.expect("expiry")) < SystemTime::now(), "the lease has not expired");

    d.server("server-2");
    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    let attempts = d.attempts(run, "validate");
    assert_eq!(attempts.len(), 2, "{attempts:?}");
    assert_eq!(attempts[0].outcome, Some(AttemptOutcome::Expired));
    assert_eq!(attempts[1].outcome, Some(AttemptOutcome::Succeeded));
    assert_ne!(attempts[1].worker_name, victim);
    assert!(d.log("server-2").contains("reaping expired leases"));
}

/// PostgreSQL restarted mid-run: the server and the workers ride it out, reconnect, finish the
/// run, and take new work afterwards.
#[test]
fn postgres_restart_mid_run_workers_reconnect() {
    // Validating 600 MB sharded for 64 ranks takes longer than a restart: the restart falls
    // inside `validate`.
    let source = synth("qwen3_moe", "600MB");
    let mut d = Deployment::new(true);
    d.server("server");
    // Leases outlast the restart: the running attempt is not reaped meanwhile.
    d.worker("w1", &["--cpus", "1", "--lease-seconds", "10"]);
    d.worker("w2", &["--cpus", "1", "--lease-seconds", "10"]);
    let run = d.submit(&spec("pg-restart", &source, 1, 64, ""));
    d.wait_task(run, "validate", |t| t.state == TaskState::Leased);

    restart_postgres();
    let restarted = SystemTime::now();

    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    // The restart happened while `validate` ran: its outcome was reported to the new server.
    let attempts = d.attempts(run, "validate");
    let last = attempts.last().expect("an attempt");
    assert_eq!(last.outcome, Some(AttemptOutcome::Succeeded));
    assert!(
        SystemTime::from(last.ended_at.expect("ended")) > restarted,
        "validate finished before the restart was over: nothing was tested"
    );
    // Its log lines were not lost on the dead connections.
    let wants = ["attempt 1 of `validate`", "reconstructed bit-exactly", "succeeded in"];
    let log = d.task_log_holding(run, "validate", &wants);
    for want in wants {
        assert!(log.contains(want), "`{want}` is missing from validate's log after the restart:\n{log}");
    }
    for p in ["server", "w1", "w2"] {
        assert!(d.alive(p), "`{p}` exited over the restart:\n{}", d.log(p));
    }
    // Claims and wake-ups work on the new connections.
    let again = d.submit(&spec("pg-restart-after", &fixture("qwen3_next"), 2, 2, ""));
    let r = d.wait_run(again);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
}

/// SIGTERM drains: the worker finishes the task it runs, exits 0, and leases nothing new.
#[test]
fn sigterm_drains_the_running_task_and_takes_no_new_one() {
    let source = synth("qwen3_moe", "200MB");
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("w1", &["--cpus", "2", "--lease-seconds", "2"]);
    let out = d.dir.path().join("published");
    let upload = format!(
        "  - id: upload\n    uses: store.upload\n    needs: [validate]\n    with: {{to: \"file://{}\"}}\n",
        out.display()
    );
    // 32 ranks: validate runs long enough for the signal to arrive while it runs.
    let run = d.submit(&spec("drain", &source, 1, 32, &upload));
    let leased = d.wait_task(run, "validate", |t| t.state == TaskState::Leased && t.progress.is_some());
    assert_eq!(d.worker_name(leased.lease_owner.expect("owner")), "w1");

    d.signal("w1", "TERM");
    let status = d.wait_exit("w1", WAIT);
    assert!(status.success(), "the draining worker exited with {status}:\n{}", d.log("w1"));
    assert!(d.log("w1").contains("draining"), "{}", d.log("w1"));
    let validate = d.task(run, "validate");
    assert_eq!((validate.state, validate.attempt), (TaskState::Succeeded, 1), "the running task was not finished");
    let attempts = d.attempts(run, "validate");
    assert_eq!((attempts[0].worker_name.as_str(), attempts[0].outcome), ("w1", Some(AttemptOutcome::Succeeded)));
    // `upload` became ready while w1 drained; w1 did not take it.
    let upload = d.task(run, "upload");
    assert_eq!((upload.state, upload.attempt), (TaskState::Ready, 0));
    assert!(d.attempts(run, "upload").is_empty());
    assert_eq!(d.run_row(run).state, RunState::Running);

    d.worker("w2", &["--cpus", "2", "--lease-seconds", "2"]);
    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    assert_eq!(d.attempts(run, "upload")[0].worker_name, "w2");
    assert!(out.join("shardline-manifest.json").is_file());
}

/// A step asking for a GPU waits for a worker that has one: a CPU-only worker never leases it;
/// a worker started with `--gpus 0,1` does, with the device assigned in its log.
#[test]
fn gpu_steps_lease_only_to_gpu_workers() {
    let mut d = Deployment::new(false);
    d.server("server");
    d.worker("cpu", &["--cpus", "4", "--lease-seconds", "2"]);
    // `validate` is the spec's last step: the resources line belongs to it.
    let run = d.submit(&spec("gpu", &fixture("qwen3_next"), 2, 2, "    resources: {gpus: 1}\n"));
    d.wait_task(run, "validate", |t| t.state == TaskState::Ready);
    assert_eq!(d.task(run, "validate").resources.gpus, 1);
    // The CPU worker polls and is woken meanwhile; it never takes the GPU task.
    std::thread::sleep(Duration::from_secs(2));
    let t = d.task(run, "validate");
    assert_eq!((t.state, t.attempt), (TaskState::Ready, 0), "a CPU-only worker leased a GPU task");
    assert_eq!(d.run_row(run).state, RunState::Running);

    d.worker("gpu", &["--cpus", "4", "--gpus", "0,1", "--lease-seconds", "2"]);
    let r = d.wait_run(run);
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    let attempts = d.attempts(run, "validate");
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].worker_name, "gpu");
    let o = d.task_log(run, "validate");
    assert!(
        o.contains("CUDA_VISIBLE_DEVICES=0") || o.contains("CUDA_VISIBLE_DEVICES=1"),
        "no device assignment in the task's log:\n{o}"
    );
    // Every other task ran on the CPU worker or the GPU worker alike; none waited for a GPU.
    assert!(d.alive("cpu"));
}

/// `shardline run`: embedded SQLite under `./.shardline`, in-process workers, and the exit code
/// is the run's result (0 succeeded, 1 failed); a second run is served from the step cache.
#[test]
fn embedded_run_exit_code_is_the_run_result() {
    let dir = tempfile::tempdir().expect("temp dir");
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/demo.yaml");
    let source = format!("source={}", fixture("qwen3_next").display());
    let embedded = |args: &[&str]| {
        let mut c = bin();
        c.args(args).current_dir(dir.path()).env_remove("SHARDLINE_DATABASE_URL");
        run(&mut c)
    };
    let o = embedded(&["run", demo.to_str().expect("path"), "--set", &source]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(dir.path().join(".shardline/state.db").is_file(), "the embedded state is not under ./.shardline");
    let out = dir.path().join(".shardline/out");
    assert_eq!(std::fs::read_dir(&out).expect("published").count(), 1);
    let o = embedded(&["run", demo.to_str().expect("path"), "--set", &source]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("(cached)"), "the second run was not served from the cache:\n{}", stderr(&o));

    // A run that fails (its destination is blocked by a file) exits 1 and says why.
    std::fs::write(dir.path().join("blocked"), b"").expect("blocking file");
    let failing = dir.path().join("failing.yaml");
    let spec = std::fs::read_to_string(&demo)
        .expect("demo")
        .replace("file://.shardline/out/${{ run.id }}", "file://blocked/out")
        .replace(
            "    with: {to: \"file://blocked/out\"}",
            "    with: {to: \"file://blocked/out\"}\n    retry: {attempts: 1}",
        );
    assert!(spec.contains("retry: {attempts: 1}"), "the demo's upload step moved: update this test");
    std::fs::write(&failing, spec).expect("spec");
    let o = embedded(&["run", failing.to_str().expect("path"), "--set", &source]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("failed: task `upload` failed"), "{}", stderr(&o));
}
