//! `shardline server --pipelines DIR` with the local Hub server (`HF_ENDPOINT`): two server
//! processes watching the same repository through one store start one run between them, for
//! the repository's commit, and `shardline triggers` lists the trigger with that run.

use std::fs;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_hub::fake::{FakeFile, FakeHub};

use crate::{bin, run, stderr, stdout};

const SPEC: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: watched
params:
  repo: {type: string, default: none}
  revision: {type: string, default: main}
triggers:
  - watch: {repo: acme/tiny, every: 10m}
    params: {repo: "${{ trigger.repo }}", revision: "${{ trigger.sha }}"}
steps:
  - id: download
    uses: hf.download
    with: {repo: "${{ params.repo }}", revision: "${{ params.revision }}"}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: 1, dp: 1}
"#;

/// A server process, killed (by its own handle) when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server(dir: &Path, endpoint: &str, log: &str) -> Server {
    let out = fs::File::create(dir.join(log)).expect("server log");
    let child = bin()
        .current_dir(dir)
        .args(["server", "--pipelines", "pipelines", "--state-dir", "state"])
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", dir.join("hf"))
        .env_remove("HF_TOKEN")
        .env_remove("SHARDLINE_DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .expect("start shardline server");
    Server(child)
}

fn json_of(dir: &Path, args: &[&str]) -> Value {
    let o = run(bin()
        .current_dir(dir)
        .args(args)
        .args(["--json", "--state-dir", "state"])
        .env_remove("SHARDLINE_DATABASE_URL"));
    assert!(o.status.success(), "shardline {args:?}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("shardline {args:?} --json: {e}: {}", stdout(&o)))
}

#[test]
fn two_servers_watching_one_repo_start_one_run() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let hub = runtime.block_on(FakeHub::start()).expect("start the local Hub");
    let sha = hub.publish("acme/tiny", vec![FakeFile::new("config.json", "{}")]).expect("publish");
    let dir = tempfile::tempdir().expect("temp dir");
    fs::create_dir_all(dir.path().join("pipelines")).expect("mkdir");
    fs::write(dir.path().join("pipelines/watched.yaml"), SPEC).expect("write spec");
    // The store exists (migrated) before the two servers open it.
    assert_eq!(json_of(dir.path(), &["triggers"]), serde_json::json!([]));

    let _a = server(dir.path(), &hub.endpoint(), "a.log");
    let _b = server(dir.path(), &hub.endpoint(), "b.log");
    // The first server to check the new trigger fires; the other finds the check done, or
    // the firing claimed, and starts nothing.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if json_of(dir.path(), &["triggers"])[0]["last_run"].is_number() {
            break;
        }
        let logs = ["a.log", "b.log"].map(|l| fs::read_to_string(dir.path().join(l)).unwrap_or_default());
        let requests: Vec<String> =
            hub.requests().iter().map(|r| format!("{} {} {}", r.method, r.uri, r.status)).collect();
        assert!(
            Instant::now() < deadline,
            "no run after 60 s; Hub requests: {requests:#?}\nserver logs:\n{}\n{}",
            logs[0],
            logs[1]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Give the slower server time to finish its check too.
    std::thread::sleep(Duration::from_secs(1));

    let runs = json_of(dir.path(), &["runs"]);
    let runs = runs.as_array().expect("runs array");
    assert_eq!(runs.len(), 1, "one run between the two servers: {runs:?}");
    assert_eq!(runs[0]["pipeline_name"], "watched");
    assert_eq!(runs[0]["params"]["repo"], "acme/tiny");
    assert_eq!(runs[0]["params"]["revision"], sha.as_str());
    assert_eq!(runs[0]["dedupe_key"], format!("trigger/watched/acme/tiny@{sha}").as_str());

    let triggers = json_of(dir.path(), &["triggers"]);
    let t = &triggers[0];
    assert_eq!(t["pipeline"], "watched");
    assert_eq!(t["kind"], "watch");
    assert_eq!(t["summary"], "acme/tiny@main every 10m");
    assert_eq!(t["last_sha"], sha.as_str());
    assert_eq!(t["last_run"], runs[0]["id"]);
    assert_eq!(t["errors"], 0);
    assert!(t["next_at"].is_string());

    // The table names the same.
    let o = run(bin()
        .current_dir(dir.path())
        .args(["triggers", "--state-dir", "state"])
        .env_remove("SHARDLINE_DATABASE_URL"));
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(table.contains("acme/tiny@main every 10m"), "{table}");
    assert!(table.contains(&sha[..12]), "{table}");
    drop(runtime);
}
