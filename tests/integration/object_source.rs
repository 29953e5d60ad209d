//! `shardline run` with `hf.download {path: s3://…}`: the store is configured from the
//! environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, …, as `store.upload` reads it) and is a
//! real S3 server (moto, from the repository's `.venv`; fails, never skips, without it). The tiny
//! llama release is published there with its manifest; the pipeline downloads, shards and
//! validates it bit-exactly; a second run is served from the step cache without reading an
//! object; a corrupted object fails the run at the download, nothing later runs.

use std::fs;
use std::path::Path;
use std::process::Output;

use shardline_publish::moto::Moto;
use shardline_publish::object_store::{ObjectStoreExt, PutPayload};
use shardline_publish::{Destination, PublishOptions};

use crate::{bin, fixture, stderr, stdout};

const BUCKET: &str = "releases";

const PIPELINE: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: s3-source
params:
  source: {type: string}
steps:
  - id: download
    uses: hf.download
    with: {path: "${{ params.source }}"}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: 2, dp: 2}
  - id: validate
    uses: checkpoint.validate
    needs: [shard]
"#;

fn shardline_run(dir: &Path, moto: &Moto, source: &str) -> Output {
    bin()
        .current_dir(dir)
        .args(["run", "pipeline.yaml", "--set", &format!("source={source}")])
        .env_remove("SHARDLINE_DATABASE_URL")
        .envs(moto.env())
        .output()
        .expect("run shardline")
}

/// GET requests for objects (not listings) since request `from`, but the manifest.
fn object_reads_since(moto: &Moto, from: usize) -> Vec<String> {
    moto.requests()[from..]
        .iter()
        .filter(|(m, p, _)| m == "GET" && !p.contains("list-type") && p.starts_with(&format!("/{BUCKET}/")))
        .filter(|(_, p, _)| !p.ends_with(shardline_publish::MANIFEST))
        .map(|(_, p, _)| p.clone())
        .collect()
}

#[test]
fn s3_source_runs_validates_and_is_cached() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(BUCKET);
    let url = format!("s3://{BUCKET}/models/llama");
    let options = PublishOptions { store_options: moto.store_options(), ..Default::default() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime
        .block_on(shardline_publish::publish(
            &fixture("llama"),
            &url,
            serde_json::json!({}),
            serde_json::json!({}),
            &options,
        ))
        .expect("publish the fixture");
    let work = tmp.path().join("work");
    fs::create_dir_all(&work).expect("work dir");
    fs::write(work.join("pipeline.yaml"), PIPELINE).expect("spec");

    let o = shardline_run(&work, &moto, &url);
    assert!(o.status.success(), "shardline run failed ({}):\n{}\n{}", o.status, stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("validate: 1/1 tasks"), "{err}");
    // The release is in the state directory's download cache, byte for byte.
    let cache = work.join(".shardline/work/cache/objects");
    let dirs: Vec<_> = fs::read_dir(&cache)
        .expect("download cache")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    for e in fs::read_dir(fixture("llama")).expect("fixture") {
        let p = e.expect("entry").path();
        let name = p.file_name().expect("name");
        assert_eq!(fs::read(dirs[0].join(name)).expect("downloaded file"), fs::read(&p).expect("fixture file"));
    }

    // Again: the same listing, served from the step cache; no object is read.
    let before = moto.requests().len();
    let o = shardline_run(&work, &moto, &url);
    assert!(o.status.success(), "second run failed:\n{}", stderr(&o));
    assert!(stderr(&o).contains("download: 1/1 tasks (cached)"), "{}", stderr(&o));
    let reads = object_reads_since(&moto, before);
    assert!(reads.is_empty(), "objects were read again: {reads:?}");

    // One weight file corrupted in place (same size): the run fails at the download.
    let bad = "model-00001-of-00002.safetensors";
    let mut bytes = fs::read(fixture("llama").join(bad)).expect("fixture file");
    bytes[1000] ^= 0xff;
    let dest = Destination::open(&url, &moto.store_options()).expect("open");
    runtime.block_on(dest.store().put(&dest.object(bad), PutPayload::from(bytes))).expect("put");
    let o = shardline_run(&work, &moto, &url);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("does not match the manifest") && err.contains(bad), "{err}");
    assert!(!err.contains("shard: 1/"), "a later step ran: {err}");
    assert!(!err.contains(shardline_publish::moto::SECRET_ACCESS_KEY), "{err}");
}
