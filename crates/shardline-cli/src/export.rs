//! `export`: a checkpoint's model weights written back as the HF release they came from.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Result;
use clap::Args;
use serde_json::json;
use shardline_formats::execute::Progress;
use shardline_ops::{export, ExportRequest};

use crate::report::{bytes, peak_rss, Bar};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Checkpoint directory (DCP: a training checkpoint, or one `convert` wrote).
    pub ckpt: PathBuf,
    /// The HF directory to write.
    #[arg(long = "to", value_name = "HF_DIR")]
    pub to: PathBuf,
    /// The HF release whose names, dtypes, shapes and files to reproduce (its `config.json`,
    /// tokenizer files and safetensors headers are read; its weights are not). Default: the
    /// local release the checkpoint's Shardline manifest names; for a NeMo Automodel save, the
    /// release its `model/.hf_metadata/` describes (its files, each tensor's file and dtype).
    #[arg(long, value_name = "HF_RELEASE")]
    pub like: Option<PathBuf>,
    /// Prefix of model keys in the checkpoint.
    #[arg(long, default_value = "model.module.")]
    pub prefix: String,
    /// Expert-TP size the checkpoint was saved with (default: its `args`, else 1): gpt-oss's
    /// expert fc1 is stored fused in a layout of that size.
    #[arg(long)]
    pub etp: Option<u64>,
    /// Largest safetensors file, e.g. `5GB` (HF's default); a larger tensor gets a file of its own.
    #[arg(long, default_value = "5GB")]
    pub max_file_size: String,
    /// Replace an existing directory at HF_DIR.
    #[arg(long)]
    pub overwrite: bool,
    /// Writer threads (default: number of CPUs, at least 2).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The local release directory the checkpoint's Shardline manifest names as its source.
fn release_of_manifest(ckpt: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(ckpt.join(shardline_publish::MANIFEST)).ok()?;
    let manifest: serde_json::Value = serde_json::from_str(&text).ok()?;
    let source = &manifest["source"];
    let found = [&source["path"], &source["dir"]]
        .into_iter()
        .filter_map(|p| p.as_str())
        .map(PathBuf::from)
        .find(|p| p.join("config.json").is_file());
    found
}

pub fn run_export(args: ExportArgs) -> Result<ExitCode> {
    // Without --like: the release a Shardline manifest names, else (a NeMo Automodel save) the
    // one its `.hf_metadata/` describes.
    let like = args.like.clone().or_else(|| release_of_manifest(&args.ckpt));
    let max_file_bytes = shardline_units::parse_size_lenient(&args.max_file_size)
        .map_err(|e| anyhow::anyhow!("--max-file-size: {e}"))?;
    let request = ExportRequest {
        ckpt: args.ckpt.clone(),
        to: args.to.clone(),
        like,
        prefix: args.prefix.clone(),
        etp: args.etp,
        max_file_bytes,
        overwrite: args.overwrite,
        threads: args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)),
    };
    let progress = Arc::new(Progress::default());
    let done = {
        let _bar = (!args.json).then(|| Bar::follow("export", progress.clone()));
        export(&request, &progress)?
    };
    let (report, secs) = (&done.written, done.seconds);
    if args.json {
        println!(
            "{}",
            json!({"out": args.to, "like": done.like, "files": report.files, "tensors": report.tensors,
                   "bytes": report.bytes, "copied": report.copied, "seconds": secs, "peak_rss_bytes": peak_rss()})
        );
    } else {
        println!(
            "exported {} → {}: {} tensors, {} in {} file(s), {} copied from {}, in {secs:.2}s",
            args.ckpt.display(),
            args.to.display(),
            report.tensors,
            bytes(report.bytes),
            report.files.len(),
            report.copied.join(", "),
            done.like.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
