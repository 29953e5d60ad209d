//! One file's header: reading it without the tensor data and checking every rule of the format.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::error::Category;
use shardline_layout::DType;

use super::error::io_error;
use super::*;

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
    pub(super) path: PathBuf,
    pub(super) header_len: u64,
    pub(super) file_len: u64,
    pub(super) metadata: BTreeMap<String, String>,
    /// In data order (increasing offsets).
    pub(super) tensors: Vec<TensorInfo>,
    /// Indices into `tensors`, sorted by tensor name.
    pub(super) by_name: Vec<usize>,
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

pub(super) fn name_order(tensors: &[TensorInfo]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let name = |i: usize| tensors.get(i).map(|t| t.name.as_str());
        name(a).cmp(&name(b))
    });
    order
}

pub(super) fn lookup_by_name<'a>(tensors: &'a [TensorInfo], by_name: &[usize], name: &str) -> Option<&'a TensorInfo> {
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
pub(super) fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<FileHeader, SafetensorsError> {
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
pub(super) fn byte_len_of(dtype: DType, shape: &[u64]) -> Option<u64> {
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
pub(super) struct StringPairs;

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
