//! A Megatron-Core `torch_dist` checkpoint read as the reshard core reads a Megatron-FSDP one:
//! every on-disk key taken apart into the planned tensors it holds (the dialect's placement read
//! backwards, `shardline_layout::dialect::unplace`) under their `fsdp_dtensor` names, each stored
//! chunk cut into the pieces that meet them. A piece of a chunk is one contiguous run of its
//! bytes (a planned tensor covers one layer and expert index and a run of rows, whole trailing
//! dims), so it is read in place: no byte is copied to translate.
//!
//! The common state (`common.pt`, or the `common_state` item) becomes the top-level items an
//! `fsdp_dtensor` checkpoint holds (`args`, `iteration`, …), each pickled again; what
//! Megatron-FSDP does not save (`_extra_state`, the rerun state, `content_metadata`) is left
//! out, and said so.

use std::collections::BTreeMap;
use std::fs::File;

use shardline_layout::dialect::{share_of_box, unplace};
use shardline_layout::reshard::{
    classify_torch_dist, param_layout, ChunkBox, ItemKind, PathElem, SourceItem, SourceTensorMeta,
};

use super::common_state::{common_entries, read_common_pt};
use super::{ItemData, TrainingArgs, TrainingError};
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
pub(super) fn translate(checkpoint: Checkpoint, model_only: bool) -> Result<Translated, TrainingError> {
    let mut notes = Vec::new();
    let mut tensors: Vec<StoredTensor> = Vec::new();
    for t in &checkpoint.tensors {
        match classify_torch_dist(&t.key) {
            ItemKind::Model { .. } => {}
            _ if model_only => continue,
            ItemKind::OptimizerState { .. } => {
                return Err(refuse(
                    &t.key,
                    "optimizer state is not translated yet: reshard the model (re-save with --no-save-optim), or keep the dialect",
                ))
            }
            _ if t.key.starts_with("optimizer.distributed.") => {
                return Err(refuse(
                    &t.key,
                    "a `dp_reshardable` distributed-optimizer bucket: its flat buckets' mapping to parameters is not in \
                     the checkpoint (it follows Megatron's buffer layout of that run), so it is not guessed; re-save \
                     with `--dist-ckpt-optim-fully-reshardable`, or translate the model alone after loading with \
                     `--no-load-optim`",
                ))
            }
            _ => return Err(refuse(&t.key, "a tensor Shardline does not know how to translate")),
        }
        let parts = unplace(&t.key, &t.shape, gated).map_err(|p| refuse(&t.key, p))?;
        for part in parts {
            if param_layout(&part.key, None).is_some_and(|l| l.tp_dependent) {
                return Err(refuse(
                    &t.key,
                    "Megatron-FSDP keeps this parameter fused in an expert-TP-dependent layout (gpt-oss's expert fc1); not translated yet",
                ));
            }
            let elem = t.dtype.size() as u64;
            let chunks = t.chunks.iter().filter_map(|c| piece_of(c, &part.origin, &part.shape, elem)).collect();
            tensors.push(StoredTensor {
                key: format!("{MODEL_PREFIX}{}", part.key),
                dtype: t.dtype,
                shape: part.shape,
                chunks,
            });
        }
    }
    tensors.sort_by(|a, b| a.key.cmp(&b.key));

    // Top-level items from the common state; the DCP's bytes items Megatron-FSDP does not save
    // are left out.
    let mut common: Option<Value> = read_common_pt(&checkpoint.dir)?;
    let mut dropped: BTreeMap<&str, u64> = BTreeMap::new();
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
        let what = if base.ends_with("._extra_state") {
            "`_extra_state` objects"
        } else if base.starts_with("rng_state") {
            "RNG states"
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
    let mut objects: Vec<(String, usize)> = Vec::new();
    if let Some(entries) = common.as_ref().and_then(common_entries) {
        for (k, v) in entries {
            let Some(name) = k.as_str() else { continue };
            match name {
                "content_metadata" => {
                    notes.push("`content_metadata` left out: it describes torch_dist's own layout".to_string());
                    continue;
                }
                "args" => args = Some(TrainingArgs::from_value(v)),
                "optimizer" | "rng_state" | "rerun_state_machine" => {
                    notes.push(format!("`{name}` of the common state left out (not translated yet)"));
                    continue;
                }
                _ => {}
            }
            let pkl = dumps(v).map_err(|p| refuse(name, p))?;
            objects.push((name.to_string(), inline.len()));
            inline.push(encode_pickle_archive(&pkl));
        }
    }

    let mut items = Vec::new();
    let mut data = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let chunks = t.chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
        let rest = t.key.strip_prefix("model.").unwrap_or(&t.key).to_string();
        items.push(SourceItem {
            key: t.key.clone(),
            path: vec![PathElem::Key("model".into()), PathElem::Key(rest)],
            tensor: Some(SourceTensorMeta { dtype: t.dtype, shape: t.shape.clone(), chunks }),
        });
        data.push(ItemData::Tensor(i));
    }
    for (name, j) in objects {
        items.push(SourceItem { key: name.clone(), path: vec![PathElem::Key(name)], tensor: None });
        data.push(ItemData::Inline(j));
    }
    let checkpoint = Checkpoint { tensors, objects: Vec::new(), planner_data: BTreeMap::new(), ..checkpoint };
    Ok(Translated { checkpoint, items, data, inline, args, notes })
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
