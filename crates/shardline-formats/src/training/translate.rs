//! A Megatron-Core `torch_dist` checkpoint read as the reshard core reads a Megatron-FSDP one:
//! every on-disk key taken apart into the planned tensors it holds (the dialect's placement read
//! backwards, `shardline_layout::dialect::unplace`) under their `fsdp_dtensor` names, each stored
//! chunk cut into the pieces that meet them. A piece of a chunk is one contiguous run of its
//! bytes (a planned tensor covers one layer and expert index and a run of rows, whole trailing
//! dims), so it is read in place: no byte is copied to translate.
//!
//! The common state (`common.pt`, or the `common_state` item) becomes the top-level items an
//! `fsdp_dtensor` checkpoint holds (`args`, `iteration`, …), each pickled again; each RNG
//! `ShardedObject` becomes the items of `rng_state.(pp, tp)` (see `rng`); what Megatron-FSDP
//! does not save (`_extra_state`, the rerun state, `content_metadata`) is left out, and said so.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;

use shardline_layout::dialect::{share_of_box, unplace};
use shardline_layout::reshard::{
    classify_torch_dist, flat_key, param_layout, rng_rank_part, ChunkBox, ItemKind, PathElem, SourceItem,
    SourceTensorMeta,
};

use super::common_state::{common_entries, read_common_pt};
use super::fused::{fused, fused_rows, marks_fused_experts};
use super::param_groups::{group_of, saved_groups};
use super::rng::{read_rng_object, RngLeaf};
use super::{read_object, ItemData, TrainingArgs, TrainingError};
use crate::checkpoint::{Checkpoint, StoredChunk, StoredTensor};
use crate::pickle::{dumps, Value};
use crate::torch_save::{encode_pickle_archive, read_object_archive};

/// The prefix of model keys in `fsdp_dtensor`.
const MODEL_PREFIX: &str = "model.module.";

/// What a translated checkpoint reads as.
pub(super) struct Translated {
    pub checkpoint: Checkpoint,
    pub items: Vec<SourceItem>,
    pub data: Vec<ItemData>,
    pub inline: Vec<Vec<u8>>,
    pub args: Option<TrainingArgs>,
    pub notes: Vec<String>,
}

fn refuse(key: &str, problem: impl Into<String>) -> TrainingError {
    TrainingError::Translate { key: key.to_string(), problem: problem.into() }
}

/// Whether the canonical `key` is a SwiGLU fc1 (its `_w`/`_v` sections are what the mapping
/// tables know).
fn gated(key: &str) -> bool {
    param_layout(&format!("{key}_w"), None)
        .and_then(|l| l.section)
        .is_some_and(|(fused, index, suffixes)| fused == key && index == 0 && suffixes == ["_w", "_v"])
}

/// Reads `checkpoint` (a `torch_dist` checkpoint directory) as `fsdp_dtensor` items; with
/// `model_only`, its model parameters alone (what `export` reads), anything else skipped.
/// Parameters Megatron-FSDP keeps fused in an expert-TP-dependent layout (gpt-oss's expert fc1,
/// stored `[gate; up]` in `torch_dist`) are read in that layout for expert-TP size `fused_etp`;
/// without it they are refused.
pub(super) fn translate(
    checkpoint: Checkpoint,
    model_only: bool,
    fused_etp: Option<u64>,
) -> Result<Translated, TrainingError> {
    let mut notes = Vec::new();
    // Parameters whose fp32 master is saved (`optimizer.state.param.*`, `fp32_param` for a
    // non-distributed optimizer): in Megatron-FSDP the master is the model tensor, so it
    // replaces the rounded model weights.
    let masters: BTreeSet<String> = checkpoint
        .tensors
        .iter()
        .filter_map(|t| match classify_torch_dist(&t.key) {
            ItemKind::OptimizerState { name, state } if is_master(&state) && !model_only => Some(name),
            _ => None,
        })
        .collect();
    // Routed experts with fc1 biases are gpt-oss's kind, whose fc1 Megatron-FSDP keeps whole
    // (fused in the expert-TP layout), not split into SwiGLU sections: the model's layers decide.
    let fused_experts = checkpoint.tensors.iter().any(|t| marks_fused_experts(&t.key));
    let mut tensors: Vec<StoredTensor> = Vec::new();
    // Every optimized parameter's live (unsplit) name, its dimensions and whether it is an expert's.
    let mut optimized: BTreeMap<String, (usize, bool)> = BTreeMap::new();
    for t in &checkpoint.tensors {
        // The planned tensors' key: `model.module.<part>` or `optimizer.state.<opt>.<part>.<state>`.
        let name_of: Box<dyn Fn(&str) -> String> = match classify_torch_dist(&t.key) {
            ItemKind::Model { name } if masters.contains(&name) => continue,
            ItemKind::Model { .. } => Box::new(|part| format!("{MODEL_PREFIX}{part}")),
            _ if model_only => continue,
            ItemKind::OptimizerState { state, .. } if is_master(&state) => {
                Box::new(|part| format!("{MODEL_PREFIX}{part}"))
            }
            ItemKind::OptimizerState { state, .. } if state == "exp_avg" || state == "exp_avg_sq" => {
                Box::new(move |part| format!("{OPTIMIZER_PREFIX}{part}.{state}"))
            }
            ItemKind::OptimizerState { state, .. } => {
                return Err(refuse(&t.key, format!("optimizer state `{state}` has no Megatron-FSDP counterpart")))
            }
            _ if t.key.starts_with("optimizer.distributed.") => return Err(refuse(
                &t.key,
                "a `dp_reshardable` distributed-optimizer bucket: its flat buckets' mapping to parameters is not in \
                     the checkpoint (it follows Megatron's buffer layout of that run), so it is not guessed; re-save \
                     with `--dist-ckpt-optim-fully-reshardable`, or translate the model alone after loading with \
                     `--no-load-optim`",
            )),
            _ => return Err(refuse(&t.key, "a tensor Shardline does not know how to translate")),
        };
        let on_disk = match classify_torch_dist(&t.key) {
            ItemKind::OptimizerState { name, .. } => name,
            _ => t.key.clone(),
        };
        let moment = t.key.starts_with("optimizer.state.exp_avg.");
        let parts =
            unplace(&on_disk, &t.shape, |k| gated(k) && !(fused_experts && fused(k))).map_err(|p| refuse(&t.key, p))?;
        for part in parts {
            let layout = param_layout(&part.key, None);
            let keep_fused = fused_experts && fused(&part.key);
            if keep_fused && fused_etp.is_none() {
                return Err(refuse(
                    &t.key,
                    "Megatron-FSDP keeps this parameter fused in a layout of the expert-TP size (gpt-oss's expert \
                     fc1), which is not known here",
                ));
            }
            if moment {
                let live = match layout.as_ref().and_then(|l| l.section.as_ref()) {
                    Some((_, index, suffixes)) => part.key.strip_suffix(suffixes[*index]).unwrap_or(&part.key),
                    None => &part.key,
                };
                let expert = layout.as_ref().is_some_and(|l| l.expert.is_some());
                optimized.insert(live.to_string(), (part.shape.len(), expert));
            }
            let elem = t.dtype.size() as u64;
            let mut chunks: Vec<StoredChunk> =
                t.chunks.iter().filter_map(|c| piece_of(c, &part.origin, &part.shape, elem)).collect();
            if let (true, Some(etp)) = (keep_fused, fused_etp) {
                chunks = fused_rows(chunks, &part.shape, etp, elem).map_err(|p| refuse(&t.key, p))?;
            }
            tensors.push(StoredTensor { key: name_of(&part.key), dtype: t.dtype, shape: part.shape, chunks });
        }
    }
    if !masters.is_empty() {
        notes.push(format!(
            "{} parameters taken from their fp32 masters (optimizer.state.param), as Megatron-FSDP keeps them; \
             the rounded model weights left out",
            masters.len()
        ));
    }

    // Top-level items from the common state; the DCP's bytes items Megatron-FSDP does not save
    // are left out.
    let mut common: Option<Value> = read_common_pt(&checkpoint.dir)?;
    let mut dropped: BTreeMap<&str, u64> = BTreeMap::new();
    // Each (pp, tp) rank's RNG `ShardedObject`, unpickled: its leaves become items.
    let mut rng_values: Vec<(usize, String, Value)> = Vec::new();
    for (i, o) in checkpoint.objects.iter().enumerate() {
        let base = o.key.split_once("/shard_").map_or(o.key.as_str(), |(k, _)| k);
        if base == "common_state" {
            if common.is_none() {
                let path = checkpoint.dir.join(&*o.file);
                let f = File::open(&path).map_err(|error| {
                    TrainingError::Checkpoint(crate::checkpoint::CheckpointError::Io { path, action: "open", error })
                })?;
                common = Some(
                    read_object_archive(&f, o.offset, o.length)
                        .map_err(|source| TrainingError::Object { key: o.key.clone(), source })?,
                );
            }
            continue;
        }
        if base == "rng_state" && !model_only {
            let ItemKind::Rng { pp, tp } = classify_torch_dist(&o.key) else {
                return Err(refuse(&o.key, "an RNG state whose key does not say its (pp, tp) rank"));
            };
            rng_values.push((i, rng_rank_part(pp, tp), read_object(&checkpoint, i)?));
            continue;
        }
        let what = if base.ends_with("._extra_state") {
            "`_extra_state` objects"
        } else if base == "rng_state" {
            continue;
        } else if base.starts_with("rerun_state_machine") {
            "rerun states"
        } else {
            return Err(refuse(&checkpoint.objects[i].key, "a bytes item Shardline does not know how to translate"));
        };
        *dropped.entry(what).or_default() += 1;
    }
    for (what, n) in dropped {
        notes.push(format!("{n} {what} left out: Megatron-FSDP's fsdp_dtensor does not save them"));
    }
    let mut inline = Vec::new();
    let mut args = None;
    let mut objects: Vec<(Vec<PathElem>, usize)> = Vec::new();
    let mut push = |path: Vec<PathElem>, v: &Value, inline: &mut Vec<Vec<u8>>| -> Result<(), TrainingError> {
        let pkl = dumps(v).map_err(|p| refuse(&flat_key(&path), p))?;
        objects.push((path, inline.len()));
        inline.push(encode_pickle_archive(&pkl));
        Ok(())
    };
    let entries = common.as_ref().and_then(common_entries).unwrap_or(&[]);
    check_version(entries, &mut notes)?;
    for (k, v) in entries {
        let Some(name) = k.as_str() else { continue };
        match name {
            "content_metadata" => {
                notes.push("`content_metadata` left out: it describes torch_dist's own layout".to_string());
                continue;
            }
            "args" => args = Some(TrainingArgs::from_value(v)),
            "optimizer" if !optimized.is_empty() => {
                let groups = saved_groups(v).map_err(|p| refuse("optimizer", p))?;
                for (live, &(ndim, expert)) in &optimized {
                    let group = group_of(&groups, live, ndim, expert).map_err(|p| refuse("optimizer", p))?;
                    for (field, value) in group {
                        let Some(field) = field.as_str().filter(|f| *f != "params") else { continue };
                        let path = ["optimizer", "param_to_group_meta", &format!("{OPTIMIZER_MODULES}{live}"), field]
                            .map(|p| PathElem::Key(p.to_string()));
                        push(path.to_vec(), value, &mut inline)?;
                    }
                }
                continue;
            }
            "optimizer" | "rng_state" | "rerun_state_machine" => {
                notes.push(format!("`{name}` of the common state left out (not translated)"));
                continue;
            }
            _ => {}
        }
        // DCP flattens nested dicts (the scheduler's state) into an item per leaf.
        let mut leaves = Vec::new();
        flatten(vec![PathElem::Key(name.to_string())], v, &mut leaves);
        for (path, leaf) in leaves {
            push(path, leaf, &mut inline)?;
        }
    }
    // RNG states, as Megatron-FSDP keeps them: a tensor item or a bytes item per leaf.
    let mut rng_paths: BTreeMap<String, Vec<PathElem>> = BTreeMap::new();
    for (i, rank_part, value) in &rng_values {
        let o = &checkpoint.objects[*i];
        let path = checkpoint.dir.join(&*o.file);
        let f = File::open(&path).map_err(|error| {
            TrainingError::Checkpoint(crate::checkpoint::CheckpointError::Io { path, action: "open", error })
        })?;
        for (path, leaf) in read_rng_object(o, &f, value, rank_part)? {
            match leaf {
                RngLeaf::Tensor(t) => {
                    rng_paths.insert(t.key.clone(), path);
                    tensors.push(t);
                }
                RngLeaf::Value(v) => push(path, v, &mut inline)?,
            }
        }
    }
    // Sorted once every tensor is in, the RNG states' too.
    tensors.sort_by(|a, b| a.key.cmp(&b.key));
    if !optimized.is_empty() && !entries.iter().any(|(k, _)| k.as_str() == Some("optimizer")) {
        // As `reshard --target torch_dist` writes moments that came without group settings.
        notes.push(
            "optimizer moments without the optimizer's param_groups in the common state: translated without \
             param_to_group_meta"
                .to_string(),
        );
    }

    let mut items = Vec::new();
    let mut data = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let chunks = t.chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
        items.push(SourceItem {
            key: t.key.clone(),
            path: rng_paths.remove(&t.key).unwrap_or_else(|| tensor_path(&t.key)),
            tensor: Some(SourceTensorMeta { dtype: t.dtype, shape: t.shape.clone(), chunks }),
        });
        data.push(ItemData::Tensor(i));
    }
    for (path, j) in objects {
        items.push(SourceItem { key: flat_key(&path), path, tensor: None });
        data.push(ItemData::Inline(j));
    }
    let checkpoint = Checkpoint { tensors, objects: Vec::new(), planner_data: BTreeMap::new(), ..checkpoint };
    Ok(Translated { checkpoint, items, data, inline, args, notes })
}

/// The common state's `checkpoint_version`: Megatron-Core writes 3.0 (a version below 2 would
/// mean the legacy QKV order, one above 3 a layout this reader was not written for).
fn check_version(entries: &[(Value, Value)], notes: &mut Vec<String>) -> Result<(), TrainingError> {
    let version = entries.iter().find(|(k, _)| k.as_str() == Some("checkpoint_version")).map(|(_, v)| v);
    let number = match version {
        None => {
            notes.push("the common state has no `checkpoint_version`; read as Megatron-Core's 3.0".to_string());
            return Ok(());
        }
        Some(Value::Float(f)) => Some(*f),
        Some(Value::Int(i)) => Some(*i as f64),
        Some(_) => None,
    };
    match number {
        Some(v) if (3.0..4.0).contains(&v) => Ok(()),
        _ => Err(refuse(
            "checkpoint_version",
            format!(
                "the common state's checkpoint_version is {}; Shardline reads Megatron-Core's 3.x (older versions \
                 order QKV differently, newer ones are not known)",
                version.map_or_else(String::new, |v| v.repr(40))
            ),
        )),
    }
}

/// The prefix Megatron-FSDP's optimizer keys its parameters by (the DDP, FSDP and Float16Module
/// wrappers' `module.`s).
const OPTIMIZER_MODULES: &str = "module.module.module.";
const OPTIMIZER_PREFIX: &str = "optimizer.state.module.module.module.";

/// Whether a `fully_reshardable` state is the fp32 master (`param`; `fp32_param` for a
/// non-distributed optimizer, which Megatron-Core accepts as its alias).
fn is_master(state: &str) -> bool {
    state == "param" || state == "fp32_param"
}

/// The `planner_data` path of a translated tensor, as Megatron-FSDP nests its state dict.
fn tensor_path(key: &str) -> Vec<PathElem> {
    if let Some(rest) = key.strip_prefix("optimizer.state.") {
        if let Some((param, state)) = rest.rsplit_once('.') {
            return ["optimizer", "state", param, state].map(|p| PathElem::Key(p.to_string())).to_vec();
        }
    }
    let rest = key.strip_prefix("model.").unwrap_or(key).to_string();
    vec![PathElem::Key("model".into()), PathElem::Key(rest)]
}

/// The leaves of `v` under `path`: a dict with string keys is descended into, anything else is a leaf.
fn flatten<'v>(path: Vec<PathElem>, v: &'v Value, out: &mut Vec<(Vec<PathElem>, &'v Value)>) {
    match v.as_dict() {
        Some(items) if !items.is_empty() && items.iter().all(|(k, _)| k.as_str().is_some()) => {
            for (k, child) in items {
                let mut p = path.clone();
                p.push(PathElem::Key(k.as_str().unwrap_or_default().to_string()));
                flatten(p, child, out);
            }
        }
        _ => out.push((path, v)),
    }
}

/// The piece of the stored chunk `c` that the planned tensor at `origin` (of `shape`) holds,
/// read in place: its box in the planned tensor's coordinates, its bytes one run of the chunk's
/// (see `share_of_box`).
fn piece_of(c: &StoredChunk, origin: &[u64], shape: &[u64], elem: u64) -> Option<StoredChunk> {
    let share = share_of_box(&c.offsets, &c.sizes, origin, shape)?;
    let at = share.first_in_box.iter().zip(&c.sizes).fold(0u64, |at, (f, s)| at * s + f);
    let numel: u64 = share.sizes.iter().product();
    Some(StoredChunk {
        offsets: share.offsets,
        sizes: share.sizes,
        file: c.file.clone(),
        data_offset: c.data_offset + at * elem,
        data_len: numel * elem,
    })
}
