//! `inspect` and `validate`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use shardline_formats::checkpoint::{open_checkpoint, CheckpointFormat};
use shardline_formats::execute::Progress;
use shardline_formats::verify::verify;
use shardline_layout::{Mesh, PlanOptions};

use crate::convert::plan_release;
use crate::report::{bytes, Bar};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Checkpoint directory (DCP or DCP-sharded safetensors).
    pub ckpt: PathBuf,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

pub fn run_inspect(args: InspectArgs) -> Result<ExitCode> {
    let ckpt = open_checkpoint(&args.ckpt).with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
    let format = match ckpt.format {
        CheckpointFormat::Dcp => "dcp",
        CheckpointFormat::DcpSafetensors => "dcp-safetensors",
    };
    let mut per_file: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in &ckpt.tensors {
        for c in &t.chunks {
            let e = per_file.entry(c.file.as_str()).or_default();
            e.0 += 1;
            e.1 += c.data_len;
        }
    }
    if args.json {
        let tensors: Vec<_> = ckpt
            .tensors
            .iter()
            .map(|t| {
                json!({"key": t.key, "dtype": t.dtype.to_string(), "shape": t.shape,
                       "chunks": t.chunks.iter().map(|c| json!({"file": c.file, "offsets": c.offsets, "sizes": c.sizes})).collect::<Vec<_>>()})
            })
            .collect();
        let files: BTreeMap<_, _> =
            per_file.iter().map(|(f, (n, b))| (f.to_string(), json!({"chunks": n, "bytes": b}))).collect();
        println!("{}", json!({"format": format, "tensors": tensors, "files": files, "bytes_items": ckpt.bytes_items}));
        return Ok(ExitCode::SUCCESS);
    }
    println!("{} checkpoint at {}: {} tensors", format, args.ckpt.display(), ckpt.tensors.len());
    println!("{:<90} {:>6} {:>18} {:>7}", "key", "dtype", "global shape", "chunks");
    for t in &ckpt.tensors {
        println!("{:<90} {:>6} {:>18} {:>7}", t.key, t.dtype.to_string(), format!("{:?}", t.shape), t.chunks.len());
    }
    println!("\nfiles:");
    for (f, (n, b)) in &per_file {
        println!("  {f:<50} {n:>6} chunks {:>12}", bytes(*b));
    }
    if !ckpt.bytes_items.is_empty() {
        println!("bytes items: {}", ckpt.bytes_items.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// Checkpoint directory.
    pub ckpt: PathBuf,
    /// The HF release it was converted from.
    #[arg(long, value_name = "HF_DIR")]
    pub against: PathBuf,
    /// Prefix of model keys in the checkpoint.
    #[arg(long, default_value = "model.module.")]
    pub prefix: String,
    #[arg(long)]
    pub json: bool,
}

pub fn run_validate(args: ValidateArgs) -> Result<ExitCode> {
    let ckpt = open_checkpoint(&args.ckpt).with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
    let defaults = PlanOptions::default();
    let options = PlanOptions {
        prefix: args.prefix.clone(),
        // Global tensors do not depend on the mesh but for vocab padding, which validation
        // accepts as trailing zero rows.
        vocab_divisible_by: 1,
        optimizer_state: ckpt.tensors.iter().any(|t| t.key.starts_with(&defaults.optimizer_prefix)),
        ..defaults
    };
    let (release, reference) = plan_release(&args.against, Mesh::new(1, 1, 1, 1), &options)?;
    let total: u64 = ckpt.tensors.iter().flat_map(|t| &t.chunks).map(|c| c.data_len).sum();
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let report = {
        let p = progress.clone();
        let _bar = Bar::start("validate", total, move || p.bytes_written.load(Ordering::Relaxed));
        verify(&ckpt, &release, &reference, &progress).context("validating")?
    };
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({
                "ok": report.ok(), "tensors": report.digests.len(), "bytes_checked": report.bytes_checked,
                "seconds": secs,
                "findings": report.findings.iter().map(|f| json!({"key": f.key, "message": f.message})).collect::<Vec<_>>(),
                "digests": report.digests.iter().map(|d| json!({"key": d.key, "sha256": d.sha256, "bytes": d.bytes})).collect::<Vec<_>>(),
            })
        );
    } else if report.ok() {
        println!(
            "ok: {} tensors, {} reconstructed bit-exactly against {} in {:.2}s",
            report.digests.len(),
            bytes(report.bytes_checked),
            args.against.display(),
            secs
        );
    } else {
        println!("FAILED: {} finding(s):", report.findings.len());
        for f in &report.findings {
            println!("  `{}`: {}", f.key, f.message);
        }
    }
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
