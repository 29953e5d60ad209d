//! `bench --s3 URL`: a release converted from and to an S3-compatible store, next to a plain
//! parallel copy of the same bytes through the same server, and the converting process's peak
//! memory. The store is configured from the environment as everywhere (`AWS_ENDPOINT_URL`, …).
//!
//! Per size: the synthetic release is put under `URL/bench/<arch>-<size>/src` once; the copy
//! baseline reads every object in one streamed request and uploads it in 16 MiB multipart parts
//! as they fill (`Artifacts::copy_through`, 4 files and 4 parts in flight each); the conversion is `shardline
//! run` of `hf.download` (the prefix, read in place) → `megatron.shard` with `--artifacts
//! URL/bench/<…>/art` and two in-process workers, timed from start to exit, its peak RSS read from
//! `/proc/<pid>/status` (VmHWM) while it runs. The run then validates the checkpoint, split into a
//! part per rank file, timed from the commit's end to the validation's (read from the run's job
//! store) and left out of the conversion's time. Copies and checkpoints are deleted after each
//! repetition, so the server holds the release and one output at a time.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::stream::{self, StreamExt, TryStreamExt};
use serde_json::json;
use shardline_artifacts::Artifacts;
use shardline_formats::safetensors::Release;

use crate::convert::BenchArgs;
use crate::report::bytes;

/// Files copied or uploaded at once.
const FILES_IN_FLIGHT: usize = 4;

pub fn run_s3_bench(args: &BenchArgs, url: &str) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the shardline binary")?;
    let mesh = args.mesh.mesh();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let root = Artifacts::open(url, &[]).context("opening the benchmark's store")?;
    let mut rows = Vec::new();
    for size in &args.sizes {
        let local = crate::convert::bench_release(&exe, args, size)?;
        let input = Release::open(&local)?.total_bytes();
        let base = root.child(&format!("bench/{}-{size}", args.arch));
        let src = base.child("src");
        rt.block_on(put_release(&src, &local))?;
        let (mut best_copy, mut best_conv, mut best_validate, mut rss) = (f64::MAX, f64::MAX, f64::MAX, 0u64);
        for _ in 0..args.repeat.max(1) {
            let copy = base.child("copy");
            let started = Instant::now();
            let copied = rt.block_on(copy_all(&src, &copy))?;
            best_copy = best_copy.min(started.elapsed().as_secs_f64());
            rt.block_on(copy.delete_all())?;
            if copied != input_objects_bytes(&local)? {
                bail!("the copy moved {copied} bytes, the release has more");
            }

            let art = base.child("art");
            rt.block_on(art.delete_all())?;
            let work = tempfile::tempdir().context("a state directory for the conversion")?;
            let spec = work.path().join("bench-s3.yaml");
            std::fs::write(
                &spec,
                format!(
                    "apiVersion: shardline/v1\nkind: Pipeline\nname: bench-s3\nsteps:\n\
                     \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}, cache: false}}\n\
                     \x20 - {{id: shard, uses: megatron.shard, needs: [download], cache: false,\n\
                     \x20     with: {{tp: {}, cp: {}, dp: {}, ep: {}, etp: {}}}}}\n\
                     \x20 - {{id: validate, uses: checkpoint.validate, needs: [shard]}}\n",
                    src.url(),
                    mesh.tp,
                    mesh.cp,
                    mesh.dp,
                    mesh.ep,
                    mesh.etp
                ),
            )?;
            let (t, peak) = run_measured(
                Command::new(&exe)
                    .arg("run")
                    .arg(&spec)
                    .args(["--workers", "2", "--artifacts", art.url()])
                    .arg("--state-dir")
                    .arg(work.path().join("state")),
            )?;
            let validated = rt.block_on(validate_span(&work.path().join("state")))?;
            best_conv = best_conv.min(t - validated);
            best_validate = best_validate.min(validated);
            rss = rss.max(peak);
            rt.block_on(art.delete_all())?;
        }
        rows.push(json!({
            "arch": args.arch, "size": size, "input_bytes": input, "mesh": mesh.to_string(),
            "copy_seconds": best_copy, "convert_seconds": best_conv, "ratio_to_copy": best_conv / best_copy,
            "peak_rss_bytes": rss, "validate_seconds": best_validate,
            "validate_ratio_to_copy": best_validate / best_copy,
        }));
        if !args.json {
            println!(
                "{} {size} ({}) on {mesh}, S3 → S3: parallel copy {best_copy:.2}s, convert {best_conv:.2}s → {:.2}× \
                 the copy; validate (a part per rank file) {best_validate:.2}s → {:.2}× the copy; peak RSS of the \
                 process (2 workers) {}",
                args.arch,
                bytes(input),
                best_conv / best_copy,
                best_validate / best_copy,
                bytes(rss)
            );
        }
    }
    if args.json {
        println!("{}", serde_json::Value::Array(rows));
    }
    Ok(ExitCode::SUCCESS)
}

/// Seconds from the commit of the run's checkpoint to the end of its validation, read from the
/// job store of the run's state directory `state` (it holds that one run).
async fn validate_span(state: &Path) -> Result<f64> {
    let url = format!("sqlite://{}", state.join("state.db").display());
    let store = shardline_store::Store::connect(&url).await.with_context(|| format!("opening {url}"))?;
    let runs = store.list_runs(&Default::default(), Default::default()).await?;
    let run = runs.runs.first().context("the benchmark's run is not in its job store")?;
    let mut ends = std::collections::BTreeMap::new();
    for task in store.run_tasks(run.id).await? {
        let attempts = store.task_attempts(task.id).await?;
        if let Some(end) = attempts.iter().filter_map(|a| a.ended_at).max() {
            ends.insert(task.name, end);
        }
    }
    match (ends.get("shard/commit"), ends.get("validate")) {
        (Some(commit), Some(validated)) => Ok((*validated - *commit).as_seconds_f64()),
        _ => bail!("the run's commit or validation did not end"),
    }
}

fn input_objects_bytes(dir: &Path) -> Result<u64> {
    Ok(std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum())
}

/// Puts the release's files under `src` unless every one is already there with its size.
async fn put_release(src: &Artifacts, dir: &Path) -> Result<()> {
    let listed = src.list().await?;
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let size = e.metadata()?.len();
        if !listed.iter().any(|o| o.name == name && o.size == size) {
            files.push((name, e.path()));
        }
    }
    if files.is_empty() {
        return Ok(());
    }
    eprintln!("putting {} release files under {} …", files.len(), src.url());
    stream::iter(files)
        .map(|(name, path)| async move {
            let upload = src.upload_file(&name, &path, |_| async { true }).await?;
            src.complete(&upload).await
        })
        .buffer_unordered(FILES_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Copies every object of `src` to `dest` through this client; returns the bytes.
async fn copy_all(src: &Artifacts, dest: &Artifacts) -> Result<u64> {
    let listed = src.list().await?;
    let sizes: Vec<u64> = stream::iter(listed)
        .map(|o| async move { src.copy_through(&o.name, dest, &o.name).await })
        .buffer_unordered(FILES_IN_FLIGHT)
        .try_collect()
        .await?;
    Ok(sizes.iter().sum())
}

/// Runs `cmd` to completion: its wall time and its peak RSS (VmHWM, polled while it runs).
fn run_measured(cmd: &mut Command) -> Result<(f64, u64)> {
    let started = Instant::now();
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().with_context(|| format!("{cmd:?}"))?;
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0u64;
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            if let Some(kb) = text.lines().find_map(|l| l.strip_prefix("VmHWM:")) {
                let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                peak = peak.max(kb * 1024);
            }
        }
        if let Some(s) = child.try_wait()? {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let secs = started.elapsed().as_secs_f64();
    if !status.success() {
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        bail!("{cmd:?} failed ({status}): {err}");
    }
    Ok((secs, peak))
}
