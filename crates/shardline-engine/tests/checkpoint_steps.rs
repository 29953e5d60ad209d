//! `checkpoint.reshard` and `checkpoint.export` in a pipeline, on the embedded SQLite store with
//! in-process workers: `pipelines/reshard-export.yaml` shards the tiny real Qwen3-MoE release
//! with optimizer state, reshards it to another mesh (the target's rank files, validated
//! bit-exact against the release), exports it to HF (every tensor equal to the release's, byte
//! for byte) and uploads both; the same pipeline again is served from the step cache. A reshard
//! whose `path` is an `s3://` prefix (moto's S3 server, from the repository's `.venv`; the test
//! fails, never skips, without it) downloads the prefix as `hf.download` does, checked against
//! its manifest, and gives the same result.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use shardline_formats::execute::Progress;
use shardline_formats::safetensors::Release;
use shardline_formats::verify::{verify_checkpoint, VerifyOptions};
use shardline_layout::{build_plan, Mesh, ModelConfig, PlanOptions, SourceTensor};
use shardline_publish::moto::Moto;
use shardline_publish::PublishOptions;
use shardline_store::{RunState, TaskState};

const RUN_TIMEOUT: Duration = Duration::from_secs(300);
const LEASE: Duration = Duration::from_secs(3);
const MODEL: &str = "qwen3_moe";

fn dir_of(v: &Value) -> PathBuf {
    PathBuf::from(v.get("dir").and_then(Value::as_str).unwrap_or_else(|| panic!("no `dir` in {v}")))
}

/// The files of a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn rank_files(world: u64) -> Vec<String> {
    let mut want: Vec<String> = (0..world).map(|r| format!("__{r}_0.distcp")).collect();
    want.push(".metadata".into());
    want.sort();
    want
}

/// Every tensor of `ckpt` (model weights and, where present, optimizer moments) rebuilt from the
/// release and compared bit for bit, independently of the pipeline's own validate step.
fn assert_validates(ckpt: &Path, release_dir: &Path) {
    let release = Release::open(release_dir).expect("release");
    let config = ModelConfig::from_json(release.config_json()).expect("config");
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let defaults = PlanOptions::default();
    let options = PlanOptions { vocab_divisible_by: 1, optimizer_state: true, ..defaults.clone() };
    let reference = build_plan(&config, sources, Mesh::new(1, 1, 1, 1), &options).expect("reference plan");
    let options =
        VerifyOptions { optional_prefix: Some(&defaults.optimizer_prefix), threads: 2, ..VerifyOptions::default() };
    let report = verify_checkpoint(ckpt, &release, &reference, &options, &Progress::default()).expect("verify");
    assert!(report.ok(), "{} differs from {}: {:?}", ckpt.display(), release_dir.display(), &report.findings[..1]);
    assert!(report.tensors > 0 && report.bytes_checked > 0);
}

/// name → (dtype, shape, bytes) of every tensor of a release.
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let release = Release::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let files: Vec<std::fs::File> = release.file_paths().map(|p| std::fs::File::open(p).expect("open")).collect();
    release
        .tensors()
        .map(|t| {
            let mut bytes = vec![0u8; t.info.byte_len as usize];
            files[t.file_index].read_exact_at(&mut bytes, t.info.file_offset).expect("read");
            (t.info.name.clone(), (t.info.dtype.to_string(), t.info.shape.clone(), bytes))
        })
        .collect()
}

/// The exported release holds the fixture's tensors exactly (qwen3_moe converts losslessly).
fn assert_same_tensors(exported: &Path, release: &Path) {
    let (want, got) = (tensors(release), tensors(exported));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "tensor names");
    for (name, w) in &want {
        let g = &got[name];
        assert_eq!((&g.0, &g.1), (&w.0, &w.1), "`{name}`: dtype and shape");
        assert!(g.2 == w.2, "`{name}`: the exported bytes differ from the release's");
    }
    assert!(exported.join("config.json").is_file(), "config.json copied");
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reshard_export_pipeline_runs_end_to_end_and_is_cached() {
    let mut h = Harness::new(Kind::Sqlite).await;
    h.start_workers(2, LEASE);
    let out = format!("file://{}", h.base.path().join("out").display());
    let set =
        [("model", fixture(MODEL).display().to_string()), ("checkpoint_dest", out.clone()), ("hf_dest", out.clone())];
    let text = pipeline_text("reshard-export.yaml");
    let s = h.submit(&text, &set, false).await;
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    for t in h.tasks(s.run).await {
        assert_eq!((t.state, t.attempt), (TaskState::Succeeded, 1), "{}", t.name);
    }

    // The resharded checkpoint: the target mesh's rank files and .metadata, nothing staged left.
    let reshard = h.task(s.run, "reshard").await;
    assert_eq!(reshard.kind, "checkpoint.reshard");
    let resharded = dir_of(output(&reshard));
    assert_eq!(output(&reshard)["mesh"], json!("tp2·cp1·dp2·ep2·etp1"));
    assert_eq!(output(&reshard)["from"], json!("tp1·cp1·dp4·ep2·etp1"), "the source mesh is the shard step's");
    assert!(output(&reshard)["optimizer_states"].as_u64().is_some_and(|n| n > 0), "{}", output(&reshard));
    assert_eq!(names(&resharded), rank_files(4));
    assert!(!PathBuf::from(format!("{}.partial", resharded.display())).exists(), "staging left behind");
    let shard = dir_of(output(&h.task(s.run, "shard/commit").await));
    assert_eq!(names(&shard), rank_files(4));
    assert_ne!(shard, resharded);
    // Both validate steps passed, and an independent check agrees.
    for v in ["validate", "validate-resharded"] {
        assert_eq!(output(&h.task(s.run, v).await)["ok"], json!(true), "{v}");
    }
    assert_eq!(dir_of(output(&h.task(s.run, "validate-resharded").await)), resharded);
    assert_validates(&resharded, &fixture(MODEL));

    // The export: the release's tensors, byte for byte.
    let export = h.task(s.run, "export").await;
    let hf = dir_of(output(&export));
    assert_same_tensors(&hf, &fixture(MODEL));
    assert_eq!(output(&export)["keys"].as_u64(), Some(tensors(&fixture(MODEL)).len() as u64));

    // Both uploaded, under the run id, with their manifests.
    let name = r.options.name.clone().expect("run name");
    let published = h.base.path().join("out").join(&name);
    for (what, dir) in [("checkpoint", &resharded), ("hf", &hf)] {
        let up = published.join(what);
        assert!(up.join(shardline_publish::MANIFEST).is_file(), "{what} has no manifest");
        let mut got = names(&up);
        got.retain(|n| n != shardline_publish::MANIFEST);
        assert_eq!(got, names(dir), "{what}: the published files");
    }
    assert_validates(&published.join("checkpoint"), &fixture(MODEL));
    assert_same_tensors(&published.join("hf"), &fixture(MODEL));

    // The same pipeline again: the reshard and the export are step-cache hits on the same outputs.
    let again = h.submit(&text, &set, false).await;
    let r2 = h.wait_finished(again.run, RUN_TIMEOUT).await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    for (task, dir) in [("reshard", &resharded), ("export", &hf)] {
        let t = h.task(again.run, task).await;
        assert_eq!(output(&t)["cached"], json!(true), "{task} was not served from the cache: {}", output(&t));
        assert_eq!(&dir_of(output(&t)), dir, "{task}");
    }
    h.finish().await;
}

/// A step-cache-free run of download → shard (optimizer state) → split on the fixture: its
/// checkpoint directory.
async fn sharded_checkpoint(h: &Harness) -> PathBuf {
    let text = format!(
        r#"apiVersion: shardline/v1
kind: Pipeline
name: shard-only
steps:
  - id: download
    uses: hf.download
    with: {{path: "{}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 1, dp: 4, ep: 2, etp: 1, optimizer_state: true}}
  - id: split
    uses: megatron.split_fused
    needs: [shard]
"#,
        fixture(MODEL).display()
    );
    let s = h.submit(&text, &[], true).await;
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);
    dir_of(output(&h.task(s.run, "split").await))
}

const FROM_S3: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: reshard-s3
params:
  source: {type: string}
  release: {type: path}
steps:
  - id: download
    uses: hf.download
    with: {path: "${{ params.release }}"}
  - id: reshard
    uses: checkpoint.reshard
    needs: [download]
    with: {path: "${{ params.source }}", tp: 2, dp: 3, ep: 2, etp: 1, from_mesh: "tp=1,dp=4,ep=2,etp=1"}
    retry: {attempts: 2, backoff: 0s}
  - id: validate
    uses: checkpoint.validate
    needs: [reshard]
  - id: export
    uses: checkpoint.export
    needs: [validate]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reshard_of_an_s3_prefix_downloads_it_first() {
    let mut h = Harness::new(Kind::Sqlite).await;
    let moto = Moto::start(h.base.path());
    moto.create_bucket("checkpoints");
    let store_options = moto.store_options();
    h.start_workers_configured(2, LEASE, |c| c.objects.store_options = store_options.clone());

    // A checkpoint published to the bucket as `store.upload` publishes one (manifest last).
    let ckpt = sharded_checkpoint(&h).await;
    let url = "s3://checkpoints/qwen3-moe/iter_0000100";
    let options = PublishOptions { store_options: moto.store_options(), ..Default::default() };
    shardline_publish::publish(&ckpt, url, json!({"test": "reshard-s3"}), json!({}), &options)
        .await
        .expect("publish the checkpoint");

    let set = [("source", url.to_string()), ("release", fixture(MODEL).display().to_string())];
    let s = h.submit(FROM_S3, &set, false).await;
    let r = h.wait_finished(s.run, RUN_TIMEOUT).await;
    assert_eq!(r.state, RunState::Succeeded, "{:?}", r.error);

    // The prefix was fetched into the object cache by a task of its own, checked against its
    // manifest; the reshard read that directory.
    let fetch = h.task(s.run, "reshard/fetch").await;
    assert_eq!(fetch.kind, "checkpoint.reshard.fetch");
    let fetched = PathBuf::from(output(&fetch)["path"].as_str().expect("fetch path"));
    assert!(fetched.starts_with(h.work_dir().join("cache/objects")), "{}", fetched.display());
    assert_eq!(output(&fetch)["manifest"], json!(true));
    assert_eq!(names(&fetched), names(&ckpt));
    let reshard = h.task(s.run, "reshard").await;
    let resharded = dir_of(output(&reshard));
    assert_eq!(names(&resharded), rank_files(6));
    assert_eq!(output(&reshard)["from"], json!("tp1·cp1·dp4·ep2·etp1"));
    assert_eq!(output(&reshard)["source"]["url"], json!(url), "{}", output(&reshard));
    // No `args` and no release upstream of the checkpoint: the vocabulary warning is in the log.
    let logs = h.logs(s.run, "reshard").await;
    assert!(logs.iter().any(|l| l.starts_with("warning:") && l.contains("vocabulary size is unknown")), "{logs:#?}");
    assert_eq!(output(&h.task(s.run, "validate").await)["ok"], json!(true));
    assert_validates(&resharded, &fixture(MODEL));
    assert_same_tensors(&dir_of(output(&h.task(s.run, "export").await)), &fixture(MODEL));

    // Again: the unchanged prefix and the reshard are served from the step cache, no object read.
    let before = moto.requests().len();
    let again = h.submit(FROM_S3, &set, false).await;
    let r2 = h.wait_finished(again.run, RUN_TIMEOUT).await;
    assert_eq!(r2.state, RunState::Succeeded, "{:?}", r2.error);
    for task in ["reshard/fetch", "reshard", "export"] {
        let t = h.task(again.run, task).await;
        assert_eq!(output(&t)["cached"], json!(true), "{task}: {}", output(&t));
    }
    let reads: Vec<String> = moto.requests()[before..]
        .iter()
        .filter(|(m, p, _)| m == "GET" && !p.contains("list-type") && !p.ends_with(shardline_publish::MANIFEST))
        .map(|(_, p, _)| p.clone())
        .collect();
    assert!(reads.is_empty(), "a cached fetch read objects: {reads:?}");
    h.finish().await;
}
