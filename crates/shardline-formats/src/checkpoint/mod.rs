//! Reading a written checkpoint back — DCP (`.metadata` + `.distcp`, ours or torch's) or
//! DCP-sharded safetensors — into one view: keys, global shapes, and where every chunk's bytes are.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardline_layout::{DType, TorchtitanTarget, TorchtitanVersion};
use thiserror::Error;

use crate::dcp_metadata::{DcpMetadataError, PathElem};
use crate::safetensors::{read_header, SafetensorsError};
use crate::torch_save::TorchSaveError;

/// Which layout a checkpoint directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    Dcp,
    DcpSafetensors,
}

/// One stored chunk and where its raw bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredChunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// File name relative to the checkpoint directory (shared by the chunks of one file).
    pub file: Arc<str>,
    /// Absolute offset of the chunk's first data byte in `file`.
    pub data_offset: u64,
    pub data_len: u64,
}

/// A tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredTensor {
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub chunks: Vec<StoredChunk>,
}

/// A bytes item (a `torch.save`d Python object) and where its archive is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredObject {
    pub key: String,
    /// File name relative to the checkpoint directory.
    pub file: Arc<str>,
    pub offset: u64,
    pub length: u64,
}

/// A checkpoint directory, read.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub format: CheckpointFormat,
    /// Sorted by key.
    pub tensors: Vec<StoredTensor>,
    /// Non-tensor (bytes) items, in `.metadata` order.
    pub objects: Vec<StoredObject>,
    /// Every key's path in the saved state dict (`planner_data`); empty when the checkpoint
    /// has none (DCP-safetensors, or a `.metadata` written without it).
    pub planner_data: BTreeMap<String, Vec<PathElem>>,
}

/// Why a checkpoint cannot be read.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },
    #[error(
        "{0} holds no checkpoint: no `.metadata` and no `*.safetensors` (an interrupted write leaves no `.metadata`)"
    )]
    NotACheckpoint(PathBuf),
    #[error("{path}: {source}")]
    Metadata { path: PathBuf, source: DcpMetadataError },
    #[error("`{key}` chunk at offsets {offsets:?} in {file} (bytes {offset}..+{length}): {source}")]
    Item { key: String, offsets: Vec<u64>, file: String, offset: u64, length: u64, source: TorchSaveError },
    #[error("`{key}` chunk at offsets {offsets:?}: {message}")]
    Inconsistent { key: String, offsets: Vec<u64>, message: String },
    #[error("`{key}`: no storage entry for chunk at offsets {offsets:?}")]
    MissingStorage { key: String, offsets: Vec<u64> },
    #[error("storage file name `{0}` escapes the checkpoint directory")]
    PathEscapes(String),
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error("{file}: DCP_SHARDING_INFO: {message}")]
    ShardingInfo { file: String, message: String },
    #[error("{0}: names neither `release` nor an iteration number: {1:?}")]
    Tracker(PathBuf, String),
    #[error(
        "{0} is still being written (its `.incomplete` marker is there): a NeMo Automodel save that did not finish"
    )]
    Incomplete(PathBuf),
}

/// Megatron-LM's tracker file in a save directory.
pub const MEGATRON_TRACKER: &str = "latest_checkpointed_iteration.txt";

/// The checkpoint directory a Megatron-LM save directory's tracker names (`release/`, or
/// `iter_0000123/` for `123`); `None` when `dir` has no tracker.
pub fn megatron_checkpoint_dir(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let tracker = dir.join(MEGATRON_TRACKER);
    let text = match fs::read_to_string(&tracker) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CheckpointError::Io { path: tracker, action: "read", error: e }),
    };
    match tracked_dir(&text) {
        Some(name) => Ok(Some(dir.join(name))),
        None => Err(CheckpointError::Tracker(tracker, text.trim().chars().take(40).collect())),
    }
}

/// The checkpoint directory a Megatron-LM tracker's text names: `release`, or `iter_%07d` of
/// the iteration it holds.
pub fn tracked_dir(text: &str) -> Option<String> {
    let text = text.trim();
    if text == "release" {
        return Some(text.to_string());
    }
    text.parse::<u64>().ok().map(|n| format!("iter_{n:07}"))
}

fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> CheckpointError + 'a {
    move |error| CheckpointError::Io { path: path.to_path_buf(), action, error }
}

/// Opens the checkpoint in `dir`, locating every chunk's bytes (the bytes themselves are not read).
pub fn open_checkpoint(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    open_any(dir, None)
}

/// [`open_checkpoint`] of the keys `keep` accepts only (`export` reads the model, not the
/// optimizer's moments); the others are neither located nor read.
pub fn open_checkpoint_keys(dir: &Path, keep: impl Fn(&str) -> bool) -> Result<Checkpoint, CheckpointError> {
    open_any(dir, Some(&keep))
}

/// The DCP checkpoint in `dir` (not a save directory or folder naming one) with no tensor chunk
/// located: each chunk's `data_offset`/`data_len` stand for its whole storage item until
/// [`locate_chunks`] finds the bytes of those a reader needs. For a sparse local copy of a
/// checkpoint holding `.metadata`, its bytes items and only the items one task reads.
pub fn open_checkpoint_unlocated(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    dcp::open_dcp_as(dir, None, false)
}

/// The directory holding the checkpoint `dir` names: `dir` itself; for a Megatron-LM save
/// directory, the checkpoint its tracker names; for a torchtitan checkpoint folder, its latest
/// complete `step-N` (one level, never further).
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf, CheckpointError> {
    if dir.join(".metadata").is_file() {
        return Ok(dir.to_path_buf());
    }
    if let Some(d) = megatron_checkpoint_dir(dir)? {
        return Ok(d);
    }
    if let Some(d) = automodel_model_dir(dir)? {
        return Ok(d);
    }
    Ok(torchtitan_latest_step(dir).unwrap_or_else(|| dir.to_path_buf()))
}

/// NeMo Automodel's save marker: present in `epoch_E_step_S/` while the save is written.
pub const AUTOMODEL_INCOMPLETE: &str = ".incomplete";

/// The model weights of a NeMo Automodel checkpoint `epoch_E_step_S/`: its `model/` directory
/// (HF-named sharded safetensors, or DCP), when it has one; an error while `.incomplete` says
/// the save did not finish.
pub fn automodel_model_dir(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let model = dir.join("model");
    if !model.is_dir() {
        return Ok(None);
    }
    if dir.join(AUTOMODEL_INCOMPLETE).exists() {
        return Err(CheckpointError::Incomplete(dir.to_path_buf()));
    }
    Ok(Some(model))
}

/// What a torchtitan checkpoint was written as, read off its keys: its model keys sit at the top
/// level from `tok_embeddings.weight`; the dtype is its embedding's. The version is the oldest
/// whose names it holds (`TorchtitanVersion`'s rows): `routed_experts` is main's, the shape
/// suffixes `w1_EFD` 2026-05-27's, `lm_head` 2026-04-27's, `qkv_linear` 2026-04-16's. Rows whose
/// names a model does not use (a dense model's experts) name it alike, and give the same plan.
/// `None` for any other checkpoint.
pub fn torchtitan_target(checkpoint: &Checkpoint) -> Option<TorchtitanTarget> {
    let embed = checkpoint.tensors.iter().find(|t| t.key == "tok_embeddings.weight")?;
    let has = |f: &dyn Fn(&str) -> bool| checkpoint.tensors.iter().any(|t| f(&t.key));
    let version = if has(&|k| k.contains(".moe.routed_experts.")) {
        TorchtitanVersion::Main
    } else if has(&|k| k.contains(".moe.experts.w1_EFD")) {
        TorchtitanVersion::V2026_05_27
    } else if has(&|k| k == "lm_head.weight") {
        // Main when the model has no routed experts to tell the rows since apart.
        let old_experts = has(&|k| k.contains(".moe.experts."));
        if old_experts {
            TorchtitanVersion::V2026_04_27
        } else {
            TorchtitanVersion::Main
        }
    } else if has(&|k| k.contains(".qkv_linear.")) {
        TorchtitanVersion::V2026_04_16
    } else {
        TorchtitanVersion::V2025_12
    };
    Some(TorchtitanTarget { version, dtype: embed.dtype })
}

/// [`torchtitan_target`] of the checkpoint `dir` names, reading only the keys it looks at.
pub fn torchtitan_target_of(dir: &Path) -> Result<Option<TorchtitanTarget>, CheckpointError> {
    let keep = |k: &str| {
        k == "tok_embeddings.weight"
            || k == "lm_head.weight"
            || k.starts_with("layers.0.attention.")
            || (k.starts_with("layers.") && k.contains(".moe.") && k.contains("experts."))
    };
    Ok(torchtitan_target(&open_checkpoint_keys(dir, keep)?))
}

/// Where torchtitan finds its seed under `checkpoint.folder`: step 0, which it loads model-only.
pub const TORCHTITAN_SEED_DIR: &str = "step-0";

/// The `step-N` of largest `N` under `dir` that holds a `.metadata` (torchtitan loads the latest
/// step whose save completed).
pub fn torchtitan_latest_step(dir: &Path) -> Option<PathBuf> {
    fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let step: u64 = name.to_str()?.strip_prefix("step-")?.parse().ok()?;
            e.path().join(".metadata").is_file().then(|| (step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, path)| path)
}

fn open_any(dir: &Path, keep: Option<&dyn Fn(&str) -> bool>) -> Result<Checkpoint, CheckpointError> {
    let dir = &resolve_checkpoint_dir(dir)?;
    if dir.join(".metadata").is_file() {
        return dcp::open_dcp(dir, keep);
    }
    let mut files: Vec<String> = fs::read_dir(dir)
        .map_err(io_err(dir, "list checkpoint directory"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with('.'))
        .collect();
    if files.is_empty() {
        return Err(CheckpointError::NotACheckpoint(dir.to_path_buf()));
    }
    files.sort();
    open_dcp_safetensors(dir, &files)
}

fn safe_name(name: &str) -> Result<(), CheckpointError> {
    let p = Path::new(name);
    if name.is_empty() || p.is_absolute() || p.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
        return Err(CheckpointError::PathEscapes(name.to_string()));
    }
    Ok(())
}

fn open_dcp_safetensors(dir: &Path, files: &[String]) -> Result<Checkpoint, CheckpointError> {
    let mut by_key: BTreeMap<String, StoredTensor> = BTreeMap::new();
    for name in files {
        let header = read_header(dir.join(name))?;
        let info: BTreeMap<String, serde_json::Value> = match header.metadata().get("DCP_SHARDING_INFO") {
            Some(s) => serde_json::from_str(s).map_err(|e| CheckpointError::ShardingInfo {
                file: name.clone(),
                message: format!("not a JSON object: {e}"),
            })?,
            None => BTreeMap::new(),
        };
        for t in header.tensors() {
            let offsets: Vec<u64> = match info.get(&t.name) {
                None if info.is_empty() => vec![0; t.shape.len()],
                None => {
                    return Err(CheckpointError::ShardingInfo {
                        file: name.clone(),
                        message: format!("no entry for `{}`", t.name),
                    })
                }
                Some(v) => v
                    .get("saved_offsets")
                    .and_then(|o| o.as_array())
                    .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
                    .filter(|o| o.len() == t.shape.len())
                    .ok_or_else(|| CheckpointError::ShardingInfo {
                        file: name.clone(),
                        message: format!(
                            "`{}`: saved_offsets must list {} non-negative integers",
                            t.name,
                            t.shape.len()
                        ),
                    })?,
            };
            let entry = by_key.entry(t.name.clone()).or_insert_with(|| StoredTensor {
                key: t.name.clone(),
                dtype: t.dtype,
                shape: vec![0; t.shape.len()],
                chunks: Vec::new(),
            });
            if entry.dtype != t.dtype || entry.shape.len() != t.shape.len() {
                return Err(CheckpointError::Inconsistent {
                    key: t.name.clone(),
                    offsets,
                    message: format!(
                        "{name} holds {} rank {} but another file {} rank {}",
                        t.dtype,
                        t.shape.len(),
                        entry.dtype,
                        entry.shape.len()
                    ),
                });
            }
            // Like torch's reader: the global size is the element-wise max of offset + size.
            for (g, (o, s)) in entry.shape.iter_mut().zip(offsets.iter().zip(&t.shape)) {
                *g = (*g).max(o.saturating_add(*s));
            }
            entry.chunks.push(StoredChunk {
                offsets,
                sizes: t.shape.clone(),
                file: name.as_str().into(),
                data_offset: t.file_offset,
                data_len: t.byte_len,
            });
        }
    }
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        format: CheckpointFormat::DcpSafetensors,
        tensors: by_key.into_values().collect(),
        objects: Vec::new(),
        planner_data: BTreeMap::new(),
    })
}

mod blocks;
mod dcp;
mod ranges;
mod scan;
mod slices;
pub use blocks::BlockReader;
pub use dcp::locate_chunks;
pub use ranges::storage_ranges;
pub use scan::{scan_checkpoint, FileSummary, ScanSummary, TensorSummary};
pub use slices::{read_box, read_box_from, ChunkReadError, SliceRead};

#[cfg(test)]
mod tests;
