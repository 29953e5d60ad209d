//! The DCP `.metadata` file: a pickle of `torch.distributed.checkpoint.metadata.Metadata`.
//!
//! [`encode_metadata`] writes the minimal protocol-2 pickle that every torch from 2.5 to 2.15
//! loads (the brief's recipe, with its version traps): `TensorProperties` state as a 5-tuple via
//! `BUILD`, `torch.Size` via `REDUCE`, `_MEM_FORMAT_ENCODING(0)` via `REDUCE`, `planner_data`
//! always present, no `storage_meta`, no memo.
//!
//! [`decode_metadata`] reads what torch writes (protocol 4 with frames, memo and
//! `STACK_GLOBAL`; `TensorProperties` state as a 5- or 6-tuple or a dict; `storage_meta`;
//! `transform_descriptors` present or not; `MetadataIndex` with or without `offset`/`index`) as
//! well as what [`encode_metadata`] writes. It only extracts what a reader of the checkpoint
//! needs; extra fields are ignored.

use std::collections::HashSet;

use shardline_layout::DType;
use thiserror::Error;

use crate::pickle::{self, PickleError, PickleWriter, Value};

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

/// One component of a `planner_data` path: a dict key or a list index.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PathElem {
    Key(String),
    Index(u64),
}

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
    #[error(".metadata: duplicate {what} {key}")]
    Duplicate { what: &'static str, key: String },
}

// ------------------------------------------------------------------------------------------------
// Encoding

/// `GLOBAL cls; EMPTY_TUPLE; NEWOBJ`: a dataclass instance before its state.
fn new_instance(w: &mut PickleWriter, module: &str, class: &str) {
    w.global(module, class).empty_tuple().newobj();
}

/// `torch.Size(dims)`: `GLOBAL torch Size; ((d0, d1, ...),); REDUCE`.
fn write_size(w: &mut PickleWriter, dims: &[u64]) {
    w.global("torch", "Size").int_tuple(dims).tuple1().reduce();
}

fn write_tensor_properties(w: &mut PickleWriter, dtype: DType) {
    new_instance(w, MD_MODULE, "TensorProperties");
    // (dtype, layout, requires_grad, memory_format, pin_memory): exactly 5 values, which every
    // torch from 2.5 on unpacks (2.15's 6th value, strides, breaks torch <= 2.11).
    w.mark()
        .global("torch", dtype.torch_name())
        .global("torch", "strided")
        .bool(false)
        .global(MD_MODULE, "_MEM_FORMAT_ENCODING")
        .int(0)
        .tuple1()
        .reduce()
        .bool(false)
        .tuple();
    w.build();
}

/// A `state_dict_metadata` entry, borrowed: what [`MetadataEncoder::entry`] writes.
pub enum EntryRef<'a, C> {
    /// `TensorStorageMetadata`; `chunks` yields `(offsets, sizes)` of each saved chunk.
    Tensor {
        dtype: DType,
        size: &'a [u64],
        chunks: C,
    },
    Bytes,
}

/// A `storage_data` item, borrowed: what [`MetadataEncoder::storage`] writes.
pub struct StorageRef<'a> {
    pub fqn: &'a str,
    /// Chunk offsets (`None` for a bytes item).
    pub chunk_offset: Option<&'a [u64]>,
    pub relative_path: &'a str,
    pub offset: u64,
    pub length: u64,
    pub transform_descriptors: Option<&'a [String]>,
}

/// Bytes the encoder gathers before handing them to its sink.
const ENCODER_FLUSH_BYTES: usize = 256 << 10;

/// Writes a `.metadata` pickle (protocol 2, loadable by torch 2.5 through 2.15) to a sink
/// section by section, in the order the sections must appear: every [`entry`](Self::entry), then
/// [`begin_planner_data`](Self::begin_planner_data) and its paths, then
/// [`begin_storage_data`](Self::begin_storage_data) and its items, then [`finish`](Self::finish).
///
/// Memory stays bounded by one flush buffer however many chunks the checkpoint has: the caller
/// streams borrowed views of its own plan instead of building a [`Metadata`] first.
pub struct MetadataEncoder<W: std::io::Write> {
    w: PickleWriter,
    sink: W,
    /// Whether the open dict (or list) has items, i.e. whether its `MARK` was written.
    open_items: bool,
}

impl<W: std::io::Write> MetadataEncoder<W> {
    /// Starts the pickle and the `state_dict_metadata` dict.
    pub fn new(sink: W) -> Self {
        let mut w = PickleWriter::new();
        w.proto(2);
        new_instance(&mut w, MD_MODULE, "Metadata");
        w.empty_dict().mark();
        w.str("state_dict_metadata").empty_dict();
        MetadataEncoder { w, sink, open_items: false }
    }

    /// `MARK` before the first item of the open dict: an empty dict is a bare `EMPTY_DICT`.
    fn item(&mut self) {
        if !self.open_items {
            self.w.mark();
            self.open_items = true;
        }
    }

    /// Closes the open dict with `SETITEMS` if it has items.
    fn close_dict(&mut self) {
        if std::mem::take(&mut self.open_items) {
            self.w.setitems();
        }
    }

    fn flush_if_full(&mut self) -> std::io::Result<()> {
        if self.w.as_bytes().len() >= ENCODER_FLUSH_BYTES {
            self.w.drain_into(&mut self.sink)?;
        }
        Ok(())
    }

    /// One `state_dict_metadata` entry.
    pub fn entry<'c, C>(&mut self, fqn: &str, entry: EntryRef<'_, C>) -> std::io::Result<()>
    where
        C: IntoIterator<Item = (&'c [u64], &'c [u64])>,
    {
        self.item();
        let w = &mut self.w;
        w.str(fqn);
        match entry {
            EntryRef::Tensor { dtype, size, chunks } => {
                new_instance(w, MD_MODULE, "TensorStorageMetadata");
                w.empty_dict().mark();
                w.str("properties");
                write_tensor_properties(w, dtype);
                w.str("size");
                write_size(w, size);
                w.str("chunks").empty_list();
                let mut any = false;
                for (offsets, sizes) in chunks {
                    if !any {
                        w.mark();
                        any = true;
                    }
                    new_instance(w, MD_MODULE, "ChunkStorageMetadata");
                    w.empty_dict().mark().str("offsets");
                    write_size(w, offsets);
                    w.str("sizes");
                    write_size(w, sizes);
                    w.setitems().build();
                }
                if any {
                    w.appends();
                }
                w.setitems().build();
            }
            EntryRef::Bytes => new_instance(w, MD_MODULE, "BytesStorageMetadata"),
        }
        self.flush_if_full()
    }

    /// Ends `state_dict_metadata` and opens `planner_data`, which is always present: torch
    /// 2.5-2.7's dcp_to_torch_save and FSDP1's optimizer loading index it.
    pub fn begin_planner_data(&mut self) {
        self.close_dict();
        self.w.str("planner_data").empty_dict();
    }

    /// One `planner_data` item: `fqn` → its path in the nested state dict.
    pub fn planner_path(&mut self, fqn: &str, path: &[PathElem]) -> std::io::Result<()> {
        self.item();
        let w = &mut self.w;
        w.str(fqn).mark();
        for p in path {
            match p {
                PathElem::Key(k) => w.str(k),
                PathElem::Index(i) => w.int((*i).into()),
            };
        }
        w.tuple();
        self.flush_if_full()
    }

    /// Ends `planner_data` and opens `storage_data`.
    pub fn begin_storage_data(&mut self) {
        self.close_dict();
        self.w.str("storage_data").empty_dict();
    }

    /// One `storage_data` item: a `MetadataIndex` → `_StorageInfo`.
    pub fn storage(&mut self, item: &StorageRef<'_>) -> std::io::Result<()> {
        self.item();
        let w = &mut self.w;
        new_instance(w, MD_MODULE, "MetadataIndex");
        w.empty_dict().mark().str("fqn").str(item.fqn);
        if let Some(offset) = item.chunk_offset {
            w.str("offset");
            write_size(w, offset);
        }
        w.setitems().build();

        new_instance(w, FS_MODULE, "_StorageInfo");
        w.empty_dict().mark();
        w.str("relative_path").str(item.relative_path);
        w.str("offset").int(item.offset.into());
        w.str("length").int(item.length.into());
        if let Some(tds) = item.transform_descriptors {
            w.str("transform_descriptors").empty_list();
            if !tds.is_empty() {
                w.mark();
                for t in tds {
                    w.str(t);
                }
                w.appends();
            }
        }
        w.setitems().build();
        self.flush_if_full()
    }

    /// Ends `storage_data`, writes `version` if given, closes the pickle and returns the sink
    /// with every byte handed to it.
    pub fn finish(mut self, version: Option<&str>) -> std::io::Result<W> {
        self.close_dict();
        if let Some(v) = version {
            self.w.str("version").str(v);
        }
        self.w.setitems().build().stop();
        self.w.drain_into(&mut self.sink)?;
        Ok(self.sink)
    }
}

/// Streams `md` through `encoder`'s sections (the one encoder; [`encode_metadata`] is this into
/// a byte vector).
fn write_metadata<W: std::io::Write>(md: &Metadata, mut e: MetadataEncoder<W>) -> std::io::Result<W> {
    for (fqn, entry) in &md.state_dict_metadata {
        let entry = match entry {
            EntryMeta::Tensor { dtype, size, chunks } => EntryRef::Tensor {
                dtype: *dtype,
                size,
                chunks: chunks.iter().map(|c| (c.offsets.as_slice(), c.sizes.as_slice())),
            },
            EntryMeta::Bytes => EntryRef::Bytes,
        };
        e.entry(fqn, entry)?;
    }
    e.begin_planner_data();
    for (fqn, path) in &md.planner_data {
        e.planner_path(fqn, path)?;
    }
    e.begin_storage_data();
    for (key, info) in &md.storage_data {
        e.storage(&StorageRef {
            fqn: &key.fqn,
            chunk_offset: key.offset.as_deref(),
            relative_path: &info.relative_path,
            offset: info.offset,
            length: info.length,
            transform_descriptors: info.transform_descriptors.as_deref(),
        })?;
    }
    e.finish(md.version.as_deref())
}

/// The `.metadata` pickle of `md` (protocol 2, loadable by torch 2.5 through 2.15).
pub fn encode_metadata(md: &Metadata) -> Vec<u8> {
    // Writing to a Vec cannot fail.
    write_metadata(md, MetadataEncoder::new(Vec::new())).unwrap_or_default()
}

// ------------------------------------------------------------------------------------------------
// Decoding

fn unexpected(path: &str, expected: &'static str, found: &Value) -> DcpMetadataError {
    DcpMetadataError::Unexpected { path: path.to_owned(), expected, found: found.describe() }
}

/// A Python repr-ish rendering of a key for paths.
fn key_path(parent: &str, key: &str) -> String {
    format!("{parent}[{key:?}]")
}

/// The class and state of a pickled instance: `cls.__new__(cls)` + `BUILD` (protocol 2+), or
/// `copyreg._reconstructor(cls, object, None)` + `BUILD` (protocols 0 and 1).
fn instance(v: &Value) -> Option<(&Value, Option<&Value>)> {
    match v {
        Value::Object { class, state, .. } => Some((class, state.as_deref())),
        Value::Reduce { callable, args, state, .. } if callable.is_global("copyreg", "_reconstructor") => {
            Some((args.as_seq()?.first()?, state.as_deref()))
        }
        _ => None,
    }
}

/// The state of an instance of `module.class` at `path`.
fn expect_instance<'a>(
    v: &'a Value,
    path: &str,
    module: &str,
    class: &str,
    expected: &'static str,
) -> Result<Option<&'a Value>, DcpMetadataError> {
    match instance(v) {
        Some((cls, state)) if cls.is_global(module, class) => Ok(state),
        _ => Err(unexpected(path, expected, v)),
    }
}

/// Field `name` of an instance state: a `__dict__`, or `(__dict__, slots)`.
fn field<'a>(state: Option<&'a Value>, name: &str) -> Option<&'a Value> {
    match state? {
        d @ Value::Dict(_) => d.dict_get(name),
        Value::Tuple(parts) => parts.iter().rev().find_map(|p| p.dict_get(name)),
        _ => None,
    }
}

fn required<'a>(state: Option<&'a Value>, path: &str, name: &'static str) -> Result<&'a Value, DcpMetadataError> {
    field(state, name).ok_or_else(|| DcpMetadataError::Missing { path: path.to_owned(), field: name })
}

fn to_u64(v: &Value, path: &str) -> Result<u64, DcpMetadataError> {
    v.as_int().and_then(|i| u64::try_from(i).ok()).ok_or_else(|| unexpected(path, "a non-negative int", v))
}

fn to_str<'a>(v: &'a Value, path: &str) -> Result<&'a str, DcpMetadataError> {
    v.as_str().ok_or_else(|| unexpected(path, "a str", v))
}

/// A `torch.Size` (or a plain tuple or list of ints).
fn to_size(v: &Value, path: &str) -> Result<Vec<u64>, DcpMetadataError> {
    let dims = match v {
        Value::Reduce { callable, args, .. } if callable.is_global("torch", "Size") => match args.as_seq() {
            Some([dims]) => dims,
            _ => return Err(unexpected(path, "torch.Size((dims...))", v)),
        },
        other => other,
    };
    let items = dims.as_seq().ok_or_else(|| unexpected(path, "a torch.Size", v))?;
    items.iter().enumerate().map(|(i, d)| to_u64(d, &format!("{path}[{i}]"))).collect()
}

fn to_dtype(v: &Value, path: &str) -> Result<DType, DcpMetadataError> {
    match v.as_global() {
        Some(("torch", name)) => DType::from_torch_name(name)
            .ok_or_else(|| DcpMetadataError::UnsupportedDtype { path: path.to_owned(), name: format!("torch.{name}") }),
        _ => Err(unexpected(path, "a torch dtype", v)),
    }
}

/// `None` or absent → `None`.
fn optional(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !matches!(v, Value::None))
}

fn decode_tensor_properties(v: &Value, path: &str) -> Result<DType, DcpMetadataError> {
    let state = expect_instance(v, path, MD_MODULE, "TensorProperties", "TensorProperties")?;
    let dtype_path = format!("{path}.dtype");
    match state {
        // (dtype, layout, requires_grad, memory_format, pin_memory[, strides])
        Some(Value::Tuple(items)) => match items.first() {
            Some(dtype) if (5..=6).contains(&items.len()) => to_dtype(dtype, &dtype_path),
            _ => Err(unexpected(path, "a 5- or 6-tuple state", state.unwrap_or(&Value::None))),
        },
        Some(d @ Value::Dict(_)) => {
            let dtype = d
                .dict_get("dtype")
                .ok_or_else(|| DcpMetadataError::Missing { path: path.to_owned(), field: "dtype" })?;
            to_dtype(dtype, &dtype_path)
        }
        Some(other) => Err(unexpected(path, "a tuple or dict state", other)),
        None => Err(DcpMetadataError::Missing { path: path.to_owned(), field: "dtype" }),
    }
}

fn decode_entry(v: &Value, path: &str) -> Result<EntryMeta, DcpMetadataError> {
    let Some((class, state)) = instance(v) else {
        return Err(unexpected(path, "TensorStorageMetadata or BytesStorageMetadata", v));
    };
    if class.is_global(MD_MODULE, "BytesStorageMetadata") {
        return Ok(EntryMeta::Bytes);
    }
    if !class.is_global(MD_MODULE, "TensorStorageMetadata") {
        return Err(unexpected(path, "TensorStorageMetadata or BytesStorageMetadata", v));
    }
    let dtype = decode_tensor_properties(required(state, path, "properties")?, &format!("{path}.properties"))?;
    let size = to_size(required(state, path, "size")?, &format!("{path}.size"))?;
    let chunks_path = format!("{path}.chunks");
    let chunks_v = required(state, path, "chunks")?;
    let items = chunks_v.as_seq().ok_or_else(|| unexpected(&chunks_path, "a list", chunks_v))?;
    let chunks = items
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let p = format!("{chunks_path}[{i}]");
            let st = expect_instance(c, &p, MD_MODULE, "ChunkStorageMetadata", "ChunkStorageMetadata")?;
            Ok(ChunkMeta {
                offsets: to_size(required(st, &p, "offsets")?, &format!("{p}.offsets"))?,
                sizes: to_size(required(st, &p, "sizes")?, &format!("{p}.sizes"))?,
            })
        })
        .collect::<Result<Vec<_>, DcpMetadataError>>()?;
    Ok(EntryMeta::Tensor { dtype, size, chunks })
}

fn decode_storage_key(v: &Value, path: &str) -> Result<StorageKey, DcpMetadataError> {
    let st = expect_instance(v, path, MD_MODULE, "MetadataIndex", "MetadataIndex")?;
    let fqn = to_str(required(st, path, "fqn")?, &format!("{path}.fqn"))?.to_owned();
    let offset = optional(field(st, "offset")).map(|o| to_size(o, &format!("{path}.offset"))).transpose()?;
    Ok(StorageKey { fqn, offset })
}

fn decode_storage_info(v: &Value, path: &str) -> Result<StorageInfo, DcpMetadataError> {
    let st = expect_instance(v, path, FS_MODULE, "_StorageInfo", "_StorageInfo")?;
    let relative_path = to_str(required(st, path, "relative_path")?, &format!("{path}.relative_path"))?.to_owned();
    let offset = to_u64(required(st, path, "offset")?, &format!("{path}.offset"))?;
    let length = to_u64(required(st, path, "length")?, &format!("{path}.length"))?;
    let td_path = format!("{path}.transform_descriptors");
    let transform_descriptors = optional(field(st, "transform_descriptors"))
        .map(|t| {
            let items = t.as_seq().ok_or_else(|| unexpected(&td_path, "a list of str", t))?;
            items
                .iter()
                .enumerate()
                .map(|(i, s)| to_str(s, &format!("{td_path}[{i}]")).map(str::to_owned))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Ok(StorageInfo { relative_path, offset, length, transform_descriptors })
}

fn decode_path(v: &Value, path: &str) -> Result<Vec<PathElem>, DcpMetadataError> {
    let items = v.as_seq().ok_or_else(|| unexpected(path, "a tuple of str and int", v))?;
    items
        .iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::Str(s) => Ok(PathElem::Key(s.clone())),
            Value::Int(n) => u64::try_from(*n)
                .map(PathElem::Index)
                .map_err(|_| unexpected(&format!("{path}[{i}]"), "a str or non-negative int", p)),
            other => Err(unexpected(&format!("{path}[{i}]"), "a str or int", other)),
        })
        .collect()
}

/// Parses a `.metadata` file's bytes.
pub fn decode_metadata(bytes: &[u8]) -> Result<Metadata, DcpMetadataError> {
    let root = pickle::loads(bytes)?;
    let st = expect_instance(&root, "Metadata", MD_MODULE, "Metadata", "Metadata")?;

    let sdm_path = "state_dict_metadata";
    let sdm_v = required(st, "Metadata", "state_dict_metadata")?;
    let sdm = sdm_v.as_dict().ok_or_else(|| unexpected(sdm_path, "a dict", sdm_v))?;
    let mut seen = HashSet::new();
    let mut state_dict_metadata = Vec::with_capacity(sdm.len());
    for (k, v) in sdm {
        let fqn = to_str(k, &format!("{sdm_path} key"))?;
        if !seen.insert(fqn) {
            return Err(DcpMetadataError::Duplicate { what: "state_dict_metadata key", key: format!("{fqn:?}") });
        }
        state_dict_metadata.push((fqn.to_owned(), decode_entry(v, &key_path(sdm_path, fqn))?));
    }

    let mut storage_data = Vec::new();
    if let Some(sd_v) = optional(field(st, "storage_data")) {
        let sd = sd_v.as_dict().ok_or_else(|| unexpected("storage_data", "a dict", sd_v))?;
        let mut seen = HashSet::new();
        storage_data.reserve(sd.len());
        for (i, (k, v)) in sd.iter().enumerate() {
            let key = decode_storage_key(k, &format!("storage_data key {i}"))?;
            let p = format!("storage_data[{:?}, {:?}]", key.fqn, key.offset);
            let info = decode_storage_info(v, &p)?;
            if !seen.insert(key.clone()) {
                return Err(DcpMetadataError::Duplicate {
                    what: "storage_data key",
                    key: format!("({:?}, {:?})", key.fqn, key.offset),
                });
            }
            storage_data.push((key, info));
        }
    }

    let mut planner_data = Vec::new();
    if let Some(pd_v) = optional(field(st, "planner_data")) {
        let pd = pd_v.as_dict().ok_or_else(|| unexpected("planner_data", "a dict", pd_v))?;
        for (k, v) in pd {
            let fqn = to_str(k, "planner_data key")?;
            planner_data.push((fqn.to_owned(), decode_path(v, &key_path("planner_data", fqn))?));
        }
    }

    let version = optional(field(st, "version")).map(|v| to_str(v, "version").map(str::to_owned)).transpose()?;

    Ok(Metadata { state_dict_metadata, storage_data, planner_data, version })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_save::{
        encode_object_archive, encode_tensor_archive, read_object_archive, read_tensor_archive, PyObject,
    };

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch-written");

    fn key(fqn: &str, offset: Option<&[u64]>) -> StorageKey {
        StorageKey { fqn: fqn.into(), offset: offset.map(<[u64]>::to_vec) }
    }

    fn info(path: &str, offset: u64, length: u64) -> StorageInfo {
        StorageInfo { relative_path: path.into(), offset, length, transform_descriptors: None }
    }

    fn keys(path: &[&str]) -> Vec<PathElem> {
        path.iter().map(|k| PathElem::Key((*k).into())).collect()
    }

    fn x(s: &str) -> Vec<u8> {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        b
    }

    #[test]
    fn encoding_follows_the_brief_recipe_byte_for_byte() {
        let md = Metadata {
            state_dict_metadata: vec![
                (
                    "s".into(),
                    EntryMeta::Tensor {
                        dtype: DType::F32,
                        size: vec![],
                        chunks: vec![ChunkMeta { offsets: vec![], sizes: vec![] }],
                    },
                ),
                ("it".into(), EntryMeta::Bytes),
            ],
            storage_data: vec![
                (key("s", Some(&[])), info("d.distcp", 0, 100)),
                (key("it", None), info("d.distcp", 100, 50)),
            ],
            planner_data: vec![("s".into(), keys(&["s"])), ("it".into(), keys(&["it"]))],
            version: None,
        };
        let m = b"ctorch.distributed.checkpoint.metadata\n".to_vec();
        let size0 = b"ctorch\nSize\n)\x85R".to_vec();
        let tp = [
            &m[..],
            b"TensorProperties\n)\x81(ctorch\nfloat32\nctorch\nstrided\n\x89",
            &m,
            b"_MEM_FORMAT_ENCODING\nK\x00\x85R\x89tb",
        ]
        .concat();
        let chunk =
            [&m[..], b"ChunkStorageMetadata\n)\x81}(", &x("offsets"), &size0, &x("sizes"), &size0, b"ub"].concat();
        let tsm = [
            &m[..],
            b"TensorStorageMetadata\n)\x81}(",
            &x("properties"),
            &tp,
            &x("size"),
            &size0,
            &x("chunks"),
            b"](",
            &chunk,
            b"eub",
        ]
        .concat();
        let si = |path: &str, off: &[u8], len: &[u8]| {
            [
                &b"ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n)\x81}("[..],
                &x("relative_path"),
                &x(path),
                &x("offset"),
                off,
                &x("length"),
                len,
                b"ub",
            ]
            .concat()
        };
        let want = [
            &b"\x80\x02"[..],
            &m,
            b"Metadata\n)\x81}(",
            &x("state_dict_metadata"),
            b"}(",
            &x("s"),
            &tsm,
            &x("it"),
            &m,
            b"BytesStorageMetadata\n)\x81u",
            &x("planner_data"),
            b"}(",
            &x("s"),
            b"(",
            &x("s"),
            b"t",
            &x("it"),
            b"(",
            &x("it"),
            b"tu",
            &x("storage_data"),
            b"}(",
            &m,
            b"MetadataIndex\n)\x81}(",
            &x("fqn"),
            &x("s"),
            &x("offset"),
            &size0,
            b"ub",
            &si("d.distcp", b"K\x00", b"Kd"),
            &m,
            b"MetadataIndex\n)\x81}(",
            &x("fqn"),
            &x("it"),
            b"ub",
            &si("d.distcp", b"Kd", b"K2"),
            b"u",   // storage_data
            b"ub.", // Metadata
        ]
        .concat();
        let got = encode_metadata(&md);
        assert_eq!(got, want);
        assert_eq!(decode_metadata(&got).unwrap(), md);
    }

    fn rich_metadata() -> Metadata {
        Metadata {
            state_dict_metadata: vec![
                (
                    "model.w".into(),
                    EntryMeta::Tensor {
                        dtype: DType::BF16,
                        size: vec![3, 4],
                        chunks: vec![
                            ChunkMeta { offsets: vec![0, 0], sizes: vec![2, 4] },
                            ChunkMeta { offsets: vec![2, 0], sizes: vec![1, 4] },
                        ],
                    },
                ),
                (
                    "big".into(),
                    EntryMeta::Tensor { dtype: DType::F8E5M2, size: vec![1 << 33, 2, 3, 4, 5], chunks: vec![] },
                ),
                ("optimizer.param_groups.0.lr".into(), EntryMeta::Bytes),
            ],
            storage_data: vec![
                (key("model.w", Some(&[0, 0])), info("__0_0.distcp", 0, 1000)),
                (key("model.w", Some(&[2, 0])), info("__1_0.distcp", (1 << 40) + 3, 1 << 31)),
                (
                    key("optimizer.param_groups.0.lr", None),
                    StorageInfo {
                        transform_descriptors: Some(vec!["stream.zstd/1".into()]),
                        ..info("é/x.distcp", u64::MAX, 0)
                    },
                ),
            ],
            planner_data: vec![
                ("model.w".into(), keys(&["model", "w"])),
                (
                    "optimizer.param_groups.0.lr".into(),
                    vec![
                        PathElem::Key("optimizer".into()),
                        PathElem::Key("param_groups".into()),
                        PathElem::Index(0),
                        PathElem::Key("lr".into()),
                    ],
                ),
            ],
            version: Some(CURRENT_DCP_VERSION.into()),
        }
    }

    /// A sink that records how many writes it took.
    struct CountingSink {
        bytes: Vec<u8>,
        writes: usize,
    }

    impl std::io::Write for CountingSink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.writes += 1;
            self.bytes.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_large_metadata_streams_in_bounded_pieces() {
        let mut md = rich_metadata();
        for i in 0..20_000u64 {
            md.storage_data.push((key(&format!("layers.{i}.w"), Some(&[i, 0])), info("__0_0.distcp", i * 64, 64)));
        }
        let want = encode_metadata(&md);
        let sink = write_metadata(&md, MetadataEncoder::new(CountingSink { bytes: Vec::new(), writes: 0 })).unwrap();
        assert!(sink.bytes == want);
        assert!(want.len() > 4 * ENCODER_FLUSH_BYTES, "{} bytes", want.len());
        // Every flush hands over one buffer of about ENCODER_FLUSH_BYTES (one item past it at most).
        assert!(sink.writes >= want.len() / (2 * ENCODER_FLUSH_BYTES), "{} writes", sink.writes);
        assert_eq!(decode_metadata(&sink.bytes).unwrap(), md);
    }

    #[test]
    fn round_trip() {
        let md = rich_metadata();
        let bytes = encode_metadata(&md);
        let back = decode_metadata(&bytes).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.storage("model.w", Some(&[2, 0])).unwrap().length, 1 << 31);
        assert_eq!(back.entry("optimizer.param_groups.0.lr"), Some(&EntryMeta::Bytes));
        // Empty metadata.
        let empty = Metadata { state_dict_metadata: vec![], storage_data: vec![], planner_data: vec![], version: None };
        assert_eq!(decode_metadata(&encode_metadata(&empty)).unwrap(), empty);
    }

    #[test]
    fn decodes_torch_written_metadata_and_items() {
        let bytes = std::fs::read(format!("{FIXTURES}/ckpt/.metadata")).unwrap();
        assert_eq!(&bytes[..3], b"\x80\x04\x95", "protocol 4 with frames");
        let md = decode_metadata(&bytes).unwrap();
        let p = "__0_0.distcp";
        assert_eq!(
            md,
            Metadata {
                state_dict_metadata: vec![
                    (
                        "model.w".into(),
                        EntryMeta::Tensor {
                            dtype: DType::BF16,
                            size: vec![3, 4],
                            chunks: vec![ChunkMeta { offsets: vec![0, 0], sizes: vec![3, 4] }],
                        }
                    ),
                    (
                        "model.f8".into(),
                        EntryMeta::Tensor {
                            dtype: DType::F8E4M3,
                            size: vec![3],
                            chunks: vec![ChunkMeta { offsets: vec![0], sizes: vec![3] }],
                        }
                    ),
                    (
                        "step".into(),
                        EntryMeta::Tensor {
                            dtype: DType::F32,
                            size: vec![],
                            chunks: vec![ChunkMeta { offsets: vec![], sizes: vec![] }],
                        }
                    ),
                    ("lr".into(), EntryMeta::Bytes),
                    ("iteration".into(), EntryMeta::Bytes),
                ],
                storage_data: vec![
                    (key("lr", None), info(p, 0, 1261)),
                    (key("iteration", None), info(p, 1261, 1261)),
                    (key("model.w", Some(&[0, 0])), info(p, 2522, 1577)),
                    (key("model.f8", Some(&[0])), info(p, 4099, 1577)),
                    (key("step", Some(&[])), info(p, 5676, 1577)),
                ],
                planner_data: vec![
                    ("model.w".into(), keys(&["model", "w"])),
                    ("model.f8".into(), keys(&["model", "f8"])),
                    ("step".into(), keys(&["step"])),
                    ("lr".into(), keys(&["lr"])),
                    ("iteration".into(), keys(&["iteration"])),
                ],
                version: Some("1.0.0".into()),
            }
        );

        // Every item the metadata points at reads back with the shape and dtype it declares.
        let file = std::fs::File::open(format!("{FIXTURES}/ckpt/{p}")).unwrap();
        for (k, si) in &md.storage_data {
            match md.entry(&k.fqn).unwrap() {
                EntryMeta::Tensor { dtype, chunks, .. } => {
                    let t = read_tensor_archive(&file, si.offset, si.length).unwrap();
                    assert_eq!(t.dtype, *dtype);
                    let chunk = chunks.iter().find(|c| Some(&c.offsets) == k.offset.as_ref()).unwrap();
                    assert_eq!(t.shape, chunk.sizes);
                }
                EntryMeta::Bytes => {
                    read_object_archive(&file, si.offset, si.length).unwrap();
                }
            }
        }
    }

    /// Builds `.metadata` pickles the way other torch versions do, to exercise the variants.
    fn variant_pickle(tp_state: impl Fn(&mut PickleWriter), with_index: bool) -> Vec<u8> {
        let mut w = PickleWriter::new();
        w.proto(2);
        new_instance(&mut w, MD_MODULE, "Metadata");
        w.empty_dict().mark().str("state_dict_metadata").empty_dict().mark().str("t");
        new_instance(&mut w, MD_MODULE, "TensorStorageMetadata");
        w.empty_dict().mark().str("properties");
        new_instance(&mut w, MD_MODULE, "TensorProperties");
        tp_state(&mut w);
        w.build().str("size");
        write_size(&mut w, &[2]);
        w.str("chunks").empty_list().setitems().build().setitems();
        w.str("storage_data").empty_dict().mark();
        new_instance(&mut w, MD_MODULE, "MetadataIndex");
        w.empty_dict().mark().str("fqn").str("t").str("offset");
        write_size(&mut w, &[0]);
        if with_index {
            w.str("index").int(0);
        }
        w.setitems().build();
        new_instance(&mut w, FS_MODULE, "_StorageInfo");
        w.empty_dict().mark().str("relative_path").str("f").str("offset").int(1);
        w.str("length").int(2).str("transform_descriptors").none().setitems().build();
        w.setitems();
        // storage_meta as torch writes it; planner_data None (torch without a planner mapping).
        w.str("storage_meta");
        new_instance(&mut w, MD_MODULE, "StorageMeta");
        w.empty_dict().mark().str("checkpoint_id").global("pathlib", "PosixPath").str("/x");
        w.tuple1().reduce().str("save_id").str("u").str("load_id").none();
        w.str("modules").empty_list().setitems().build();
        w.str("planner_data").none();
        w.setitems().build().stop();
        w.into_bytes()
    }

    #[test]
    fn accepts_the_variants_torch_versions_write() {
        let six = |w: &mut PickleWriter| {
            w.mark().global("torch", "float16");
            w.global("torch.serialization", "_get_layout").str("torch.strided").tuple1().reduce();
            w.bool(false).global(MD_MODULE, "_MEM_FORMAT_ENCODING").int(0).tuple1().reduce();
            w.bool(false).int_tuple(&[1]).tuple();
        };
        let five = |w: &mut PickleWriter| {
            w.mark().global("torch", "float16").global("torch", "strided").bool(false).none();
            w.bool(false).tuple();
        };
        let dict = |w: &mut PickleWriter| {
            w.empty_dict().mark().str("dtype").global("torch", "float16").str("layout");
            w.global("torch", "strided").setitems();
        };
        for (name, pkl) in [
            ("6-tuple with index", variant_pickle(six, true)),
            ("5-tuple without index", variant_pickle(five, false)),
            ("dict", variant_pickle(dict, true)),
        ] {
            let md = decode_metadata(&pkl).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                md.state_dict_metadata,
                vec![("t".to_string(), EntryMeta::Tensor { dtype: DType::F16, size: vec![2], chunks: vec![] })],
                "{name}"
            );
            assert_eq!(md.storage_data, vec![(key("t", Some(&[0])), info("f", 1, 2))], "{name}");
            assert!(md.planner_data.is_empty());
            assert_eq!(md.version, None);
        }
    }

    #[test]
    fn errors_name_the_field() {
        let mut md = rich_metadata();
        let good = encode_metadata(&md);

        // A 4-tuple TensorProperties state.
        let four = |w: &mut PickleWriter| {
            w.mark().global("torch", "float16").global("torch", "strided").bool(false).none();
            w.tuple();
        };
        let err = decode_metadata(&variant_pickle(four, false)).unwrap_err();
        assert_eq!(
            err.to_string(),
            ".metadata: state_dict_metadata[\"t\"].properties: expected a 5- or 6-tuple state, \
             found tuple of 4"
        );
        // An unknown dtype.
        let cplx = |w: &mut PickleWriter| {
            w.mark().global("torch", "complex64").global("torch", "strided").bool(false).none();
            w.bool(false).tuple();
        };
        let err = decode_metadata(&variant_pickle(cplx, false)).unwrap_err();
        assert_eq!(
            err.to_string(),
            ".metadata: state_dict_metadata[\"t\"].properties.dtype: unsupported dtype \
             torch.complex64"
        );
        // A negative chunk offset.
        let mut w = PickleWriter::new();
        w.proto(2);
        new_instance(&mut w, MD_MODULE, "Metadata");
        w.empty_dict().mark().str("state_dict_metadata").empty_dict().mark().str("t");
        new_instance(&mut w, MD_MODULE, "TensorStorageMetadata");
        w.empty_dict().mark().str("properties");
        write_tensor_properties(&mut w, DType::F32);
        w.str("size");
        write_size(&mut w, &[2]);
        w.str("chunks").empty_list();
        new_instance(&mut w, MD_MODULE, "ChunkStorageMetadata");
        w.empty_dict().mark().str("offsets").global("torch", "Size").mark().int(-1).tuple();
        w.tuple1().reduce().str("sizes");
        write_size(&mut w, &[2]);
        w.setitems().build().append(); // the chunk
        w.setitems().build(); // TensorStorageMetadata
        w.setitems().setitems().build().stop(); // state_dict_metadata, Metadata
        let err = decode_metadata(w.as_bytes()).unwrap_err();
        assert_eq!(
            err.to_string(),
            ".metadata: state_dict_metadata[\"t\"].chunks[0].offsets[0]: expected a non-negative \
             int, found int -1"
        );
        // Not a Metadata at all.
        let err = decode_metadata(b"\x80\x02}.").unwrap_err();
        assert_eq!(err.to_string(), ".metadata: Metadata: expected Metadata, found dict of 0");
        // Duplicate storage keys.
        md.storage_data.push(md.storage_data[0].clone());
        let err = decode_metadata(&encode_metadata(&md)).unwrap_err();
        assert!(matches!(err, DcpMetadataError::Duplicate { what: "storage_data key", .. }));
        // Every truncation of a valid file is an error.
        for n in 0..good.len() {
            assert!(decode_metadata(&good[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        let torch = std::fs::read(format!("{FIXTURES}/ckpt/.metadata")).unwrap();
        for n in 0..torch.len() {
            assert!(decode_metadata(&torch[..n]).is_err(), "prefix of {n} bytes accepted");
        }
    }

    fn bf16(v: f32) -> [u8; 2] {
        ((v.to_bits() >> 16) as u16).to_le_bytes()
    }

    /// Writes a small checkpoint (`.metadata` + `__0_0.distcp`) into `dir`:
    /// `model.w` bf16 [3, 4] = i * 0.5 - 1 in two row chunks, `model.b` f32 [5],
    /// `model.f8` float8_e4m3fn [3], `step` f32 0-d = 2.5, and bytes items
    /// `checkpoint_version` = 3.0, `iteration` = 0, `optimizer.param_groups.0.lr` = 0.001.
    fn write_interop_checkpoint(dir: &std::path::Path) -> Metadata {
        let path = "__0_0.distcp";
        let mut file = Vec::new();
        let mut storage_data = Vec::new();
        let mut state_dict_metadata = Vec::new();
        let mut planner_data = Vec::new();
        let w: Vec<u8> = (0..12).flat_map(|i| bf16(i as f32 * 0.5 - 1.0)).collect();
        let b: Vec<u8> = [1.0f32, -2.0, 3.25, 1e30, -0.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        type Chunk = (Vec<u64>, Vec<u64>, Vec<u8>); // offsets, sizes, bytes
        let tensors: Vec<(&str, DType, Vec<u64>, Vec<Chunk>)> = vec![
            (
                "model.w",
                DType::BF16,
                vec![3, 4],
                vec![(vec![0, 0], vec![2, 4], w[..16].to_vec()), (vec![2, 0], vec![1, 4], w[16..].to_vec())],
            ),
            ("model.b", DType::F32, vec![5], vec![(vec![0], vec![5], b)]),
            ("model.f8", DType::F8E4M3, vec![3], vec![(vec![0], vec![3], vec![0x30, 0xB8, 0x40])]),
            ("step", DType::F32, vec![], vec![(vec![], vec![], 2.5f32.to_le_bytes().to_vec())]),
        ];
        for (fqn, dtype, size, chunks) in tensors {
            let mut metas = Vec::new();
            for (offsets, sizes, data) in chunks {
                let item = encode_tensor_archive(dtype, &sizes, &data).unwrap();
                storage_data.push((key(fqn, Some(&offsets)), info(path, file.len() as u64, item.len() as u64)));
                file.extend_from_slice(&item);
                metas.push(ChunkMeta { offsets, sizes });
            }
            state_dict_metadata.push((fqn.to_string(), EntryMeta::Tensor { dtype, size, chunks: metas }));
            planner_data.push((fqn.to_string(), keys(&fqn.split('.').collect::<Vec<_>>())));
        }
        for (fqn, value, path_elems) in [
            ("checkpoint_version", PyObject::Float(3.0), keys(&["checkpoint_version"])),
            ("iteration", PyObject::Int(0), keys(&["iteration"])),
            (
                "optimizer.param_groups.0.lr",
                PyObject::Float(0.001),
                vec![
                    PathElem::Key("optimizer".into()),
                    PathElem::Key("param_groups".into()),
                    PathElem::Index(0),
                    PathElem::Key("lr".into()),
                ],
            ),
        ] {
            let item = encode_object_archive(&value);
            storage_data.push((key(fqn, None), info(path, file.len() as u64, item.len() as u64)));
            file.extend_from_slice(&item);
            state_dict_metadata.push((fqn.to_string(), EntryMeta::Bytes));
            planner_data.push((fqn.to_string(), path_elems));
        }
        let md = Metadata { state_dict_metadata, storage_data, planner_data, version: None };
        std::fs::write(dir.join(path), &file).unwrap();
        std::fs::write(dir.join(".metadata"), encode_metadata(&md)).unwrap();
        md
    }

    /// Writes the interop checkpoint into `$SHARDLINE_DCP_INTEROP_DIR` when set (to load it with
    /// real torch by hand), else into a temporary directory, and reads it back.
    #[test]
    fn interop_checkpoint_reads_back() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::env::var_os("SHARDLINE_DCP_INTEROP_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| tmp.path().to_path_buf());
        std::fs::create_dir_all(&dir).unwrap();
        let md = write_interop_checkpoint(&dir);
        let back = decode_metadata(&std::fs::read(dir.join(".metadata")).unwrap()).unwrap();
        assert_eq!(back, md);
        let file = std::fs::File::open(dir.join("__0_0.distcp")).unwrap();
        let bytes = std::fs::read(dir.join("__0_0.distcp")).unwrap();
        let si = back.storage("model.w", Some(&[2, 0])).unwrap();
        let t = read_tensor_archive(&file, si.offset, si.length).unwrap();
        assert_eq!((t.dtype, t.shape.clone()), (DType::BF16, vec![1, 4]));
        let start = (si.offset + t.data_offset_in_item) as usize;
        assert_eq!(bytes[start..start + 2], bf16(3.0));
        let si = back.storage("checkpoint_version", None).unwrap();
        assert_eq!(read_object_archive(&file, si.offset, si.length).unwrap(), pickle::Value::Float(3.0));
    }
}
