//! Webhook notifications end to end, with the real binary on PostgreSQL: two servers deliver
//! (both with `--notify`), one worker runs, and a local receiver answers HTTP 500 to its first
//! two requests. Every finished run reaches each of its targets exactly once (retried through
//! the failures), a cancelled run only where `on` asks for it, a Slack target gets `{"text"}`,
//! a failing trigger is reported, and no URL secret shows in the API, the run page or the logs.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_store::{DeliveryState, RunId, RunState, Store};
use shardline_testdb::TestDb;

use crate::{bin, fixture, run, stderr, stdout};

const WAIT: Duration = Duration::from_secs(90);
const SECRETS: &[&str] = &["KEYSECRET", "SRVSECRET", "pathsecret123", "slacksecret"];

/// One request the receiver got: path, body, and whether it was accepted.
#[derive(Clone, Debug)]
struct Received {
    path: String,
    body: Value,
    accepted: bool,
}

/// A webhook receiver on a local port: 500 for its first `fail_first` requests, then 200.
struct Receiver {
    addr: String,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start(fail_first: usize) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind receiver");
        let addr = listener.local_addr().expect("addr").to_string();
        let got: Arc<Mutex<Vec<Received>>> = Arc::default();
        let log = Arc::clone(&got);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let log = Arc::clone(&log);
                // One request per connection is enough for reqwest (it reconnects).
                let _ = handle(stream, &log, fail_first);
            }
        });
        Receiver { addr, got }
    }

    fn accepted(&self) -> Vec<Received> {
        self.got.lock().expect("lock").iter().filter(|r| r.accepted).cloned().collect()
    }

    fn all(&self) -> Vec<Received> {
        self.got.lock().expect("lock").clone()
    }
}

fn handle(stream: TcpStream, log: &Mutex<Vec<Received>>, fail_first: usize) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        reader.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body)?;
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let accepted = {
        let mut got = log.lock().expect("lock");
        let accepted = got.len() >= fail_first;
        got.push(Received { path, body, accepted });
        accepted
    };
    let status = if accepted { "200 OK" } else { "500 Internal Server Error" };
    let mut stream = stream;
    write!(stream, "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    stream.flush()
}

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

struct Deployment {
    db: Option<TestDb>,
    dir: tempfile::TempDir,
    procs: Vec<Proc>,
    rt: tokio::runtime::Runtime,
    store: Store,
}

impl Deployment {
    fn new() -> Deployment {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let db = rt.block_on(TestDb::postgres(false));
        let store = rt.block_on(db.store());
        Deployment { db: Some(db), dir: tempfile::tempdir().expect("temp dir"), procs: Vec::new(), rt, store }
    }

    fn url(&self) -> String {
        self.db.as_ref().expect("db").url.clone()
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = bin();
        c.args(args).arg("--database-url").arg(self.url()).arg("--state-dir").arg(self.dir.path().join("state"));
        c.current_dir(self.dir.path());
        c
    }

    fn spawn(&mut self, name: &str, args: &[&str], env: &[(&str, &str)]) {
        let log = self.dir.path().join(format!("{name}.log"));
        let out = File::create(&log).expect("log file");
        let mut cmd = self.cmd(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        self.procs.push(Proc { name: name.into(), child, log });
    }

    fn log(&self, name: &str) -> String {
        let p = self.procs.iter().find(|p| p.name == name).expect("process");
        std::fs::read_to_string(&p.log).unwrap_or_default()
    }

    /// The HTTP address a server printed.
    fn http_addr(&self, name: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let log = self.log(name);
            let addr = log
                .lines()
                .find_map(|l| l.strip_prefix("server: dashboard and API on http://"))
                .and_then(|rest| rest.split('/').next());
            if let (Some(a), true) = (addr, log.contains("server: reaping")) {
                return a.to_string();
            }
            assert!(Instant::now() < deadline, "{name} did not come up:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn submit(&self, name: &str, spec: &str) -> RunId {
        let file = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, spec).expect("write spec");
        let o = run(self.cmd(&["submit"]).arg(&file));
        assert!(o.status.success(), "submit: {}", stderr(&o));
        RunId(stdout(&o).trim().parse().unwrap_or_else(|e| panic!("run id `{}`: {e}", stdout(&o))))
    }

    fn wait_state(&self, run: RunId, want: RunState) {
        let deadline = Instant::now() + WAIT;
        loop {
            let row = self.rt.block_on(self.store.get_run(run)).expect("get_run").expect("run");
            if row.state.is_terminal() {
                assert_eq!(row.state, want, "run {run}: {:?}", row.error);
                return;
            }
            assert!(Instant::now() < deadline, "run {run} still {}", row.state);
            std::thread::sleep(Duration::from_millis(100));
        }
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
                eprintln!("---- {} ----\n{}", p.name, std::fs::read_to_string(&p.log).unwrap_or_default());
            }
        }
        if let Some(db) = self.db.take() {
            self.rt.block_on(db.cleanup());
        }
    }
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    body.to_string()
}

fn spec(name: &str, source: &Path, notify: &str, extra_step: &str) -> String {
    format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: {name}\nnotify:\n{notify}steps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}, retry: {{attempts: 1}}{extra_step}}}\n",
        source.display()
    )
}

#[test]
fn every_finished_run_is_notified_once_through_a_failing_receiver() {
    let receiver = Receiver::start(2);
    let r = &receiver.addr;
    let mut d = Deployment::new();
    let server_hook = format!("http://{r}/server?token=SRVSECRET");
    let pipelines = d.dir.path().join("pipelines");
    std::fs::create_dir_all(&pipelines).expect("pipelines dir");
    // A watch on a Hub that refuses connections: its first check fails.
    std::fs::write(
        pipelines.join("watched.yaml"),
        format!(
            "apiVersion: shardline/v1\nkind: Pipeline\nname: watched\n\
             triggers:\n  - watch: {{repo: acme/tiny, every: 10m}}\n\
             notify:\n  - {{url: \"http://{r}/trigger\", on: [trigger-error]}}\n\
             steps:\n  - {{id: download, uses: hf.download, with: {{path: /nonexistent}}}}\n"
        ),
    )
    .expect("pipeline");
    let env = [("NOTIFY_PATH", "pathsecret123"), ("HF_ENDPOINT", "http://127.0.0.1:9"), ("HF_TOKEN", "")];
    let base = ["server", "--http", "127.0.0.1:0", "--public-reads", "--public-url", "http://dash.example/"];
    let mut one: Vec<&str> = base.to_vec();
    one.extend(["--notify", &server_hook, "--pipelines"]);
    let pipelines_arg = pipelines.to_string_lossy().to_string();
    one.push(&pipelines_arg);
    d.spawn("server-1", &one, &env);
    let mut two: Vec<&str> = base.to_vec();
    two.extend(["--notify", &server_hook]);
    d.spawn("server-2", &two, &env);
    d.spawn("worker", &["worker", "--name", "w", "--cpus", "2", "--lease-seconds", "5"], &[]);
    let addr = d.http_addr("server-1");
    d.http_addr("server-2");

    let source = fixture("qwen3_next");
    let ok = d.submit(
        "notified",
        &spec(
            "notified",
            &source,
            &format!(
                "  - url: \"http://{r}/spec/${{NOTIFY_PATH}}?key=KEYSECRET\"\n\
                 \x20 - {{url: \"http://{r}/slack/services/T0/slacksecret\", on: [succeeded], format: slack}}\n"
            ),
            "",
        ),
    );
    let missing = d.dir.path().join("no-such-model");
    let failed = d.submit("broken", &spec("broken", &missing, &format!("  - url: \"http://{r}/spec/failed\"\n"), ""));
    // Cancelled while queued (it asks for a GPU no worker has): told only where `on` says so.
    let gpu = ", resources: {gpus: 1}";
    let quiet = d.submit("quiet", &spec("quiet", &source, &format!("  - url: \"http://{r}/spec/quiet\"\n"), gpu));
    let asked = d.submit(
        "asked",
        &spec("asked", &source, &format!("  - {{url: \"http://{r}/spec/asked\", on: [cancelled]}}\n"), gpu),
    );
    d.wait_state(ok, RunState::Succeeded);
    d.wait_state(failed, RunState::Failed);
    for run in [quiet, asked] {
        assert!(d.rt.block_on(d.store.cancel_run(run, "user:test")).expect("cancel"));
    }

    // What must arrive: (path, run id or none, event).
    let expected: Vec<(String, Option<i64>, &str)> = vec![
        ("/spec/pathsecret123?key=KEYSECRET".into(), Some(ok.0), "succeeded"),
        ("/slack/services/T0/slacksecret".into(), Some(ok.0), "succeeded"),
        ("/server?token=SRVSECRET".into(), Some(ok.0), "succeeded"),
        ("/spec/failed".into(), Some(failed.0), "failed"),
        ("/server?token=SRVSECRET".into(), Some(failed.0), "failed"),
        ("/spec/asked".into(), Some(asked.0), "cancelled"),
        ("/trigger".into(), None, "trigger-error"),
    ];
    let key = |rcv: &Received| -> (String, Option<i64>, String) {
        let body = &rcv.body;
        let run = body["run_id"].as_i64().or_else(|| {
            // Slack bodies carry the run in their text.
            body["text"]
                .as_str()
                .and_then(|t| t.split("(#").nth(1))
                .and_then(|t| t.split(')').next())
                .and_then(|n| n.parse().ok())
        });
        let event = body["event"].as_str().map(str::to_string).unwrap_or_else(|| "succeeded".into());
        (rcv.path.clone(), run, event)
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let got: Vec<_> = receiver.accepted().iter().map(key).collect();
        if expected.iter().all(|(p, run, e)| got.iter().any(|(gp, grun, ge)| gp == p && grun == run && ge == e)) {
            break;
        }
        assert!(Instant::now() < deadline, "accepted so far: {got:#?}\nall: {:#?}", receiver.all());
        std::thread::sleep(Duration::from_millis(200));
    }
    // Give a duplicate (a second server, a retry) time to show.
    std::thread::sleep(Duration::from_secs(4));
    let accepted = receiver.accepted();
    let mut counts: BTreeMap<(String, Option<i64>, String), usize> = BTreeMap::new();
    for rcv in &accepted {
        *counts.entry(key(rcv)).or_default() += 1;
    }
    assert!(counts.values().all(|&n| n == 1), "a notification arrived twice: {counts:#?}");
    assert_eq!(accepted.len(), expected.len(), "unexpected notifications: {counts:#?}");
    assert_eq!(receiver.all().len(), expected.len() + 2, "two failed requests were retried");

    // Bodies, by value.
    let body_of = |path: &str, run: RunId| -> Value {
        accepted
            .iter()
            .find(|rcv| rcv.path == path && rcv.body["run_id"].as_i64() == Some(run.0))
            .map(|rcv| rcv.body.clone())
            .unwrap_or_else(|| panic!("no body for {path} run {run}"))
    };
    let row = d.rt.block_on(d.store.get_run(ok)).expect("get_run").expect("run");
    let b = body_of("/spec/pathsecret123?key=KEYSECRET", ok);
    assert_eq!(b["event"], "succeeded");
    assert_eq!(b["state"], "succeeded");
    assert_eq!(b["pipeline"], "notified");
    assert_eq!(b["run_name"].as_str(), row.options.name.as_deref());
    assert_eq!(b["model"].as_str(), Some(source.to_string_lossy().as_ref()));
    assert_eq!(b["revision"], Value::Null);
    assert_eq!(b["error"], Value::Null);
    assert_eq!(b["link"], format!("http://dash.example/runs/{ok}"));
    assert!(b["started_at"].is_string() && b["finished_at"].is_string());
    let f = body_of("/spec/failed", failed);
    assert_eq!(f["event"], "failed");
    assert_eq!(f["state"], "failed");
    assert_eq!(f["pipeline"], "broken");
    let error = f["error"].as_str().expect("error");
    assert!(error.contains("download"), "{error}");
    let slack = accepted.iter().find(|rcv| rcv.path.starts_with("/slack/")).expect("slack body");
    let text = slack.body["text"].as_str().expect("text");
    assert_eq!(slack.body.as_object().map(|o| o.len()), Some(1), "{}", slack.body);
    assert!(text.contains(&format!("(#{ok})")) && text.contains("`notified`") && text.contains("succeeded"), "{text}");
    assert!(text.ends_with(&format!("http://dash.example/runs/{ok}")), "{text}");
    let t = accepted.iter().find(|rcv| rcv.path == "/trigger").expect("trigger body");
    assert_eq!(t.body["pipeline"], "watched");
    assert!(t.body["error"].is_string(), "{}", t.body);

    // Recorded on the run, shown redacted.
    let api = http_get(&addr, &format!("/api/v1/runs/{ok}"));
    let view = http_get(&addr, &format!("/api/v1/runs/{ok}/view"));
    let page = http_get(&addr, &format!("/runs/{ok}"));
    let detail: Value = serde_json::from_str(&api).expect("run JSON");
    let notes = detail["notifications"].as_array().expect("notifications");
    assert_eq!(notes.len(), 3, "{api}");
    assert!(notes.iter().all(|n| n["state"] == "delivered" && n["last_status"] == 200), "{api}");
    let targets: Vec<&str> = notes.iter().filter_map(|n| n["target"].as_str()).collect();
    assert!(targets.contains(&format!("http://{r}/spec/${{NOTIFY_PATH}}?key=***").as_str()), "{targets:?}");
    assert!(targets.contains(&format!("http://{r}/server?token=***").as_str()), "{targets:?}");
    let stored = d.rt.block_on(d.store.run_notifications(ok)).expect("notifications");
    assert!(stored.iter().all(|n| n.state == DeliveryState::Delivered));
    for secret in SECRETS {
        for (what, text) in [("API", &api), ("view", &view), ("page", &page)] {
            assert!(!text.contains(secret), "{secret} in the {what}: {text}");
        }
        for name in ["server-1", "server-2"] {
            assert!(!d.log(name).contains(secret), "{secret} in the log of {name}");
        }
    }
    let quiet_notes = d.rt.block_on(d.store.run_notifications(quiet)).expect("notifications");
    assert!(quiet_notes.is_empty(), "{quiet_notes:?}");
}
