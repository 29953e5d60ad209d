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
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use shardline_hub::fake::{FakeHub, RequestKind};
use shardline_publish::moto::{repo_root, venv_python, Moto};

use crate::{bin, fixture, stderr, stdout};

const BUCKET: &str = "checkpoints";
const REPO: &str = "acme/tiny-qwen3-next";

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
        .envs(moto.env())
        .output()
        .expect("run shardline");
    assert!(o.status.success(), "shardline run failed ({}):\n{}\n{}", o.status, stdout(&o), stderr(&o));
    o
}

/// The checkpoint published under `s3://bucket/prefix` (tp2, of the qwen3_next fixture), read back
/// into `out` and loaded with torch.distributed.checkpoint by `tests/python/load_published.py`,
/// compared with the independent reference: its summary.
pub(crate) fn load_published(moto: &Moto, bucket: &str, prefix: &str, out: &Path) -> Value {
    let o = Command::new(venv_python())
        .arg(repo_root().join("tests/python/load_published.py"))
        .args(["--endpoint", &moto.endpoint(), "--bucket", bucket, "--prefix", prefix, "--tp", "2"])
        .arg("--source")
        .arg(fixture("qwen3_next"))
        .arg("--out")
        .arg(out)
        .output()
        .expect("run .venv python");
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "loading the published checkpoint with torch failed:\n{summary}\n{}", {
        String::from_utf8_lossy(&o.stderr)
    });
    serde_json::from_str(summary.trim()).unwrap_or_else(|e| panic!("{e}: {summary}"))
}

/// The `key` objects under `s3://BUCKET/prefix/`, listed through moto's plain HTTP API.
fn list_keys(moto: &Moto, prefix: &str) -> Vec<String> {
    moto.list_keys(BUCKET, &format!("{prefix}/"))
}

#[test]
fn hub_to_s3_pipeline_loads_in_torch() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let hub = runtime.block_on(FakeHub::start()).expect("start the local Hub");
    let sha = hub.publish_dir(REPO, &fixture("qwen3_next")).expect("publish the fixture");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(BUCKET);

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
    let summary = load_published(&moto, BUCKET, &prefix, &tmp.path().join("downloaded"));
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
