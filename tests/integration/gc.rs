//! Retention end to end, with real server and worker processes on an embedded store: three old
//! finished runs (each an object-store download, a sharded checkpoint in the step cache and a
//! command's output), a running run and a queued run that will hit the first run's caches.
//! `shardline gc --dry-run` lists exactly what the server's policy frees and keeps, with the
//! sizes measured here, and deletes nothing; `shardline gc` frees exactly that; the queued run
//! then runs and is served both its download and its checkpoint from the caches gc kept; and a
//! worker's own periodic gc frees the runs that finished since.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_control::TaskOutput;
use shardline_store::{RunId, RunRow, RunState, Store};

use crate::procs::{cmd, spawn, Process};
use crate::{fixture, http_get, run, stderr, stdout};

const WAIT: Duration = Duration::from_secs(180);
const BLOB: u64 = 12_345;

fn convert_spec(pool: Option<&str>) -> String {
    let pool = pool.map(|p| format!("pool: {p}\n")).unwrap_or_default();
    format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: convert
{pool}params:
  src: {{type: string}}
steps:
  - id: download
    uses: hf.download
    with: {{path: "${{{{ params.src }}}}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 1, dp: 2}}
  - id: note
    uses: command
    needs: [shard]
    with: {{run: [sh, -c, 'head -c {BLOB} /dev/zero > "$SHARDLINE_OUTPUT_DIR/blob"']}}
"#
    )
}

const HOLD: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: hold
params:
  gate: {type: string}
steps:
  - id: wait
    uses: command
    with:
      run: 'head -c 777 /dev/zero > "$SHARDLINE_OUTPUT_DIR/partial"; while [ ! -e "$GATE" ]; do sleep 0.1; done'
      shell: true
      env: {GATE: "${{ params.gate }}"}
"#;

/// Bytes of the regular files under `p` (symlinks not followed): measured here, apart from the
/// gc's own walk.
fn du(p: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(p) else { return 0 };
    if meta.is_file() {
        return meta.len();
    }
    if !meta.is_dir() {
        return 0;
    }
    fs::read_dir(p).expect("read_dir").map(|e| du(&e.expect("entry").path())).sum()
}

/// Every file under `root` with its size.
fn files(root: &Path) -> BTreeMap<PathBuf, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            let m = fs::symlink_metadata(&p).expect("metadata");
            if m.is_dir() {
                stack.push(p);
            } else {
                out.insert(p, m.len());
            }
        }
    }
    out
}

struct Env {
    dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
    store: Store,
}

impl Env {
    fn submit(&self, spec: &str, set: &[String]) -> RunId {
        let mut args = vec!["submit", spec];
        for s in set {
            args.extend(["--set", s.as_str()]);
        }
        let o = run(&mut cmd(self.dir.path(), &args));
        assert!(o.status.success(), "submit {spec}: {}", stderr(&o));
        RunId(stdout(&o).trim().parse().expect("run id"))
    }

    fn run_row(&self, id: RunId) -> RunRow {
        self.rt.block_on(self.store.get_run(id)).expect("get_run").expect("run")
    }

    fn wait_state(&self, id: RunId, want: RunState) -> RunRow {
        let deadline = Instant::now() + WAIT;
        loop {
            let r = self.run_row(id);
            if r.state == want {
                return r;
            }
            assert!(!(r.state.is_terminal() && r.state != want), "run {id} ended {}: {:?}", r.state, r.error);
            assert!(Instant::now() < deadline, "run {id} is {} after {WAIT:?}", r.state);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The recorded output of a run's task.
    fn output(&self, id: RunId, task: &str) -> TaskOutput {
        let tasks = self.rt.block_on(self.store.run_tasks(id)).expect("tasks");
        let t = tasks.iter().find(|t| t.name == task).unwrap_or_else(|| panic!("run {id} has no task {task}"));
        TaskOutput::from_value(t.output.as_ref().unwrap_or_else(|| panic!("{task} of run {id} has no output")))
    }

    fn work(&self) -> PathBuf {
        self.dir.path().join("state/work")
    }

    fn gc(&self, dry_run: bool) -> Value {
        let mut args = vec!["gc", "--json"];
        if dry_run {
            args.push("--dry-run");
        }
        let o = run(&mut cmd(self.dir.path(), &args));
        assert!(o.status.success(), "gc: {}\n{}", stdout(&o), stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("gc --json: {e}: {}", stdout(&o)))
    }
}

/// What one finished `convert` run left: its directory, its checkpoint and its download.
struct Left {
    id: RunId,
    dir: PathBuf,
    checkpoint: PathBuf,
    download: PathBuf,
}

fn left(env: &Env, id: RunId) -> Left {
    let row = env.wait_state(id, RunState::Succeeded);
    let name = row.options.name.expect("run name");
    let download = env.output(id, "download").path.expect("download path");
    let checkpoint = env.output(id, "shard/commit").dir.expect("checkpoint dir");
    let dir = env.work().join("runs").join(name);
    assert!(checkpoint.starts_with(&dir), "{} in {}", checkpoint.display(), dir.display());
    assert!(download.starts_with(env.work().join("cache/objects")), "{}", download.display());
    Left { id, dir, checkpoint, download }
}

/// (action, kind, bytes, reason) of each item of a `gc --json` answer, by path.
fn decisions(v: &Value) -> BTreeMap<PathBuf, (String, String, u64, String)> {
    v["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| {
            let s = |k: &str| i[k].as_str().unwrap_or_default().to_string();
            (PathBuf::from(s("path")), (s("action"), s("kind"), i["bytes"].as_u64().expect("bytes"), s("reason")))
        })
        .collect()
}

fn server(env: &Env, name: &str, extra: &[&str]) -> Process {
    let mut args = vec!["server", "--http", "127.0.0.1:0", "--public-reads", "--retain-runs", "2s"];
    args.extend(extra);
    spawn(env.dir.path(), name, &args)
}

fn api(addr: &str, path: &str) -> Value {
    let (status, body) = http_get(addr, path);
    assert!(status.contains("200"), "GET {path}: {status}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

#[test]
fn gc_frees_old_runs_and_caches_and_keeps_what_live_runs_need() {
    let dir = tempfile::tempdir().expect("temp dir");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    // Three copies of one release: three object-store prefixes of the same size.
    for m in ["a", "b", "c"] {
        let to = dir.path().join("models").join(m);
        fs::create_dir_all(&to).expect("models");
        for f in fs::read_dir(fixture("llama")).expect("fixture") {
            let f = f.expect("entry").path();
            fs::copy(&f, to.join(f.file_name().expect("name"))).expect("copy");
        }
    }
    fs::write(dir.path().join("convert.yaml"), convert_spec(None)).expect("spec");
    fs::write(dir.path().join("convert-later.yaml"), convert_spec(Some("later"))).expect("spec");
    fs::write(dir.path().join("hold.yaml"), HOLD).expect("spec");
    let models = dir.path().join("models");
    let src = |m: &str| format!("src=file://{}", models.join(m).display());

    let first = spawn(dir.path(), "server", &["server", "--retain-runs", "2s"]);
    let worker = spawn(dir.path(), "worker", &["worker", "--name", "w1", "--cpus", "2", "--no-gc"]);
    let url = format!("sqlite://{}", dir.path().join("state/state.db").display());
    let deadline = Instant::now() + WAIT;
    let store = loop {
        // The server creates the store; wait for it.
        if let Ok(s) = rt.block_on(Store::connect(&url)) {
            break s;
        }
        assert!(Instant::now() < deadline, "no store at {url}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let env = Env { dir, rt, store };

    let a = env.submit("convert.yaml", &[src("a")]);
    let a = left(&env, a);
    let b = env.submit("convert.yaml", &[src("b")]);
    let b = left(&env, b);
    let c = env.submit("convert.yaml", &[src("c")]);
    let c = left(&env, c);
    // In progress: a running command, and a run queued on a pool no server defines yet, which
    // will read `a`'s prefix and hit its checkpoint.
    let gate = env.dir.path().join("gate");
    let hold = env.submit("hold.yaml", &[format!("gate={}", gate.display())]);
    env.wait_state(hold, RunState::Running);
    let hold_dir = env.work().join("runs").join(env.run_row(hold).options.name.expect("name"));
    let deadline = Instant::now() + WAIT;
    while du(&hold_dir) < 777 {
        assert!(Instant::now() < deadline, "the command did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let queued = env.submit("convert-later.yaml", &[src("a")]);
    std::thread::sleep(Duration::from_millis(2500)); // past the 2s retention of a, b and c
    assert_eq!(env.run_row(queued).state, RunState::Queued);

    // The policy is the server's: 2s for finished runs, and a cache limit that keeps what the
    // queued run needs and the newest run's entries, so that `b`'s entries (older) must go.
    let size = |p: &Path| {
        let n = du(p);
        assert!(n > 0, "{} is empty", p.display());
        n
    };
    let keep_bytes = size(&a.download) + size(&a.checkpoint) + size(&c.download) + size(&c.checkpoint);
    drop(first);
    let second = server(&env, "server2", &["--cache-max", &format!("{keep_bytes}B")]);
    // It records its policy before it listens.
    let addr = second.wait_for_address();

    let before = files(&env.work());
    let dry = env.gc(true);
    assert_eq!(files(&env.work()), before, "a dry run deletes nothing");
    assert_eq!(dry["policy"]["retain_runs"], "2s");
    assert_eq!(dry["policy"]["cache_max"], keep_bytes);
    let own = |l: &Left| du(&l.dir) - du(&l.checkpoint);
    for l in [&a, &b, &c] {
        assert_eq!(own(l), BLOB, "a run's own bytes are its command's blob");
    }
    let q = queued.0;
    let expected: BTreeMap<PathBuf, (&str, &str, u64, String)> = [
        (a.dir.clone(), ("free", "run", BLOB, "beyond its 2s retention".to_string())),
        (b.dir.clone(), ("free", "run", BLOB, "beyond its 2s retention".into())),
        (c.dir.clone(), ("free", "run", BLOB, "beyond its 2s retention".into())),
        (hold_dir.clone(), ("keep", "run", du(&hold_dir), format!("run {} is running", hold.0))),
        (a.download.clone(), ("keep", "cache", du(&a.download), format!("queued run {q} may hit it (url file://"))),
        (a.checkpoint.clone(), ("keep", "cache", du(&a.checkpoint), format!("queued run {q} may hit it (step "))),
        (b.download.clone(), ("free", "cache", du(&b.download), "least recently used".into())),
        (b.checkpoint.clone(), ("free", "cache", du(&b.checkpoint), "least recently used".into())),
        (c.download.clone(), ("keep", "cache", du(&c.download), "the cache fits".into())),
        (c.checkpoint.clone(), ("keep", "cache", du(&c.checkpoint), "the cache fits".into())),
    ]
    .into_iter()
    .collect();
    let check = |v: &Value, free_word: &str| {
        let got = decisions(v);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "the items: {}",
            serde_json::to_string_pretty(v).unwrap_or_default()
        );
        for (path, (action, kind, bytes, reason)) in &expected {
            let (a, k, n, r) = &got[path];
            let action = if *action == "free" { free_word } else { action };
            assert_eq!((a.as_str(), k.as_str(), *n), (action, *kind, *bytes), "{}: {r}", path.display());
            assert!(r.contains(reason.as_str()), "{}: `{r}` should say `{reason}`", path.display());
        }
        let freed: u64 = expected.values().filter(|e| e.0 == "free").map(|e| e.2).sum();
        assert_eq!(v["freed"]["items"], 5);
        assert_eq!(v["freed"]["bytes"], freed);
        let kept: u64 = expected.values().filter(|e| e.0 == "keep").map(|e| e.2).sum();
        assert_eq!((v["kept"]["items"].as_u64(), v["kept"]["bytes"].as_u64()), (Some(5), Some(kept)));
    };
    check(&dry, "free");
    let o = run(&mut cmd(env.dir.path(), &["gc", "--dry-run"]));
    let text = stdout(&o);
    assert!(text.contains("— dry run, nothing deleted"), "{text}");
    let freed = BLOB * 3 + du(&b.download) + du(&b.checkpoint);
    assert!(text.contains("would free 5 item(s), ") && text.contains(&format!("({freed} bytes)")), "{text}");
    assert_eq!(files(&env.work()), before);

    // The dashboard shows what the (dry) pass measured.
    assert_eq!(api(&addr, &format!("/api/v1/runs/{}", hold.0))["disk_bytes"], du(&hold_dir));
    assert_eq!(api(&addr, &format!("/api/v1/runs/{}", a.id.0))["disk_bytes"], du(&a.dir));

    let real = env.gc(false);
    check(&real, "freed");
    for gone in [&b.dir, &b.download] {
        assert!(!gone.exists(), "{} should be gone", gone.display());
    }
    for (l, keeps) in [(&a, &a.checkpoint), (&c, &c.checkpoint)] {
        let kept: Vec<PathBuf> = files(&l.dir).into_keys().filter(|p| !p.starts_with(keeps)).collect();
        assert!(kept.is_empty(), "only the checkpoint is left of {}: {kept:?}", l.dir.display());
    }
    for kept in [&a.download, &a.checkpoint, &c.download, &c.checkpoint] {
        assert!(du(kept) > 0, "{} should be kept", kept.display());
    }
    assert!(du(&hold_dir) >= 777, "the running run's directory is untouched");
    let entries = env.rt.block_on(env.store.cache_entries()).expect("cache");
    let rows = |p: &Path| {
        let names = |e: &&shardline_store::CacheEntry| {
            let o = TaskOutput::from_value(&e.output);
            o.dir.or(o.path).as_deref() == Some(p)
        };
        entries.iter().filter(names).count()
    };
    assert_eq!((rows(&b.download), rows(&b.checkpoint)), (0, 0), "freed entries lose their rows");
    assert_eq!((rows(&a.download), rows(&a.checkpoint), rows(&c.checkpoint)), (1, 1, 1));
    let storage = api(&addr, "/api/v1/storage");
    let listed: Vec<&str> =
        storage["caches"].as_array().expect("caches").iter().filter_map(|c| c["path"].as_str()).collect();
    assert!(!listed.contains(&b.checkpoint.to_str().expect("utf-8")), "{listed:?}");
    assert!(listed.contains(&a.checkpoint.to_str().expect("utf-8")), "{listed:?}");
    assert_eq!(api(&addr, &format!("/api/v1/runs/{}", b.id.0))["disk_bytes"], Value::Null, "freed");

    // A server with the pool lets the queued run start: both of its caches are hits.
    drop(second);
    let third = server(&env, "server3", &["--cache-max", &format!("{keep_bytes}B"), "--pool", "later=1"]);
    env.wait_state(queued, RunState::Succeeded);
    assert_eq!(env.output(queued, "download").cached, Some(serde_json::json!(true)), "download from the cache");
    assert!(env.output(queued, "shard").cached.is_some(), "checkpoint from the cache");
    assert_eq!(env.output(queued, "shard/commit").dir.as_deref(), Some(a.checkpoint.as_path()));

    // A worker's own gc, every second: the runs that finished since go too.
    fs::write(&gate, b"").expect("gate");
    env.wait_state(hold, RunState::Succeeded);
    drop(worker);
    let queued_dir = env.work().join("runs").join(env.run_row(queued).options.name.expect("name"));
    assert!(queued_dir.exists());
    let _w2 = spawn(env.dir.path(), "worker2", &["worker", "--name", "w2", "--cpus", "1", "--gc-every", "1s"]);
    let deadline = Instant::now() + WAIT;
    while queued_dir.exists() || hold_dir.exists() {
        assert!(Instant::now() < deadline, "the worker's gc did not free the finished runs");
        std::thread::sleep(Duration::from_millis(200));
    }
    let addr = third.wait_for_address();
    let storage = api(&addr, "/api/v1/storage");
    assert_eq!(storage["retention"]["retain_runs"], "2s");
    let reporter = storage["reporters"][0]["reporter"].as_str().unwrap_or_default().to_string();
    assert!(reporter.ends_with(&format!(":{}", env.work().display())), "{reporter}");
}
