//! `reshard --simulate CONFIG_JSON`: the reshard of a training checkpoint that is not here,
//! planned and costed per target rank file from the model's `config.json` alone (the release's
//! inventory is what `synth` would generate for it; no tensor is made).

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::json;
use shardline_layout::reshard::{RankCost, ReshardCost};
use shardline_layout::{Dialect, ModelConfig, SourceTensor};
use shardline_ops::simulate_reshard;
use shardline_synth::SynthModel;

use crate::convert::Target;
use crate::report::{bytes, peak_rss};
use crate::reshard::{parse_mesh, ReshardArgs};

pub fn run_simulated(config_path: &Path, args: &ReshardArgs) -> Result<ExitCode> {
    let text = std::fs::read_to_string(config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let model = SynthModel::from_config_json(&text).with_context(|| format!("reading {}", config_path.display()))?;
    let config = ModelConfig::from_json(&text).with_context(|| format!("reading {}", config_path.display()))?;
    let sources: Vec<SourceTensor> = model
        .tensors()
        .iter()
        .map(|t| SourceTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect();
    let from = parse_mesh(args.from_mesh.as_deref().unwrap_or_default())?;
    let to = args.mesh.mesh();
    let dialect = args.target.map_or(Dialect::FsdpDtensor, Target::dialect);
    let sim = simulate_reshard(&config, sources, from, to, dialect)?;
    let cost = &sim.cost;
    let planning = sim.planning.as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({
                "model_type": config.model_type, "parameters": model.total_parameters(),
                "from": from.to_string(), "to": to.to_string(), "target": dialect.name(),
                "source_tensors": sim.source_tensors, "source_chunks": cost.source_chunks,
                "source_bytes": cost.source_bytes, "target_tensors": sim.plan.tensors.len(),
                "rank_files": cost.ranks.len(),
                "per_rank_file": per_rank_file_json(cost),
                "planning_seconds": planning, "peak_rss_bytes": peak_rss(),
            })
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "simulated reshard of {} ({:.1}B parameters) {from} → {to} ({}): nothing read or written",
        config.model_type,
        model.total_parameters() as f64 / 1e9,
        dialect.name()
    );
    println!(
        "  source: {} tensors, {} chunks, {}; target: {} tensors in {} rank files",
        sim.source_tensors,
        cost.source_chunks,
        bytes(cost.source_bytes),
        sim.plan.tensors.len(),
        cost.ranks.len()
    );
    println!("  {}", per_rank_file_line(cost));
    println!("  planned in {planning:.2}s, peak RSS {}", peak_rss().map_or("unknown".into(), bytes));
    Ok(ExitCode::SUCCESS)
}

/// Each target rank file's cost as `--json` reports it: max, mean and total of every figure.
pub(crate) fn per_rank_file_json(cost: &ReshardCost) -> serde_json::Value {
    let world = cost.ranks.len().max(1) as u64;
    let stat =
        |f: fn(&RankCost) -> u64| json!({"max": cost.max(f), "mean": cost.total(f) / world, "total": cost.total(f)});
    json!({
        "chunks": stat(|r| r.chunks), "bytes_written": stat(|r| r.bytes_written),
        "bytes_read": stat(|r| r.bytes_read), "reads": stat(|r| r.reads),
        "source_files": stat(|r| r.source_files),
    })
}

/// Each target rank file's cost in one line: max and mean of every figure.
pub(crate) fn per_rank_file_line(cost: &ReshardCost) -> String {
    let world = cost.ranks.len().max(1) as u64;
    let mean = |f: fn(&RankCost) -> u64| cost.total(f) / world;
    format!(
        "per rank file (max / mean): writes {} / {} in {} / {} chunks; reads {} / {} in {} / {} ranged reads from {} / \
         {} source files",
        bytes(cost.max(|r| r.bytes_written)),
        bytes(mean(|r| r.bytes_written)),
        cost.max(|r| r.chunks),
        mean(|r| r.chunks),
        bytes(cost.max(|r| r.bytes_read)),
        bytes(mean(|r| r.bytes_read)),
        cost.max(|r| r.reads),
        mean(|r| r.reads),
        cost.max(|r| r.source_files),
        mean(|r| r.source_files),
    )
}
