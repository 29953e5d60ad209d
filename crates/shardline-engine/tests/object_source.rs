//! `hf.download` of an object-store prefix, against a real S3 server (moto, from the repository's
//! `.venv`, through `shardline_publish::moto`; the test fails, never skips, without it): the tiny
//! real llama release is uploaded (with a Shardline manifest, as `store.upload` publishes, or as
//! plain objects), and `hf.download {path: s3://…}` → `megatron.shard` → `checkpoint.validate`
//! completes with a bit-exact validation; the same prefix again is a step-cache hit with no object
//! read; a changed object downloads again; an object whose bytes differ from the manifest fails
//! the run at the download and nothing later runs; a prefix without objects is a clear error.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use shardline_engine::steps::StepContext;
use shardline_engine::{HubSettings, ObjectSourceSettings};
use shardline_formats::execute::Progress;
use shardline_publish::moto::Moto;
use shardline_publish::object_store::{ObjectStoreExt, PutPayload};
use shardline_publish::{Destination, PublishOptions};
use shardline_store::{RunState, TaskState};

const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const LEASE: Duration = Duration::from_secs(3);
const BUCKET: &str = "releases";
const FIXTURE: &str = "llama";

const PIPELINE: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: object-source
params:
  source: {type: string}
steps:
  - id: download
    uses: hf.download
    with: {path: "${{ params.source }}"}
    retry: {attempts: 2, backoff: 0s}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: 2, dp: 2}
  - id: validate
    uses: checkpoint.validate
    needs: [shard]
"#;

struct Setup {
    h: Harness,
    moto: Moto,
}

async fn setup(kind: Kind) -> Setup {
    let mut h = Harness::new(kind).await;
    let moto = Moto::start(h.base.path());
    moto.create_bucket(BUCKET);
    let options = moto.store_options();
    h.start_workers_configured(2, LEASE, |c| c.objects.store_options = options.clone());
    Setup { h, moto }
}

impl Setup {
    async fn run(&self, source: &str) -> (shardline_control::Submitted, shardline_store::RunRow) {
        let s = self.h.submit(PIPELINE, &[("source", source.to_string())], false).await;
        let r = self.h.wait_finished(s.run, RUN_TIMEOUT).await;
        (s, r)
    }

    fn dest(&self, url: &str) -> Destination {
        Destination::open(url, &self.moto.store_options()).expect("open the bucket")
    }

    /// Publishes the fixture under `prefix` as `store.upload` does: data, then the manifest.
    async fn publish(&self, prefix: &str) -> String {
        let url = format!("s3://{BUCKET}/{prefix}");
        let options = PublishOptions { store_options: self.moto.store_options(), ..Default::default() };
        shardline_publish::publish(&fixture(FIXTURE), &url, json!({"fixture": FIXTURE}), json!({}), &options)
            .await
            .expect("publish the fixture");
        url
    }

    /// Uploads the fixture's files under `prefix` as plain objects (no manifest).
    async fn upload_plain(&self, prefix: &str) -> String {
        let url = format!("s3://{BUCKET}/{prefix}");
        let dest = self.dest(&url);
        for (name, path) in fixture_files() {
            let bytes = std::fs::read(&path).expect("fixture file");
            dest.store().put(&dest.object(&name), PutPayload::from(bytes)).await.expect("put");
        }
        url
    }

    async fn put(&self, url: &str, name: &str, bytes: Vec<u8>) {
        let dest = self.dest(url);
        dest.store().put(&dest.object(name), PutPayload::from(bytes)).await.expect("put");
    }

    /// GET requests for objects (not listings) since request `from`.
    fn object_reads_since(&self, from: usize) -> Vec<String> {
        self.moto.requests()[from..]
            .iter()
            .filter(|(m, p, _)| m == "GET" && !p.contains("list-type") && p.starts_with(&format!("/{BUCKET}/")))
            .map(|(_, p, _)| p.clone())
            .collect()
    }

    fn cache_root(&self) -> PathBuf {
        self.h.work_dir().join("cache/objects")
    }
}

fn fixture_files() -> Vec<(String, PathBuf)> {
    let mut files: Vec<(String, PathBuf)> = std::fs::read_dir(fixture(FIXTURE))
        .expect("fixture")
        .map(|e| {
            let p = e.expect("entry").path();
            (p.file_name().expect("name").to_string_lossy().into_owned(), p)
        })
        .collect();
    files.sort();
    files
}

fn fixture_bytes() -> u64 {
    fixture_files().iter().map(|(_, p)| std::fs::metadata(p).expect("metadata").len()).sum()
}

/// Every fixture file is in `dir` with the same bytes.
fn assert_same_files(dir: &Path) {
    for (name, path) in fixture_files() {
        let got = std::fs::read(dir.join(&name)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(&name).display()));
        assert_eq!(got, std::fs::read(&path).expect("fixture file"), "{name} differs from the fixture");
    }
}

/// Names in the cache root: complete directories only, nothing partial or temporary.
fn cache_entries(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map(|d| d.map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

shardline_testdb::on_both_backends!(
    s3_source_validates_and_the_same_prefix_is_a_cache_hit,
    changed_object_downloads_again,
    corrupt_object_fails_the_run_at_download,
    missing_prefix_and_bucket_are_clear_errors,
);

async fn s3_source_validates_and_the_same_prefix_is_a_cache_hit(kind: Kind) {
    let s = setup(kind).await;
    let url = s.publish("models/llama").await;
    let (sub, r) = s.run(&url).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    // The download: every file of the release, checked against the manifest, in the cache.
    let download = s.h.task(sub.run, "download").await;
    let out = output(&download).clone();
    assert_eq!(out["url"], json!(url));
    assert_eq!(out["manifest"], json!(true));
    assert_eq!(out["files"], json!(4));
    assert_eq!(out["bytes"], json!(fixture_bytes()));
    assert_eq!(out["bytes_downloaded"], json!(fixture_bytes()), "everything came from S3 once");
    let key = out["cache_key"].as_str().expect("cache key").to_string();
    let dir = s.cache_root().join(&key);
    assert_eq!(out["path"], json!(dir));
    assert_same_files(&dir);
    assert!(!dir.join(shardline_publish::MANIFEST).exists(), "the manifest is not part of the release");
    for f in out["file_list"].as_array().expect("file list") {
        let name = f["path"].as_str().expect("name");
        let expected = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            std::fs::read(fixture(FIXTURE).join(name)).expect("fixture file"),
        ));
        assert_eq!(f["sha256"], json!(expected), "{name}");
    }
    assert_eq!(out["source"]["url"], json!(url));
    // Only the complete directory and its lock are left: no `.partial`, no temporary file.
    assert_eq!(cache_entries(&s.cache_root()), vec![key.clone(), format!("{key}.lock")]);
    let logs = s.h.logs(sub.run, "download").await.join("\n");
    assert!(logs.contains("every file matches the manifest"), "{logs}");

    // The later steps read the downloaded directory; the validation is bit-exact.
    let validate = s.h.task(sub.run, "validate").await;
    assert_eq!(validate.state, TaskState::Succeeded);
    assert_eq!(output(&validate)["ok"], json!(true));
    assert!(output(&validate)["bytes_checked"].as_u64().is_some_and(|b| b > 0));

    // The same prefix again: listed, not read; the shard step is served from its cache too.
    let before = s.moto.requests().len();
    let (sub2, r2) = s.run(&url).await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    let d2 = s.h.task(sub2.run, "download").await;
    assert_eq!(output(&d2)["cached"], json!(true), "{}", output(&d2));
    assert_eq!(output(&d2)["path"], json!(dir));
    assert_eq!(s.h.attempts(sub2.run, "download").await.len(), 1);
    let logs = s.h.logs(sub2.run, "download").await.join("\n");
    assert!(logs.contains("cache hit"), "{logs}");
    let reads: Vec<String> =
        s.object_reads_since(before).into_iter().filter(|p| !p.ends_with(shardline_publish::MANIFEST)).collect();
    assert!(reads.is_empty(), "objects were read again: {reads:?}");
    let plan2 = s.h.task(sub2.run, "shard").await;
    assert!(output(&plan2).get("cached").is_some(), "{}", output(&plan2));
    s.h.finish().await;
}

/// The download's counters, as the worker's heartbeats report them: bytes done out of the total,
/// files done; a second download of the same listing reuses the directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn download_reports_bytes_done_out_of_the_total() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(BUCKET);
    let url = format!("s3://{BUCKET}/models/llama");
    let options = PublishOptions { store_options: moto.store_options(), ..Default::default() };
    shardline_publish::publish(&fixture(FIXTURE), &url, json!({}), json!({}), &options).await.expect("publish");
    let settings = ObjectSourceSettings { store_options: moto.store_options(), ..Default::default() };
    let cache = tmp.path().join("cache");
    let run = |cache: PathBuf, url: String, settings: ObjectSourceSettings| {
        tokio::task::spawn_blocking(move || {
            let progress = Arc::new(Progress::default());
            let total = Arc::new(AtomicU64::new(0));
            let log = |_: String| {};
            let runtime = tokio::runtime::Handle::current();
            let scratch = cache.join("scratch");
            let ctx = StepContext {
                outputs: &BTreeMap::new(),
                progress: &progress,
                bytes_total: &total,
                log: &log,
                hub: &HubSettings::default(),
                objects: &settings,
                cpus: 1,
                gpus: &[],
                timeout: std::time::Duration::ZERO,
                stderr: &log,
                runtime: &runtime,
                ledger: None,
                scratch: &scratch,
                scratch_root: &scratch,
            };
            let out = shardline_engine::objects::download(&url, &cache, &settings, &ctx).expect("download");
            (
                out,
                progress.bytes_written.load(Ordering::Relaxed),
                progress.files_done.load(Ordering::Relaxed),
                total.load(Ordering::Relaxed),
            )
        })
    };
    let (out, done, files, total) = run(cache.clone(), url.clone(), settings.clone()).await.expect("join");
    assert_eq!((done, files, total), (fixture_bytes(), 4, fixture_bytes()));
    assert_eq!(out["bytes_downloaded"], json!(fixture_bytes()));
    let (again, done, files, total) = run(cache.clone(), url.clone(), settings.clone()).await.expect("join");
    assert_eq!((done, files, total), (fixture_bytes(), 4, fixture_bytes()));
    assert_eq!(again["path"], out["path"]);
    assert_eq!(again["bytes_downloaded"], json!(0));
    assert_eq!(again["bytes_reused"], json!(fixture_bytes()));

    // An interrupted download: only `<key>.partial` exists, with one file finished, one missing
    // and one half-written under its temporary name. The next download keeps the finished files,
    // fetches the rest, and only then does the directory appear under its key.
    let dir = PathBuf::from(out["path"].as_str().expect("path"));
    let partial = PathBuf::from(format!("{}.partial", dir.display()));
    std::fs::rename(&dir, &partial).expect("back to partial");
    let missing = "model-00001-of-00002.safetensors";
    let half = "model-00002-of-00002.safetensors";
    std::fs::remove_file(partial.join(missing)).expect("remove");
    std::fs::remove_file(partial.join(half)).expect("remove");
    std::fs::write(partial.join(format!("{half}.shardline-download")), b"half of it").expect("tmp");
    let size = |n: &str| std::fs::metadata(fixture(FIXTURE).join(n)).expect("metadata").len();
    let (resumed, done, _, _) = run(cache.clone(), url.clone(), settings.clone()).await.expect("join");
    assert_eq!(done, fixture_bytes());
    assert_eq!(resumed["bytes_downloaded"], json!(size(missing) + size(half)));
    assert_eq!(resumed["bytes_reused"], json!(fixture_bytes() - size(missing) - size(half)));
    assert_eq!(resumed["path"], out["path"]);
    assert!(!partial.exists(), "the partial directory was renamed into place");
    assert_same_files(&dir);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let expected: Vec<String> = fixture_files().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, expected, "only the release's files, no temporary one");
}

async fn changed_object_downloads_again(kind: Kind) {
    let s = setup(kind).await;
    // Plain objects, no manifest: sizes are checked, every byte is downloaded.
    let url = s.upload_plain("plain/llama").await;
    let (sub, r) = s.run(&url).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    let first = output(&s.h.task(sub.run, "download").await).clone();
    assert_eq!(first["manifest"], json!(false));
    assert_eq!(first["files"], json!(4));
    assert_same_files(Path::new(first["path"].as_str().expect("path")));

    // A new object under the prefix: another listing, another key, downloaded again.
    s.put(&url, "README.md", b"release notes\n".to_vec()).await;
    let before = s.moto.requests().len();
    let (sub2, r2) = s.run(&url).await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    let second = output(&s.h.task(sub2.run, "download").await).clone();
    assert!(second.get("cached").is_none(), "{second}");
    assert_ne!(second["cache_key"], first["cache_key"]);
    assert_ne!(second["digest"], first["digest"]);
    assert_eq!(second["files"], json!(5));
    let dir = PathBuf::from(second["path"].as_str().expect("path"));
    assert_same_files(&dir);
    assert_eq!(std::fs::read(dir.join("README.md")).expect("README"), b"release notes\n");
    assert_eq!(s.object_reads_since(before).len(), 5, "every object was read once");
    // A changed source digest: the shard step ran again rather than being served from its cache.
    let plan2 = s.h.task(sub2.run, "shard").await;
    assert!(output(&plan2).get("cached").is_none(), "{}", output(&plan2));
    s.h.finish().await;
}

async fn corrupt_object_fails_the_run_at_download(kind: Kind) {
    let s = setup(kind).await;
    let url = s.publish("models/llama").await;
    // Same size, one byte different: only the manifest's SHA-256 can tell.
    let bad = "model-00002-of-00002.safetensors";
    let mut bytes = std::fs::read(fixture(FIXTURE).join(bad)).expect("fixture file");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x5a;
    s.put(&url, bad, bytes).await;

    let (sub, r) = s.run(&url).await;
    assert_eq!(r.state, RunState::Failed);
    let download = s.h.task(sub.run, "download").await;
    assert_eq!(download.state, TaskState::Failed);
    let error = download.error.clone().unwrap_or_default();
    assert!(error.contains(bad) && error.contains("does not match the manifest") && error.contains(&url), "{error}");
    assert!(r.error.clone().unwrap_or_default().contains("does not match the manifest"), "{:?}", r.error);
    // A mismatch is final: not retried.
    assert_eq!(s.h.attempts(sub.run, "download").await.len(), 1);
    for t in s.h.tasks(sub.run).await {
        if t.name != "download" {
            assert_eq!(t.attempt, 0, "task `{}` ran after a failed download ({})", t.name, t.state);
            assert!(t.output.is_none());
        }
    }
    // Nothing that looks complete: no directory without `.partial`, no corrupt file kept.
    for name in cache_entries(&s.cache_root()) {
        assert!(name.ends_with(".partial") || name.ends_with(".lock"), "{name} left in the cache");
        if name.ends_with(".partial") {
            let partial = s.cache_root().join(&name);
            assert!(!partial.join(bad).exists(), "the corrupt file was kept");
        }
    }
    s.h.finish().await;
}

async fn missing_prefix_and_bucket_are_clear_errors(kind: Kind) {
    let s = setup(kind).await;
    s.publish("models/llama").await;
    // A prefix with nothing under it (a sibling of a published one: prefixes match whole names).
    let url = format!("s3://{BUCKET}/models/llam");
    let (sub, r) = s.run(&url).await;
    assert_eq!(r.state, RunState::Failed);
    let error = s.h.task(sub.run, "download").await.error.unwrap_or_default();
    assert!(error.contains(&url) && error.contains("has no objects"), "{error}");
    assert_eq!(s.h.attempts(sub.run, "download").await.len(), 1, "an empty prefix is not retried");

    // A bucket that does not exist.
    let url = "s3://no-such-bucket/models/llama";
    let (sub, r) = s.run(url).await;
    assert_eq!(r.state, RunState::Failed);
    let error = s.h.task(sub.run, "download").await.error.unwrap_or_default();
    assert!(error.contains(url) && error.contains("NoSuchBucket"), "{error}");
    assert!(!error.contains(shardline_publish::moto::SECRET_ACCESS_KEY), "{error}");
    assert_eq!(s.h.attempts(sub.run, "download").await.len(), 1, "a missing bucket is not retried");
    s.h.finish().await;
}

/// A `file://` prefix takes the same path (object_store's local filesystem), and the download is
/// a copy in the cache, not the directory itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_url_source_is_downloaded_into_the_cache() {
    let mut h = Harness::new(Kind::Sqlite).await;
    h.start_workers(1, LEASE);
    let text = "apiVersion: shardline/v1\nkind: Pipeline\nname: file-source\nparams:\n  source: {type: string}\nsteps:\n  - id: download\n    uses: hf.download\n    with: {path: \"${{ params.source }}\"}\n";
    let url = format!("file://{}", fixture(FIXTURE).display());
    let sub = h.submit(text, &[("source", url.clone())], false).await;
    let r = h.wait_finished(sub.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    let out: Value = output(&h.task(sub.run, "download").await).clone();
    assert_eq!(out["url"], json!(url));
    assert_eq!(out["files"], json!(4));
    let dir = PathBuf::from(out["path"].as_str().expect("path"));
    assert!(dir.starts_with(h.work_dir().join("cache/objects")), "{}", dir.display());
    assert_same_files(&dir);
    h.finish().await;
}
