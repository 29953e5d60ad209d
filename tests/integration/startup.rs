//! Start-up that cannot race, with the real binary: three `shardline server` and three `shardline
//! worker` processes started at the same moment on a new store — a fresh `--state-dir` (the
//! embedded SQLite default) or a fresh PostgreSQL database — all come up, round after round:
//! every server serves its HTTP API and reaps, every worker registers, none exits, and a run
//! submitted afterwards completes. Before the store's migration lock, most of these processes
//! exited with `cannot migrate the SQLite job store: … table pipelines already exists`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardline_store::{RunId, RunState, Store};
use shardline_testdb::TestDb;

use crate::{bin, fixture, http_get, run, stderr, stdout};

const ROUNDS: usize = 10;
const SERVERS: usize = 3;
const WORKERS: usize = 3;
/// The longest any single wait of these tests may take.
const WAIT: Duration = Duration::from_secs(90);

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

/// One round: a state directory, the processes started on it, and the store they share.
struct Round {
    dir: tempfile::TempDir,
    /// `--database-url`, or `None` for the embedded SQLite store under the state directory.
    url: Option<String>,
    procs: Vec<Proc>,
}

impl Round {
    fn new(url: Option<String>) -> Round {
        Round { dir: tempfile::tempdir().expect("temp dir"), url, procs: Vec::new() }
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The store's URL as the binary derives it.
    fn store_url(&self) -> String {
        self.url.clone().unwrap_or_else(|| format!("sqlite://{}", self.state_dir().join("state.db").display()))
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = bin();
        c.args(args).arg("--state-dir").arg(self.state_dir()).current_dir(self.dir.path());
        match &self.url {
            Some(url) => c.arg("--database-url").arg(url),
            None => c.env_remove("SHARDLINE_DATABASE_URL"),
        };
        c
    }

    fn spawn(&mut self, name: &str, args: &[&str]) {
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

    /// Starts every server and worker at once (nothing waits between the spawns).
    fn start_all(&mut self) {
        for i in 0..SERVERS {
            self.spawn(&format!("server-{i}"), &["server", "--http", "127.0.0.1:0", "--public-reads"]);
        }
        for i in 0..WORKERS {
            let name = format!("worker-{i}");
            self.spawn(&name, &["worker", "--name", &name, "--cpus", "2", "--lease-seconds", "5"]);
        }
    }

    fn log(&self, p: &Proc) -> String {
        std::fs::read_to_string(&p.log).unwrap_or_default()
    }

    /// Fails if any process has exited (with its log).
    fn assert_all_alive(&mut self, when: &str) {
        for i in 0..self.procs.len() {
            if let Some(status) = self.procs[i].child.try_wait().expect("try_wait") {
                let p = &self.procs[i];
                panic!("`{}` exited with {status} {when}:\n{}", p.name, self.log(p));
            }
        }
    }

    /// Waits until every server printed its HTTP address and started reaping, and every worker
    /// announced itself; returns the servers' addresses.
    fn wait_up(&mut self) -> Vec<String> {
        let deadline = Instant::now() + WAIT;
        loop {
            self.assert_all_alive("while starting");
            let mut addrs = Vec::new();
            let mut up = 0;
            for p in &self.procs {
                let log = self.log(p);
                if p.name.starts_with("server") {
                    let addr = log
                        .lines()
                        .find_map(|l| l.strip_prefix("server: dashboard and API on http://"))
                        .and_then(|rest| rest.split('/').next());
                    if let (Some(addr), true) = (addr, log.contains("server: reaping expired leases")) {
                        addrs.push(addr.to_string());
                        up += 1;
                    }
                } else if log.contains(&format!("worker `{}`:", p.name)) {
                    up += 1;
                }
            }
            if up == self.procs.len() {
                return addrs;
            }
            assert!(Instant::now() < deadline, "{up} of {} processes came up within {WAIT:?}", self.procs.len());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn submit(&self, spec: &str) -> RunId {
        let file = self.dir.path().join("pipeline.yaml");
        std::fs::write(&file, spec).expect("write spec");
        let o = run(self.cmd(&["submit"]).arg(&file));
        assert!(o.status.success(), "submit: {}", stderr(&o));
        RunId(stdout(&o).trim().parse().unwrap_or_else(|e| panic!("run id `{}`: {e}", stdout(&o))))
    }
}

impl Drop for Round {
    fn drop(&mut self) {
        for p in &mut self.procs {
            let _ = p.child.kill();
            let _ = p.child.wait();
        }
        if std::thread::panicking() {
            for p in &self.procs {
                let log = std::fs::read_to_string(&p.log).unwrap_or_default();
                eprintln!("---- {} ({}) ----\n{log}", p.name, p.log.display());
            }
        }
    }
}

fn spec(source: &Path) -> String {
    format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: after-startup\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 2, dp: 1}}}}\n\
         \x20 - {{id: validate, uses: checkpoint.validate, needs: [shard]}}\n",
        source.display()
    )
}

/// One round on `url` (or the embedded store): everything starts at once and comes up, then a
/// run completes.
fn round(rt: &tokio::runtime::Runtime, n: usize, url: Option<String>) {
    let mut r = Round::new(url);
    r.start_all();
    let addrs = r.wait_up();
    assert_eq!(addrs.len(), SERVERS);

    let store_url = r.store_url();
    let store: Store = rt.block_on(Store::connect(&store_url)).unwrap_or_else(|e| panic!("round {n}: {e}"));
    // Every worker registered (each announces itself before registering: wait for the rows).
    let deadline = Instant::now() + WAIT;
    loop {
        let workers = rt.block_on(store.list_workers()).expect("list_workers");
        let mut names: Vec<String> = workers.into_iter().map(|w| w.name).collect();
        names.sort();
        if names == (0..WORKERS).map(|i| format!("worker-{i}")).collect::<Vec<_>>() {
            break;
        }
        assert!(Instant::now() < deadline, "round {n}: registered workers {names:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every server answers from the store.
    for addr in &addrs {
        let (status, body) = http_get(addr, "/api/v1/workers");
        assert!(status.contains(" 200 "), "round {n}: {addr}: {status}\n{body}");
        for i in 0..WORKERS {
            assert!(body.contains(&format!("\"worker-{i}\"")), "round {n}: {addr} does not list worker-{i}: {body}");
        }
    }

    let run_id = r.submit(&spec(&fixture("qwen3_next")));
    let deadline = Instant::now() + WAIT;
    let done = loop {
        let row = rt.block_on(store.get_run(run_id)).expect("get_run").expect("the run exists");
        if row.state.is_terminal() {
            break row;
        }
        r.assert_all_alive("while the run ran");
        assert!(Instant::now() < deadline, "round {n}: run {run_id} still {} after {WAIT:?}", row.state);
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(done.state, RunState::Succeeded, "round {n}: {:?}", done.error);
    r.assert_all_alive("after the run");
    rt.block_on(store.close());
}

#[test]
fn servers_and_workers_started_at_once_on_a_new_sqlite_store_all_come_up() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for n in 0..ROUNDS {
        round(&rt, n, None);
    }
}

#[test]
fn servers_and_workers_started_at_once_on_a_new_postgres_database_all_come_up() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for n in 0..ROUNDS {
        let db = rt.block_on(TestDb::postgres(false));
        round(&rt, n, Some(db.url.clone()));
        rt.block_on(db.cleanup());
    }
}
