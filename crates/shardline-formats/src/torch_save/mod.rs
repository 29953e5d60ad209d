//! The `torch.save` zip archive: one per DCP item.
//!
//! Every item of a `.distcp` file is a complete, uncompressed (STORED) zip archive whose offsets
//! are relative to the start of the item (DCP's `_ReaderView` rebases them), with the
//! end-of-central-directory record ending exactly at `offset + length`.
//!
//! * [`TensorArchive`] lays out an archive holding one C-contiguous tensor so that the tensor
//!   bytes can be streamed: [`TensorArchive::prefix`] (everything before the data), then
//!   [`TensorArchive::data_len`] raw little-endian bytes, then [`TensorArchive::suffix`]. The
//!   data starts 64-byte aligned relative to the start of the archive (an `FB` extra field pads
//!   the local header, as torch does), and zip64 records appear when the data reaches 4 GiB.
//! * [`encode_object_archive`] writes `torch.save(obj)` of a small Python value (a DCP bytes
//!   item such as `checkpoint_version` or `iteration`).
//! * [`read_tensor_archive`] and [`read_object_archive`] read items back from random-access
//!   storage, whether written by this module or by torch (any archive directory name, data
//!   descriptors, zip64, the extra entries torch adds).

mod read;
mod strict;
mod write;

use std::io;

use shardline_layout::DType;
use thiserror::Error;

use crate::pickle::PickleError;

pub use read::{
    edit_object_archive, is_tensor_value, list_archive, locate_object_tensor, read_object_archive, read_tensor_archive,
    read_tensor_archive_with, ArchiveEntry, ArchivedTensor, ReadAt, SpecCache,
};
pub use write::*;

/// The directory inside the archive. torch uses `archive`; readers take whatever the first
/// entry's directory is.
pub const ARCHIVE_DIR: &str = "archive";

/// Alignment of the tensor data relative to the start of the archive (torch's
/// `.storage_alignment`).
pub const DATA_ALIGNMENT: u64 = 64;

/// Largest `data.pkl` the reader accepts.
pub(crate) const MAX_PICKLE_LEN: u64 = 64 << 20;
/// Largest central directory the reader accepts (a torch archive has a handful of entries).
pub(crate) const MAX_CENTRAL_DIRECTORY_LEN: u64 = 16 << 20;
/// Sizes and offsets at or above this need zip64 records.
pub(crate) const ZIP64_THRESHOLD: u64 = 0xFFFF_FFFF;

pub(crate) const SIG_LOCAL: u32 = 0x0403_4b50;
pub(crate) const SIG_CENTRAL: u32 = 0x0201_4b50;
pub(crate) const SIG_EOCD: u32 = 0x0605_4b50;
pub(crate) const SIG_EOCD64: u32 = 0x0606_4b50;
pub(crate) const SIG_EOCD64_LOCATOR: u32 = 0x0706_4b50;
pub(crate) const LOCAL_HEADER_LEN: u64 = 30;
pub(crate) const CENTRAL_HEADER_LEN: usize = 46;
pub(crate) const EOCD_LEN: u64 = 22;
pub(crate) const EOCD64_LEN: u64 = 56;
pub(crate) const EOCD64_LOCATOR_LEN: u64 = 20;
pub(crate) const EXTRA_ZIP64: u16 = 0x0001;
/// torch's padding extra field, the bytes `FB`.
pub(crate) const EXTRA_PADDING: u16 = 0x4246;
pub(crate) const VERSION_DEFAULT: u16 = 20;
pub(crate) const VERSION_ZIP64: u16 = 45;
/// 1980-01-01, the earliest DOS date.
pub(crate) const DOS_DATE: u16 = (1 << 5) | 1;

/// Errors of writing or reading a `torch.save` archive. Offsets are relative to the item.
#[derive(Debug, Error)]
pub enum TorchSaveError {
    #[error("tensor of shape {shape:?} and dtype {dtype} is larger than 2^64 bytes")]
    TooLarge { dtype: DType, shape: Vec<u64> },
    #[error("tensor data is {got} bytes, shape {shape:?} of {dtype} needs {want}")]
    DataLength { dtype: DType, shape: Vec<u64>, want: u64, got: u64 },
    #[error("i/o error reading {what} at item offset {offset}: {source}")]
    Io {
        what: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error("not a zip archive: {0}")]
    NotZip(String),
    #[error("corrupt zip archive: {0}")]
    Corrupt(String),
    #[error("archive has no entry {0}")]
    MissingEntry(String),
    #[error("archive entry {name} is compressed (method {method}); only stored entries are supported")]
    Compressed { name: String, method: u16 },
    #[error("archive entry {name}: crc-32 is {actual:08x}, central directory says {expected:08x}")]
    Crc { name: String, expected: u32, actual: u32 },
    #[error("archive entry {name} is {size} bytes, above the limit of {max}")]
    EntryTooLarge { name: String, size: u64, max: u64 },
    #[error("archive byteorder is {0:?}; only little endian is supported")]
    ByteOrder(String),
    #[error("data.pkl: {0}")]
    Pickle(#[from] PickleError),
    #[error("data.pkl does not describe a tensor: {0}")]
    NotATensor(String),
    #[error("data.pkl: unsupported dtype {0}")]
    UnsupportedDtype(String),
    #[error("tensor is not contiguous: shape {shape:?}, strides {strides:?}")]
    NonContiguous { shape: Vec<u64>, strides: Vec<u64> },
    #[error(
        "tensor does not fit its storage: storage offset {storage_offset} + {numel} elements of \
         {dtype} exceed the {storage_bytes}-byte storage"
    )]
    StorageBounds { dtype: DType, storage_offset: u64, numel: u64, storage_bytes: u64 },
    #[error("storage {key} declares {declared} bytes but its entry {name} holds {actual}")]
    StorageSize { key: String, name: String, declared: u64, actual: u64 },
}

#[cfg(test)]
mod tests;
