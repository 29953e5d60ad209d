//! `reshard`: a training checkpoint saved on one mesh, written for another.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use serde_json::json;
use shardline_formats::execute::Progress;
use shardline_layout::reshard::RngPolicy;
use shardline_layout::Mesh;
use shardline_ops::{plan_reshard_of, ReshardRequest};

use crate::convert::{MeshArgs, Target};
use crate::report::{bytes, peak_rss, Bar};
use crate::reshard_sim::{per_rank_file_json, per_rank_file_line};

/// What happens to the per-(pp, tp) RNG states when the TP grid changes.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Rng {
    /// Keep the ranks both grids have; a new TP rank gets a copy of rank (0, 0)'s state (its
    /// dropout then repeats rank 0's); ranks the target lacks are dropped.
    FromRank0,
    /// Drop every RNG state; the job must load with `--no-load-rng`.
    Drop,
}

#[derive(Args, Debug)]
pub struct ReshardArgs {
    /// Training checkpoint directory (DCP, as Megatron-FSDP's `fsdp_dtensor` format saves it), or
    /// a Megatron-Core `torch_dist` checkpoint or save directory (with `--target fsdp_dtensor`).
    #[arg(required_unless_present = "simulate")]
    pub ckpt: Option<PathBuf>,
    /// Plan and cost the reshard of a checkpoint that is not here: the one Megatron-FSDP saves
    /// for the model this HF `config.json` describes on `--from-mesh` (parameters in fp32 and
    /// both Adam moments), reported per target rank file (bytes written and read, ranged reads,
    /// source files) with the planning time and peak memory; nothing is read or written.
    #[arg(long, value_name = "CONFIG_JSON", conflicts_with_all = ["ckpt", "to"], requires = "from_mesh")]
    pub simulate: Option<PathBuf>,
    /// The dialect to write (default: the source's). `fsdp_dtensor` from a `torch_dist` source
    /// translates it: layers and experts unstacked, SwiGLU fc1 split where the model's layers are
    /// SwiGLU, `args` and the common state carried as top-level items, each RNG `ShardedObject` as
    /// the `rng_state.(pp, tp)` items; what Megatron-FSDP does not
    /// save (`_extra_state`, the rerun state) is left out, and said so. `torch_dist` writes a
    /// Megatron-LM save directory (`iter_%07d/` of the source's iteration, or `release/`, then
    /// the tracker): layers stacked, experts and `[gate; up]` joined, an `_extra_state` per
    /// Transformer Engine module, the bytes items as the common state `common.pt`, optimizer
    /// moments as `fully_reshardable` state with the fp32 masters as `optimizer.state.param.*`
    /// and the parameter groups as `param_groups`, the RNG states of each TP rank as one
    /// `ShardedObject` `rng_state` (`no_save_rng` only when there are none).
    #[arg(long, value_enum)]
    pub target: Option<crate::convert::Target>,
    /// Output checkpoint directory.
    #[arg(long = "to", value_name = "OUT_DIR", required_unless_present_any = ["dry_run", "simulate"])]
    pub to: Option<PathBuf>,
    /// The target mesh.
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// The source mesh, for a checkpoint without `args` (Megatron-Bridge writes none):
    /// `tp=2,dp=4,ep=2,etp=1` (cp, ep default to 1, etp to tp).
    #[arg(long, value_name = "tp=N,dp=N,…")]
    pub from_mesh: Option<String>,
    /// RNG states for the target's TP grid.
    #[arg(long, value_enum, default_value = "from-rank0")]
    pub rng: Rng,
    /// The tokenizer's vocabulary size, to re-pad the embedding and output layer for the target
    /// TP (default: `args.vocab_size`).
    #[arg(long)]
    pub vocab_size: Option<u64>,
    /// Megatron's --make-vocab-size-divisible-by (default: `args`, else 128).
    #[arg(long)]
    pub vocab_divisible_by: Option<u64>,
    /// Plan and check, write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replace a checkpoint already in OUT_DIR.
    #[arg(long)]
    pub overwrite: bool,
    /// Writer threads (default: number of CPUs, at least 2).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Parses `tp=2,dp=4,…` (as a pipeline's `from_mesh` is).
pub(crate) fn parse_mesh(s: &str) -> Result<Mesh> {
    Mesh::parse_assignments(s).map_err(|e| anyhow::anyhow!("--from-mesh: {e}"))
}

pub fn run_reshard(args: ReshardArgs) -> Result<ExitCode> {
    if let Some(config) = &args.simulate {
        return crate::reshard_sim::run_simulated(config, &args);
    }
    let Some(ckpt) = args.ckpt.clone() else { bail!("a checkpoint to reshard is required") };
    let started = Instant::now();
    let request = ReshardRequest {
        ckpt: ckpt.clone(),
        mesh: args.mesh.mesh(),
        target: args.target.map(Target::dialect),
        from_mesh: args.from_mesh.as_deref().map(parse_mesh).transpose()?,
        rng: match args.rng {
            Rng::FromRank0 => RngPolicy::FromRank0,
            Rng::Drop => RngPolicy::Drop,
        },
        vocab_size: args.vocab_size,
        vocab_divisible_by: args.vocab_divisible_by,
    };
    let planned = plan_reshard_of(&request)?;
    for note in &planned.source.notes {
        eprintln!("note: {note}");
    }
    let (plan, mesh) = (&planned.plan, planned.options.mesh);
    for note in &plan.notes {
        let note = note.strip_prefix("warning: ").unwrap_or(note);
        eprintln!("warning: {note}");
    }
    let from = planned.source_mesh_said();
    let moments = planned.optimizer_states();
    if args.dry_run {
        let cost = planned.cost();
        if args.json {
            println!(
                "{}",
                json!({"from": from, "to": mesh.to_string(), "tensors": planned.tensor_count(),
                       "optimizer_states": moments, "objects": plan.objects.len(), "notes": plan.notes,
                       "per_rank_file": per_rank_file_json(&cost)})
            );
        } else {
            println!(
                "reshard {} ({from}) → {}: {} tensors ({moments} optimizer states), {} bytes items; nothing written (--dry-run)",
                ckpt.display(),
                mesh,
                planned.tensor_count(),
                plan.objects.len()
            );
            println!("  {}", per_rank_file_line(&cost));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(to) = &args.to else { bail!("--to is required") };
    let progress = Arc::new(Progress::default());
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()).max(2));
    let report = {
        let _bar = (!args.json).then(|| Bar::follow("reshard", progress.clone()));
        planned.write(to, threads, args.overwrite, &progress)?
    };
    if !report.args_missing.is_empty() {
        eprintln!("warning: `args` has no {}; left as they were", report.args_missing.join(", "));
    }
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({"from": from, "to": mesh.to_string(), "out": to, "files": report.files,
                   "tensor_bytes": report.tensor_bytes, "file_bytes": report.file_bytes, "chunks": report.chunks,
                   "optimizer_states": moments, "args_updated": report.args_set, "notes": plan.notes,
                   "left_out": planned.source.notes, "seconds": secs, "peak_rss_bytes": peak_rss(),
                   "bytes_written": progress.bytes_written.load(Ordering::Relaxed)})
        );
    } else {
        println!(
            "resharded {} ({from}) → {} ({}): {} rank files, {} tensors ({moments} optimizer states), {} in {:.2}s",
            ckpt.display(),
            to.display(),
            mesh,
            report.files,
            planned.tensor_count(),
            bytes(report.file_bytes),
            secs
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_mesh_parses_and_defaults() {
        assert_eq!(parse_mesh("tp=2,dp=4").unwrap(), Mesh { tp: 2, cp: 1, dp: 4, ep: 1, etp: 2 });
        assert_eq!(parse_mesh("tp=2, dp=4, ep=2, etp=1").unwrap(), Mesh { tp: 2, cp: 1, dp: 4, ep: 2, etp: 1 });
        assert!(parse_mesh("tp=2,pp=2").unwrap_err().to_string().contains("unknown dimension `pp`"));
        assert!(parse_mesh("tp").is_err());
    }
}
