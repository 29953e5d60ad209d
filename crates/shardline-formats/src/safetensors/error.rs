//! What can be wrong with a safetensors file, a release, or a write.

use std::io;
use std::path::{Path, PathBuf};

use shardline_layout::DType;
use thiserror::Error;

use super::{INDEX_FILE_NAME, LEN_PREFIX, SINGLE_FILE_NAME};

/// Everything that can be wrong with a safetensors file, a release, or a write.
///
/// Messages name the file (or directory), the tensor and the offending numbers.
#[derive(Debug, Error)]
pub enum SafetensorsError {
    #[error("{}: cannot {action}: {source}", .path.display())]
    Io { path: PathBuf, action: &'static str, source: io::Error },

    // ---- one file's header ----
    #[error(
        "{}: file is {file_len} bytes, too short for the 8-byte header length",
        .path.display()
    )]
    FileTooShort { path: PathBuf, file_len: u64 },

    #[error(
        "{}: header length {header_len} exceeds the limit of {limit} bytes",
        .path.display()
    )]
    HeaderTooLarge { path: PathBuf, header_len: u64, limit: u64 },

    #[error(
        "{}: header length {header_len} runs past the end of the file ({file_len} bytes, so at \
         most {} header bytes)",
        .path.display(),
        .file_len.saturating_sub(LEN_PREFIX)
    )]
    HeaderBeyondFile { path: PathBuf, header_len: u64, file_len: u64 },

    #[error("{}: header is not valid json: {reason}", .path.display())]
    HeaderNotJson { path: PathBuf, reason: String },

    #[error("{}: header key {key:?} appears more than once", .path.display())]
    DuplicateKey { path: PathBuf, key: String },

    #[error("{}: __metadata__ must map strings to strings: {reason}", .path.display())]
    InvalidMetadata { path: PathBuf, reason: String },

    #[error("{}: tensor {tensor:?}: invalid header entry: {reason}", .path.display())]
    InvalidEntry { path: PathBuf, tensor: String, reason: String },

    #[error("{}: tensor {tensor:?} has unsupported dtype {dtype:?}", .path.display())]
    UnknownDtype { path: PathBuf, tensor: String, dtype: String },

    #[error(
        "{}: tensor {tensor:?} has out-of-order data_offsets [{begin}, {end}]: the end comes \
         before the start",
        .path.display()
    )]
    ReversedOffsets { path: PathBuf, tensor: String, begin: u64, end: u64 },

    #[error(
        "{}: tensor {tensor:?}: shape {shape:?} of {dtype} overflows a 64-bit byte count",
        .path.display()
    )]
    ShapeOverflow { path: PathBuf, tensor: String, dtype: DType, shape: Vec<u64> },

    #[error(
        "{}: tensor {tensor:?}: shape {shape:?} of {dtype} needs {expected} bytes but \
         data_offsets [{begin}, {end}] span {} bytes",
        .path.display(),
        span(.begin, .end)
    )]
    SizeMismatch { path: PathBuf, tensor: String, dtype: DType, shape: Vec<u64>, expected: u64, begin: u64, end: u64 },

    #[error(
        "{}: tensor {tensor:?} at data_offsets [{begin}, {end}] overlaps tensor {other:?} at \
         [{other_begin}, {other_end}]",
        .path.display()
    )]
    Overlap { path: PathBuf, tensor: String, begin: u64, end: u64, other: String, other_begin: u64, other_end: u64 },

    #[error(
        "{}: hole in the data section: bytes [{gap_begin}, {gap_end}) between {} and tensor \
         {tensor:?} belong to no tensor",
        .path.display(),
        describe_previous(.previous)
    )]
    Hole { path: PathBuf, previous: Option<String>, tensor: String, gap_begin: u64, gap_end: u64 },

    #[error(
        "{}: file is truncated: tensor {tensor:?} ends at data offset {end} but the data section \
         on disk has only {data_len} bytes",
        .path.display()
    )]
    Truncated { path: PathBuf, tensor: String, end: u64, data_len: u64 },

    #[error(
        "{}: data section on disk has {data_len} bytes but the header's tensors end at \
         {declared}",
        .path.display()
    )]
    TrailingBytes { path: PathBuf, declared: u64, data_len: u64 },

    // ---- a release ----
    #[error("{}: release has no config.json", .dir.display())]
    MissingConfig { dir: PathBuf },

    #[error("{}: release has neither {INDEX_FILE_NAME} nor {SINGLE_FILE_NAME}", .dir.display())]
    NoWeights { dir: PathBuf },

    #[error("{}: file is larger than the limit of {limit} bytes", .path.display())]
    FileTooLarge { path: PathBuf, limit: u64 },

    #[error("{}: file is not valid utf-8: {reason}", .path.display())]
    NotUtf8 { path: PathBuf, reason: String },

    #[error("{}: index is not valid json: {reason}", .path.display())]
    IndexNotJson { path: PathBuf, reason: String },

    #[error("{}: invalid index: {reason}", .path.display())]
    InvalidIndex { path: PathBuf, reason: String },

    #[error(
        "{}: shard file name {file:?} escapes the release directory",
        .index.display()
    )]
    ShardPathEscapes { index: PathBuf, file: String },

    #[error(
        "{}: shard file {file:?} listed in the index is missing ({})",
        .index.display(),
        .path.display()
    )]
    MissingShard { index: PathBuf, file: String, path: PathBuf },

    #[error(
        "{}: tensor {tensor:?} is mapped to {file:?} but that file has no such tensor{}",
        .index.display(),
        found_in_note(.found_in)
    )]
    NotInFile { index: PathBuf, tensor: String, file: String, found_in: Option<String> },

    #[error(
        "{}: tensor {tensor:?} is in shard {file:?} but not in the index's weight_map",
        .index.display()
    )]
    NotInIndex { index: PathBuf, tensor: String, file: String },

    #[error(
        "{}: tensor {tensor:?} appears in two shard files, {first:?} and {second:?}",
        .dir.display()
    )]
    DuplicateAcrossFiles { dir: PathBuf, tensor: String, first: String, second: String },

    #[error("{}: total tensor bytes overflow a 64-bit count", .dir.display())]
    TotalOverflow { dir: PathBuf },

    // ---- writing ----
    #[error("cannot lay out tensor {tensor:?}: {reason}")]
    InvalidLayout { tensor: String, reason: String },

    #[error("header of {header_len} bytes exceeds the limit of {limit} bytes")]
    LayoutHeaderTooLarge { header_len: u64, limit: u64 },

    #[error("{}: not a file path in a directory", .path.display())]
    InvalidOutputPath { path: PathBuf },

    #[error(
        "{}: write of {len} bytes at file offset {offset} falls outside the data section \
         [{data_begin}, {data_end})",
        .path.display()
    )]
    WriteOutOfBounds { path: PathBuf, offset: u64, len: u64, data_begin: u64, data_end: u64 },

    #[error(
        "{}: write of {len} bytes at offset {offset} of tensor {tensor:?} runs past its \
         {byte_len} bytes",
        .path.display()
    )]
    TensorWriteOutOfBounds { path: PathBuf, tensor: String, offset: u64, len: u64, byte_len: u64 },

    #[error("{}: no tensor {tensor:?} in this file's layout", .path.display())]
    UnknownTensor { path: PathBuf, tensor: String },

    #[error(
        "{}: tensor {tensor:?} needs {expected} bytes but {actual} were given",
        .path.display()
    )]
    DataSizeMismatch { path: PathBuf, tensor: String, expected: u64, actual: u64 },

    #[error(
        "{}: refusing to finish: bytes [{missing_begin}, {missing_end}) of the file (in tensor \
         {tensor:?}) were never written",
        .path.display()
    )]
    Incomplete { path: PathBuf, tensor: String, missing_begin: u64, missing_end: u64 },
}

fn describe_previous(previous: &Option<String>) -> String {
    match previous {
        Some(name) => format!("tensor {name:?}"),
        None => "the start of the data section".to_string(),
    }
}

fn span(begin: &u64, end: &u64) -> u64 {
    end.saturating_sub(*begin)
}

fn found_in_note(found_in: &Option<String>) -> String {
    found_in.as_deref().map(|f| format!(" (it is in {f:?})")).unwrap_or_default()
}

pub(super) fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> SafetensorsError {
    let path = path.to_path_buf();
    move |source| SafetensorsError::Io { path, action, source }
}
