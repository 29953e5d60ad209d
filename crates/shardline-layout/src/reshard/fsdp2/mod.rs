//! Resharding an FSDP2 framework's training checkpoint (torchtitan's `step-N/`, NeMo Automodel's
//! `model/` and `optim/`) over another data- and expert-parallel mesh.
//!
//! FSDP2 shards a parameter, and its optimizer moments with it, along one dim in `torch.chunk`
//! pieces (`Shard(d)`: rank `j` of `D` holds `[j·q, (j+1)·q)` clipped, `q = ceil(n / D)`); what
//! is replicated (buffers, scalars, torchtitan's fused-QKV model keys) DCP writes once, whole.
//! The target keeps each tensor's placement as its chunks show it and changes the degree, except
//! where the framework's own rule depends on the degree or the source cannot show it:
//! torchtitan's grouped experts take `Shard(1)` once there are more ranks than experts, and a
//! one-rank save (every tensor whole) is sharded as FSDP2 shards parameters, `Shard(0)`. Under
//! expert parallelism grouped experts are cut into one slab per EP rank first, and an expert's
//! own tensor lives on its EP rank's expert-FSDP group (`placement`).
//!
//! Bytes items are carried, except per-DP-rank dataloader state at another degree, which
//! torchtitan refuses to load (`dp_world_size` must match): it is left out, with a note.

use std::collections::{BTreeMap, BTreeSet};

use super::boxes::check_tiling;
use super::keys::PathElem;
use super::plan::{ReshardPlan, SourceItem, SourceTensorMeta, TargetObject, TargetTensor};
use super::ReshardError;
use crate::arch::TpMode;
use crate::dialect::{Dialect, DiskLayout};
use crate::mesh::Mesh;
use crate::plan::{dense_mesh_tiling, sparse_mesh_tiling, FsdpNumbers, FsdpTiling, Group, OutputTensor, Role, Tiling};
use crate::recipe::RowBlock;

mod placement;

use placement::Target;
pub use placement::{source_placement, ExpertKeys, Placement};

/// What an FSDP2 reshard is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fsdp2Options {
    /// The framework that wrote the checkpoint and will load the target (its placement rules).
    pub dialect: Dialect,
    /// The target's data-parallel (FSDP shard) degree.
    pub dp: u64,
    /// The target's tensor-parallel degree (torchtitan only; 1: none).
    pub tp: u64,
    /// The target's expert-parallel degree (1: none).
    pub ep: u64,
    /// Rank files of the source: a one-rank save holds every tensor whole, which says nothing of
    /// how FSDP2 places it.
    pub source_ranks: u64,
}

/// What an item of an FSDP2 framework's checkpoint is, from its `planner_data` path: model keys
/// at the top level, the optimizer's flat state (`state.<fqn>.<state>`, `param_groups.<fqn>.<k>`)
/// under `optimizer` (torchtitan) or `optim` (Automodel).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fsdp2Item {
    Param {
        name: String,
    },
    State {
        name: String,
        state: String,
    },
    /// `dataloader.dp_rank_<d>`: one data-parallel rank's dataloader state.
    DataloaderRank(u64),
    /// Another `dataloader` item (torchtitan's `world_size`).
    Dataloader,
    /// Everything else: parameter groups, the LR scheduler, the train state.
    Other,
}

/// What the item at `path` is.
pub fn classify_fsdp2(path: &[PathElem]) -> Fsdp2Item {
    let key = |i: usize| match path.get(i) {
        Some(PathElem::Key(k)) => Some(k.as_str()),
        _ => None,
    };
    match (key(0), key(1), path.len()) {
        (Some("optimizer" | "optim"), Some(flat), 2) => {
            match flat.strip_prefix("state.").and_then(|r| r.rsplit_once('.')) {
                Some((name, state)) => Fsdp2Item::State { name: name.to_string(), state: state.to_string() },
                None => Fsdp2Item::Other,
            }
        }
        (Some("dataloader"), Some(k), 2) => k
            .strip_prefix("dp_rank_")
            .and_then(|d| d.parse().ok())
            .map_or(Fsdp2Item::Dataloader, Fsdp2Item::DataloaderRank),
        (Some("optimizer" | "optim" | "dataloader" | "lr_scheduler" | "train_state" | "sched"), _, _) => {
            Fsdp2Item::Other
        }
        (Some(name), None, 1) => Fsdp2Item::Param { name: name.to_string() },
        _ => Fsdp2Item::Other,
    }
}

/// Plans the target checkpoint of `items` at data-parallel degree `options.dp`.
pub fn plan_fsdp2_reshard(items: &[SourceItem], options: &Fsdp2Options) -> Result<ReshardPlan, ReshardError> {
    let dp = options.dp;
    let mesh = Mesh { tp: options.tp, cp: 1, dp, ep: options.ep, etp: 1 };
    let mut errors: Vec<ReshardError> = mesh.check().into_iter().map(|e| ReshardError::Mesh(e.to_string())).collect();
    // The placements below divide by the mesh's sizes.
    if !errors.is_empty() {
        return Err(ReshardError::Many(errors));
    }
    let kinds: Vec<Fsdp2Item> = items.iter().map(|i| classify_fsdp2(&i.path)).collect();
    let params: BTreeMap<&str, &SourceTensorMeta> = items
        .iter()
        .zip(&kinds)
        .filter_map(|(item, kind)| match (kind, &item.tensor) {
            (Fsdp2Item::Param { name }, Some(t)) => Some((name.as_str(), t)),
            _ => None,
        })
        .collect();
    let fused_qkv: BTreeSet<&str> = kinds
        .iter()
        .filter_map(|k| match k {
            Fsdp2Item::State { name, .. } => name.strip_suffix(".wqkv.weight"),
            _ => None,
        })
        .collect();
    let experts = ExpertKeys::new(items.iter().map(|i| i.key.as_str()));
    let target = Target {
        dialect: options.dialect,
        dp,
        tp: options.tp,
        ep: options.ep,
        source_ranks: options.source_ranks,
        fused_qkv: &fused_qkv,
        experts: &experts,
    };
    // Each DP rank writes its own dataloader key: their count is the source's degree.
    let source_dp = kinds.iter().filter(|k| matches!(k, Fsdp2Item::DataloaderRank(_))).count() as u64;
    let drop_dataloader = source_dp > 0 && source_dp != dp;

    let mut tensors = Vec::new();
    let mut objects = Vec::new();
    let mut notes = Vec::new();
    for (i, (item, kind)) in items.iter().zip(&kinds).enumerate() {
        if drop_dataloader && matches!(kind, Fsdp2Item::DataloaderRank(_) | Fsdp2Item::Dataloader) {
            continue;
        }
        let Some(t) = &item.tensor else {
            objects.push(TargetObject { key: item.key.clone(), path: item.path.clone(), source: i, is_args: false });
            continue;
        };
        if let Err(problem) = check_tiling(&t.shape, &t.chunks) {
            errors.push(ReshardError::Tiling { key: item.key.clone(), problem: problem.to_string() });
            continue;
        }
        let shown = source_placement(&t.shape, &t.chunks);
        let role = match kind {
            Fsdp2Item::State { name, state } => {
                if let Some(problem) = params.get(name.as_str()).and_then(|p| state_mismatch(p, t)) {
                    errors.push(ReshardError::StateMismatch { key: item.key.clone(), param: name.clone(), problem });
                    continue;
                }
                Role::OptimizerState { param_key: name.clone(), state: state_name(state) }
            }
            _ => Role::Param,
        };
        let param = match kind {
            Fsdp2Item::State { name, .. } | Fsdp2Item::Param { name } => name.as_str(),
            _ => item.key.as_str(),
        };
        match target.placement(&item.key, param, &t.shape, shown) {
            Ok(placement) => tensors.push(target_tensor(item, t, i, placement, &mesh, role)),
            Err(problem) => errors.push(ReshardError::Tiling { key: item.key.clone(), problem }),
        }
    }
    if drop_dataloader {
        notes.push(format!(
            "the dataloader state of {source_dp} data-parallel ranks is left out: torchtitan refuses it at another \
             degree ({dp}); resume with `--checkpoint.exclude_from_loading dataloader` (the data order restarts)"
        ));
    }
    if !errors.is_empty() {
        return Err(ReshardError::Many(errors));
    }
    tensors.sort_by(|a, b| a.out.key.cmp(&b.out.key));
    objects.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(ReshardPlan {
        mesh,
        tensors,
        objects,
        padded_vocab: None,
        notes,
        dialect: options.dialect,
        disk: DiskLayout::AsPlanned,
        group_meta: Vec::new(),
        rng_objects: Vec::new(),
    })
}

/// The optimizer moments of `states` (a separate directory, as NeMo Automodel's `optim/`) that
/// cannot follow the parameter of the same name in `params` (its `model/`): another global shape,
/// or other chunks. Grouped native parameters with no such name are not compared.
pub fn mismatched_states(params: &[SourceItem], states: &[SourceItem]) -> Vec<ReshardError> {
    let by_name: BTreeMap<&str, &SourceTensorMeta> =
        params.iter().filter_map(|p| Some((p.key.as_str(), p.tensor.as_ref()?))).collect();
    states
        .iter()
        .filter_map(|item| {
            let Fsdp2Item::State { name, .. } = classify_fsdp2(&item.path) else { return None };
            let problem = state_mismatch(by_name.get(name.as_str())?, item.tensor.as_ref()?)?;
            Some(ReshardError::StateMismatch { key: item.key.clone(), param: name, problem })
        })
        .collect()
}

/// Which source rank's per-rank state file each rank of a world of `n` takes: its own where the
/// source has one (`ranks`, ascending), else the lowest rank's. Every rank of an FSDP2 job has
/// stepped as often as every other, so a rank's position in its data or RNG stream carries; the
/// streams themselves differ from an uninterrupted run at another degree.
pub fn per_rank_sources(ranks: &[u64], n: u64) -> Vec<(u64, u64)> {
    let Some(&first) = ranks.first() else { return Vec::new() };
    (0..n).map(|r| (r, if ranks.binary_search(&r).is_ok() { r } else { first })).collect()
}

/// The optimizer state names `Role` knows; others are still re-tiled, under a generic name.
fn state_name(state: &str) -> &'static str {
    const KNOWN: &[&str] = &["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step"];
    KNOWN.iter().find(|k| **k == state).copied().unwrap_or("state")
}

/// Why a moment cannot follow its parameter: FSDP2 shards it exactly like the parameter.
fn state_mismatch(param: &SourceTensorMeta, state: &SourceTensorMeta) -> Option<String> {
    if state.shape.is_empty() {
        return None;
    }
    if param.shape != state.shape {
        return Some(format!("global shape {:?}, its parameter's {:?}", state.shape, param.shape));
    }
    let boxes = |t: &SourceTensorMeta| t.chunks.iter().filter(|c| c.numel() > 0).cloned().collect::<BTreeSet<_>>();
    (boxes(param) != boxes(state))
        .then(|| "its chunks are not its parameter's (FSDP2 shards a moment like its parameter)".into())
}

fn target_tensor(
    item: &SourceItem,
    t: &SourceTensorMeta,
    source: usize,
    placement: Placement,
    mesh: &Mesh,
    role: Role,
) -> TargetTensor {
    let world = mesh.world();
    let fsdp = |dim: u8, fsdp_size: u64, group: Group| {
        let size = t.shape.get(usize::from(dim)).copied().unwrap_or(1);
        let numbers = FsdpNumbers {
            fsdp_size,
            local_rows: size,
            section_start: 0,
            section_rows: size,
            dp_writer: 0,
            dim,
            slabs: 1,
        };
        (TpMode::Replicated, 1, group, Tiling::Fsdp(FsdpTiling { numbers, writers: Box::new([]) }))
    };
    let (tp_mode, tp, group, tiling) = match placement {
        Placement::Whole => fsdp(0, 1, Group::Dense),
        Placement::Shard(d) => fsdp(d, world, Group::Dense),
        Placement::OfExpert { expert, experts, dim } => {
            let ep_rank = expert / (experts / mesh.ep).max(1);
            fsdp(dim, mesh.expert_dp_size(), Group::Expert { expert, ep_rank })
        }
        // Chunk `i` on rank `i` over the whole mesh: the tensor spans the TP ranks too.
        Placement::Grouped { dim } => {
            (TpMode::Replicated, mesh.tp, Group::Dense, sparse_mesh_tiling(&t.shape, dim, mesh))
        }
        Placement::DenseMesh { split, dim } => {
            // A TP replica's FSDP piece `j` is written by TP rank `j mod tp`, spreading them.
            let writer = |j: u64| u32::try_from(j % mesh.tp).unwrap_or(0);
            let (mode, tiling) = dense_mesh_tiling(&t.shape, split.map(usize::from), usize::from(dim), mesh, writer);
            (mode, mesh.tp, Group::Dense, tiling)
        }
    };
    let rows = t.shape.first().copied().unwrap_or(1);
    TargetTensor {
        out: OutputTensor {
            key: item.key.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            recipe: vec![RowBlock::copy(source, 0, rows)],
            tp_mode,
            tp,
            group,
            split: None,
            role,
            tiling,
        },
        path: item.path.clone(),
        source,
    }
}

#[cfg(test)]
mod tests;
