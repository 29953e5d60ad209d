//! The cache layout against `huggingface_hub` itself (the project's `.venv`, made by
//! `scripts/setup-python`): it must find our downloads offline, and we must reuse its downloads.
//! These tests fail, not skip, when the venv is missing.

mod common;

use std::path::PathBuf;
use std::process::Stdio;

use common::*;
use shardline_hub::fake::RequestKind;

fn venv_python() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let py = root.join(".venv/bin/python");
    assert!(py.exists(), "{} is missing: run scripts/setup-python (it installs huggingface_hub)", py.display());
    py
}

async fn python(script: &str, args: &[String], envs: &[(&str, String)]) -> String {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(venv_python());
    cmd.arg("-c").arg(script).args(args);
    cmd.env("HF_HOME", home.path()).env("HF_HUB_DISABLE_TELEMETRY", "1").env("HF_HUB_DISABLE_UPDATE_CHECK", "1");
    cmd.env_remove("HF_TOKEN").env_remove("HF_ENDPOINT").env_remove("HF_HUB_CACHE");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "python failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

const READ_OUR_CACHE: &str = r#"
import hashlib, json, os, sys
from huggingface_hub import hf_hub_download, scan_cache_dir, snapshot_download
cache, repo, sha, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
snap = snapshot_download(repo, revision=sha, local_files_only=True, cache_dir=cache)
assert os.path.isdir(snap), snap
for path, digest in expected.items():
    f = os.path.join(snap, path)
    assert os.path.islink(f), f
    with open(f, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == digest, path
    q = hf_hub_download(repo, path, revision=sha, local_files_only=True, cache_dir=cache)
    assert os.path.samefile(q, f), (q, f)
# A branch name resolves through refs/main.
assert snapshot_download(repo, revision="main", local_files_only=True, cache_dir=cache) == snap
info = scan_cache_dir(cache)
assert not info.warnings, info.warnings
(r,) = [r for r in info.repos if r.repo_id == repo]
(rev,) = r.revisions
assert rev.commit_hash == sha and "main" in rev.refs, (rev.commit_hash, rev.refs)
assert r.nb_files == len(expected), r.nb_files
print("snapshot", snap)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huggingface_hub_finds_our_downloads_offline() {
    let (hub, sha) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    let expected: serde_json::Map<String, serde_json::Value> =
        release().iter().map(|(p, d)| (p.clone(), serde_json::Value::String(sha256_hex(d)))).collect();
    let args = [
        cache.path().to_string_lossy().into_owned(),
        REPO.to_owned(),
        sha,
        serde_json::Value::Object(expected).to_string(),
    ];
    let out = python(READ_OUR_CACHE, &args, &[("HF_HUB_OFFLINE", "1".into())]).await;
    assert_eq!(out.trim(), format!("snapshot {}", snap.dir.display()));
}

const DOWNLOAD_WITH_HUGGINGFACE_HUB: &str = r#"
import sys
from huggingface_hub import snapshot_download
print(snapshot_download(sys.argv[2], revision="main", cache_dir=sys.argv[1]))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn we_reuse_what_huggingface_hub_downloaded_from_the_local_server() {
    let (hub, sha) = hub_with_release().await;
    let cache = tempfile::tempdir().unwrap();
    let args = [cache.path().to_string_lossy().into_owned(), REPO.to_owned()];
    let out = python(DOWNLOAD_WITH_HUGGINGFACE_HUB, &args, &[("HF_ENDPOINT", hub.endpoint())]).await;
    assert!(out.trim().ends_with(&sha), "{out}");
    hub.clear_requests();
    let snap = client(&hub).download(REPO, "main", &opts(cache.path())).await.unwrap();
    assert_eq!(snap.bytes_downloaded, 0, "every blob huggingface_hub wrote is reused");
    assert_eq!(snap.bytes_reused, release().iter().map(|(_, d)| d.len() as u64).sum::<u64>());
    assert!(hub.requests().iter().all(|r| !matches!(r.kind, RequestKind::Resolve | RequestKind::Cdn)));
}
