//! `hf.download` from a Hub repository, against the local Hub server (`shardline_hub::fake`)
//! serving the tiny real releases of `tests/fixtures/hf-tiny`: the whole pipeline publishes a
//! checkpoint whose manifest names the repository and commit; a blob whose bytes do not match
//! its sha256 fails the run at the download; the same commit again is a step-cache hit with no
//! byte downloaded, a new commit runs again; 429 with `Retry-After` and a cut connection are
//! retried and resumed within the attempt.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use shardline_engine::HubSettings;
use shardline_hub::fake::{FakeFile, FakeHub, Fault, FaultKind, FaultTarget, RequestKind};
use shardline_store::{RunState, TaskState};

const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const LEASE: Duration = Duration::from_secs(3);
const REPO: &str = "acme/tiny-qwen3-next";

const PIPELINE: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: hub-tiny
params:
  endpoint: {type: string}
steps:
  - id: download
    uses: hf.download
    with:
      repo: acme/tiny-qwen3-next
      endpoint: "${{ params.endpoint }}"
      allow: ["*.json", "*.safetensors"]
    retry: {attempts: 2, backoff: 0s}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: 2, dp: 2}
  - id: split
    uses: megatron.split_fused
    needs: [shard]
  - id: validate
    uses: checkpoint.validate
    needs: [split]
  - id: upload
    uses: store.upload
    needs: [validate]
    with: {to: "file://published/${{ run.id }}"}
"#;

struct Setup {
    h: Harness,
    hub: FakeHub,
    sha: String,
    cache: PathBuf,
}

async fn setup(kind: Kind) -> Setup {
    let mut h = Harness::new(kind).await;
    let hub = FakeHub::start().await.expect("start the local Hub");
    let sha = hub.publish_dir(REPO, &fixture("qwen3_next")).expect("publish the fixture");
    let cache = h.base.path().join("hf-home/hub");
    h.start_workers_with(2, LEASE, HubSettings { cache_dir: Some(cache.clone()), retry: None });
    Setup { h, hub, sha, cache }
}

impl Setup {
    async fn run(&self) -> (shardline_control::Submitted, shardline_store::RunRow) {
        let s = self.h.submit(PIPELINE, &[("endpoint", self.hub.endpoint())], false).await;
        let r = self.h.wait_finished(s.run, RUN_TIMEOUT).await;
        (s, r)
    }

    fn snapshot(&self, sha: &str) -> PathBuf {
        self.cache.join("models--acme--tiny-qwen3-next/snapshots").join(sha)
    }

    fn requests_of(&self, kind: RequestKind) -> usize {
        self.hub.requests().iter().filter(|r| r.kind == kind).count()
    }
}

fn fixture_bytes() -> u64 {
    std::fs::read_dir(fixture("qwen3_next"))
        .expect("fixture")
        .map(|e| e.expect("entry").metadata().expect("metadata").len())
        .sum()
}

fn run_name(r: &shardline_store::RunRow) -> String {
    r.options.name.clone().expect("run name")
}

shardline_testdb::on_both_backends!(
    hub_pipeline_publishes_with_repo_and_sha,
    corrupt_blob_fails_the_run_at_download,
    same_commit_is_a_cache_hit_and_a_new_commit_runs,
    rate_limit_and_cut_connection_are_retried_and_resumed,
);

async fn hub_pipeline_publishes_with_repo_and_sha(kind: Kind) {
    let s = setup(kind).await;
    // One file answers slowly, so heartbeats report progress while the download runs.
    s.hub.inject(
        Fault::new(FaultTarget::File("model-00004-of-00004.safetensors".into()), FaultKind::Delay(LEASE)).times(1),
    );
    let (sub, r) = s.run().await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    // The download's output: the snapshot directory in the HF cache layout, the resolved commit.
    let download = s.h.task(sub.run, "download").await;
    let out = output(&download);
    assert_eq!(out["sha"], json!(s.sha));
    assert_eq!(out["repo"], json!(REPO));
    assert_eq!(out["revision"], json!("main"));
    let snapshot = s.snapshot(&s.sha);
    assert_eq!(out["path"], json!(snapshot));
    assert_eq!(out["files"], json!(6));
    assert_eq!(out["bytes"], json!(fixture_bytes()));
    assert_eq!(out["bytes_downloaded"], json!(fixture_bytes()), "everything came over the network once");
    assert_eq!(
        std::fs::read_to_string(s.cache.join("models--acme--tiny-qwen3-next/refs/main")).expect("refs/main"),
        s.sha
    );
    for f in std::fs::read_dir(fixture("qwen3_next")).expect("fixture") {
        let f = f.expect("entry").path();
        let linked = snapshot.join(f.file_name().expect("name"));
        assert!(std::fs::symlink_metadata(&linked).expect("linked file").file_type().is_symlink());
        assert_eq!(std::fs::read(&linked).expect("snapshot file"), std::fs::read(&f).expect("fixture file"));
    }

    // Progress went through the heartbeats: bytes done out of the known total.
    let progress = download.progress.clone().expect("the download reported progress");
    assert_eq!(progress["bytes_total"], json!(fixture_bytes()), "{progress}");
    assert!(progress["bytes"].as_u64().is_some_and(|b| b > 0 && b <= fixture_bytes()), "{progress}");
    let logs = s.h.logs(sub.run, "download").await.join("\n");
    assert!(logs.contains(&format!("commit {}", s.sha)), "{logs}");

    // Everything after the download read the snapshot; the published checkpoint is bit-exact.
    let published = s.h.base.path().join("published").join(run_name(&r));
    assert_bit_exact(&published, &fixture("qwen3_next"));
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(published.join(shardline_publish::MANIFEST)).expect("published manifest"),
    )
    .expect("manifest json");
    assert_eq!(manifest["source"]["repo"], json!(REPO), "{manifest:#}");
    assert_eq!(manifest["source"]["sha"], json!(s.sha), "{manifest:#}");
    assert_eq!(manifest["source"]["revision"], json!("main"));
    assert_eq!(manifest["source"]["endpoint"], json!(s.hub.endpoint()));
    assert_eq!(manifest["source"]["allow"], json!(["*.json", "*.safetensors"]));
    s.h.finish().await;
}

async fn corrupt_blob_fails_the_run_at_download(kind: Kind) {
    let s = setup(kind).await;
    let bad = "model-00002-of-00004.safetensors";
    s.hub.inject(Fault::new(FaultTarget::File(bad.into()), FaultKind::Corrupt));
    let (sub, r) = s.run().await;
    assert_eq!(r.state, RunState::Failed);

    let download = s.h.task(sub.run, "download").await;
    assert_eq!(download.state, TaskState::Failed);
    let error = download.error.clone().unwrap_or_default();
    assert!(error.contains("checksum mismatch") && error.contains(bad) && error.contains(REPO), "{error}");
    assert!(r.error.clone().unwrap_or_default().contains("checksum mismatch"), "{:?}", r.error);
    // A checksum mismatch is not retried as a task (the client already downloaded twice).
    assert_eq!(s.h.attempts(sub.run, "download").await.len(), 1);

    // No later task ran, and the corrupt bytes never reached the snapshot.
    for t in s.h.tasks(sub.run).await {
        if t.name != "download" {
            assert_eq!(t.attempt, 0, "task `{}` ran after a failed download ({})", t.name, t.state);
            assert!(t.output.is_none());
        }
    }
    assert!(!s.snapshot(&s.sha).join(bad).exists(), "a corrupt file was linked into the snapshot");
    let blobs = s.cache.join("models--acme--tiny-qwen3-next/blobs");
    let expected_blob = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        std::fs::read(fixture("qwen3_next").join(bad)).expect("fixture file"),
    ));
    assert!(!blobs.join(&expected_blob).exists(), "a corrupt blob was kept under its published name");
    s.h.finish().await;
}

async fn same_commit_is_a_cache_hit_and_a_new_commit_runs(kind: Kind) {
    let s = setup(kind).await;
    let (_, r1) = s.run().await;
    assert_eq!(r1.state, RunState::Succeeded, "{:?}", r1.error);
    assert!(s.requests_of(RequestKind::Cdn) >= 4, "the first run downloaded the weights");

    // The same commit: one revision request, no listing, no file request.
    s.hub.clear_requests();
    let (sub2, r2) = s.run().await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    let d2 = s.h.task(sub2.run, "download").await;
    assert_eq!(output(&d2)["cached"], json!(true), "{}", output(&d2));
    assert_eq!(output(&d2)["sha"], json!(s.sha));
    assert_eq!(s.requests_of(RequestKind::Revision), 1, "{:?}", s.hub.requests());
    assert_eq!(s.requests_of(RequestKind::Tree), 0);
    assert_eq!(s.requests_of(RequestKind::Resolve) + s.requests_of(RequestKind::Cdn), 0, "a file was downloaded");
    let logs = s.h.logs(sub2.run, "download").await.join("\n");
    assert!(logs.contains("cache hit"), "{logs}");
    // The snapshot's digest did not change, so the shard step is served from its cache too.
    let plan2 = s.h.task(sub2.run, "shard").await;
    assert!(output(&plan2).get("cached").is_some(), "{}", output(&plan2));
    let published = s.h.base.path().join("published").join(run_name(&r2));
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(published.join(shardline_publish::MANIFEST)).expect("manifest"))
            .expect("json");
    assert_eq!(manifest["source"]["sha"], json!(s.sha));

    // A new commit on `main` (one weight file changed): the download runs again.
    let dir = fixture("qwen3_next");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir).expect("fixture") {
        let p = e.expect("entry").path();
        let name = p.file_name().expect("name").to_string_lossy().into_owned();
        files.push(FakeFile::from_disk(name, p));
    }
    files.push(FakeFile::new("README.md", "a new commit\n"));
    let sha3 = s.hub.publish(REPO, files).expect("publish a new commit");
    assert_ne!(sha3, s.sha);
    s.hub.clear_requests();
    let (sub3, r3) = s.run().await;
    assert_eq!(r3.state, RunState::Succeeded, "{:?}", r3.error);
    let d3 = s.h.task(sub3.run, "download").await;
    assert!(output(&d3).get("cached").is_none(), "{}", output(&d3));
    assert_eq!(output(&d3)["sha"], json!(sha3));
    assert_eq!(output(&d3)["path"], json!(s.snapshot(&sha3)));
    assert_eq!(s.requests_of(RequestKind::Tree), 1, "the new commit was listed");
    // README.md is not selected by `allow`; the weights' blobs were verified in the cache and reused.
    assert_eq!(output(&d3)["files"], json!(6));
    assert_eq!(output(&d3)["bytes_reused"], json!(fixture_bytes()));
    assert_eq!(s.requests_of(RequestKind::Cdn), 0, "blobs of the cache were downloaded again");
    s.h.finish().await;
}

async fn rate_limit_and_cut_connection_are_retried_and_resumed(kind: Kind) {
    let s = setup(kind).await;
    let cut = "model-00001-of-00004.safetensors";
    s.hub.inject(Fault::new(FaultTarget::Api, FaultKind::TooManyRequests { retry_after_secs: 2 }).times(1));
    s.hub.inject(Fault::new(FaultTarget::File(cut.into()), FaultKind::CutAfter(50_000)).times(1));
    let (sub, r) = s.run().await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    // Retried inside one attempt of the task, which waited as long as `Retry-After` said.
    let attempts = s.h.attempts(sub.run, "download").await;
    assert_eq!(attempts.len(), 1);
    let took = attempts[0].ended_at.expect("attempt ended") - attempts[0].started_at;
    assert!(took >= chrono::Duration::seconds(2), "Retry-After: 2 was not waited for (the attempt took {took})");

    let requests = s.hub.requests();
    let limited = requests.iter().position(|r| r.status == 429).expect("the 429 was served");
    assert!(requests[limited + 1..].iter().any(|r| r.kind == RequestKind::Revision && r.status == 200));
    let cut_at = requests
        .iter()
        .position(|r| r.file.as_deref() == Some(cut) && matches!(r.fault, Some(FaultKind::CutAfter(_))))
        .expect("the cut was served");
    let resumed = requests[cut_at + 1..]
        .iter()
        .find(|r| r.file.as_deref() == Some(cut) && r.kind == RequestKind::Cdn)
        .expect("the cut file was requested again");
    assert!(
        resumed.range.as_deref().is_some_and(|r| r.starts_with("bytes=50000-")),
        "not resumed from the bytes on disk: {resumed:?}"
    );
    let snapshot = s.snapshot(&s.sha);
    assert_eq!(
        std::fs::read(snapshot.join(cut)).expect("snapshot file"),
        std::fs::read(fixture("qwen3_next").join(cut)).expect("fixture file")
    );
    s.h.finish().await;
}
