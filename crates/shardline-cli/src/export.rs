//! `export`: a checkpoint's model weights written back as the HF release they came from.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use shardline_engine::checkpoints::{export_tensors, saved_etp};
use shardline_formats::checkpoint::open_checkpoint_keys;
use shardline_formats::execute::Progress;
use shardline_formats::training::TrainingCheckpoint;
use shardline_formats::training::{write_export, ExportOptions};

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
    /// local release the checkpoint's Shardline manifest names.
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
    let started = Instant::now();
    let dir = shardline_formats::checkpoint::resolve_checkpoint_dir(&args.ckpt)?;
    let torch_dist = shardline_formats::training::common_state::is_torch_dist(&dir);
    let Some(like) = args.like.clone().or_else(|| release_of_manifest(&args.ckpt)) else {
        bail!(
            "{} has no Shardline manifest naming a local release: pass --like HF_RELEASE (its config.json decides the names)",
            args.ckpt.display()
        );
    };
    let max_file_bytes = shardline_units::parse_size_lenient(&args.max_file_size)
        .map_err(|e| anyhow::anyhow!("--max-file-size: {e}"))?;
    // A torch_dist checkpoint's fused parameters are read for expert-TP size 1 (`[gate; up]`).
    let etp = if torch_dist { 1 } else { args.etp.or_else(|| saved_etp(&args.ckpt)).unwrap_or(1) };
    // The model's keys only: the optimizer's moments are not exported. A torch_dist checkpoint's
    // are read under the fsdp_dtensor names its keys stand for (layers and experts unstacked,
    // `[gate; up]` split), in place.
    let torchtitan = !torch_dist
        && shardline_formats::checkpoint::torchtitan_target_of(&dir)
            .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?
            .is_some();
    let (checkpoint, prefix) = if torch_dist {
        let c = TrainingCheckpoint::open_torch_dist_model(&args.ckpt)
            .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
        (c, "model.module.")
    } else if shardline_formats::checkpoint::automodel_model_dir(&args.ckpt)?.is_some() {
        // NeMo Automodel's `model/`: the release's own names, every key is the model's.
        let c = open_checkpoint_keys(&args.ckpt, |_| true)
            .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
        (c, "")
    } else if torchtitan {
        // Its model keys sit at the top level, beside nothing else in a seed; a training step's
        // optimizer, scheduler, dataloader and train state are not exported.
        let model =
            |k: &str| !["optimizer.", "lr_scheduler.", "dataloader.", "train_state."].iter().any(|p| k.starts_with(p));
        let c = open_checkpoint_keys(&args.ckpt, model)
            .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
        (c, "")
    } else {
        let c = open_checkpoint_keys(&args.ckpt, |k| k.starts_with(args.prefix.as_str()))
            .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
        (c, args.prefix.as_str())
    };
    let tensors = export_tensors(&checkpoint, &like, etp, prefix).map_err(|e| anyhow::anyhow!(e))?;
    let progress = Arc::new(Progress::default());
    let total: u64 = tensors.iter().map(|t| t.shape.iter().product::<u64>() * t.dtype.size() as u64).sum();
    let counter = Arc::clone(&progress);
    let bar = (!args.json).then(|| Bar::start("export", total, move || counter.bytes_written.load(Ordering::Relaxed)));
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()).max(2));
    let options = ExportOptions { max_file_bytes, threads, overwrite: args.overwrite };
    let report = write_export(&checkpoint, &tensors, &like, &args.to, &options, &progress)
        .with_context(|| format!("writing {}", args.to.display()));
    drop(bar);
    let report = report?;
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({"out": args.to, "like": like, "files": report.files, "tensors": report.tensors,
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
            like.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
