//! The DCP `.metadata` file: a pickle of `torch.distributed.checkpoint.metadata.Metadata`.
//!
//! * [`encode`]: [`encode_metadata`] and [`MetadataEncoder`] write the minimal protocol-2 pickle
//!   that every torch from 2.5 to 2.15 loads (the brief's recipe, with its version traps):
//!   `TensorProperties` state as a 5-tuple via `BUILD`, `torch.Size` via `REDUCE`,
//!   `_MEM_FORMAT_ENCODING(0)` via `REDUCE`, `planner_data` always present, no `storage_meta`, no
//!   memo, dicts in `SETITEMS` batches of bounded size.
//! * [`decode`]: [`read_metadata`] streams a `.metadata` item by item, strictly: exactly the
//!   classes, globals and field shapes DCP writes (torch 2.5 … 2.15: protocol 4 with frames and
//!   memo, `TensorProperties` as a 5- or 6-tuple, `storage_meta`, `version`,
//!   `transform_descriptors`, `MetadataIndex` with or without `offset`/`index`) are accepted, and
//!   anything torch would fail to unpickle, or would unpickle into something else, is an error
//!   naming the field. [`decode_metadata`] collects the items into a [`Metadata`].

mod decode;
mod encode;

use shardline_layout::DType;
use thiserror::Error;

use crate::pickle::PickleError;

pub use decode::{decode_metadata, read_metadata, read_metadata_file, MetadataItem, MetadataTail};
pub use encode::{encode_metadata, EntryRef, MetadataEncoder, StorageRef};

const MD_MODULE: &str = "torch.distributed.checkpoint.metadata";
const FS_MODULE: &str = "torch.distributed.checkpoint.filesystem";

/// The DCP version string torch 2.9+ writes (`CURRENT_DCP_VERSION`).
pub const CURRENT_DCP_VERSION: &str = "1.0.0";

/// One saved chunk of a tensor: a box at `offsets` of extent `sizes` (`ChunkStorageMetadata`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunkMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// An entry of `state_dict_metadata`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryMeta {
    /// `TensorStorageMetadata`: global `size` and the saved chunks.
    Tensor { dtype: DType, size: Vec<u64>, chunks: Vec<ChunkMeta> },
    /// `BytesStorageMetadata`: a `torch.save`d Python object.
    Bytes,
}

/// A key of `storage_data` (`MetadataIndex`): the fqn, and the chunk offsets for a tensor chunk
/// (`None` for a bytes item).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StorageKey {
    pub fqn: String,
    pub offset: Option<Vec<u64>>,
}

/// Where an item's bytes are (`_StorageInfo`): `[offset, offset + length)` of the file at
/// `relative_path` in the checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
    /// E.g. `["stream.zstd/1"]` (torch 2.7+); `None` for plain items.
    pub transform_descriptors: Option<Vec<String>>,
}

/// One component of a `planner_data` path (defined by the layout core, which classifies keys
/// by their paths).
pub use shardline_layout::reshard::PathElem;

/// The parts of `Metadata` a checkpoint reader and writer need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// `state_dict_metadata`, in order.
    pub state_dict_metadata: Vec<(String, EntryMeta)>,
    /// `storage_data`, in order.
    pub storage_data: Vec<(StorageKey, StorageInfo)>,
    /// `planner_data`: flat fqn → path in the nested state dict. Empty when the file has None.
    pub planner_data: Vec<(String, Vec<PathElem>)>,
    /// `version` (torch 2.9+ writes `"1.0.0"`).
    pub version: Option<String>,
}

impl Metadata {
    /// The `state_dict_metadata` entry of `fqn`.
    pub fn entry(&self, fqn: &str) -> Option<&EntryMeta> {
        self.state_dict_metadata.iter().find(|(k, _)| k == fqn).map(|(_, e)| e)
    }

    /// The storage of the chunk of `fqn` at `offset` (`None` for a bytes item).
    pub fn storage(&self, fqn: &str, offset: Option<&[u64]>) -> Option<&StorageInfo> {
        self.storage_data.iter().find(|(k, _)| k.fqn == fqn && k.offset.as_deref() == offset).map(|(_, s)| s)
    }
}

/// Errors of decoding a `.metadata` pickle. `path` names the field, Python-style
/// (`state_dict_metadata['w'].chunks[1].offsets`).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DcpMetadataError {
    #[error(".metadata is not a valid pickle: {0}")]
    Pickle(#[from] PickleError),
    #[error(".metadata: {path}: expected {expected}, found {found}")]
    Unexpected { path: String, expected: &'static str, found: String },
    #[error(".metadata: {path}: missing field {field}")]
    Missing { path: String, field: &'static str },
    #[error(".metadata: {path}: unsupported dtype {name}")]
    UnsupportedDtype { path: String, name: String },
    #[error(".metadata: {path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: {error}")]
    Io { path: String, error: String },
    #[error(".metadata: duplicate {what} {key}")]
    Duplicate { what: &'static str, key: String },
}

#[cfg(test)]
mod tests;
