//! End to end, with real parts on both sides: `shardline run pipelines/hub-qwen3.yaml` downloads a
//! tiny real release from a local Hub server (`shardline_hub::fake`, the Hub's HTTP API on
//! 127.0.0.1, found through `HF_ENDPOINT`), shards it, splits the fused parameters, validates it
//! and publishes it to a real S3-compatible server (moto, from the repository's `.venv`). Then the
//! published objects are read back from S3 and loaded with real PyTorch
//! (`torch.distributed.checkpoint`) and compared, tensor by tensor, with the independent Python
//! reference mapping of the release (`tests/python/load_published.py`).
//!
//! Fails, never skips, when `.venv`, moto, boto3 or torch is missing (`scripts/setup-python`
//! installs them).

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_hub::fake::{FakeHub, RequestKind};

use crate::{bin, fixture, stderr, stdout};

const BUCKET: &str = "checkpoints";
const REPO: &str = "acme/tiny-qwen3-next";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn venv_python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: this test needs the repository's venv with torch, boto3 and moto[server] \
         (run scripts/setup-python)",
        python.display()
    );
    python
}

/// moto's S3 server on 127.0.0.1, killed on drop; it also exits when this process goes away (it
/// watches its stdin, a pipe from us). The same way the publish crate's tests start it.
struct Moto {
    child: Child,
    port: u16,
}

const MOTO_MAIN: &str = r#"
import os, sys, threading
def watch_parent():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=watch_parent, daemon=True).start()
from moto.server import main
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"#;

impl Moto {
    fn start(dir: &Path) -> Moto {
        let python = venv_python();
        let check = Command::new(&python).args(["-c", "import moto.server, boto3"]).output().expect("run .venv python");
        assert!(
            check.status.success(),
            "moto[server] is not installed in .venv (run scripts/setup-python): {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let mut last_log = String::new();
        for attempt in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
            let log = dir.join(format!("moto-{attempt}.log"));
            let out = fs::File::create(&log).expect("moto log");
            let mut child = Command::new(&python)
                .args(["-c", MOTO_MAIN, &port.to_string()])
                .stdin(Stdio::piped())
                .stdout(out.try_clone().expect("log handle"))
                .stderr(out)
                .spawn()
                .expect("start moto");
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if let Ok((200, _)) = http(port, "GET", "/") {
                    return Moto { child, port };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = fs::read_to_string(&log).unwrap_or_default();
        }
        panic!("moto did not start on 127.0.0.1 after 3 attempts; its log:\n{last_log}");
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.1 request to 127.0.0.1:port (moto takes unsigned requests).
fn http(port: u16, method: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response: {resp}")))?;
    Ok((status, resp))
}

fn shardline_run(dir: &Path, hub: &FakeHub, moto: &Moto, hf_home: &Path, dest: &str) -> std::process::Output {
    let pipeline = repo_root().join("pipelines/hub-qwen3.yaml");
    let o = bin()
        .current_dir(dir)
        .arg("run")
        .arg(&pipeline)
        .args(["--set", &format!("repo={REPO}"), "--set", "tp=2", "--set", "dp=2", "--set", &format!("dest={dest}")])
        .env_remove("SHARDLINE_DATABASE_URL")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", hf_home)
        .env("AWS_ENDPOINT_URL", moto.endpoint())
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing-secret")
        .output()
        .expect("run shardline");
    assert!(o.status.success(), "shardline run failed ({}):\n{}\n{}", o.status, stdout(&o), stderr(&o));
    o
}

/// The `key` objects under `s3://BUCKET/prefix/`, listed through moto's plain HTTP API.
fn list_keys(moto: &Moto, prefix: &str) -> Vec<String> {
    let (status, body) = http(moto.port, "GET", &format!("/{BUCKET}?list-type=2&prefix={prefix}/")).expect("list");
    assert_eq!(status, 200, "{body}");
    body.split("<Key>").skip(1).filter_map(|s| s.split("</Key>").next()).map(str::to_string).collect()
}

#[test]
fn hub_to_s3_pipeline_loads_in_torch() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let hub = runtime.block_on(FakeHub::start()).expect("start the local Hub");
    let sha = hub.publish_dir(REPO, &fixture("qwen3_next")).expect("publish the fixture");
    let moto = Moto::start(tmp.path());
    let (status, body) = http(moto.port, "PUT", &format!("/{BUCKET}")).expect("create bucket");
    assert_eq!(status, 200, "{body}");

    let hf_home = tmp.path().join("hf-home");
    let work = tmp.path().join("work");
    fs::create_dir_all(&work).expect("work dir");
    shardline_run(&work, &hub, &moto, &hf_home, &format!("s3://{BUCKET}/runs"));

    // The snapshot is in the standard cache layout under HF_HOME/hub.
    let snapshot = hf_home.join("hub/models--acme--tiny-qwen3-next/snapshots").join(&sha);
    for f in fs::read_dir(fixture("qwen3_next")).expect("fixture") {
        let f = f.expect("entry").path();
        let name = f.file_name().expect("name");
        assert_eq!(fs::read(snapshot.join(name)).expect("snapshot file"), fs::read(&f).expect("fixture file"));
    }
    let cdn_requests = hub.requests().iter().filter(|r| r.kind == RequestKind::Cdn).count();
    assert!(cdn_requests >= 4, "the weights came from the Hub's CDN ({cdn_requests} requests)");

    // One run published under s3://checkpoints/runs/<run id>/.
    let all = list_keys(&moto, "runs");
    let manifest_key = all
        .iter()
        .find(|k| k.ends_with("/shardline-manifest.json"))
        .unwrap_or_else(|| panic!("no manifest under s3://{BUCKET}/runs: {all:?}"));
    let prefix = manifest_key.trim_end_matches("/shardline-manifest.json").to_string();
    let keys = list_keys(&moto, &prefix);
    // tp2·dp2: four rank files, .metadata and the manifest.
    assert_eq!(keys.len(), 6, "{keys:?}");

    // Read back from S3 and loaded with torch.distributed.checkpoint; compared with the reference.
    let out = Command::new(venv_python())
        .arg(repo_root().join("tests/python/load_published.py"))
        .args(["--endpoint", &moto.endpoint(), "--bucket", BUCKET, "--prefix", &prefix, "--tp", "2"])
        .arg("--source")
        .arg(fixture("qwen3_next"))
        .arg("--out")
        .arg(tmp.path().join("downloaded"))
        .output()
        .expect("run .venv python");
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "loading the published checkpoint with torch failed:\n{summary}\n{}", {
        String::from_utf8_lossy(&out.stderr)
    });
    let summary: Value = serde_json::from_str(summary.trim()).unwrap_or_else(|e| panic!("{e}: {summary}"));
    assert_eq!(summary["objects"], 6);
    assert_eq!(summary["problems"], serde_json::json!([]));
    assert!(summary["tensors"].as_u64().is_some_and(|n| n > 20), "{summary}");
    assert!(summary["bytes"].as_u64().is_some_and(|n| n > 100_000), "{summary}");
    assert_eq!(summary["source"]["repo"], REPO, "{summary}");
    assert_eq!(summary["source"]["sha"], sha.as_str(), "{summary}");
    assert_eq!(summary["source"]["revision"], "main", "{summary}");
    assert_eq!(summary["source"]["endpoint"], hub.endpoint().as_str(), "{summary}");

    // The same commit again: served from the step cache, nothing downloaded.
    hub.clear_requests();
    let o = shardline_run(&work, &hub, &moto, &hf_home, &format!("s3://{BUCKET}/again"));
    let requests = hub.requests();
    assert!(
        requests.iter().all(|r| r.kind == RequestKind::Revision),
        "a second run of the same commit downloaded again: {requests:?}\n{}",
        stdout(&o)
    );
    assert_eq!(list_keys(&moto, "again").len(), 6);
    drop(runtime);
}
