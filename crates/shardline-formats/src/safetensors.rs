//! Safetensors files and the HuggingFace releases made of them.
//!
//! * [`read_header`] reads the 8-byte length and the JSON header of one file — never the tensor
//!   data — and checks every entry against the format and against the file's length on disk.
//! * [`Release::open`] opens a release directory (`config.json` plus a single `model.safetensors`
//!   or shards listed by `model.safetensors.index.json`) and cross-checks the index against the
//!   shard headers.
//! * [`FileLayout`] and [`SafetensorsWriter`] write safetensors files: the header is computed up
//!   front, so every tensor's absolute offset is known before a data byte is written, and tensor
//!   bytes can be written in any order (positional writes) or streamed sequentially. The file is
//!   written under a temporary name and renamed into place by [`SafetensorsWriter::finish`] only
//!   once every data byte has been written.
//!
//! # Why the header is parsed here rather than by the `safetensors` crate
//!
//! The reference crate (`safetensors`, a dev-dependency used by the interoperability tests below)
//! does not fit reading headers of files of hundreds of GB without loading them:
//!
//! * `SafeTensors::read_metadata` wants a buffer holding the *whole file* (it compares the
//!   header's end offset with the buffer length), so it needs the file in memory or memory-mapped,
//!   and mapping a file takes `unsafe`, which this workspace forbids.
//! * Its `Metadata` deserializer goes through a `HashMap`, so a duplicated tensor name silently
//!   keeps one of the two entries; it also rejects with errors that name neither the numbers nor,
//!   for size mismatches, the tensor (`TensorInvalidInfo`), and accepts dtypes we cannot convert
//!   (`C64`, `F4`, …) that we must reject with our own message anyway.
//!
//! So the header is parsed with `serde_json` into a list of entries in document order (keeping
//! duplicates visible), and every rule of the format is checked here with a precise error. The
//! tests check that files written here are accepted by the reference crate with identical
//! tensors, and that files written by the reference crate are read identically here.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::error::Category;
use shardline_layout::{DType, SourceTensor};
use thiserror::Error;

/// Largest JSON header accepted or written, in bytes (the 8-byte length prefix not included).
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;
/// Largest `model.safetensors.index.json` read, in bytes.
pub const MAX_INDEX_LEN: u64 = 256 * 1024 * 1024;
/// Largest `config.json` read, in bytes.
pub const MAX_CONFIG_LEN: u64 = 64 * 1024 * 1024;
/// Name of the index of a sharded release.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";
/// Name of the weights file of an unsharded release.
pub const SINGLE_FILE_NAME: &str = "model.safetensors";
/// Name of the model configuration of a release.
pub const CONFIG_FILE_NAME: &str = "config.json";

/// Size of the little-endian `u64` header length that starts every safetensors file.
const LEN_PREFIX: u64 = 8;
/// The header key holding free-form string metadata rather than a tensor.
const METADATA_KEY: &str = "__metadata__";

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

fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> SafetensorsError {
    let path = path.to_path_buf();
    move |source| SafetensorsError::Io { path, action, source }
}

// ------------------------------------------------------------------------------------------------
// Tensors and file headers
// ------------------------------------------------------------------------------------------------

/// One tensor of a safetensors file, as checked against the file on disk.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's data in the file (length prefix and header included).
    pub file_offset: u64,
    /// Length of the tensor's data in bytes (`product(shape) * dtype.size()`).
    pub byte_len: u64,
}

impl TensorInfo {
    /// Number of elements (`byte_len / dtype.size()`, exact by construction).
    pub fn numel(&self) -> u64 {
        self.byte_len / (self.dtype.size() as u64).max(1)
    }

    /// One past the last byte of the tensor's data in the file.
    pub fn file_end(&self) -> u64 {
        self.file_offset.saturating_add(self.byte_len)
    }
}

/// The checked header of one safetensors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHeader {
    path: PathBuf,
    header_len: u64,
    file_len: u64,
    metadata: BTreeMap<String, String>,
    /// In data order (increasing offsets).
    tensors: Vec<TensorInfo>,
    /// Indices into `tensors`, sorted by tensor name.
    by_name: Vec<usize>,
}

impl FileHeader {
    /// The file this header was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length of the JSON header (padding included), as stored in the 8-byte prefix.
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Absolute offset of the data section (`8 + header_len`).
    pub fn data_start(&self) -> u64 {
        LEN_PREFIX + self.header_len
    }

    /// Length of the data section, equal to the sum of the tensors' byte lengths.
    pub fn data_len(&self) -> u64 {
        self.file_len.saturating_sub(self.data_start())
    }

    /// Length of the file on disk when its header was read.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The `__metadata__` map (empty when the header has none).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The tensors in data order (increasing file offsets).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        lookup_by_name(&self.tensors, &self.by_name, name)
    }
}

fn name_order(tensors: &[TensorInfo]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let name = |i: usize| tensors.get(i).map(|t| t.name.as_str());
        name(a).cmp(&name(b))
    });
    order
}

fn lookup_by_name<'a>(tensors: &'a [TensorInfo], by_name: &[usize], name: &str) -> Option<&'a TensorInfo> {
    let position =
        by_name.binary_search_by(|&i| tensors.get(i).map(|t| t.name.as_str()).unwrap_or_default().cmp(name)).ok()?;
    tensors.get(*by_name.get(position)?)
}

/// Reads and checks the header of the safetensors file at `path`, reading only the 8-byte length
/// and the JSON header, never the tensor data.
///
/// Checks: the header length is at most [`MAX_HEADER_LEN`] and fits in the file; the header is a
/// JSON object without duplicate keys; `__metadata__`, if present, maps strings to strings; every
/// other entry has a known dtype, a shape and two `data_offsets` in order whose span equals
/// `product(shape) * dtype.size()` (overflow-checked); the tensors, sorted by offset, cover the
/// data section from 0 without overlaps or holes; and their end equals the data section length
/// actually on disk.
pub fn read_header(path: impl AsRef<Path>) -> Result<FileHeader, SafetensorsError> {
    let path = path.as_ref();
    let mut file = File::open(path).map_err(io_error(path, "open safetensors file"))?;
    let file_len = file.metadata().map_err(io_error(path, "read the length of safetensors file"))?.len();
    if file_len < LEN_PREFIX {
        return Err(SafetensorsError::FileTooShort { path: path.to_path_buf(), file_len });
    }
    let mut prefix = [0u8; LEN_PREFIX as usize];
    file.read_exact(&mut prefix).map_err(io_error(path, "read the header length"))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLarge { path: path.to_path_buf(), header_len, limit: MAX_HEADER_LEN });
    }
    if header_len > file_len - LEN_PREFIX {
        return Err(SafetensorsError::HeaderBeyondFile { path: path.to_path_buf(), header_len, file_len });
    }
    // Both bounds above make this allocation at most MAX_HEADER_LEN and at most the file length.
    let header_size = usize::try_from(header_len).map_err(|_| SafetensorsError::HeaderTooLarge {
        path: path.to_path_buf(),
        header_len,
        limit: MAX_HEADER_LEN,
    })?;
    let mut header = vec![0u8; header_size];
    file.read_exact(&mut header).map_err(io_error(path, "read the json header"))?;
    parse_header(path, &header, file_len)
}

/// Checks a header already read from a file of `file_len` bytes (see [`read_header`]).
fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<FileHeader, SafetensorsError> {
    let header_len = header.len() as u64;
    let entries = parse_header_json(path, header)?;

    let mut seen = HashSet::with_capacity(entries.len());
    for (key, _) in &entries {
        if !seen.insert(key.as_str()) {
            return Err(SafetensorsError::DuplicateKey { path: path.to_path_buf(), key: key.clone() });
        }
    }
    drop(seen);

    struct Checked {
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        begin: u64,
        end: u64,
    }

    let mut metadata = BTreeMap::new();
    let mut checked = Vec::with_capacity(entries.len());
    for (key, entry) in entries {
        match entry {
            RawEntry::Metadata(pairs) => {
                for (k, v) in pairs {
                    if metadata.contains_key(&k) {
                        return Err(SafetensorsError::InvalidMetadata {
                            path: path.to_path_buf(),
                            reason: format!("key {k:?} appears more than once"),
                        });
                    }
                    metadata.insert(k, v);
                }
            }
            RawEntry::Tensor(raw) => {
                let Some(dtype) = DType::from_safetensors_name(&raw.dtype) else {
                    return Err(SafetensorsError::UnknownDtype {
                        path: path.to_path_buf(),
                        tensor: key,
                        dtype: raw.dtype,
                    });
                };
                let [begin, end] = raw.data_offsets[..] else {
                    return Err(SafetensorsError::InvalidEntry {
                        path: path.to_path_buf(),
                        reason: format!("data_offsets has {} values, expected 2", raw.data_offsets.len()),
                        tensor: key,
                    });
                };
                if end < begin {
                    return Err(SafetensorsError::ReversedOffsets {
                        path: path.to_path_buf(),
                        tensor: key,
                        begin,
                        end,
                    });
                }
                let Some(expected) = byte_len_of(dtype, &raw.shape) else {
                    return Err(SafetensorsError::ShapeOverflow {
                        path: path.to_path_buf(),
                        tensor: key,
                        dtype,
                        shape: raw.shape,
                    });
                };
                if expected != end - begin {
                    return Err(SafetensorsError::SizeMismatch {
                        path: path.to_path_buf(),
                        tensor: key,
                        dtype,
                        shape: raw.shape,
                        expected,
                        begin,
                        end,
                    });
                }
                checked.push(Checked { name: key, dtype, shape: raw.shape, begin, end });
            }
        }
    }

    // The format does not fix the order of the JSON keys, only that the tensors, taken by offset,
    // tile the data section. Ties (empty tensors) are broken by name for a stable result.
    checked.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut covered = 0u64;
    let mut previous: Option<&Checked> = None;
    for t in &checked {
        if t.begin < covered {
            let other = previous.map_or((String::new(), 0, 0), |p| (p.name.clone(), p.begin, p.end));
            return Err(SafetensorsError::Overlap {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                begin: t.begin,
                end: t.end,
                other: other.0,
                other_begin: other.1,
                other_end: other.2,
            });
        }
        if t.begin > covered {
            return Err(SafetensorsError::Hole {
                path: path.to_path_buf(),
                previous: previous.map(|p| p.name.clone()),
                tensor: t.name.clone(),
                gap_begin: covered,
                gap_end: t.begin,
            });
        }
        covered = t.end;
        // Name the tensor that reaches `covered` in messages, not an empty one sitting at its end.
        if previous.is_none() || t.end > t.begin {
            previous = Some(t);
        }
    }

    // `header_len <= file_len - 8` was checked by the caller; keep the arithmetic checked anyway.
    let data_start = LEN_PREFIX + header_len;
    let data_len = file_len.checked_sub(data_start).ok_or(SafetensorsError::HeaderBeyondFile {
        path: path.to_path_buf(),
        header_len,
        file_len,
    })?;
    if covered > data_len {
        let (tensor, end) =
            checked.iter().find(|t| t.end > data_len).map_or((String::new(), covered), |t| (t.name.clone(), t.end));
        return Err(SafetensorsError::Truncated { path: path.to_path_buf(), tensor, end, data_len });
    }
    if covered < data_len {
        return Err(SafetensorsError::TrailingBytes { path: path.to_path_buf(), declared: covered, data_len });
    }

    let tensors: Vec<TensorInfo> = checked
        .into_iter()
        .map(|t| TensorInfo {
            name: t.name,
            dtype: t.dtype,
            shape: t.shape,
            // begin <= end <= data_len, so data_start + begin <= file_len.
            file_offset: data_start + t.begin,
            byte_len: t.end - t.begin,
        })
        .collect();
    let by_name = name_order(&tensors);
    Ok(FileHeader { path: path.to_path_buf(), header_len, file_len, metadata, tensors, by_name })
}

/// `product(shape) * dtype.size()`, or `None` on overflow.
fn byte_len_of(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?.checked_mul(dtype.size() as u64)
}

// ---- JSON parsing of the header, keeping every entry in document order ----

enum RawEntry {
    Metadata(Vec<(String, String)>),
    Tensor(RawTensor),
}

/// A tensor entry before any check. Unknown fields are ignored, as the reference implementation
/// does.
#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

fn parse_header_json(path: &Path, header: &[u8]) -> Result<Vec<(String, RawEntry)>, SafetensorsError> {
    let mut current: Option<String> = None;
    let mut de = serde_json::Deserializer::from_slice(header);
    let parsed =
        HeaderSeed { current: &mut current }.deserialize(&mut de).and_then(|entries| de.end().map(|()| entries));
    parsed.map_err(|e| match (current, e.classify()) {
        (Some(key), Category::Data) if key == METADATA_KEY => {
            SafetensorsError::InvalidMetadata { path: path.to_path_buf(), reason: e.to_string() }
        }
        (Some(tensor), Category::Data) => {
            SafetensorsError::InvalidEntry { path: path.to_path_buf(), tensor, reason: e.to_string() }
        }
        _ => SafetensorsError::HeaderNotJson { path: path.to_path_buf(), reason: e.to_string() },
    })
}

/// Deserializes the header object into its entries; while an entry's value is being read, its key
/// sits in `current`, so that an error can name the tensor.
struct HeaderSeed<'a> {
    current: &'a mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Vec<(String, RawEntry)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = Vec<(String, RawEntry)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a json object mapping tensor names to dtype, shape and data_offsets")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let is_metadata = key == METADATA_KEY;
            *self.current = Some(key);
            let entry = if is_metadata {
                RawEntry::Metadata(map.next_value_seed(StringPairs)?)
            } else {
                RawEntry::Tensor(map.next_value()?)
            };
            if let Some(key) = self.current.take() {
                entries.push((key, entry));
            }
        }
        Ok(entries)
    }
}

/// A JSON object of strings, as a list of pairs in document order (duplicates kept).
struct StringPairs;

impl<'de> DeserializeSeed<'de> for StringPairs {
    type Value = Vec<(String, String)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for StringPairs {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a json object whose values are strings")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::new();
        while let Some(entry) = map.next_entry::<String, String>()? {
            pairs.push(entry);
        }
        Ok(pairs)
    }
}

// ------------------------------------------------------------------------------------------------
// Releases
// ------------------------------------------------------------------------------------------------

/// A tensor of a release and the file that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseTensor<'a> {
    /// Index into [`Release::files`].
    pub file_index: usize,
    pub info: &'a TensorInfo,
}

/// A checked HuggingFace safetensors release: `config.json` plus one `model.safetensors`, or the
/// shards listed by `model.safetensors.index.json`.
#[derive(Clone, Debug)]
pub struct Release {
    dir: PathBuf,
    config_json: String,
    index_path: Option<PathBuf>,
    /// Sorted by path.
    files: Vec<FileHeader>,
    /// Every tensor as `(file index, index in that file's header)`, sorted by name: the headers
    /// hold each tensor's description once, however many tensors a release has.
    by_name: Vec<(u32, u32)>,
    total_bytes: u64,
}

impl Release {
    /// Opens the release in `dir`, reading `config.json`, the index if any, and every shard's
    /// header (never tensor data), and checks that the index and the shards agree exactly.
    pub fn open(dir: impl AsRef<Path>) -> Result<Release, SafetensorsError> {
        let dir = dir.as_ref();
        let meta = fs::metadata(dir).map_err(io_error(dir, "open release directory"))?;
        if !meta.is_dir() {
            return Err(SafetensorsError::Io {
                path: dir.to_path_buf(),
                action: "open release directory",
                source: io::Error::other("not a directory"),
            });
        }

        let config_path = dir.join(CONFIG_FILE_NAME);
        let config_json = match read_bounded(&config_path, MAX_CONFIG_LEN, "read config.json")? {
            Some(bytes) => String::from_utf8(bytes)
                .map_err(|e| SafetensorsError::NotUtf8 { path: config_path.clone(), reason: e.to_string() })?,
            None => return Err(SafetensorsError::MissingConfig { dir: dir.to_path_buf() }),
        };

        let index_path = dir.join(INDEX_FILE_NAME);
        match read_bounded(&index_path, MAX_INDEX_LEN, "read the index")? {
            Some(bytes) => {
                let weight_map = parse_index(&index_path, &bytes)?;
                drop(bytes);
                Self::open_sharded(dir, config_json, index_path, weight_map)
            }
            None => {
                let path = dir.join(SINGLE_FILE_NAME);
                if !path.exists() {
                    return Err(SafetensorsError::NoWeights { dir: dir.to_path_buf() });
                }
                let header = read_header(&path)?;
                Self::assemble(dir, config_json, None, vec![header])
            }
        }
    }

    fn open_sharded(
        dir: &Path,
        config_json: String,
        index_path: PathBuf,
        weight_map: Vec<(String, String)>,
    ) -> Result<Release, SafetensorsError> {
        let mut mapped: HashMap<&str, &str> = HashMap::with_capacity(weight_map.len());
        for (tensor, file) in &weight_map {
            if mapped.insert(tensor, file).is_some() {
                return Err(SafetensorsError::InvalidIndex {
                    path: index_path,
                    reason: format!("tensor {tensor:?} appears more than once in weight_map"),
                });
            }
        }

        let names: BTreeSet<&str> = weight_map.iter().map(|(_, f)| f.as_str()).collect();
        for name in &names {
            if !stays_inside(name) {
                return Err(SafetensorsError::ShardPathEscapes { index: index_path, file: (*name).to_string() });
            }
        }
        let names: Vec<&str> = names.into_iter().collect();
        let mut files = Vec::with_capacity(names.len());
        for name in &names {
            let path = dir.join(name);
            if !path.exists() {
                return Err(SafetensorsError::MissingShard { index: index_path, file: (*name).to_string(), path });
            }
            files.push(read_header(&path)?);
        }

        // Which file holds each tensor, according to the shards themselves.
        let mut owner: HashMap<&str, usize> = HashMap::new();
        for (fi, header) in files.iter().enumerate() {
            for t in header.tensors() {
                if let Some(&first) = owner.get(t.name.as_str()) {
                    return Err(SafetensorsError::DuplicateAcrossFiles {
                        dir: dir.to_path_buf(),
                        tensor: t.name.clone(),
                        first: names.get(first).copied().unwrap_or_default().to_string(),
                        second: names.get(fi).copied().unwrap_or_default().to_string(),
                    });
                }
                owner.insert(&t.name, fi);
            }
        }
        let file_name = |fi: usize| names.get(fi).copied().unwrap_or_default().to_string();

        let mut sorted_map: Vec<(&str, &str)> = mapped.iter().map(|(t, f)| (*t, *f)).collect();
        sorted_map.sort_unstable();
        for (tensor, file) in sorted_map {
            let fi = names.binary_search(&file).ok();
            let holds = fi.and_then(|fi| files.get(fi)).is_some_and(|h| h.tensor(tensor).is_some());
            if !holds {
                return Err(SafetensorsError::NotInFile {
                    index: index_path,
                    tensor: tensor.to_string(),
                    file: file.to_string(),
                    found_in: owner.get(tensor).map(|&o| file_name(o)),
                });
            }
        }
        for (fi, header) in files.iter().enumerate() {
            if let Some(t) = header.tensors().iter().find(|t| !mapped.contains_key(t.name.as_str())) {
                return Err(SafetensorsError::NotInIndex {
                    index: index_path,
                    tensor: t.name.clone(),
                    file: file_name(fi),
                });
            }
        }
        drop(owner);
        drop(mapped);

        Self::assemble(dir, config_json, Some(index_path), files)
    }

    fn assemble(
        dir: &Path,
        config_json: String,
        index_path: Option<PathBuf>,
        files: Vec<FileHeader>,
    ) -> Result<Release, SafetensorsError> {
        let count: usize = files.iter().map(|h| h.tensors().len()).sum();
        let mut by_name = Vec::with_capacity(count);
        let mut total_bytes = 0u64;
        for (file_index, header) in files.iter().enumerate() {
            for (i, info) in header.tensors().iter().enumerate() {
                total_bytes = total_bytes
                    .checked_add(info.byte_len)
                    .ok_or_else(|| SafetensorsError::TotalOverflow { dir: dir.to_path_buf() })?;
                let index =
                    |n: usize| u32::try_from(n).map_err(|_| SafetensorsError::TotalOverflow { dir: dir.to_path_buf() });
                by_name.push((index(file_index)?, index(i)?));
            }
        }
        let name = |&(f, i): &(u32, u32)| files[f as usize].tensors[i as usize].name.as_str();
        by_name.sort_by(|a, b| name(a).cmp(name(b)));
        Ok(Release { dir: dir.to_path_buf(), config_json, index_path, files, by_name, total_bytes })
    }

    /// The release directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The contents of `config.json`.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// The index file, for a sharded release.
    pub fn index_path(&self) -> Option<&Path> {
        self.index_path.as_deref()
    }

    /// The safetensors files, sorted by path; [`ReleaseTensor::file_index`] indexes this.
    pub fn files(&self) -> &[FileHeader] {
        &self.files
    }

    /// The paths of the safetensors files, in the order of [`Release::files`].
    pub fn file_paths(&self) -> impl Iterator<Item = &Path> + '_ {
        self.files.iter().map(FileHeader::path)
    }

    /// Every tensor of the release, sorted by name.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = ReleaseTensor<'_>> + Clone + '_ {
        self.by_name.iter().map(|&entry| self.entry(entry))
    }

    fn entry(&self, (file, index): (u32, u32)) -> ReleaseTensor<'_> {
        ReleaseTensor { file_index: file as usize, info: &self.files[file as usize].tensors[index as usize] }
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<ReleaseTensor<'_>> {
        let i = self.by_name.binary_search_by(|&e| self.entry(e).info.name.as_str().cmp(name)).ok()?;
        Some(self.entry(self.by_name[i]))
    }

    /// The file holding the tensor `name`, and the tensor.
    pub fn locate(&self, name: &str) -> Option<(&FileHeader, &TensorInfo)> {
        let t = self.tensor(name)?;
        Some((self.files.get(t.file_index)?, t.info))
    }

    /// Sum of the byte lengths of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Every tensor of the release, sorted by name, as a plan's sources, and where each one's
    /// bytes are (`locations.tensors[i]` holds `sources[i]`). The headers' names and shapes move
    /// into the sources instead of being copied, so a large release is described once, not twice,
    /// while it is planned.
    pub fn into_sources(self) -> (Vec<SourceTensor>, SourceLocations) {
        let Release { mut files, by_name, .. } = self;
        let mut sources = Vec::with_capacity(by_name.len());
        let mut tensors = Vec::with_capacity(by_name.len());
        for (file, index) in by_name {
            let info = &mut files[file as usize].tensors[index as usize];
            sources.push(SourceTensor {
                name: std::mem::take(&mut info.name),
                dtype: info.dtype,
                shape: std::mem::take(&mut info.shape),
            });
            tensors.push((file, info.file_offset, info.byte_len));
        }
        let files = files.into_iter().map(|f| f.path).collect();
        (sources, SourceLocations { files, tensors })
    }
}

/// Where the bytes of a release's tensors are: its files, and for each tensor `(file index,
/// absolute data offset, byte length)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLocations {
    pub files: Vec<PathBuf>,
    pub tensors: Vec<(u32, u64, u64)>,
}

/// Whether a file name from an index stays inside the release directory: relative, and made only
/// of plain components (no `..`, no root, no drive prefix). Symbolic links are followed as usual,
/// since the HuggingFace cache links every file of a snapshot into a blob store.
fn stays_inside(name: &str) -> bool {
    let path = Path::new(name);
    let mut plain = 0usize;
    for component in path.components() {
        match component {
            Component::Normal(_) => plain += 1,
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    plain > 0
}

/// Reads a whole file of at most `limit` bytes; `Ok(None)` when it does not exist.
fn read_bounded(path: &Path, limit: u64, action: &'static str) -> Result<Option<Vec<u8>>, SafetensorsError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, action)(e)),
    };
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(io_error(path, action))?;
    if bytes.len() as u64 > limit {
        return Err(SafetensorsError::FileTooLarge { path: path.to_path_buf(), limit });
    }
    Ok(Some(bytes))
}

/// The index file: only `weight_map` is used; `metadata` (with its informational `total_size`)
/// and any other key are ignored.
#[derive(Deserialize)]
struct RawIndex {
    weight_map: WeightMap,
}

struct WeightMap(Vec<(String, String)>);

impl<'de> Deserialize<'de> for WeightMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StringPairs.deserialize(deserializer).map(WeightMap)
    }
}

fn parse_index(path: &Path, bytes: &[u8]) -> Result<Vec<(String, String)>, SafetensorsError> {
    match serde_json::from_slice::<RawIndex>(bytes) {
        Ok(index) => Ok(index.weight_map.0),
        Err(e) if e.classify() == Category::Data => {
            Err(SafetensorsError::InvalidIndex { path: path.to_path_buf(), reason: e.to_string() })
        }
        Err(e) => Err(SafetensorsError::IndexNotJson { path: path.to_path_buf(), reason: e.to_string() }),
    }
}

// ------------------------------------------------------------------------------------------------
// Writing
// ------------------------------------------------------------------------------------------------

/// The layout of a safetensors file to be written: its header bytes and every tensor's place.
///
/// Tensors are laid out contiguously in the order given; the JSON header is padded with spaces to
/// a multiple of 8 bytes, so the data section (and every tensor whose offset is a multiple of 8)
/// is 8-byte aligned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileLayout {
    /// The 8-byte length prefix followed by the padded JSON header.
    header: Vec<u8>,
    tensors: Vec<TensorInfo>,
    by_name: Vec<usize>,
    file_len: u64,
}

impl FileLayout {
    /// Lays out `tensors` (`(name, dtype, shape)`, in data order) with the given `__metadata__`
    /// (omitted from the header when empty).
    pub fn new<'a, I>(tensors: I, metadata: &BTreeMap<String, String>) -> Result<FileLayout, SafetensorsError>
    where
        I: IntoIterator<Item = (&'a str, DType, &'a [u64])>,
    {
        let mut json = Vec::new();
        json.push(b'{');
        let mut first = true;
        if !metadata.is_empty() {
            json.extend_from_slice(b"\"__metadata__\":");
            serde_json::to_writer(&mut json, metadata).map_err(|e| SafetensorsError::InvalidLayout {
                tensor: METADATA_KEY.to_string(),
                reason: e.to_string(),
            })?;
            first = false;
        }

        let mut names = HashSet::new();
        let mut placed: Vec<(String, DType, Vec<u64>, u64, u64)> = Vec::new();
        let mut offset = 0u64;
        for (name, dtype, shape) in tensors {
            let invalid = |reason: String| SafetensorsError::InvalidLayout { tensor: name.to_string(), reason };
            if name == METADATA_KEY {
                return Err(invalid("the name is reserved for the header's metadata".into()));
            }
            if !names.insert(name) {
                return Err(invalid("the name is listed more than once".into()));
            }
            let byte_len = byte_len_of(dtype, shape)
                .ok_or_else(|| invalid(format!("shape {shape:?} of {dtype} overflows a 64-bit byte count")))?;
            let end = offset
                .checked_add(byte_len)
                .ok_or_else(|| invalid(format!("data offset {offset} + {byte_len} overflows")))?;
            if !first {
                json.push(b',');
            }
            first = false;
            serde_json::to_writer(&mut json, name).map_err(|e| invalid(e.to_string()))?;
            json.extend_from_slice(b":{\"dtype\":\"");
            json.extend_from_slice(dtype.safetensors_name().as_bytes());
            json.extend_from_slice(b"\",\"shape\":");
            serde_json::to_writer(&mut json, shape).map_err(|e| invalid(e.to_string()))?;
            json.extend_from_slice(format!(",\"data_offsets\":[{offset},{end}]}}").as_bytes());
            placed.push((name.to_string(), dtype, shape.to_vec(), offset, byte_len));
            offset = end;
        }
        json.push(b'}');

        let padded = json.len().div_ceil(8) * 8;
        json.resize(padded, b' ');
        let header_len = json.len() as u64;
        if header_len > MAX_HEADER_LEN {
            return Err(SafetensorsError::LayoutHeaderTooLarge { header_len, limit: MAX_HEADER_LEN });
        }
        let data_start = LEN_PREFIX + header_len;
        let file_len = data_start.checked_add(offset).ok_or_else(|| SafetensorsError::InvalidLayout {
            tensor: placed.last().map(|p| p.0.clone()).unwrap_or_default(),
            reason: format!("file length {data_start} + {offset} overflows"),
        })?;

        let mut header = Vec::with_capacity(json.len() + LEN_PREFIX as usize);
        header.extend_from_slice(&header_len.to_le_bytes());
        header.extend_from_slice(&json);
        let tensors: Vec<TensorInfo> = placed
            .into_iter()
            .map(|(name, dtype, shape, begin, byte_len)| TensorInfo {
                name,
                dtype,
                shape,
                file_offset: data_start + begin,
                byte_len,
            })
            .collect();
        let by_name = name_order(&tensors);
        Ok(FileLayout { header, tensors, by_name, file_len })
    }

    /// The bytes that start the file: the 8-byte length and the padded JSON header.
    pub fn header_bytes(&self) -> &[u8] {
        &self.header
    }

    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    /// Length of the complete file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The tensors in data order, with their absolute offsets.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        lookup_by_name(&self.tensors, &self.by_name, name)
    }
}

/// Writes one safetensors file under a temporary name in the destination directory, renaming it
/// into place only when [`finish`](SafetensorsWriter::finish) finds every data byte written.
///
/// The header is written and the file extended to its final length on creation. Tensor bytes go
/// in with positional writes in any order, from any number of threads
/// ([`write_all_at`](SafetensorsWriter::write_all_at), [`write_tensor_at`](SafetensorsWriter::write_tensor_at)),
/// or sequentially ([`write_next`](SafetensorsWriter::write_next)). The writer records which bytes
/// were written. Dropped without `finish` (or when `finish` fails), it removes its temporary file,
/// so an interrupted write never leaves a file under the final name.
#[derive(Debug)]
pub struct SafetensorsWriter {
    layout: FileLayout,
    path: PathBuf,
    temp_path: PathBuf,
    file: File,
    /// Written absolute byte ranges of the data section, sorted, disjoint and non-adjacent.
    written: Mutex<Vec<(u64, u64)>>,
    /// Next absolute offset for `write_next`.
    cursor: u64,
    finished: bool,
}

impl SafetensorsWriter {
    /// Starts writing the file `path` with `layout`: creates a temporary file next to it, writes
    /// the header and sizes the file.
    pub fn create(path: impl AsRef<Path>, layout: FileLayout) -> Result<SafetensorsWriter, SafetensorsError> {
        let path = path.as_ref().to_path_buf();
        let Some(file_name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return Err(SafetensorsError::InvalidOutputPath { path });
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (file, temp_path) = create_temp(&dir, &file_name)?;
        let writer = SafetensorsWriter {
            cursor: layout.data_start(),
            layout,
            path,
            temp_path,
            file,
            written: Mutex::new(Vec::new()),
            finished: false,
        };
        // From here on, Drop removes the temporary file if anything fails.
        writer.file.set_len(writer.layout.file_len()).map_err(io_error(&writer.temp_path, "size the output file"))?;
        writer
            .file
            .write_all_at(writer.layout.header_bytes(), 0)
            .map_err(io_error(&writer.temp_path, "write the header"))?;
        Ok(writer)
    }

    /// The layout being written.
    pub fn layout(&self) -> &FileLayout {
        &self.layout
    }

    /// The final path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary path written to until `finish`.
    pub fn temp_path(&self) -> &Path {
        &self.temp_path
    }

    /// Writes `bytes` at the absolute file `offset`, which must lie within the data section
    /// (the header is written by the writer itself).
    pub fn write_all_at(&self, offset: u64, bytes: &[u8]) -> Result<(), SafetensorsError> {
        let len = bytes.len() as u64;
        let data_begin = self.layout.data_start();
        let data_end = self.layout.file_len();
        let end = offset.checked_add(len);
        if offset < data_begin || end.is_none_or(|e| e > data_end) {
            return Err(SafetensorsError::WriteOutOfBounds {
                path: self.path.clone(),
                offset,
                len,
                data_begin,
                data_end,
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.file.write_all_at(bytes, offset).map_err(io_error(&self.temp_path, "write tensor data"))?;
        let mut written = self.written.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        insert_range(&mut written, offset, offset + len);
        Ok(())
    }

    /// Writes `bytes` at `offset` within the tensor `name`.
    pub fn write_tensor_at(&self, name: &str, offset: u64, bytes: &[u8]) -> Result<(), SafetensorsError> {
        let Some(info) = self.layout.tensor(name) else {
            return Err(SafetensorsError::UnknownTensor { path: self.path.clone(), tensor: name.to_string() });
        };
        let len = bytes.len() as u64;
        if offset.checked_add(len).is_none_or(|e| e > info.byte_len) {
            return Err(SafetensorsError::TensorWriteOutOfBounds {
                path: self.path.clone(),
                tensor: name.to_string(),
                offset,
                len,
                byte_len: info.byte_len,
            });
        }
        self.write_all_at(info.file_offset + offset, bytes)
    }

    /// Appends `bytes` to the data written so far by `write_next`, starting at the data section's
    /// start: streaming the tensors' bytes in layout order writes the file sequentially.
    pub fn write_next(&mut self, bytes: &[u8]) -> Result<(), SafetensorsError> {
        self.write_all_at(self.cursor, bytes)?;
        self.cursor += bytes.len() as u64;
        Ok(())
    }

    /// Checks that every data byte was written, flushes the file to disk and renames it to its
    /// final path. Returns that path.
    pub fn finish(mut self) -> Result<PathBuf, SafetensorsError> {
        if let Some((missing_begin, missing_end)) = self.first_gap() {
            let tensor = self
                .layout
                .tensors()
                .iter()
                .find(|t| t.file_end() > missing_begin && t.byte_len > 0)
                .map(|t| t.name.clone())
                .unwrap_or_default();
            return Err(SafetensorsError::Incomplete { path: self.path.clone(), tensor, missing_begin, missing_end });
        }
        self.file.sync_all().map_err(io_error(&self.temp_path, "flush the output file to disk"))?;
        fs::rename(&self.temp_path, &self.path).map_err(io_error(&self.path, "rename the finished file into place"))?;
        self.finished = true;
        // Make the rename itself durable.
        if let Some(dir) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir, "flush the output directory to disk"))?;
        }
        Ok(self.path.clone())
    }

    /// The first range of the data section never written, if any.
    fn first_gap(&self) -> Option<(u64, u64)> {
        let written = self.written.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (begin, end) = (self.layout.data_start(), self.layout.file_len());
        if begin == end {
            return None;
        }
        match written.first() {
            Some(&(b, e)) if b == begin && e == end => None,
            Some(&(b, e)) if b == begin => Some((e, written.get(1).map_or(end, |n| n.0))),
            Some(&(b, _)) => Some((begin, b)),
            None => Some((begin, end)),
        }
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = fs::remove_file(&self.temp_path);
        }
    }
}

/// Creates a new, unique temporary file for `file_name` in `dir`. Its name starts with a dot and
/// ends in `.partial`, so it is never mistaken for a finished file.
fn create_temp(dir: &Path, file_name: &str) -> Result<(File, PathBuf), SafetensorsError> {
    let pid = std::process::id();
    let mut attempt = 0u32;
    loop {
        let temp = dir.join(format!(".{file_name}.{pid}-{attempt}.partial"));
        match OpenOptions::new().read(true).write(true).create_new(true).open(&temp) {
            Ok(file) => return Ok((file, temp)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 10_000 => attempt += 1,
            Err(e) => return Err(io_error(&temp, "create the temporary output file")(e)),
        }
    }
}

/// Adds `[begin, end)` to a sorted list of disjoint, non-adjacent ranges.
fn insert_range(ranges: &mut Vec<(u64, u64)>, begin: u64, end: u64) {
    // First range that ends at or after `begin` (it may touch or overlap the new one).
    let first = ranges.partition_point(|&(_, e)| e < begin);
    // First range that starts after `end` (it stays separate).
    let last = ranges.partition_point(|&(b, _)| b <= end);
    let (mut b, mut e) = (begin, end);
    if first < last {
        if let (Some(lo), Some(hi)) = (ranges.get(first), ranges.get(last - 1)) {
            b = b.min(lo.0);
            e = e.max(hi.1);
        }
    }
    ranges.splice(first..last.max(first), [(b, e)]);
}

/// Writes a complete safetensors file in one go (for small files and tests): lays out `tensors`
/// in the order given, checks each data length, and writes through [`SafetensorsWriter`].
pub fn write_file(
    path: impl AsRef<Path>,
    tensors: &[(&str, DType, &[u64], &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<(), SafetensorsError> {
    let path = path.as_ref();
    let layout = FileLayout::new(tensors.iter().map(|&(n, d, s, _)| (n, d, s)), metadata)?;
    for (&(name, _, _, data), info) in tensors.iter().zip(layout.tensors()) {
        if data.len() as u64 != info.byte_len {
            return Err(SafetensorsError::DataSizeMismatch {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                expected: info.byte_len,
                actual: data.len() as u64,
            });
        }
    }
    let mut writer = SafetensorsWriter::create(path, layout)?;
    for &(_, _, _, data) in tensors {
        writer.write_next(data)?;
    }
    writer.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};
    use tempfile::TempDir;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
    }

    fn no_metadata() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    fn pt_metadata() -> BTreeMap<String, String> {
        BTreeMap::from([("format".to_string(), "pt".to_string())])
    }

    /// Writes `header` after its 8-byte length, then `data_len` data bytes.
    fn raw_file(dir: &Path, name: &str, header: &str, data_len: usize) -> PathBuf {
        let path = dir.join(name);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data_len, 0xAB);
        fs::write(&path, bytes).unwrap();
        path
    }

    /// A header JSON from `(name, dtype, shape, begin, end)` entries.
    fn header_of(entries: &[(&str, &str, &[u64], u64, u64)]) -> String {
        let mut map = serde_json::Map::new();
        for &(name, dtype, shape, begin, end) in entries {
            map.insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}));
        }
        Value::Object(map).to_string()
    }

    fn bad(dir: &TempDir, header: &str, data_len: usize) -> (PathBuf, SafetensorsError) {
        let path = raw_file(dir.path(), "bad.safetensors", header, data_len);
        let err = read_header(&path).unwrap_err();
        (path, err)
    }

    fn assert_mentions(err: &SafetensorsError, parts: &[&str]) {
        let message = err.to_string();
        for part in parts {
            assert!(message.contains(part), "{message:?} does not mention {part:?}");
        }
        assert_eq!(message.chars().next().map(|c| c.is_uppercase()), Some(false), "{message:?} starts with a capital");
    }

    fn read_range(path: &Path, offset: u64, len: u64) -> Vec<u8> {
        let file = File::open(path).unwrap();
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset).unwrap();
        buf
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn dir_entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    // ---- writing, then reading back ----

    #[test]
    fn round_trip_writer_to_reader() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("model.safetensors");
        let a = pattern(3 * 5 * 2, 1);
        let b = pattern(4 * 4, 2);
        let c = pattern(3, 3);
        let scalar = pattern(8, 4);
        let tensors: Vec<(&str, DType, &[u64], &[u8])> = vec![
            ("z.bf16", DType::BF16, &[3, 5], &a),
            ("a.f32", DType::F32, &[4], &b),
            ("empty", DType::F16, &[0, 7], &[]),
            ("m.u8 \"quoted\"", DType::U8, &[3], &c),
            ("scalar", DType::F64, &[], &scalar),
        ];
        write_file(&path, &tensors, &pt_metadata()).unwrap();
        assert_eq!(dir_entries(dir.path()), vec!["model.safetensors"]);

        let header = read_header(&path).unwrap();
        assert_eq!(header.metadata(), &pt_metadata());
        assert_eq!(header.header_len() % 8, 0, "json header padded to 8 bytes");
        assert_eq!(header.data_start() % 8, 0);
        assert_eq!(header.data_len(), (a.len() + b.len() + c.len() + scalar.len()) as u64);
        // Data order is the order written.
        let names: Vec<&str> = header.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, vec!["z.bf16", "a.f32", "empty", "m.u8 \"quoted\"", "scalar"]);
        for &(name, dtype, shape, data) in &tensors {
            let t = header.tensor(name).unwrap();
            assert_eq!((t.dtype, t.shape.as_slice()), (dtype, shape));
            assert_eq!(t.byte_len, data.len() as u64);
            assert_eq!(read_range(&path, t.file_offset, t.byte_len), data);
        }
        assert_eq!(header.tensor("scalar").unwrap().numel(), 1);
        assert_eq!(header.tensor("z.bf16").unwrap().numel(), 15);
        assert!(header.tensor("missing").is_none());

        // The layout predicted every offset the reader finds.
        let layout = FileLayout::new(tensors.iter().map(|&(n, d, s, _)| (n, d, s)), &pt_metadata()).unwrap();
        assert_eq!(layout.tensors(), header.tensors());
        assert_eq!(layout.file_len(), header.file_len());
        assert_eq!(read_range(&path, 0, layout.data_start()), layout.header_bytes());
    }

    #[test]
    fn empty_file_round_trips() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("empty.safetensors");
        write_file(&path, &[], &no_metadata()).unwrap();
        let header = read_header(&path).unwrap();
        assert!(header.tensors().is_empty());
        assert!(header.metadata().is_empty());
        assert_eq!(header.data_len(), 0);
    }

    #[test]
    fn positional_writes_in_any_order_from_threads() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("out.safetensors");
        let shapes: Vec<(String, Vec<u64>)> = (0..8).map(|i| (format!("t{i}"), vec![i + 1, 33])).collect();
        let layout =
            FileLayout::new(shapes.iter().map(|(n, s)| (n.as_str(), DType::BF16, s.as_slice())), &no_metadata())
                .unwrap();
        let writer = SafetensorsWriter::create(&path, layout).unwrap();
        assert!(!path.exists(), "nothing under the final name before finish");
        let data: Vec<Vec<u8>> =
            writer.layout().tensors().iter().enumerate().map(|(i, t)| pattern(t.byte_len as usize, i as u8)).collect();
        std::thread::scope(|s| {
            for half in 0..2usize {
                let (writer, data) = (&writer, &data);
                s.spawn(move || {
                    // Last tensor first, each in two chunks, second chunk first.
                    for (i, t) in writer.layout().tensors().iter().enumerate().rev() {
                        if i % 2 != half {
                            continue;
                        }
                        let bytes = &data[i];
                        let mid = bytes.len() / 3;
                        writer.write_tensor_at(&t.name, mid as u64, &bytes[mid..]).unwrap();
                        writer.write_all_at(t.file_offset, &bytes[..mid]).unwrap();
                    }
                });
            }
        });
        let temp = writer.temp_path().to_path_buf();
        assert_eq!(writer.finish().unwrap(), path);
        assert!(!temp.exists());
        let header = read_header(&path).unwrap();
        for (i, t) in header.tensors().iter().enumerate() {
            assert_eq!(read_range(&path, t.file_offset, t.byte_len), data[i]);
        }
    }

    #[test]
    fn finish_refuses_an_incomplete_file_and_leaves_nothing() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("out.safetensors");
        let layout =
            FileLayout::new([("a", DType::F32, &[4u64][..]), ("b", DType::F32, &[4u64][..])], &no_metadata()).unwrap();
        let data_start = layout.data_start();
        let mut writer = SafetensorsWriter::create(&path, layout).unwrap();
        writer.write_next(&[1; 16]).unwrap(); // all of "a"
        writer.write_tensor_at("b", 8, &[2; 8]).unwrap(); // second half of "b"
        let err = writer.finish().unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::Incomplete { tensor, missing_begin, missing_end, .. }
                if tensor == "b" && *missing_begin == data_start + 16 && *missing_end == data_start + 24),
            "{err:?}"
        );
        assert_mentions(&err, &["out.safetensors", "\"b\"", &format!("[{}, {})", data_start + 16, data_start + 24)]);
        assert!(dir_entries(dir.path()).is_empty(), "temporary file removed");
    }

    #[test]
    fn dropping_a_writer_removes_its_temporary_file() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("out.safetensors");
        let layout = FileLayout::new([("a", DType::U8, &[3u64][..])], &no_metadata()).unwrap();
        let writer = SafetensorsWriter::create(&path, layout).unwrap();
        let temp = writer.temp_path().to_path_buf();
        assert!(temp.exists());
        assert!(temp.file_name().unwrap().to_string_lossy().starts_with(".out.safetensors."));
        drop(writer);
        assert!(dir_entries(dir.path()).is_empty());
    }

    #[test]
    fn writes_outside_their_place_are_refused() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("out.safetensors");
        let layout =
            FileLayout::new([("a", DType::I32, &[2u64][..]), ("b", DType::I64, &[1u64][..])], &no_metadata()).unwrap();
        let (start, end) = (layout.data_start(), layout.file_len());
        let mut writer = SafetensorsWriter::create(&path, layout).unwrap();

        let err = writer.write_tensor_at("a", 4, &[0; 5]).unwrap_err();
        assert!(matches!(err, SafetensorsError::TensorWriteOutOfBounds { .. }), "{err:?}");
        assert_mentions(&err, &["out.safetensors", "\"a\"", "5 bytes", "offset 4", "8 bytes"]);

        let err = writer.write_all_at(0, &[0; 8]).unwrap_err();
        assert!(matches!(err, SafetensorsError::WriteOutOfBounds { .. }), "{err:?}");
        assert_mentions(&err, &[&format!("[{start}, {end})")]);
        let err = writer.write_all_at(end - 1, &[0; 2]).unwrap_err();
        assert!(matches!(err, SafetensorsError::WriteOutOfBounds { .. }), "{err:?}");

        let err = writer.write_tensor_at("nope", 0, &[0]).unwrap_err();
        assert!(matches!(err, SafetensorsError::UnknownTensor { .. }), "{err:?}");
        assert_mentions(&err, &["\"nope\""]);

        writer.write_next(&[0; 16]).unwrap();
        let err = writer.write_next(&[0; 1]).unwrap_err();
        assert!(matches!(err, SafetensorsError::WriteOutOfBounds { .. }), "{err:?}");
        writer.finish().unwrap();
        read_header(&path).unwrap();
    }

    #[test]
    fn layouts_reject_bad_tensor_lists() {
        let err = FileLayout::new([("a", DType::U8, &[1u64][..]), ("a", DType::U8, &[1u64][..])], &no_metadata())
            .unwrap_err();
        assert!(matches!(err, SafetensorsError::InvalidLayout { .. }), "{err:?}");
        assert_mentions(&err, &["\"a\"", "more than once"]);

        let err = FileLayout::new([("__metadata__", DType::U8, &[1u64][..])], &no_metadata()).unwrap_err();
        assert_mentions(&err, &["__metadata__", "reserved"]);

        let huge = [u64::MAX / 2, 3];
        let err = FileLayout::new([("big", DType::F32, &huge[..])], &no_metadata()).unwrap_err();
        assert!(matches!(err, SafetensorsError::InvalidLayout { .. }), "{err:?}");
        assert_mentions(&err, &["\"big\"", "overflows", &(u64::MAX / 2).to_string()]);
    }

    #[test]
    fn write_file_checks_data_lengths() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("out.safetensors");
        let err = write_file(&path, &[("w", DType::BF16, &[3], &[0; 5])], &no_metadata()).unwrap_err();
        assert!(matches!(err, SafetensorsError::DataSizeMismatch { expected: 6, actual: 5, .. }));
        assert_mentions(&err, &["out.safetensors", "\"w\"", "6 bytes", "5 were given"]);
        assert!(dir_entries(dir.path()).is_empty());
    }

    // ---- interoperability with the reference implementation ----

    #[test]
    fn reference_implementation_reads_our_files() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("ours.safetensors");
        let a = pattern(2 * 3 * 2, 7);
        let b = pattern(5, 8);
        write_file(
            &path,
            &[("x", DType::BF16, &[2, 3], &a), ("y", DType::F8E4M3, &[5], &b), ("e", DType::I64, &[0], &[])],
            &pt_metadata(),
        )
        .unwrap();
        let bytes = fs::read(&path).unwrap();
        let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let x = reference.tensor("x").unwrap();
        assert_eq!((x.dtype(), x.shape(), x.data()), (safetensors::Dtype::BF16, &[2usize, 3][..], &a[..]));
        let y = reference.tensor("y").unwrap();
        assert_eq!((y.dtype(), y.shape(), y.data()), (safetensors::Dtype::F8_E4M3, &[5usize][..], &b[..]));
        assert_eq!(reference.tensor("e").unwrap().data().len(), 0);
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    }

    #[test]
    fn we_read_reference_implementation_files() {
        use safetensors::tensor::TensorView;
        let a = pattern(4 * 2, 1);
        let b = pattern(3 * 4, 2);
        let c = pattern(2, 3);
        let views = vec![
            ("b.weight", TensorView::new(safetensors::Dtype::F16, vec![4], &a).unwrap()),
            ("a.weight", TensorView::new(safetensors::Dtype::F32, vec![3], &b).unwrap()),
            ("c", TensorView::new(safetensors::Dtype::BOOL, vec![1, 2], &c).unwrap()),
        ];
        let info = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        let bytes = safetensors::serialize(views, Some(info)).unwrap();
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("reference.safetensors");
        fs::write(&path, &bytes).unwrap();

        let header = read_header(&path).unwrap();
        assert_eq!(header.metadata(), &pt_metadata());
        for (name, dtype, shape, data) in [
            ("b.weight", DType::F16, vec![4u64], &a),
            ("a.weight", DType::F32, vec![3], &b),
            ("c", DType::Bool, vec![1, 2], &c),
        ] {
            let t = header.tensor(name).unwrap();
            assert_eq!((t.dtype, &t.shape), (dtype, &shape));
            assert_eq!(read_range(&path, t.file_offset, t.byte_len), *data);
        }
    }

    // ---- the real fixtures, written by transformers ----

    #[test]
    fn reads_the_llama_fixture() {
        let release = Release::open(fixture("llama")).unwrap();
        assert!(release.config_json().contains("\"llama\""));
        assert_eq!(release.files().len(), 2);
        assert_eq!(release.tensors().len(), 21);
        assert_eq!(release.total_bytes(), 205_440);
        assert!(release.index_path().is_some());
        let names: Vec<&str> = release.tensors().map(|t| t.info.name.as_str()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted, "tensors sorted by name");

        let k = release.tensor("model.layers.0.self_attn.k_proj.weight").unwrap();
        assert_eq!((k.info.dtype, k.info.shape.as_slice()), (DType::BF16, &[16u64, 64][..]));
        assert_eq!(k.info.byte_len, 2048);
        // data_offsets [82176, 84224] after a 2064-byte header.
        assert_eq!(k.info.file_offset, 8 + 2064 + 82_176);
        let (file, _) = release.locate("lm_head.weight").unwrap();
        assert!(file.path().ends_with("model-00002-of-00002.safetensors"));
        assert_eq!(file.metadata().get("format").map(String::as_str), Some("pt"));
        let paths: Vec<&Path> = release.file_paths().collect();
        assert!(paths[0].ends_with("model-00001-of-00002.safetensors"));
        assert!(release.tensor("model.nope").is_none());
    }

    #[test]
    fn reads_the_qwen3_moe_fixture() {
        let release = Release::open(fixture("qwen3_moe")).unwrap();
        assert_eq!(release.tensors().len(), 69);
        assert_eq!(release.total_bytes(), 305_856);
        let gate = release.tensor("model.layers.0.mlp.experts.0.gate_proj.weight").unwrap();
        assert_eq!((gate.info.dtype, gate.info.shape.as_slice()), (DType::BF16, &[32u64, 64][..]));
        let router = release.tensor("model.layers.0.mlp.gate.weight").unwrap();
        assert_eq!(router.info.shape, vec![8, 64]);
    }

    #[test]
    fn reads_the_qwen3_next_fixture() {
        let release = Release::open(fixture("qwen3_next")).unwrap();
        assert_eq!(release.files().len(), 4);
        assert_eq!(release.tensors().len(), 154);
        assert_eq!(release.total_bytes(), 646_960);
        let conv = release.tensor("model.layers.0.linear_attn.conv1d.weight").unwrap();
        assert_eq!(conv.info.shape, vec![128, 1, 4]);
        let a_log = release.tensor("model.layers.0.linear_attn.A_log").unwrap();
        assert_eq!((a_log.info.dtype, a_log.info.shape.as_slice()), (DType::BF16, &[4u64][..]));
        let q = release.tensor("model.layers.3.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.info.shape, vec![128, 64]);
        assert!(release.files()[q.file_index].path().ends_with("model-00004-of-00004.safetensors"));
        let sum: u64 = release.files().iter().map(FileHeader::data_len).sum();
        assert_eq!(sum, release.total_bytes());
    }

    #[test]
    fn opens_a_single_file_release() {
        let dir = TempDir::new().unwrap();
        fs::write(dir.path().join("config.json"), "{}").unwrap();
        write_file(
            dir.path().join("model.safetensors"),
            &[("w", DType::F32, &[2], &[0; 8]), ("b", DType::F32, &[1], &[0; 4])],
            &pt_metadata(),
        )
        .unwrap();
        let release = Release::open(dir.path()).unwrap();
        assert!(release.index_path().is_none());
        assert_eq!(release.total_bytes(), 12);
        let names: Vec<&str> = release.tensors().map(|t| t.info.name.as_str()).collect();
        assert_eq!(names, vec!["b", "w"]);
        assert_eq!(release.config_json(), "{}");
    }

    // ---- bad files: one test per defect ----

    #[test]
    fn header_length_beyond_the_file() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("bad.safetensors");
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}        ");
        fs::write(&path, &bytes).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(matches!(err, SafetensorsError::HeaderBeyondFile { header_len: 1000, file_len: 18, .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "1000", "18 bytes", "at most 10"]);
    }

    #[test]
    fn file_shorter_than_the_length_prefix() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("bad.safetensors");
        fs::write(&path, [1, 2, 3]).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(matches!(err, SafetensorsError::FileTooShort { file_len: 3, .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "3 bytes"]);
    }

    #[test]
    fn header_not_json() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, "{\"a\": {\"dtype\": \"F32\", \"sha", 0);
        assert!(matches!(err, SafetensorsError::HeaderNotJson { .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "not valid json"]);

        let (_, err) = bad(&dir, "[1, 2]", 0);
        assert!(matches!(err, SafetensorsError::HeaderNotJson { .. }), "{err:?}");

        let (_, err) = bad(&dir, "{} trailing", 0);
        assert!(matches!(err, SafetensorsError::HeaderNotJson { .. }), "{err:?}");
    }

    #[test]
    fn header_too_large() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("bad.safetensors");
        let mut bytes = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        fs::write(&path, &bytes).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(matches!(err, SafetensorsError::HeaderTooLarge { .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "104857601", "104857600"]);

        let mut bytes = u64::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        fs::write(&path, &bytes).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(matches!(err, SafetensorsError::HeaderTooLarge { .. }), "{err:?}");
    }

    #[test]
    fn truncated_data_section() {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("cut.safetensors");
        write_file(
            &path,
            &[("first", DType::F32, &[4], &[0; 16]), ("second", DType::F32, &[4], &[0; 16])],
            &no_metadata(),
        )
        .unwrap();
        let len = fs::metadata(&path).unwrap().len();
        File::options().write(true).open(&path).unwrap().set_len(len - 3).unwrap();
        let err = read_header(&path).unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::Truncated { tensor, end: 32, data_len: 29, .. } if tensor == "second"),
            "{err:?}"
        );
        assert_mentions(&err, &["cut.safetensors", "truncated", "\"second\"", "32", "29 bytes"]);
    }

    #[test]
    fn trailing_bytes_after_the_last_tensor() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, &header_of(&[("a", "U8", &[4], 0, 4)]), 6);
        assert!(matches!(err, SafetensorsError::TrailingBytes { declared: 4, data_len: 6, .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "6 bytes", "end at 4"]);
    }

    #[test]
    fn overlapping_offsets() {
        let dir = TempDir::new().unwrap();
        let header = header_of(&[("a", "F32", &[4], 0, 16), ("b", "F32", &[4], 8, 24)]);
        let (_, err) = bad(&dir, &header, 24);
        assert!(
            matches!(&err, SafetensorsError::Overlap { tensor, other, begin: 8, .. } if tensor == "b" && other == "a"),
            "{err:?}"
        );
        assert_mentions(&err, &["bad.safetensors", "\"b\"", "[8, 24]", "\"a\"", "[0, 16]"]);
    }

    #[test]
    fn out_of_order_offsets() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, &header_of(&[("w", "F32", &[4], 16, 0)]), 16);
        assert!(
            matches!(&err, SafetensorsError::ReversedOffsets { tensor, begin: 16, end: 0, .. } if tensor == "w"),
            "{err:?}"
        );
        assert_mentions(&err, &["bad.safetensors", "\"w\"", "[16, 0]"]);
    }

    #[test]
    fn json_key_order_does_not_matter() {
        // The format orders tensors by offset, not by their place in the JSON object.
        let dir = TempDir::new().unwrap();
        let header = r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let path = raw_file(dir.path(), "ok.safetensors", header, 6);
        let read = read_header(&path).unwrap();
        let names: Vec<&str> = read.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, vec!["a", "b"]);
        assert_eq!(read.tensor("b").unwrap().file_offset, read.data_start() + 4);
    }

    #[test]
    fn hole_between_tensors() {
        let dir = TempDir::new().unwrap();
        let header = header_of(&[("a", "F32", &[4], 0, 16), ("b", "F32", &[4], 24, 40)]);
        let (_, err) = bad(&dir, &header, 40);
        assert!(
            matches!(&err, SafetensorsError::Hole { previous: Some(p), tensor, gap_begin: 16, gap_end: 24, .. }
                if p == "a" && tensor == "b"),
            "{err:?}"
        );
        assert_mentions(&err, &["bad.safetensors", "[16, 24)", "\"a\"", "\"b\""]);

        // Data that does not start at 0 leaves a hole too.
        let (_, err) = bad(&dir, &header_of(&[("a", "U8", &[4], 4, 8)]), 8);
        assert!(matches!(&err, SafetensorsError::Hole { previous: None, gap_begin: 0, gap_end: 4, .. }), "{err:?}");
        assert_mentions(&err, &["start of the data section", "[0, 4)"]);
    }

    #[test]
    fn shape_times_dtype_size_differs_from_byte_length() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, &header_of(&[("w", "F32", &[2, 3], 0, 16)]), 16);
        assert!(
            matches!(&err, SafetensorsError::SizeMismatch { tensor, expected: 24, begin: 0, end: 16, .. } if tensor == "w"),
            "{err:?}"
        );
        assert_mentions(&err, &["bad.safetensors", "\"w\"", "[2, 3]", "F32", "24 bytes", "span 16 bytes"]);
    }

    #[test]
    fn shape_overflowing_the_byte_count() {
        let dir = TempDir::new().unwrap();
        let shape = [1u64 << 32, 1 << 32, 2];
        let (_, err) = bad(&dir, &header_of(&[("w", "BF16", &shape, 0, 16)]), 16);
        assert!(matches!(err, SafetensorsError::ShapeOverflow { .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "\"w\"", "4294967296", "overflows"]);
    }

    #[test]
    fn unknown_dtype() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, &header_of(&[("cplx", "C64", &[2], 0, 16)]), 16);
        assert!(
            matches!(&err, SafetensorsError::UnknownDtype { tensor, dtype, .. } if tensor == "cplx" && dtype == "C64"),
            "{err:?}"
        );
        assert_mentions(&err, &["bad.safetensors", "\"cplx\"", "\"C64\""]);
    }

    #[test]
    fn duplicate_key_in_a_header() {
        let dir = TempDir::new().unwrap();
        let entry = r#"{"dtype":"U8","shape":[2],"data_offsets":[0,2]}"#;
        let (_, err) = bad(&dir, &format!(r#"{{"w":{entry},"w":{entry}}}"#), 2);
        assert!(matches!(&err, SafetensorsError::DuplicateKey { key, .. } if key == "w"), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "\"w\"", "more than once"]);
    }

    #[test]
    fn metadata_that_is_not_a_string_map() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, r#"{"__metadata__":{"format":1}}"#, 0);
        assert!(matches!(err, SafetensorsError::InvalidMetadata { .. }), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "__metadata__"]);

        let (_, err) = bad(&dir, r#"{"__metadata__":{"k":"a","k":"b"}}"#, 0);
        assert!(matches!(err, SafetensorsError::InvalidMetadata { .. }), "{err:?}");
        assert_mentions(&err, &["\"k\"", "more than once"]);
    }

    #[test]
    fn malformed_tensor_entries() {
        let dir = TempDir::new().unwrap();
        let (_, err) = bad(&dir, r#"{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}"#, 0);
        assert!(matches!(&err, SafetensorsError::InvalidEntry { tensor, .. } if tensor == "w"), "{err:?}");
        assert_mentions(&err, &["bad.safetensors", "\"w\""]);

        let (_, err) = bad(&dir, r#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,1,2]}}"#, 2);
        assert!(matches!(&err, SafetensorsError::InvalidEntry { tensor, .. } if tensor == "w"), "{err:?}");
        assert_mentions(&err, &["\"w\"", "3 values"]);

        let (_, err) = bad(&dir, r#"{"w":{"dtype":"U8","shape":[2]}}"#, 2);
        assert!(matches!(&err, SafetensorsError::InvalidEntry { tensor, .. } if tensor == "w"), "{err:?}");
        assert_mentions(&err, &["data_offsets"]);
    }

    // ---- bad releases: one test per defect ----

    /// A writable copy of a fixture release.
    fn copy_release(name: &str) -> TempDir {
        let dir = TempDir::new().unwrap();
        for entry in fs::read_dir(fixture(name)).unwrap() {
            let entry = entry.unwrap();
            fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
        dir
    }

    fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
        let path = dir.join(INDEX_FILE_NAME);
        let mut index: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        edit(index["weight_map"].as_object_mut().unwrap());
        fs::write(&path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
    }

    #[test]
    fn missing_shard_file() {
        let dir = copy_release("llama");
        fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::MissingShard { file, .. } if file == "model-00002-of-00002.safetensors"),
            "{err:?}"
        );
        assert_mentions(&err, &[INDEX_FILE_NAME, "\"model-00002-of-00002.safetensors\"", "missing"]);
    }

    #[test]
    fn key_in_index_but_not_in_its_file() {
        let dir = copy_release("llama");
        edit_index(dir.path(), |map| {
            map.insert("model.extra.weight".into(), json!("model-00001-of-00002.safetensors"));
        });
        let err = Release::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::NotInFile { tensor, file, found_in: None, .. }
                if tensor == "model.extra.weight" && file == "model-00001-of-00002.safetensors"),
            "{err:?}"
        );
        assert_mentions(&err, &[INDEX_FILE_NAME, "\"model.extra.weight\"", "\"model-00001-of-00002.safetensors\""]);

        // Mapped to the wrong shard: the message says where the tensor really is.
        let dir = copy_release("llama");
        edit_index(dir.path(), |map| {
            map.insert("model.norm.weight".into(), json!("model-00002-of-00002.safetensors"));
        });
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(&err, SafetensorsError::NotInFile { found_in: Some(_), .. }), "{err:?}");
        assert_mentions(&err, &["\"model.norm.weight\"", "it is in \"model-00001-of-00002.safetensors\""]);
    }

    #[test]
    fn key_in_file_but_not_in_index() {
        let dir = copy_release("llama");
        edit_index(dir.path(), |map| {
            map.remove("model.norm.weight");
        });
        let err = Release::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::NotInIndex { tensor, file, .. }
                if tensor == "model.norm.weight" && file == "model-00001-of-00002.safetensors"),
            "{err:?}"
        );
        assert_mentions(
            &err,
            &[INDEX_FILE_NAME, "\"model.norm.weight\"", "\"model-00001-of-00002.safetensors\"", "weight_map"],
        );
    }

    #[test]
    fn duplicate_key_across_files() {
        let dir = TempDir::new().unwrap();
        fs::write(dir.path().join("config.json"), "{}").unwrap();
        write_file(
            dir.path().join("a.safetensors"),
            &[("x", DType::U8, &[1], &[1]), ("y", DType::U8, &[1], &[2])],
            &no_metadata(),
        )
        .unwrap();
        write_file(dir.path().join("b.safetensors"), &[("x", DType::U8, &[1], &[3])], &no_metadata()).unwrap();
        let index = json!({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}});
        fs::write(dir.path().join(INDEX_FILE_NAME), index.to_string()).unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, SafetensorsError::DuplicateAcrossFiles { tensor, first, second, .. }
                if tensor == "x" && first == "a.safetensors" && second == "b.safetensors"),
            "{err:?}"
        );
        assert_mentions(&err, &["\"x\"", "\"a.safetensors\"", "\"b.safetensors\""]);
    }

    #[test]
    fn duplicate_key_in_the_index() {
        let dir = copy_release("llama");
        let path = dir.path().join(INDEX_FILE_NAME);
        let text = fs::read_to_string(&path).unwrap().replacen(
            "\"weight_map\": {",
            "\"weight_map\": {\n    \"lm_head.weight\": \"model-00001-of-00002.safetensors\",",
            1,
        );
        fs::write(&path, text).unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::InvalidIndex { .. }), "{err:?}");
        assert_mentions(&err, &[INDEX_FILE_NAME, "\"lm_head.weight\"", "more than once"]);
    }

    #[test]
    fn path_traversal_in_the_index() {
        for name in ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/../../x.safetensors", ""] {
            let dir = copy_release("llama");
            edit_index(dir.path(), |map| {
                map.insert("model.norm.weight".into(), json!(name));
            });
            let err = Release::open(dir.path()).unwrap_err();
            assert!(matches!(&err, SafetensorsError::ShardPathEscapes { file, .. } if file == name), "{name}: {err:?}");
            assert_mentions(&err, &[INDEX_FILE_NAME, &format!("{name:?}"), "escapes"]);
        }
    }

    #[test]
    fn missing_config_json() {
        let dir = copy_release("llama");
        fs::remove_file(dir.path().join("config.json")).unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::MissingConfig { .. }), "{err:?}");
        assert_mentions(&err, &[&dir.path().display().to_string(), "config.json"]);
    }

    #[test]
    fn index_not_json() {
        let dir = copy_release("llama");
        fs::write(dir.path().join(INDEX_FILE_NAME), "{\"weight_map\": {").unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::IndexNotJson { .. }), "{err:?}");
        assert_mentions(&err, &[INDEX_FILE_NAME, "not valid json"]);

        fs::write(dir.path().join(INDEX_FILE_NAME), "{\"metadata\": {}}").unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::InvalidIndex { .. }), "{err:?}");
        assert_mentions(&err, &["weight_map"]);
    }

    #[test]
    fn release_without_weights() {
        let dir = TempDir::new().unwrap();
        fs::write(dir.path().join("config.json"), "{}").unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(err, SafetensorsError::NoWeights { .. }), "{err:?}");
        assert_mentions(&err, &[&dir.path().display().to_string(), SINGLE_FILE_NAME, INDEX_FILE_NAME]);
    }

    #[test]
    fn a_bad_shard_is_reported_with_its_path() {
        let dir = copy_release("llama");
        let shard = dir.path().join("model-00002-of-00002.safetensors");
        let len = fs::metadata(&shard).unwrap().len();
        File::options().write(true).open(&shard).unwrap().set_len(len - 1).unwrap();
        let err = Release::open(dir.path()).unwrap_err();
        assert!(matches!(&err, SafetensorsError::Truncated { tensor, .. } if tensor == "lm_head.weight"), "{err:?}");
        assert_mentions(&err, &["model-00002-of-00002.safetensors"]);
    }

    // ---- properties ----

    #[test]
    fn insert_range_merges() {
        let mut ranges = Vec::new();
        insert_range(&mut ranges, 10, 20);
        insert_range(&mut ranges, 30, 40);
        assert_eq!(ranges, vec![(10, 20), (30, 40)]);
        insert_range(&mut ranges, 20, 30);
        assert_eq!(ranges, vec![(10, 40)]);
        insert_range(&mut ranges, 0, 5);
        insert_range(&mut ranges, 50, 60);
        insert_range(&mut ranges, 3, 55);
        assert_eq!(ranges, vec![(0, 60)]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The written-ranges bookkeeping agrees with a byte map.
        #[test]
        fn insert_range_matches_a_byte_map(writes in proptest::collection::vec((0u64..64, 0u64..16), 0..24)) {
            let mut ranges = Vec::new();
            let mut bytes = [false; 80];
            for (begin, len) in writes {
                if len == 0 { continue; }
                insert_range(&mut ranges, begin, begin + len);
                for b in &mut bytes[begin as usize..(begin + len) as usize] { *b = true; }
            }
            let mut expected = Vec::new();
            let mut i = 0;
            while i < bytes.len() {
                if bytes[i] {
                    let start = i;
                    while i < bytes.len() && bytes[i] { i += 1; }
                    expected.push((start as u64, i as u64));
                } else {
                    i += 1;
                }
            }
            prop_assert_eq!(ranges, expected);
        }

        /// Any corruption of a valid header is either accepted as a consistent header or
        /// rejected with an error, never a panic.
        #[test]
        fn corrupted_headers_never_panic(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            cut in any::<prop::sample::Index>(),
            shrink in 0u64..40,
        ) {
            let layout = FileLayout::new(
                [("a", DType::F32, &[2u64, 3][..]), ("b.weight", DType::BF16, &[5][..]), ("e", DType::U8, &[0][..])],
                &pt_metadata(),
            ).unwrap();
            let mut json = layout.header_bytes()[8..].to_vec();
            for (at, byte) in edits {
                let i = at.index(json.len());
                json[i] = byte;
            }
            json.truncate(cut.index(json.len() + 1));
            let data_len = layout.file_len() - layout.data_start();
            let file_len = 8 + json.len() as u64 + data_len.saturating_sub(shrink);
            if let Ok(header) = parse_header(Path::new("fuzz.safetensors"), &json, file_len) {
                let total: u64 = header.tensors().iter().map(|t| t.byte_len).sum();
                prop_assert_eq!(total, header.data_len());
            }
        }

        /// Random tensor lists survive writer → reader unchanged.
        #[test]
        fn random_files_round_trip(
            specs in proptest::collection::vec(
                (0usize..DType::ALL.len(), proptest::collection::vec(0u64..5, 0..4)),
                0..6,
            )
        ) {
            let dir = TempDir::new().unwrap();
            let path = dir.path().join("r.safetensors");
            let names: Vec<String> = (0..specs.len()).map(|i| format!("t{i}")).collect();
            let owned: Vec<(DType, Vec<u64>, Vec<u8>)> = specs
                .iter()
                .enumerate()
                .map(|(i, (d, shape))| {
                    let dtype = DType::ALL[*d];
                    let len = byte_len_of(dtype, shape).unwrap() as usize;
                    (dtype, shape.clone(), pattern(len, i as u8))
                })
                .collect();
            let tensors: Vec<(&str, DType, &[u64], &[u8])> = names
                .iter()
                .zip(&owned)
                .map(|(n, (d, s, b))| (n.as_str(), *d, s.as_slice(), b.as_slice()))
                .collect();
            write_file(&path, &tensors, &no_metadata()).unwrap();
            let header = read_header(&path).unwrap();
            prop_assert_eq!(header.tensors().len(), tensors.len());
            for &(name, dtype, shape, data) in &tensors {
                let t = header.tensor(name).unwrap();
                prop_assert_eq!(t.dtype, dtype);
                prop_assert_eq!(t.shape.as_slice(), shape);
                prop_assert_eq!(read_range(&path, t.file_offset, t.byte_len), data.to_vec());
            }
        }
    }
}
