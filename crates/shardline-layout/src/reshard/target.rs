//! The target dialect of a reshard. The plan is made in the source's `fsdp_dtensor` names (a
//! `torch_dist` source is read as the `fsdp_dtensor` checkpoint it stands for); for a `torch_dist`
//! target its tensors are then re-keyed as Megatron-Core names them with a `fully_reshardable`
//! distributed optimizer (torch-dist.md §3.2): a model parameter under its bare name, each moment
//! as `optimizer.state.<state>.<name>`, and, when the checkpoint has optimizer state, the fp32
//! master `optimizer.state.param.<name>` — in Megatron-FSDP the master *is* the model tensor, so
//! it is the same source item written a second time, the model's own copy then rounded to the
//! job's dtype (`--bf16`) as Megatron-Core keeps and saves it. Where the keys land on disk (stacks,
//! experts, `[gate; up]`) is the dialect's placement, not this module's.
//!
//! What `torch_dist` keeps outside its tensors: the bytes items become the common state (the
//! writer's business); the RNG states of each (pp, tp) rank become one `ShardedObject` (see
//! [`rng_objects`]); the parameter groups' settings (`param_to_group_meta`) become the
//! optimizer's `param_groups`.

use std::collections::{BTreeMap, BTreeSet};

use super::keys::{parse_rng_rank, ItemKind, PathElem};
use super::plan::{TargetObject, TargetTensor};
use super::ReshardError;
use crate::dialect::state_key;
use crate::dtype::DType;
use crate::mesh::Mesh;
use crate::plan::{Role, Tiling};

/// One (pp, tp) rank's RNG states as Megatron-Core's `torch_dist` keeps them (torch-dist.md
/// §1.3): a `ShardedObject` `rng_state` of global shape `(PP, TP)` at `(pp, tp)`, replicated
/// over DP, whose payload is Megatron's `rng_state_list` — in `fsdp_dtensor` the same list sits
/// under `rng_state.(pp, tp)`, one item per leaf.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RngObject {
    /// `rng_state/shard_<pp>.<tp>_<PP>.<TP>`.
    pub key: String,
    /// The rank whose file holds it: the main replica, DP rank 0 of that TP rank.
    pub rank: u64,
    /// The payload's leaves in item order.
    pub leaves: Vec<RngLeaf>,
}

/// A leaf of an RNG payload: its path inside `rng_state_list` (its list index first) and the
/// source item holding it, a tensor or a bytes item.
pub type RngLeaf = (Vec<PathElem>, usize);

/// Takes the RNG states (already re-keyed for the target grid) out of `tensors` and `objects`
/// and groups them into one [`RngObject`] per (pp, tp) rank.
pub(super) fn rng_objects(
    kinds: &[ItemKind],
    mesh: &Mesh,
    tensors: &mut Vec<TargetTensor>,
    objects: &mut Vec<TargetObject>,
) -> Vec<RngObject> {
    let mut by_rank: BTreeMap<(u64, u64), Vec<RngLeaf>> = BTreeMap::new();
    // The target's (pp, tp) is in the path (a copied state keeps its source's kind).
    let mut take = |source: usize, path: &[PathElem]| -> bool {
        let rank = match (&kinds[source], path.get(1)) {
            (ItemKind::Rng { .. }, Some(PathElem::Key(part))) => parse_rng_rank(part),
            _ => None,
        };
        match rank {
            Some(rank) => {
                by_rank.entry(rank).or_default().push((path[2..].to_vec(), source));
                true
            }
            None => false,
        }
    };
    tensors.retain(|t| !take(t.source, &t.path));
    objects.retain(|o| !take(o.source, &o.path));
    // A reshard's target has no pipeline parallelism: PP is 1.
    by_rank
        .into_iter()
        .map(|((pp, tp), mut leaves)| {
            leaves.sort();
            RngObject { key: format!("rng_state/shard_{pp}.{tp}_1.{}", mesh.tp), rank: mesh.dense_rank(tp, 0), leaves }
        })
        .collect()
}

/// What becomes of a plan's items in `torch_dist`: the tensors re-keyed in place, and the
/// source items of the parameter-group settings (empty when there is no optimizer state).
pub(super) fn to_torch_dist(
    kinds: &[ItemKind],
    model_dtype: Option<DType>,
    tensors: &mut Vec<TargetTensor>,
    objects: &mut Vec<TargetObject>,
    notes: &mut Vec<String>,
    errors: &mut Vec<ReshardError>,
) -> Vec<usize> {
    // Parameters have optimizer state; buffers (`router.expert_bias`) have none.
    let optimized: BTreeSet<&str> = kinds
        .iter()
        .filter_map(|k| match k {
            ItemKind::OptimizerState { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    let has_states = !optimized.is_empty();
    let mut masters = Vec::new();
    for t in tensors.iter_mut() {
        let key = match &kinds[t.source] {
            ItemKind::Model { name } => {
                if optimized.contains(name.as_str()) && matches!(t.out.tiling, Tiling::Fsdp(_)) {
                    let mut master = t.clone();
                    // fp32, as Megatron-Core's distributed optimizer keeps its masters: a job
                    // that kept them in bf16 has them widened, exactly.
                    if master.out.dtype.size() < DType::F32.size() && master.out.dtype.is_float() {
                        master.out.dtype = DType::F32;
                    }
                    master.out.key = state_key("param", name);
                    master.out.role = Role::OptimizerState { param_key: name.clone(), state: "param" };
                    master.path = vec![PathElem::Key(master.out.key.clone())];
                    masters.push(master);
                    // The model's own copy in the job's dtype, as Megatron-Core saves it: the
                    // master rounded (never widened).
                    if let Some(d) = model_dtype.filter(|d| d.size() < t.out.dtype.size()) {
                        t.out.dtype = d;
                    }
                }
                name.clone()
            }
            ItemKind::OptimizerState { name, state } if !t.out.shape.is_empty() => {
                if let Role::OptimizerState { param_key, .. } = &mut t.out.role {
                    *param_key = name.clone();
                }
                state_key(state, name)
            }
            ItemKind::OptimizerState { state, .. } => {
                errors.push(ReshardError::Dialect {
                    key: t.out.key.clone(),
                    problem: format!(
                        "a per-parameter `{state}` tensor (torch AdamW's): torch_dist keeps Adam's step in the \
                         optimizer's param_groups, and a per-parameter step is not mapped there"
                    ),
                });
                continue;
            }
            _ => {
                errors.push(ReshardError::Dialect {
                    key: t.out.key.clone(),
                    problem: "a tensor Shardline does not know how to place in torch_dist".into(),
                });
                continue;
            }
        };
        t.out.key = key;
        t.path = vec![PathElem::Key(t.out.key.clone())];
    }
    tensors.extend(masters);

    let mut group_meta = Vec::new();
    let mut dropped_groups = 0;
    objects.retain(|o| match kinds[o.source] {
        ItemKind::GroupMeta => {
            if has_states {
                group_meta.push(o.source);
            } else {
                dropped_groups += 1;
            }
            false
        }
        _ => true,
    });
    if has_states && group_meta.is_empty() {
        notes.push(
            "warning: optimizer moments without parameter-group settings (`convert --optimizer-state` writes none): \
             written as fully_reshardable state, but with no param_groups Megatron-LM cannot restore an optimizer \
             from them (`args.no_save_optim` is set when the checkpoint has `args`)"
                .to_string(),
        );
    }
    if dropped_groups > 0 {
        notes.push(format!(
            "{dropped_groups} parameter-group settings left out: the checkpoint has no optimizer moments to go with them"
        ));
    }
    group_meta
}
