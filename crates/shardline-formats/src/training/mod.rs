//! Training checkpoints: a Megatron-FSDP (`fsdp_dtensor`) DCP directory written by PyTorch —
//! parameters, optimizer moments, plain tensors and bytes items — read as the reshard core's
//! items (`open`), what its `args` says (`args`), and written again for another mesh (`write`).

mod args;
pub mod automodel;
pub mod common_state;
mod copier;
mod export;
mod fused;
mod param_groups;
mod rng;
pub mod save_dir;
mod split;
mod summary;
mod torch_dist_save;
mod translate;
mod write;
mod write_hf;

use std::fs::File;
use std::path::{Path, PathBuf};

use shardline_layout::reshard::{ChunkBox, PathElem, ReshardError, SourceItem, SourceTensorMeta};
use thiserror::Error;

pub use args::TrainingArgs;
pub use export::{commit_export, write_export, write_export_part, ExportOptions, ExportReport};
pub use split::{commit_resharded, commit_resharded_listed, rank_source_ranges, rank_sources, write_resharded_ranks};
pub use summary::{summarize_automodel, summarize_training, TrainingSummary};
pub use write::{write_resharded, ReshardReport};
pub use write_hf::write_resharded_hf_storage;

use crate::checkpoint::{
    locate_chunks, open_checkpoint, open_checkpoint_unlocated, Checkpoint, CheckpointError, CheckpointFormat,
    StoredChunk,
};
use crate::execute::ExecuteError;
use crate::pickle::Value;
use crate::torch_save::{read_object_archive, TorchSaveError};

/// Why a training checkpoint cannot be read or resharded.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TrainingError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{0} is a DCP-safetensors checkpoint; training checkpoints are DCP (`.metadata` + `.distcp`)")]
    NotDcp(PathBuf),
    #[error("{0}/.metadata has no planner_data: the saved state dict's key paths are unknown")]
    NoPlannerData(PathBuf),
    #[error("`{key}` has no planner_data path")]
    NoPath { key: String },
    #[error("`{key}`: {source}")]
    Object { key: String, source: TorchSaveError },
    #[error("cannot reshard: {0}")]
    Reshard(#[from] ReshardError),
    #[error("`{key}` cannot be read whole: {problem}")]
    Tiling { key: String, problem: String },
    /// The release's file numbering (`fqn_to_file_index_mapping.json`) does not cover the export.
    #[error("the release's file numbering: {0}")]
    FileNumbers(String),
    #[error(transparent)]
    Write(#[from] ExecuteError),
    #[error(transparent)]
    Safetensors(#[from] crate::safetensors::SafetensorsError),
    #[error("cannot translate `{key}` from torch_dist: {problem}")]
    Translate { key: String, problem: String },
}

/// Where an item's bytes are in the source checkpoint.
#[derive(Clone, Debug)]
pub enum ItemData {
    /// Index into [`Checkpoint::tensors`].
    Tensor(usize),
    /// Index into [`Checkpoint::objects`].
    Object(usize),
    /// Index into [`TrainingCheckpoint::inline`]: an item held in memory (a `torch_dist`
    /// checkpoint's common state, carried item by item).
    Inline(usize),
}

/// A training checkpoint, opened: its items for the reshard core, in the same order as `data`.
#[derive(Debug)]
pub struct TrainingCheckpoint {
    pub checkpoint: Checkpoint,
    pub items: Vec<SourceItem>,
    pub data: Vec<ItemData>,
    /// `args`, when the checkpoint has it (Megatron-LM's trainer writes it; Megatron-Bridge does not).
    pub args: Option<TrainingArgs>,
    /// `torch.save` archives of the [`ItemData::Inline`] items.
    pub inline: Vec<Vec<u8>>,
    /// What reading it decided that its user should know (items left out of a translation).
    pub notes: Vec<String>,
    /// A translated `torch_dist` checkpoint: the expert-TP size its fused parameters were read in,
    /// whatever `args` says the job ran with.
    pub fused_etp: Option<u64>,
}

impl TrainingCheckpoint {
    /// Opens `dir`, checking every chunk's and bytes item's archive (see [`open_checkpoint`]).
    /// A Megatron-Core `torch_dist` checkpoint (or save directory) reads as the `fsdp_dtensor`
    /// checkpoint it translates to (see `translate`).
    pub fn open(dir: &Path) -> Result<TrainingCheckpoint, TrainingError> {
        Self::open_for(dir, None)
    }

    /// [`TrainingCheckpoint::open`], a `torch_dist` checkpoint read for a target of expert-TP
    /// size `etp`: parameters Megatron-FSDP keeps fused in a layout of that size (gpt-oss's
    /// expert fc1) are read in it ([`TrainingCheckpoint::fused_etp`]).
    pub fn open_for(dir: &Path, etp: Option<u64>) -> Result<TrainingCheckpoint, TrainingError> {
        let checkpoint = open_checkpoint(dir)?;
        if checkpoint.format != CheckpointFormat::Dcp {
            return Err(TrainingError::NotDcp(dir.to_path_buf()));
        }
        if common_state::is_torch_dist(&checkpoint.dir) {
            let t = translate::translate(checkpoint, false, etp)?;
            return Ok(TrainingCheckpoint {
                checkpoint: t.checkpoint,
                items: t.items,
                data: t.data,
                args: t.args,
                inline: t.inline,
                notes: t.notes,
                fused_etp: etp,
            });
        }
        Self::from_dcp(checkpoint, dir)
    }

    /// A Megatron-FSDP (`fsdp_dtensor`) checkpoint in `dir` with no tensor chunk located (see
    /// [`open_checkpoint_unlocated`]): what one task of a reshard split by rank plans from, with
    /// only `.metadata` and the bytes items at hand, before it fetches and locates the chunks it
    /// reads ([`rank_sources`], [`TrainingCheckpoint::locate`]).
    pub fn open_unlocated(dir: &Path) -> Result<TrainingCheckpoint, TrainingError> {
        let checkpoint = open_checkpoint_unlocated(dir)?;
        if common_state::is_torch_dist(&checkpoint.dir) {
            return Err(TrainingError::Translate {
                key: dir.display().to_string(),
                problem: "a torch_dist checkpoint is translated whole, not read unlocated".into(),
            });
        }
        Self::from_dcp(checkpoint, dir)
    }

    /// Finds the bytes of the chunks `wanted` (`(tensor, chunk)` of [`Self::checkpoint`]).
    pub fn locate(&mut self, wanted: &[(usize, usize)]) -> Result<(), TrainingError> {
        Ok(locate_chunks(&mut self.checkpoint, wanted)?)
    }

    fn from_dcp(checkpoint: Checkpoint, dir: &Path) -> Result<TrainingCheckpoint, TrainingError> {
        if checkpoint.planner_data.is_empty() {
            return Err(TrainingError::NoPlannerData(dir.to_path_buf()));
        }
        let path_of = |key: &str| {
            checkpoint.planner_data.get(key).cloned().ok_or_else(|| TrainingError::NoPath { key: key.to_string() })
        };
        let mut items = Vec::new();
        let mut data = Vec::new();
        for (i, t) in checkpoint.tensors.iter().enumerate() {
            let chunks =
                t.chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
            items.push(SourceItem {
                key: t.key.clone(),
                path: path_of(&t.key)?,
                tensor: Some(SourceTensorMeta { dtype: t.dtype, shape: t.shape.clone(), chunks }),
            });
            data.push(ItemData::Tensor(i));
        }
        let mut args = None;
        for (i, o) in checkpoint.objects.iter().enumerate() {
            let path = path_of(&o.key)?;
            if path.len() == 1 && o.key == "args" {
                args = Some(TrainingArgs::from_value(&read_object(&checkpoint, i)?));
            }
            items.push(SourceItem { key: o.key.clone(), path, tensor: None });
            data.push(ItemData::Object(i));
        }
        Ok(TrainingCheckpoint { checkpoint, items, data, args, inline: Vec::new(), notes: Vec::new(), fused_etp: None })
    }

    /// An HF-storage checkpoint (sharded safetensors with `DCP_SHARDING_INFO`, as NeMo Automodel
    /// saves `model/`) as the reshard core's items: these files record no planner paths, so each
    /// tensor's path is its name alone, a top-level key.
    pub fn open_hf_storage(dir: &Path) -> Result<TrainingCheckpoint, TrainingError> {
        let checkpoint = open_checkpoint(dir)?;
        let items = checkpoint
            .tensors
            .iter()
            .map(|t| SourceItem {
                key: t.key.clone(),
                path: vec![PathElem::Key(t.key.clone())],
                tensor: Some(SourceTensorMeta {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    chunks: t
                        .chunks
                        .iter()
                        .map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() })
                        .collect(),
                }),
            })
            .collect();
        let data = (0..checkpoint.tensors.len()).map(ItemData::Tensor).collect();
        Ok(TrainingCheckpoint {
            checkpoint,
            items,
            data,
            args: None,
            inline: Vec::new(),
            notes: Vec::new(),
            fused_etp: None,
        })
    }

    /// The model parameters of a Megatron-Core `torch_dist` checkpoint (or save directory) under
    /// their `fsdp_dtensor` names (`model.module.…`), read in place: what `export` reads. Other
    /// items (optimizer state, RNG, the common state) are not read.
    /// Fused parameters are read for expert-TP size 1, where the fused layout is `[gate; up]`
    /// itself: export with `--etp 1`.
    pub fn open_torch_dist_model(dir: &Path) -> Result<Checkpoint, TrainingError> {
        Ok(translate::translate(open_checkpoint(dir)?, true, Some(1))?.checkpoint)
    }

    /// The stored chunks of the tensor item `item`.
    pub fn chunks_of(&self, item: usize) -> &[StoredChunk] {
        match self.data[item] {
            ItemData::Tensor(t) => &self.checkpoint.tensors[t].chunks,
            ItemData::Object(_) | ItemData::Inline(_) => &[],
        }
    }
}

/// The rank that wrote a DCP file, from torch's name for it (`__<rank>_<n>.distcp`).
pub fn rank_of_file(name: &str) -> Option<u64> {
    name.strip_prefix("__")?.split('_').next()?.parse().ok()
}

fn read_object(checkpoint: &Checkpoint, object: usize) -> Result<Value, TrainingError> {
    let o = &checkpoint.objects[object];
    let path = checkpoint.dir.join(&*o.file);
    let f = File::open(&path).map_err(|error| {
        TrainingError::Checkpoint(CheckpointError::Io { path: path.clone(), action: "open rank file", error })
    })?;
    read_object_archive(&f, o.offset, o.length).map_err(|source| TrainingError::Object { key: o.key.clone(), source })
}
