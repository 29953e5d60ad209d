//! Reading `.metadata`: strict, and streamed item by item.
//!
//! Every accepted shape is one DCP writes; the rest is refused rather than guessed at, because a
//! `.metadata` torch cannot unpickle (an unknown global, a misshapen `TensorProperties` state, an
//! out-of-range memory format) is a checkpoint that does not load, whatever its tensors hold.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use shardline_layout::DType;

use super::{
    ChunkMeta, DcpMetadataError, EntryMeta, Metadata, PathElem, StorageInfo, StorageKey, FS_MODULE, MD_MODULE,
};
use crate::pickle::{scan_memo_references, Limits, PickleError, Reader, Value};

/// The sections of `Metadata`'s state, in the order of its dataclass fields (which is the order
/// its `__dict__`, and so its pickle, has them).
const SECTIONS: [&str; 3] = ["state_dict_metadata", "planner_data", "storage_data"];
/// The dataclass fields, then the attributes Megatron-Core sets on the `Metadata` it saves:
/// `all_local_plans` (every rank's `SavePlan`, for `--ckpt-assume-constant-structure`) and, before
/// 0.14, `mcore_data`. torch unpickles them as plain attributes; a loader never reads them, and
/// neither does Shardline.
const FIELDS: [&str; 7] =
    ["state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version", "all_local_plans", "mcore_data"];

/// One item of a `.metadata`, in file order: every entry, then every planner path, then every
/// storage location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetadataItem {
    Entry(String, EntryMeta),
    PlannerPath(String, Vec<PathElem>),
    Storage(StorageKey, StorageInfo),
}

/// What follows the items.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetadataTail {
    /// `version` (torch 2.9+ writes `"1.0.0"`).
    pub version: Option<String>,
    /// `planner_data` is present (not `None`).
    pub has_planner_data: bool,
}

// ------------------------------------------------------------------------------------------------
// Entry points

/// Streams the `.metadata` file at `path` to `item`; memory follows the largest `SETITEMS` batch
/// (Shardline bounds its batches; torch writes 1,000 items a batch), not the file.
pub fn read_metadata_file<E: From<DcpMetadataError>>(
    path: &Path,
    item: impl FnMut(MetadataItem) -> Result<(), E>,
) -> Result<MetadataTail, E> {
    let open = || {
        File::open(path)
            .map(|f| BufReader::with_capacity(1 << 20, f))
            .map_err(|e| DcpMetadataError::Io { path: path.display().to_string(), error: e.to_string() })
    };
    let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(u64::MAX);
    read_metadata(open()?, open()?, len, item)
}

/// Streams a `.metadata` given twice: `first` for the memo pre-pass, `second` to read; `len`
/// scales the reader's limits.
pub fn read_metadata<E: From<DcpMetadataError>>(
    first: impl BufRead,
    second: impl BufRead,
    len: u64,
    mut item: impl FnMut(MetadataItem) -> Result<(), E>,
) -> Result<MetadataTail, E> {
    let refs = scan_memo_references(first).map_err(DcpMetadataError::from)?;
    let limits = Limits::for_input(usize::try_from(len).unwrap_or(usize::MAX));
    let mut decoder = Decoder::default();
    let root = Reader::new(second, limits, &refs, &SECTIONS)
        .run(|section, k, v| -> Result<(), Stop<E>> {
            let it = decoder.item(section, k, v).map_err(Stop::Metadata)?;
            item(it).map_err(Stop::Caller)
        })
        .map_err(|stop| match stop {
            Stop::Metadata(e) => E::from(e),
            Stop::Caller(e) => e,
        })?;
    decoder.finish(root, &mut item)
}

/// Why a read stopped: the file, or the caller's handling of an item.
enum Stop<E> {
    Metadata(DcpMetadataError),
    Caller(E),
}

impl<E> From<PickleError> for Stop<E> {
    fn from(e: PickleError) -> Self {
        Stop::Metadata(e.into())
    }
}

/// Decodes a whole `.metadata` held in memory.
pub fn decode_metadata(bytes: &[u8]) -> Result<Metadata, DcpMetadataError> {
    let mut md =
        Metadata { state_dict_metadata: Vec::new(), storage_data: Vec::new(), planner_data: Vec::new(), version: None };
    let mut seen = HashSet::new();
    let tail = read_metadata(bytes, bytes, bytes.len() as u64, |item| {
        match item {
            MetadataItem::Entry(k, e) => md.state_dict_metadata.push((k, e)),
            MetadataItem::PlannerPath(k, p) => md.planner_data.push((k, p)),
            MetadataItem::Storage(k, s) => {
                if !seen.insert(k.clone()) {
                    return Err(DcpMetadataError::Duplicate {
                        what: "storage_data key",
                        key: format!("({:?}, {:?})", k.fqn, k.offset),
                    });
                }
                md.storage_data.push((k, s))
            }
        }
        Ok(())
    })?;
    md.version = tail.version;
    Ok(md)
}

// ------------------------------------------------------------------------------------------------
// The decoder

/// Checks what arrives: sections in order, entry keys unique.
#[derive(Default)]
struct Decoder {
    section: usize,
    entry_keys: HashSet<String>,
}

impl Decoder {
    fn item(&mut self, section: usize, k: Value, v: Value) -> Result<MetadataItem, DcpMetadataError> {
        let name = SECTIONS.get(section).copied().unwrap_or("?");
        if section < self.section {
            return Err(invalid(&At::root("Metadata"), format!("{name} comes after {}", SECTIONS[self.section])));
        }
        self.section = section;
        match section {
            0 => {
                let fqn = into_str(k, &At::root(name).field("<key>"))?;
                if !self.entry_keys.insert(fqn.clone()) {
                    return Err(DcpMetadataError::Duplicate {
                        what: "state_dict_metadata key",
                        key: format!("{fqn:?}"),
                    });
                }
                let entry = decode_entry(v, &At::root(name).key(&fqn))?;
                Ok(MetadataItem::Entry(fqn, entry))
            }
            1 => {
                let fqn = into_str(k, &At::root(name).field("<key>"))?;
                let path = decode_path(&v, &At::root(name).key(&fqn))?;
                Ok(MetadataItem::PlannerPath(fqn, path))
            }
            _ => {
                let key = decode_storage_key(k, &At::root("storage_data key"))?;
                let info = decode_storage_info(v, &key)?;
                Ok(MetadataItem::Storage(key, info))
            }
        }
    }

    /// Checks the root `Metadata` and hands over the items of sections that were not streamed
    /// (a state dict written without a `SETITEMS` batch).
    fn finish<E: From<DcpMetadataError>>(
        mut self,
        root: Value,
        item: &mut impl FnMut(MetadataItem) -> Result<(), E>,
    ) -> Result<MetadataTail, E> {
        let md = At::root("Metadata");
        let state = object_state(root, &md, MD_MODULE, "Metadata")?;
        let fields = state_fields(state, &md, &FIELDS, &["state_dict_metadata"])?;
        let mut tail = MetadataTail::default();
        let mut last = 0;
        for (name, v) in fields {
            let i = FIELDS.iter().position(|f| *f == name).unwrap_or(0);
            if i < last {
                return Err(invalid(&md, format!("field {name} out of order")).into());
            }
            last = i;
            match name.as_str() {
                "version" => tail.version = optional(v).map(|v| into_str(v, &At::root("version"))).transpose()?,
                "all_local_plans" | "mcore_data" => {}
                "storage_meta" => {
                    if let Some(v) = optional(v) {
                        check_storage_meta(v)?;
                    }
                }
                section => {
                    let Some(v) = optional(v) else {
                        if section == "state_dict_metadata" {
                            return Err(DcpMetadataError::Unexpected {
                                path: section.into(),
                                expected: "a dict",
                                found: "None".into(),
                            }
                            .into());
                        }
                        continue;
                    };
                    tail.has_planner_data |= section == "planner_data";
                    let Value::Dict(pairs) = v else {
                        return Err(unexpected(&At::root(section), "a dict", &v).into());
                    };
                    for (k, v) in pairs {
                        item(self.item(i, k, v)?)?;
                    }
                }
            }
        }
        Ok(tail)
    }
}

// ------------------------------------------------------------------------------------------------
// Shapes

/// Where a value is, Python-style (`state_dict_metadata['w'].chunks[1].offsets`): a chain of
/// borrowed segments, rendered only when an error names it (an item has a dozen fields, a
/// checkpoint millions of items).
#[derive(Clone, Copy)]
struct At<'a> {
    parent: Option<&'a At<'a>>,
    seg: Seg<'a>,
}

#[derive(Clone, Copy)]
enum Seg<'a> {
    Root(&'a str),
    Field(&'a str),
    Key(&'a str),
    Index(usize),
    Storage(&'a StorageKey),
}

impl<'a> At<'a> {
    fn root(name: &'a str) -> Self {
        At { parent: None, seg: Seg::Root(name) }
    }
    fn field(&'a self, name: &'a str) -> At<'a> {
        At { parent: Some(self), seg: Seg::Field(name) }
    }
    fn key(&'a self, key: &'a str) -> At<'a> {
        At { parent: Some(self), seg: Seg::Key(key) }
    }
    fn index(&'a self, i: usize) -> At<'a> {
        At { parent: Some(self), seg: Seg::Index(i) }
    }
    fn storage(&'a self, key: &'a StorageKey) -> At<'a> {
        At { parent: Some(self), seg: Seg::Storage(key) }
    }
}

impl std::fmt::Display for At<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(p) = self.parent {
            p.fmt(f)?;
        }
        match self.seg {
            Seg::Root(s) => write!(f, "{s}"),
            Seg::Field(s) => write!(f, ".{s}"),
            Seg::Key(k) => write!(f, "[{k:?}]"),
            Seg::Index(i) => write!(f, "[{i}]"),
            Seg::Storage(k) => write!(f, "[{:?}, {:?}]", k.fqn, k.offset),
        }
    }
}

fn unexpected(path: &At<'_>, expected: &'static str, found: &Value) -> DcpMetadataError {
    DcpMetadataError::Unexpected { path: path.to_string(), expected, found: found.describe() }
}

fn invalid(path: &At<'_>, message: String) -> DcpMetadataError {
    DcpMetadataError::Invalid { path: path.to_string(), message }
}

/// `None` → `None`.
fn optional(v: Value) -> Option<Value> {
    (!matches!(v, Value::None)).then_some(v)
}

fn into_str(v: Value, path: &At<'_>) -> Result<String, DcpMetadataError> {
    match v {
        Value::Str(s) => Ok(s),
        other => Err(unexpected(path, "a str", &other)),
    }
}

/// The state of `module.class.__new__(module.class)` + `BUILD state`: what CPython's pickler
/// writes for a dataclass, and nothing else (no arguments, no list or dict items).
fn object_state(v: Value, path: &At<'_>, module: &str, class: &str) -> Result<Option<Value>, DcpMetadataError> {
    let expected = match class {
        "Metadata" => "Metadata",
        "TensorStorageMetadata" => "TensorStorageMetadata",
        "TensorProperties" => "TensorProperties",
        "ChunkStorageMetadata" => "ChunkStorageMetadata",
        "MetadataIndex" => "MetadataIndex",
        "_StorageInfo" => "_StorageInfo",
        "StorageMeta" => "StorageMeta",
        _ => "a DCP class",
    };
    match v {
        Value::Object { class: c, args, kwargs: None, state, list_items, dict_items }
            if c.is_global(module, class)
                && *args == Value::Tuple(Vec::new())
                && list_items.is_empty()
                && dict_items.is_empty() =>
        {
            Ok(state.map(|s| *s))
        }
        other => Err(unexpected(path, expected, &other)),
    }
}

/// The fields of a dataclass state dict: str keys from `allowed`, each once, `required` present.
fn state_fields(
    state: Option<Value>,
    path: &At<'_>,
    allowed: &[&str],
    required: &[&'static str],
) -> Result<Vec<(String, Value)>, DcpMetadataError> {
    let pairs = match state {
        Some(Value::Dict(p)) => p,
        Some(other) => return Err(unexpected(path, "a dict state", &other)),
        None => Vec::new(),
    };
    let mut out: Vec<(String, Value)> = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let name = into_str(k, &path.field("<name>"))?;
        if !allowed.contains(&name.as_str()) {
            return Err(invalid(path, format!("unexpected field {name:?}")));
        }
        if out.iter().any(|(n, _)| *n == name) {
            return Err(invalid(path, format!("field {name:?} given twice")));
        }
        out.push((name, v));
    }
    for r in required {
        if !out.iter().any(|(n, _)| n == r) {
            return Err(DcpMetadataError::Missing { path: path.to_string(), field: r });
        }
    }
    Ok(out)
}

fn take_field(fields: &mut Vec<(String, Value)>, name: &str) -> Option<Value> {
    let i = fields.iter().position(|(n, _)| n == name)?;
    Some(fields.swap_remove(i).1)
}

fn to_u64(v: &Value, path: &At<'_>) -> Result<u64, DcpMetadataError> {
    v.as_int().and_then(|i| u64::try_from(i).ok()).ok_or_else(|| unexpected(path, "a non-negative int", v))
}

fn to_bool(v: &Value, path: &At<'_>) -> Result<bool, DcpMetadataError> {
    match v {
        Value::Bool(b) => Ok(*b),
        other => Err(unexpected(path, "a bool", other)),
    }
}

/// A call `module.name(*args)` with nothing applied after it.
fn call_args<'v>(v: &'v Value, module: &str, name: &str) -> Option<&'v [Value]> {
    match v {
        Value::Reduce { callable, args, state: None, list_items, dict_items }
            if callable.is_global(module, name) && list_items.is_empty() && dict_items.is_empty() =>
        {
            match &**args {
                Value::Tuple(a) => Some(a),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A `torch.Size((dims...))`.
fn to_size(v: &Value, path: &At<'_>) -> Result<Vec<u64>, DcpMetadataError> {
    let Some([Value::Tuple(dims)]) = call_args(v, "torch", "Size") else {
        return Err(unexpected(path, "torch.Size((dims...))", v));
    };
    dims.iter().enumerate().map(|(i, d)| to_u64(d, &path.index(i))).collect()
}

fn to_dtype(v: &Value, path: &At<'_>) -> Result<DType, DcpMetadataError> {
    match v.as_global() {
        Some(("torch", name)) => DType::from_torch_name(name).ok_or_else(|| DcpMetadataError::UnsupportedDtype {
            path: path.to_string(),
            name: format!("torch.{name}"),
        }),
        _ => Err(unexpected(path, "a torch dtype", v)),
    }
}

/// `torch.strided`, as a global or as `torch.serialization._get_layout("torch.strided")`.
fn check_layout(v: &Value, path: &At<'_>) -> Result<(), DcpMetadataError> {
    let ok = v.is_global("torch", "strided")
        || matches!(call_args(v, "torch.serialization", "_get_layout"), Some([Value::Str(s)]) if s == "torch.strided");
    if ok {
        Ok(())
    } else {
        Err(unexpected(path, "the layout torch.strided", v))
    }
}

/// `_MEM_FORMAT_ENCODING(n)` for one of its three members (contiguous, channels last, preserve).
fn check_memory_format(v: &Value, path: &At<'_>) -> Result<(), DcpMetadataError> {
    match call_args(v, MD_MODULE, "_MEM_FORMAT_ENCODING") {
        Some([Value::Int(0..=2)]) => Ok(()),
        _ => Err(unexpected(path, "_MEM_FORMAT_ENCODING(0, 1 or 2)", v)),
    }
}

/// `TensorProperties` state: `(dtype, layout, requires_grad, memory_format, pin_memory)`, plus
/// the strides torch 2.15 appends (`None` when not recorded, as Megatron-Core's saves have it).
fn decode_tensor_properties(v: Value, path: &At<'_>) -> Result<DType, DcpMetadataError> {
    let state = object_state(v, path, MD_MODULE, "TensorProperties")?;
    let items = match state {
        Some(Value::Tuple(items)) if (5..=6).contains(&items.len()) => items,
        Some(other) => return Err(unexpected(path, "a 5- or 6-tuple state", &other)),
        None => return Err(DcpMetadataError::Missing { path: path.to_string(), field: "dtype" }),
    };
    let at = |i: usize| items.get(i).unwrap_or(&Value::None);
    let dtype = to_dtype(at(0), &path.field("dtype"))?;
    check_layout(at(1), &path.field("layout"))?;
    to_bool(at(2), &path.field("requires_grad"))?;
    check_memory_format(at(3), &path.field("memory_format"))?;
    to_bool(at(4), &path.field("pin_memory"))?;
    if let Some(strides) = items.get(5).filter(|s| **s != Value::None) {
        let p = path.field("strides");
        let Value::Tuple(s) = strides else { return Err(unexpected(&p, "a tuple of ints", strides)) };
        for (i, x) in s.iter().enumerate() {
            to_u64(x, &p.index(i))?;
        }
    }
    Ok(dtype)
}

fn decode_chunk(v: Value, path: &At<'_>) -> Result<ChunkMeta, DcpMetadataError> {
    let state = object_state(v, path, MD_MODULE, "ChunkStorageMetadata")?;
    let mut f = state_fields(state, path, &["offsets", "sizes"], &["offsets", "sizes"])?;
    let offsets = to_size(&take_field(&mut f, "offsets").unwrap_or(Value::None), &path.field("offsets"))?;
    let sizes = to_size(&take_field(&mut f, "sizes").unwrap_or(Value::None), &path.field("sizes"))?;
    if offsets.len() != sizes.len() {
        return Err(invalid(path, format!("offsets have {} dims but sizes {}", offsets.len(), sizes.len())));
    }
    Ok(ChunkMeta { offsets, sizes })
}

fn decode_entry(v: Value, path: &At<'_>) -> Result<EntryMeta, DcpMetadataError> {
    let class = match &v {
        Value::Object { class, .. } => class.as_global().map(|(m, c)| (m == MD_MODULE, c.to_owned())),
        _ => None,
    };
    match class.as_ref().map(|(m, c)| (*m, c.as_str())) {
        Some((true, "BytesStorageMetadata")) => {
            let state = object_state(v, path, MD_MODULE, "BytesStorageMetadata")?;
            match state {
                None => Ok(EntryMeta::Bytes),
                Some(Value::Dict(d)) if d.is_empty() => Ok(EntryMeta::Bytes),
                Some(other) => Err(unexpected(path, "BytesStorageMetadata without state", &other)),
            }
        }
        Some((true, "TensorStorageMetadata")) => {
            let state = object_state(v, path, MD_MODULE, "TensorStorageMetadata")?;
            let all = ["properties", "size", "chunks"];
            let mut f = state_fields(state, path, &all, &all)?;
            let dtype = decode_tensor_properties(
                take_field(&mut f, "properties").unwrap_or(Value::None),
                &path.field("properties"),
            )?;
            let size = to_size(&take_field(&mut f, "size").unwrap_or(Value::None), &path.field("size"))?;
            let chunks_path = path.field("chunks");
            let Some(Value::List(items)) = take_field(&mut f, "chunks") else {
                return Err(invalid(&chunks_path, "expected a list".into()));
            };
            let chunks = items
                .into_iter()
                .enumerate()
                .map(|(i, c)| decode_chunk(c, &chunks_path.index(i)))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(c) = chunks.iter().position(|c| c.offsets.len() != size.len()) {
                return Err(invalid(
                    &chunks_path.index(c),
                    format!("has {} dims but the tensor has {}", chunks[c].offsets.len(), size.len()),
                ));
            }
            Ok(EntryMeta::Tensor { dtype, size, chunks })
        }
        _ => Err(unexpected(path, "TensorStorageMetadata or BytesStorageMetadata", &v)),
    }
}

fn decode_storage_key(v: Value, path: &At<'_>) -> Result<StorageKey, DcpMetadataError> {
    let state = object_state(v, path, MD_MODULE, "MetadataIndex")?;
    let mut f = state_fields(state, path, &["fqn", "offset", "index"], &["fqn"])?;
    let fqn = into_str(take_field(&mut f, "fqn").unwrap_or(Value::None), &path.field("fqn"))?;
    let offset =
        take_field(&mut f, "offset").and_then(optional).map(|o| to_size(&o, &path.field("offset"))).transpose()?;
    if let Some(index) = take_field(&mut f, "index").and_then(optional) {
        to_u64(&index, &path.field("index"))?;
    }
    Ok(StorageKey { fqn, offset })
}

fn decode_storage_info(v: Value, key: &StorageKey) -> Result<StorageInfo, DcpMetadataError> {
    let root = At::root("storage_data");
    let path = &root.storage(key);
    let state = object_state(v, path, FS_MODULE, "_StorageInfo")?;
    let all = ["relative_path", "offset", "length", "transform_descriptors"];
    let mut f = state_fields(state, path, &all, &all[..3])?;
    let relative_path =
        into_str(take_field(&mut f, "relative_path").unwrap_or(Value::None), &path.field("relative_path"))?;
    let offset = to_u64(&take_field(&mut f, "offset").unwrap_or(Value::None), &path.field("offset"))?;
    let length = to_u64(&take_field(&mut f, "length").unwrap_or(Value::None), &path.field("length"))?;
    let td_path = path.field("transform_descriptors");
    let transform_descriptors = match take_field(&mut f, "transform_descriptors").and_then(optional) {
        None => None,
        Some(Value::List(items)) => Some(
            items
                .into_iter()
                .enumerate()
                .map(|(i, s)| into_str(s, &td_path.index(i)))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(other) => return Err(unexpected(&td_path, "a list of str", &other)),
    };
    Ok(StorageInfo { relative_path, offset, length, transform_descriptors })
}

fn decode_path(v: &Value, path: &At<'_>) -> Result<Vec<PathElem>, DcpMetadataError> {
    let Value::Tuple(items) = v else {
        return Err(unexpected(path, "a tuple of str and int", v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::Str(s) => Ok(PathElem::Key(s.clone())),
            Value::Int(n) => u64::try_from(*n)
                .map(PathElem::Index)
                .map_err(|_| unexpected(&path.index(i), "a str or non-negative int", p)),
            other => Err(unexpected(&path.index(i), "a str or int", other)),
        })
        .collect()
}

/// `StorageMeta(checkpoint_id, save_id, load_id, modules)`: str or path, str, str, list of str.
fn check_storage_meta(v: Value) -> Result<(), DcpMetadataError> {
    let path = &At::root("storage_meta");
    let state = object_state(v, path, MD_MODULE, "StorageMeta")?;
    let fields = state_fields(state, path, &["checkpoint_id", "save_id", "load_id", "modules"], &[])?;
    for (name, v) in fields {
        let p = path.field(&name);
        let ok = match (name.as_str(), &v) {
            (_, Value::None) => true,
            ("save_id" | "load_id", Value::Str(_)) => true,
            ("checkpoint_id", Value::Str(_)) => true,
            ("checkpoint_id", v) => ["pathlib", "pathlib._local"].iter().any(|m| {
                ["PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"]
                    .iter()
                    .any(|c| call_args(v, m, c).is_some_and(|a| a.iter().all(|x| matches!(x, Value::Str(_)))))
            }),
            ("modules", Value::List(items)) => items.iter().all(|x| matches!(x, Value::Str(_))),
            _ => false,
        };
        if !ok {
            return Err(unexpected(&p, "a str, a path, None or a list of str", &v));
        }
    }
    Ok(())
}

/// Reads `bytes` keeping every section whole until the end, as a reader that does not stream
/// would: for tests comparing the two.
#[cfg(test)]
pub(super) fn read_metadata_whole(bytes: &[u8]) -> Result<Vec<MetadataItem>, DcpMetadataError> {
    let refs = scan_memo_references(bytes)?;
    let root =
        Reader::new(bytes, Limits::for_input(bytes.len()), &refs, &[]).run(|_, _, _| Ok::<(), PickleError>(()))?;
    let mut items = Vec::new();
    Decoder::default().finish(root, &mut |i| {
        items.push(i);
        Ok::<(), DcpMetadataError>(())
    })?;
    Ok(items)
}
