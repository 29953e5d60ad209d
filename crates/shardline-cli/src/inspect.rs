//! `inspect` and `validate`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use shardline_formats::checkpoint::{scan_checkpoint, CheckpointFormat};
use shardline_formats::execute::Progress;
use shardline_formats::training::automodel::AutomodelSave;
use shardline_formats::training::{summarize_automodel, summarize_training, TrainingSummary};
use shardline_ops::{validate, ValidateRequest};

use crate::report::{bytes, peak_rss, Bar};

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Checkpoint directory (DCP or DCP-sharded safetensors).
    pub ckpt: PathBuf,
    /// Machine-readable output: one JSON document, written as the checkpoint streams past.
    #[arg(long)]
    pub json: bool,
    /// Only the totals and the files, not every tensor (for checkpoints with millions of chunks).
    #[arg(long)]
    pub summary: bool,
}

fn format_name(f: CheckpointFormat) -> &'static str {
    match f {
        CheckpointFormat::Dcp => "dcp",
        CheckpointFormat::DcpSafetensors => "dcp-safetensors",
    }
}

pub fn run_inspect(mut args: InspectArgs) -> Result<ExitCode> {
    // A NeMo Automodel save: its `model/` listed, its `optim/` and files summarised.
    let automodel = AutomodelSave::open(&args.ckpt).with_context(|| format!("reading {}", args.ckpt.display()))?;
    // A Megatron-LM save directory: the checkpoint its tracker names.
    args.ckpt = shardline_formats::checkpoint::resolve_checkpoint_dir(&args.ckpt)
        .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 16, out.lock());
    let mut first = true;
    let mut write_error: Option<std::io::Error> = None;
    if args.json {
        write!(out, "{{\"tensors\":[")?;
    } else {
        writeln!(out, "checkpoint at {}", args.ckpt.display())?;
        if !args.summary {
            writeln!(out, "{:<90} {:>6} {:>18} {:>7}", "key", "dtype", "global shape", "chunks")?;
        }
    }
    // A training checkpoint has optimizer state or bytes items; only then is `.metadata` read a
    // second time for the training summary.
    let mut optimizer_state = false;
    let summary = scan_checkpoint(&args.ckpt, |t| {
        optimizer_state |= t.key.starts_with("optimizer.");
        if args.summary || write_error.is_some() {
            return;
        }
        let written = if args.json {
            let chunks: Vec<_> = t.chunks.iter().map(|c| json!({"offsets": c.offsets, "sizes": c.sizes})).collect();
            let v = json!({"key": t.key, "dtype": t.dtype.to_string(), "shape": t.shape, "chunks": chunks});
            let sep = if std::mem::take(&mut first) { "" } else { "," };
            write!(out, "{sep}{v}")
        } else {
            let shape = format!("{:?}", t.shape);
            writeln!(out, "{:<90} {:>6} {:>18} {:>7}", t.key, t.dtype.to_string(), shape, t.chunks.len())
        };
        if let Err(e) = written {
            write_error = Some(e);
        }
    })
    .with_context(|| format!("reading checkpoint {}", args.ckpt.display()))?;
    if let Some(e) = write_error {
        return Err(e.into());
    }
    let files: BTreeMap<_, _> =
        summary.files.iter().map(|(f, s)| (f.clone(), json!({"items": s.items, "bytes": s.bytes}))).collect();
    let training = match summary.format {
        _ if automodel.is_some() => {
            let mut t = automodel
                .as_ref()
                .map(summarize_automodel)
                .transpose()
                .with_context(|| format!("reading the training state of {}", args.ckpt.display()))?;
            // The parameters are `model/`'s, listed above.
            if let Some(t) = t.as_mut() {
                t.params = (summary.tensors, summary.files.values().map(|f| f.bytes).sum());
            }
            t
        }
        CheckpointFormat::Dcp if optimizer_state || !summary.bytes_items.is_empty() => {
            summarize_training(&args.ckpt)
                .with_context(|| format!("reading the training state of {}", args.ckpt.display()))?
        }
        _ => None,
    };
    if args.json {
        let tail = json!({"format": format_name(summary.format), "tensor_count": summary.tensors,
                          "chunk_count": summary.chunks, "files": files, "bytes_items": summary.bytes_items,
                          "version": summary.version, "training": training.as_ref().map(training_json),
                          "peak_rss_bytes": peak_rss().unwrap_or(0)});
        // The tail's fields follow the streamed tensors in the same object.
        let tail = tail.to_string();
        writeln!(out, "],{}", tail.strip_prefix('{').unwrap_or(&tail))?;
    } else {
        writeln!(
            out,
            "\n{}: {} tensors, {} chunks in {} files",
            format_name(summary.format),
            summary.tensors,
            summary.chunks,
            summary.files.len()
        )?;
        for (f, s) in &summary.files {
            writeln!(out, "  {f:<50} {:>8} items {:>12}", s.items, bytes(s.bytes))?;
        }
        match &training {
            Some(t) => write_training(&mut out, t)?,
            None if !summary.bytes_items.is_empty() => {
                writeln!(out, "bytes items: {}", summary.bytes_items.join(", "))?;
            }
            None => {}
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

fn training_json(t: &TrainingSummary) -> serde_json::Value {
    let moments: BTreeMap<_, _> = t.moments.iter().map(|(k, (n, b))| (k, json!({"tensors": n, "bytes": b}))).collect();
    let objects: BTreeMap<_, _> = t.objects.iter().map(|(k, v)| (k, v)).collect();
    json!({"mesh": t.mesh.map(|m| json!({"tp": m.tp, "cp": m.cp, "dp": m.dp, "ep": m.ep, "etp": m.etp})),
           "iteration": t.iteration, "checkpoint_version": t.checkpoint_version,
           "parameters": {"tensors": t.params.0, "bytes": t.params.1}, "optimizer_states": moments,
           "adam_steps": t.adam_steps, "adam_steps_by_group": t.adam_steps_by_group, "rng_ranks": t.rng_ranks.iter().map(|(p, r)| [p, r]).collect::<Vec<_>>(),
           "objects": objects, "unknown": t.unknown,
           "common": t.common.iter().cloned().collect::<BTreeMap<_, _>>(),
           "framework": t.framework, "data_parallel": t.data_parallel, "dataloader_ranks": t.dataloader_ranks,
           "files": t.files.iter().cloned().collect::<BTreeMap<_, _>>(),
           "group_settings": t.group_settings.iter().map(|((k, v), n)| json!({"setting": k, "value": v, "parameters": n})).collect::<Vec<_>>()})
}

/// The training section of `inspect`: what a job resuming from this checkpoint gets.
fn write_training(out: &mut impl Write, t: &TrainingSummary) -> std::io::Result<()> {
    if let Some(framework) = t.framework {
        return write_fsdp2_training(out, framework, t);
    }
    writeln!(out, "\ntraining checkpoint")?;
    let mesh = match (&t.mesh, &t.args) {
        (Some(m), _) => m.to_string(),
        (None, Some(a)) => match a.tensor_model_parallel_size {
            Some(tp) => format!("tp={tp}, the rest unknown (`args` has neither world_size nor data_parallel_size)"),
            None => "unknown (`args` has no tensor_model_parallel_size)".to_string(),
        },
        (None, None) => "unknown (no `args`)".to_string(),
    };
    writeln!(out, "  mesh:               {mesh}")?;
    writeln!(out, "  iteration:          {}", t.iteration.as_deref().unwrap_or("—"))?;
    writeln!(out, "  checkpoint_version: {}", t.checkpoint_version.as_deref().unwrap_or("—"))?;
    writeln!(out, "  parameters:         {} tensors, {}", t.params.0, bytes(t.params.1))?;
    for (state, (n, b)) in &t.moments {
        writeln!(out, "  {:<20}{n} tensors, {}", format!("optimizer {state}:"), bytes(*b))?;
    }
    if t.moments.is_empty() {
        writeln!(out, "  optimizer state:    none")?;
    }
    let holders = if t.adam_steps_by_group { "parameter groups" } else { "parameters" };
    let steps: Vec<String> = t.adam_steps.iter().map(|(s, n)| format!("{s} ({n} {holders})")).collect();
    writeln!(out, "  Adam step:          {}", if steps.is_empty() { "—".to_string() } else { steps.join(", ") })?;
    let rng: Vec<String> = t.rng_ranks.iter().map(|(p, r)| format!("({p}, {r})")).collect();
    writeln!(out, "  RNG states:         {}", if rng.is_empty() { "none".to_string() } else { rng.join(", ") })?;
    if !t.unknown.is_empty() {
        writeln!(out, "  not understood (carried by reshard): {}", t.unknown.join(", "))?;
    }
    if !t.common.is_empty() {
        writeln!(out, "  common state ({}):", t.common.len())?;
        for (k, v) in &t.common {
            writeln!(out, "    {k} = {v}")?;
        }
    }
    writeln!(out, "  bytes items ({}):", t.objects.len())?;
    for (k, v) in &t.objects {
        writeln!(out, "    {k} = {v}")?;
    }
    Ok(())
}

/// The training section of an FSDP2 framework's checkpoint (torchtitan's).
fn write_fsdp2_training(out: &mut impl Write, framework: &str, t: &TrainingSummary) -> std::io::Result<()> {
    writeln!(out, "\ntraining checkpoint ({framework})")?;
    writeln!(out, "  step:               {}", t.iteration.as_deref().unwrap_or("—"))?;
    let ranks = match (t.dataloader_ranks.first(), t.dataloader_ranks.last()) {
        (Some(a), Some(b)) => format!(" (dataloader state of DP ranks {a}–{b})"),
        _ => " (no dataloader state)".to_string(),
    };
    writeln!(out, "  data parallel:      {}{ranks}", t.data_parallel.as_deref().unwrap_or("—"))?;
    writeln!(out, "  parameters:         {} tensors, {}", t.params.0, bytes(t.params.1))?;
    for (state, (n, b)) in &t.moments {
        writeln!(out, "  {:<20}{n} tensors, {}", format!("optimizer {state}:"), bytes(*b))?;
    }
    if t.moments.is_empty() {
        writeln!(out, "  optimizer state:    none")?;
    }
    let steps: Vec<String> = t.adam_steps.iter().map(|(s, n)| format!("{s} ({n} parameters)")).collect();
    writeln!(out, "  Adam step:          {}", if steps.is_empty() { "—".to_string() } else { steps.join(", ") })?;
    if !t.group_settings.is_empty() {
        writeln!(out, "  parameter groups:")?;
        for ((k, v), n) in &t.group_settings {
            writeln!(out, "    {k} = {v} ({n} parameters)")?;
        }
    }
    if !t.unknown.is_empty() {
        writeln!(out, "  other tensors (carried by reshard): {}", t.unknown.join(", "))?;
    }
    writeln!(out, "  bytes items ({}):", t.objects.len())?;
    for (k, v) in &t.objects {
        writeln!(out, "    {k} = {v}")?;
    }
    if !t.files.is_empty() {
        writeln!(out, "  files ({}):", t.files.len())?;
        for (k, v) in &t.files {
            writeln!(out, "    {k}: {v}")?;
        }
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// Checkpoint directory.
    pub ckpt: PathBuf,
    /// The HF release it was converted from.
    #[arg(long, value_name = "HF_DIR")]
    pub against: PathBuf,
    /// Prefix of model keys in the checkpoint (default: `model.module.` for fsdp_dtensor, none
    /// for torch_dist).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Expert-TP size the checkpoint was written with: only parameters Megatron keeps fused per
    /// expert-TP rank (gpt-oss's expert fc1) have a global layout that depends on it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub etp: u64,
    #[arg(long)]
    pub json: bool,
}

pub fn run_validate(args: ValidateArgs) -> Result<ExitCode> {
    let request = ValidateRequest {
        ckpt: args.ckpt.clone(),
        against: args.against.clone(),
        prefix: args.prefix.clone(),
        etp: args.etp,
    };
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let (report, reference) = {
        let _bar = Bar::follow("validate", progress.clone());
        validate(&request, &progress)?
    };
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({
                "ok": report.ok(), "tensors": report.tensors, "items": report.items,
                "bytes_checked": report.bytes_checked, "seconds": secs,
                "findings": report.findings.iter().map(|f| json!({"key": f.key, "message": f.message})).collect::<Vec<_>>(),
                "findings_not_listed": report.findings_dropped, "peak_rss_bytes": peak_rss().unwrap_or(0),
            })
        );
    } else if report.ok() {
        println!(
            "ok: {} tensors ({} items), {} reconstructed bit-exactly against {} in {:.2}s",
            report.tensors,
            report.items,
            bytes(report.bytes_checked),
            args.against.display(),
            secs
        );
    } else {
        println!("FAILED: {} finding(s):", report.findings.len() as u64 + report.findings_dropped);
        for f in &report.findings {
            println!("  `{}`: {}", f.key, f.message);
        }
        if report.findings_dropped > 0 {
            println!("  … and {} more", report.findings_dropped);
        }
        // Only parameters kept fused per expert-TP rank depend on the etp they were written with.
        let fused_per_etp =
            reference.model_type == "gpt_oss" && report.findings.iter().any(|f| f.key.contains(".experts.linear_fc1."));
        if fused_per_etp {
            println!(
                "hint: gpt-oss keeps each expert's fc1 fused in the expert-TP layout; was the checkpoint written with an etp other than {}? (--etp)",
                args.etp
            );
        }
    }
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
