//! A reshard planned and costed without data: the training checkpoint Megatron-FSDP saves for a
//! model on one mesh — its parameters in fp32 and both Adam moments, chunked as `convert
//! --optimizer-state` plans them — resharded to another mesh. Only the release's inventory (each
//! tensor's name, dtype and shape) is needed, so a 671B model on 1,024 ranks is planned on one
//! machine; `reshard --simulate` reports what each target rank file would hold and read.

use std::time::{Duration, Instant};

use shardline_layout::reshard::{
    plan_reshard, reshard_cost, ChunkBox, PathElem, ReshardCost, ReshardOptions, ReshardPlan, RngPolicy, SourceItem,
    SourceTensorMeta,
};
use shardline_layout::{build_plan, Dialect, Mesh, ModelConfig, Plan, PlanOptions, SourceTensor};

use crate::OpsError;

/// A simulated reshard: the source checkpoint's and the target's plans, and what each target
/// rank file costs.
pub struct SimulatedReshard {
    /// Tensors of the source checkpoint (parameters and optimizer states).
    pub source_tensors: usize,
    pub plan: ReshardPlan,
    pub cost: ReshardCost,
    /// Planning the source, the reshard, and costing it.
    pub planning: Duration,
}

/// What `convert` with optimizer state plans for `sources` on `from`, resharded to `to` as
/// `dialect`.
pub fn simulate_reshard(
    config: &ModelConfig,
    sources: Vec<SourceTensor>,
    from: Mesh,
    to: Mesh,
    dialect: Dialect,
) -> Result<SimulatedReshard, OpsError> {
    let started = Instant::now();
    let options = PlanOptions { optimizer_state: true, ..PlanOptions::default() };
    let source = build_plan(config, sources, from, &options).map_err(|errors| OpsError::Plan {
        model_type: config.model_type.clone(),
        mesh: from.to_string(),
        problems: errors.iter().map(ToString::to_string).collect(),
    })?;
    let (items, files) = saved_items(&source);
    let reshard_options = ReshardOptions {
        mesh: to,
        source_mesh: Some(from),
        vocab_size: Some(config.vocab_size),
        vocab_divisible_by: options.vocab_divisible_by,
        num_experts: (config.num_experts > 0).then_some(config.num_experts),
        num_query_groups: Some(config.num_query_groups),
        rng: RngPolicy::FromRank0,
        dialect,
        model_dtype: None,
    };
    let plan = plan_reshard(&items, &reshard_options).map_err(|source| OpsError::Reshard {
        ckpt: "(simulated)".into(),
        mesh: to.to_string(),
        source,
    })?;
    let cost = reshard_cost(&items, &files, &plan);
    Ok(SimulatedReshard { source_tensors: items.len(), plan, cost, planning: started.elapsed() })
}

/// The items a checkpoint saved by `plan` reads as, each with the rank file of every chunk: its
/// `planner_data` paths as Megatron-FSDP nests its state dict (`model` → name, `optimizer` →
/// `state` → parameter → state).
fn saved_items(plan: &Plan) -> (Vec<SourceItem>, Vec<Vec<u64>>) {
    let key = |s: &str| PathElem::Key(s.to_string());
    let mut items = Vec::with_capacity(plan.tensors.len());
    let mut files = Vec::with_capacity(plan.tensors.len());
    for t in &plan.tensors {
        let path = match t.key.strip_prefix("optimizer.state.").and_then(|r| r.rsplit_once('.')) {
            Some((param, state)) => vec![key("optimizer"), key("state"), key(param), key(state)],
            None => match t.key.split_once('.') {
                Some((top, rest)) => vec![key(top), key(rest)],
                None => vec![key(&t.key)],
            },
        };
        let (mut chunks, mut ranks) = (Vec::new(), Vec::new());
        for c in t.chunks(&plan.mesh).filter(|c| c.written && c.numel() > 0) {
            ranks.push(c.rank);
            chunks.push(ChunkBox { offsets: c.offsets, sizes: c.sizes });
        }
        items.push(SourceItem {
            key: t.key.clone(),
            path,
            tensor: Some(SourceTensorMeta { dtype: t.dtype, shape: t.shape.clone(), chunks }),
        });
        files.push(ranks);
    }
    (items, files)
}
