//! One file's header: reading it without the tensor data and checking every rule of the format.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, Visitor};
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
    // Parsed as it is read: a large header is never held whole next to the tensors it describes.
    parse_header(path, BufReader::new(file.take(header_len)), header_len, file_len)
}

/// Checks the `header_len` bytes of JSON header `header` of a file of `file_len` bytes (see
/// [`read_header`]).
pub(super) fn parse_header(
    path: &Path,
    header: impl Read,
    header_len: u64,
    file_len: u64,
) -> Result<FileHeader, SafetensorsError> {
    let Entries { metadata: pairs, mut tensors } = parse_header_json(path, header)?;
    let mut metadata = BTreeMap::new();
    for (k, v) in pairs {
        if metadata.contains_key(&k) {
            return Err(SafetensorsError::InvalidMetadata {
                path: path.to_path_buf(),
                reason: format!("key {k:?} appears more than once"),
            });
        }
        metadata.insert(k, v);
    }

    // The format does not fix the order of the JSON keys, only that the tensors, taken by offset,
    // tile the data section. Ties (empty tensors) are broken by name for a stable result.
    tensors.sort_by(|a, b| (a.file_offset, a.byte_len, &a.name).cmp(&(b.file_offset, b.byte_len, &b.name)));
    tensors.shrink_to_fit();
    let by_name = name_order(&tensors);
    if let Some(pair) = by_name.windows(2).find(|pair| tensors[pair[0]].name == tensors[pair[1]].name) {
        return Err(SafetensorsError::DuplicateKey { path: path.to_path_buf(), key: tensors[pair[0]].name.clone() });
    }

    // Offsets are still relative to the data section here.
    let mut covered = 0u64;
    let mut previous: Option<&TensorInfo> = None;
    for t in &tensors {
        if t.file_offset < covered {
            let other = previous.map_or((String::new(), 0, 0), |p| (p.name.clone(), p.file_offset, p.file_end()));
            return Err(SafetensorsError::Overlap {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                begin: t.file_offset,
                end: t.file_end(),
                other: other.0,
                other_begin: other.1,
                other_end: other.2,
            });
        }
        if t.file_offset > covered {
            return Err(SafetensorsError::Hole {
                path: path.to_path_buf(),
                previous: previous.map(|p| p.name.clone()),
                tensor: t.name.clone(),
                gap_begin: covered,
                gap_end: t.file_offset,
            });
        }
        covered = t.file_end();
        // Name the tensor that reaches `covered` in messages, not an empty one sitting at its end.
        if previous.is_none() || t.byte_len > 0 {
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
        let (tensor, end) = tensors
            .iter()
            .find(|t| t.file_end() > data_len)
            .map_or((String::new(), covered), |t| (t.name.clone(), t.file_end()));
        return Err(SafetensorsError::Truncated { path: path.to_path_buf(), tensor, end, data_len });
    }
    if covered < data_len {
        return Err(SafetensorsError::TrailingBytes { path: path.to_path_buf(), declared: covered, data_len });
    }
    for t in &mut tensors {
        // Every tensor ends within the data section, so this stays within the file.
        t.file_offset += data_start;
    }
    Ok(FileHeader { path: path.to_path_buf(), header_len, file_len, metadata, tensors, by_name })
}

/// One tensor entry, checked on its own: a known dtype, and two offsets in order whose span is the
/// byte length of the shape. Its `file_offset` is the entry's begin, relative to the data section.
fn check_entry(path: &Path, name: String, raw: RawTensor) -> Result<TensorInfo, SafetensorsError> {
    let Some(dtype) = DType::from_safetensors_name(&raw.dtype) else {
        return Err(SafetensorsError::UnknownDtype { path: path.to_path_buf(), tensor: name, dtype: raw.dtype });
    };
    let [begin, end] = raw.data_offsets[..] else {
        return Err(SafetensorsError::InvalidEntry {
            path: path.to_path_buf(),
            reason: format!("data_offsets has {} values, expected 2", raw.data_offsets.len()),
            tensor: name,
        });
    };
    if end < begin {
        return Err(SafetensorsError::ReversedOffsets { path: path.to_path_buf(), tensor: name, begin, end });
    }
    let Some(expected) = byte_len_of(dtype, &raw.shape) else {
        return Err(SafetensorsError::ShapeOverflow {
            path: path.to_path_buf(),
            tensor: name,
            dtype,
            shape: raw.shape,
        });
    };
    if expected != end - begin {
        return Err(SafetensorsError::SizeMismatch {
            path: path.to_path_buf(),
            tensor: name,
            dtype,
            shape: raw.shape,
            expected,
            begin,
            end,
        });
    }
    // The shape is kept for as long as the release is planned, and serde reads a list into room
    // for at least four numbers: copied at its size (shrinking in place would leave malloc's
    // block as large as it was).
    let shape = raw.shape.as_slice().to_vec();
    Ok(TensorInfo { name, dtype, shape, file_offset: begin, byte_len: end - begin })
}

/// `product(shape) * dtype.size()`, or `None` on overflow.
pub(super) fn byte_len_of(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?.checked_mul(dtype.size() as u64)
}

// ---- JSON parsing of the header, each tensor entry checked as it is read ----

/// The header's entries: the `__metadata__` pairs in document order (duplicates kept), and the
/// tensors in document order, each checked on its own ([`check_entry`]).
#[derive(Default)]
struct Entries {
    metadata: Vec<(String, String)>,
    tensors: Vec<TensorInfo>,
}

/// A tensor entry before any check. Unknown fields are ignored, as the reference implementation
/// does.
#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

fn parse_header_json(path: &Path, header: impl Read) -> Result<Entries, SafetensorsError> {
    let mut current: Option<String> = None;
    let mut refused: Option<SafetensorsError> = None;
    let mut de = serde_json::Deserializer::from_reader(header);
    let parsed = HeaderSeed { path, current: &mut current, refused: &mut refused }
        .deserialize(&mut de)
        .and_then(|entries| de.end().map(|()| entries));
    if let Some(e) = refused {
        return Err(e);
    }
    parsed.map_err(|e| match (current, e.classify()) {
        (_, Category::Io) => {
            SafetensorsError::Io { path: path.to_path_buf(), action: "read the json header", source: e.into() }
        }
        (Some(key), Category::Data) if key == METADATA_KEY => {
            SafetensorsError::InvalidMetadata { path: path.to_path_buf(), reason: e.to_string() }
        }
        (Some(tensor), Category::Data) => {
            SafetensorsError::InvalidEntry { path: path.to_path_buf(), tensor, reason: e.to_string() }
        }
        _ => SafetensorsError::HeaderNotJson { path: path.to_path_buf(), reason: e.to_string() },
    })
}

/// Deserializes the header object into its entries. While an entry's value is being read, its key
/// sits in `current`, so that an error can name the tensor; an entry that fails its checks stops
/// the parse with its error in `refused`.
struct HeaderSeed<'a> {
    path: &'a Path,
    current: &'a mut Option<String>,
    refused: &'a mut Option<SafetensorsError>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Entries;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = Entries;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a json object mapping tensor names to dtype, shape and data_offsets")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Entries::default();
        let mut seen_metadata = false;
        while let Some(key) = map.next_key::<String>()? {
            let is_metadata = key == METADATA_KEY;
            if is_metadata && std::mem::replace(&mut seen_metadata, true) {
                *self.refused = Some(SafetensorsError::DuplicateKey { path: self.path.to_path_buf(), key });
                return Err(A::Error::custom("duplicate key"));
            }
            *self.current = Some(key);
            if is_metadata {
                entries.metadata = map.next_value_seed(StringPairs)?;
                *self.current = None;
                continue;
            }
            let raw: RawTensor = map.next_value()?;
            let name = self.current.take().unwrap_or_default();
            match check_entry(self.path, name, raw) {
                Ok(tensor) => entries.tensors.push(tensor),
                Err(e) => {
                    *self.refused = Some(e);
                    return Err(A::Error::custom("refused entry"));
                }
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
