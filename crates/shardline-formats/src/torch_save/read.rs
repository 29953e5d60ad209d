//! Reading `torch.save` archives strictly, the way torch's `PytorchStreamReader` (miniz) and
//! its unpickler walk them.

use std::borrow::Cow;
use std::io;

use shardline_layout::DType;

use super::write::numel_and_bytes;
use super::*;
use crate::pickle::{self, Value};
// Reading

/// Random-access reads (positional, like `pread`).
pub trait ReadAt {
    /// Fills `buf` from absolute position `offset`, or fails (short data is an error).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// The bytes `[offset, offset + len)` borrowed, for sources held in memory (an archive read
    /// whole is parsed without copying each header).
    fn slice_at(&self, _offset: u64, _len: usize) -> Option<&[u8]> {
        None
    }
}

impl ReadAt for std::fs::File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn slice_at(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        self.get(start..start.checked_add(len)?)
    }
}

impl ReadAt for Vec<u8> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }

    fn slice_at(&self, offset: u64, len: usize) -> Option<&[u8]> {
        self.as_slice().slice_at(offset, len)
    }
}

/// One entry of an archive's central directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchiveEntry {
    pub name: String,
    /// "Version needed to extract" and general purpose flags, as the central directory says.
    pub version_needed: u16,
    pub flags: u16,
    /// 0 = stored.
    pub method: u16,
    pub crc32: u32,
    pub compressed_size: u64,
    pub size: u64,
    pub local_header_offset: u64,
}

/// A tensor item as found in an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchivedTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// As the pickle gives them (checked to be contiguous).
    pub strides: Vec<u64>,
    /// In elements, as the pickle gives it (already applied to `data_offset_in_item`).
    pub storage_offset: u64,
    /// Offset in the item of the tensor's first byte.
    pub data_offset_in_item: u64,
    /// `numel * itemsize`: the tensor's bytes, C-contiguous and little endian.
    pub data_len: u64,
    /// The zip crc-32 of exactly those bytes, when they are the whole storage entry (always
    /// so for archives written by this module and by `torch.save` of a non-view tensor) and the
    /// writer computed it: a stored 0 means "not computed" (torch's `compute_crc32 = False`,
    /// Shardline without `--zip-crc32`), so it gives `None` unless the data is empty.
    pub data_crc32: Option<u32>,
}

/// An archive opened for reading: the byte range `[base, base + len)` of `src`.
pub(super) struct Archive<'a, R: ReadAt + ?Sized> {
    src: &'a R,
    base: u64,
    len: u64,
    pub(super) entries: Vec<ArchiveEntry>,
    /// `<dir>/` of the first entry.
    pub(super) dir: String,
    /// Where the central directory starts; entry data must end before it.
    pub(super) cd_offset: u64,
}

pub(super) fn le16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}
pub(super) fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}
pub(super) fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

impl<'a, R: ReadAt + ?Sized> Archive<'a, R> {
    pub(super) fn read(&self, what: &'static str, offset: u64, len: u64) -> Result<Cow<'a, [u8]>, TorchSaveError> {
        offset.checked_add(len).filter(|&e| e <= self.len).ok_or_else(|| {
            TorchSaveError::Corrupt(format!(
                "{what} at offset {offset} ({len} bytes) runs past the end of the {}-byte item",
                self.len
            ))
        })?;
        let n =
            usize::try_from(len).map_err(|_| TorchSaveError::Corrupt(format!("{what} of {len} bytes is too large")))?;
        let abs = self
            .base
            .checked_add(offset)
            .ok_or_else(|| TorchSaveError::Corrupt(format!("{what} offset {offset} overflows")))?;
        if let Some(b) = self.src.slice_at(abs, n) {
            return Ok(Cow::Borrowed(b));
        }
        let mut buf = vec![0u8; n];
        self.src.read_exact_at(&mut buf, abs).map_err(|source| TorchSaveError::Io { what, offset, source })?;
        Ok(Cow::Owned(buf))
    }

    pub(super) fn open(src: &'a R, base: u64, len: u64) -> Result<Self, TorchSaveError> {
        let mut ar = Archive { src, base, len, entries: Vec::new(), dir: String::new(), cd_offset: 0 };
        if len < EOCD_LEN {
            return Err(TorchSaveError::NotZip(format!(
                "item is {len} bytes, shorter than an end-of-central-directory record"
            )));
        }
        // The end record sits at the very end, followed only by its comment.
        let tail_len = len.min(EOCD_LEN + u64::from(u16::MAX));
        let tail_start = len - tail_len;
        let tail = ar.read("end of archive", tail_start, tail_len)?;
        let eocd_in_tail = (0..=tail.len().saturating_sub(EOCD_LEN as usize))
            .rev()
            .find(|&i| {
                le32(&tail, i) == SIG_EOCD && i + EOCD_LEN as usize + usize::from(le16(&tail, i + 20)) == tail.len()
            })
            .ok_or_else(|| {
                TorchSaveError::NotZip("no end-of-central-directory record at the end of the item".into())
            })?;
        let eocd_offset = tail_start + eocd_in_tail as u64;
        let eocd = tail.get(eocd_in_tail..).unwrap_or_default();
        let mut count = u64::from(le16(eocd, 10));
        let mut cd_size = u64::from(le32(eocd, 12));
        let mut cd_offset = u64::from(le32(eocd, 16));
        let mut cd_end_limit = eocd_offset;
        if le16(eocd, 4) != 0 || le16(eocd, 6) != 0 || le16(eocd, 8) != le16(eocd, 10) {
            return Err(TorchSaveError::Corrupt("multi-disk archives are not supported".into()));
        }
        if le16(eocd, 20) != 0 {
            return Err(TorchSaveError::Corrupt("the end-of-central-directory record has a comment".into()));
        }
        let saturated = le16(eocd, 10) == u16::MAX || le32(eocd, 12) == u32::MAX || le32(eocd, 16) == u32::MAX;
        let mut zip64 = false;

        // Zip64: a locator right before the end record points at the zip64 end record.
        if eocd_offset >= EOCD64_LOCATOR_LEN {
            let loc_offset = eocd_offset - EOCD64_LOCATOR_LEN;
            let loc = ar.read("zip64 locator", loc_offset, EOCD64_LOCATOR_LEN)?;
            if le32(&loc, 0) == SIG_EOCD64_LOCATOR {
                let e64_offset = le64(&loc, 8);
                if e64_offset.checked_add(EOCD64_LEN).is_none_or(|end| end > loc_offset) {
                    return Err(TorchSaveError::Corrupt(format!(
                        "zip64 end record offset {e64_offset} is not before its locator at \
                         {loc_offset}"
                    )));
                }
                let e64 = ar.read("zip64 end record", e64_offset, EOCD64_LEN)?;
                if le32(&e64, 0) != SIG_EOCD64 {
                    return Err(TorchSaveError::Corrupt(format!(
                        "no zip64 end record signature at offset {e64_offset}"
                    )));
                }
                if le64(&e64, 4) != EOCD64_LEN - 12
                    || le32(&e64, 16) != 0
                    || le32(&e64, 20) != 0
                    || le64(&e64, 24) != le64(&e64, 32)
                    || le32(&loc, 4) != 0
                    || le32(&loc, 16) != 1
                    || e64_offset + EOCD64_LEN != loc_offset
                {
                    return Err(TorchSaveError::Corrupt(format!(
                        "zip64 end records at offsets {e64_offset} and {loc_offset} are inconsistent"
                    )));
                }
                count = le64(&e64, 32);
                cd_size = le64(&e64, 40);
                cd_offset = le64(&e64, 48);
                cd_end_limit = e64_offset;
                zip64 = true;
            }
        }

        if saturated && !zip64 {
            return Err(TorchSaveError::Corrupt("end record fields are saturated but there is no zip64 record".into()));
        }
        if cd_offset.checked_add(cd_size).is_none_or(|end| end != cd_end_limit) {
            return Err(TorchSaveError::Corrupt(format!(
                "central directory at offset {cd_offset} ({cd_size} bytes) does not end where the \
                 end records start, at {cd_end_limit}"
            )));
        }
        if cd_size > MAX_CENTRAL_DIRECTORY_LEN {
            return Err(TorchSaveError::Corrupt(format!(
                "central directory of {cd_size} bytes is above the limit of \
                 {MAX_CENTRAL_DIRECTORY_LEN}"
            )));
        }
        if count > cd_size / CENTRAL_HEADER_LEN as u64 {
            return Err(TorchSaveError::Corrupt(format!(
                "{count} entries cannot fit a {cd_size}-byte central directory"
            )));
        }
        ar.cd_offset = cd_offset;
        let cd = ar.read("central directory", cd_offset, cd_size)?;
        let mut pos = 0usize;
        for i in 0..count {
            let at = cd_offset + pos as u64;
            let header =
                cd.get(pos..pos + CENTRAL_HEADER_LEN).filter(|h| le32(h, 0) == SIG_CENTRAL).ok_or_else(|| {
                    TorchSaveError::Corrupt(format!(
                        "central directory entry {i} at offset {at} is missing or has a bad \
                         signature"
                    ))
                })?;
            let version_needed = le16(header, 6);
            let flags = le16(header, 8);
            let method = le16(header, 10);
            // miniz treats an entry with the DOS directory attribute as a directory and extracts
            // nothing from it.
            if le32(header, 38) & 0x10 != 0 {
                return Err(TorchSaveError::Corrupt(format!(
                    "central directory entry {i} at offset {at} is marked as a directory"
                )));
            }
            if le16(header, 34) != 0 {
                return Err(TorchSaveError::Corrupt(format!(
                    "central directory entry {i} at offset {at} is on another disk"
                )));
            }
            let crc32 = le32(header, 16);
            let mut compressed_size = u64::from(le32(header, 20));
            let mut size = u64::from(le32(header, 24));
            let name_len = usize::from(le16(header, 28));
            let extra_len = usize::from(le16(header, 30));
            let comment_len = usize::from(le16(header, 32));
            let mut local_header_offset = u64::from(le32(header, 42));
            let name_start = pos + CENTRAL_HEADER_LEN;
            let extra_start = name_start + name_len;
            let next = extra_start + extra_len + comment_len;
            let (Some(name), Some(extra)) =
                (cd.get(name_start..extra_start), cd.get(extra_start..extra_start + extra_len))
            else {
                return Err(TorchSaveError::Corrupt(format!(
                    "central directory entry {i} at offset {at} runs past the directory"
                )));
            };
            if next > cd.len() {
                return Err(TorchSaveError::Corrupt(format!(
                    "central directory entry {i} at offset {at} runs past the directory"
                )));
            }
            let name = String::from_utf8(name.to_vec()).map_err(|_| {
                TorchSaveError::Corrupt(format!("central directory entry {i} at offset {at}: name is not UTF-8"))
            })?;
            if comment_len != 0 {
                return Err(TorchSaveError::Corrupt(format!("entry {name}: has a comment")));
            }
            // Zip64 extended information: the 64-bit values of the saturated fields, in order.
            let mut e = 0usize;
            while e + 4 <= extra.len() {
                let id = le16(extra, e);
                let n = usize::from(le16(extra, e + 2));
                let Some(body) = extra.get(e + 4..e + 4 + n) else {
                    return Err(TorchSaveError::Corrupt(format!(
                        "entry {name}: extra field at offset {e} runs past the extra data"
                    )));
                };
                if id == EXTRA_ZIP64 {
                    let mut f = 0usize;
                    let mut take = |field: &mut u64, what: &str| -> Result<(), TorchSaveError> {
                        if *field == u64::from(u32::MAX) {
                            if f + 8 > body.len() {
                                return Err(TorchSaveError::Corrupt(format!(
                                    "entry {name}: zip64 extra field lacks the {what}"
                                )));
                            }
                            *field = le64(body, f);
                            f += 8;
                        }
                        Ok(())
                    };
                    take(&mut size, "size")?;
                    take(&mut compressed_size, "compressed size")?;
                    take(&mut local_header_offset, "local header offset")?;
                }
                e += 4 + n;
            }
            if e != extra.len() {
                return Err(TorchSaveError::Corrupt(format!("entry {name}: extra data ends inside a field")));
            }
            ar.entries.push(ArchiveEntry {
                name,
                version_needed,
                flags,
                method,
                crc32,
                compressed_size,
                size,
                local_header_offset,
            });
            pos = next;
        }
        if pos != cd.len() {
            return Err(TorchSaveError::Corrupt(format!(
                "central directory has {} bytes after its {count} entries",
                cd.len() - pos
            )));
        }
        // torch takes the archive directory from the first entry.
        let first = ar.entries.first().ok_or_else(|| TorchSaveError::Corrupt("archive has no entries".into()))?;
        let dir = first
            .name
            .split_once('/')
            .map(|(d, _)| d)
            .ok_or_else(|| TorchSaveError::Corrupt(format!("first entry {} is not in a directory", first.name)))?;
        ar.dir = format!("{dir}/");
        super::strict::check_archive(&ar)?;
        Ok(ar)
    }

    pub(super) fn entry(&self, rel: &str) -> Option<&ArchiveEntry> {
        self.entries.iter().find(|e| e.name.strip_prefix(self.dir.as_str()) == Some(rel))
    }

    pub(super) fn require(&self, rel: &str) -> Result<&ArchiveEntry, TorchSaveError> {
        self.entry(rel).ok_or_else(|| TorchSaveError::MissingEntry(format!("{}{rel}", self.dir)))
    }

    /// Offset in the item of `entry`'s data, checked to be stored and in bounds.
    pub(super) fn data_offset(&self, entry: &ArchiveEntry) -> Result<u64, TorchSaveError> {
        if entry.method != 0 {
            return Err(TorchSaveError::Compressed { name: entry.name.clone(), method: entry.method });
        }
        if entry.compressed_size != entry.size {
            return Err(TorchSaveError::Corrupt(format!(
                "stored entry {} has compressed size {} and size {}",
                entry.name, entry.compressed_size, entry.size
            )));
        }
        let lh = self.read("local header", entry.local_header_offset, LOCAL_HEADER_LEN)?;
        if le32(&lh, 0) != SIG_LOCAL {
            return Err(TorchSaveError::Corrupt(format!(
                "entry {}: no local header signature at offset {}",
                entry.name, entry.local_header_offset
            )));
        }
        let start = entry.local_header_offset + LOCAL_HEADER_LEN + u64::from(le16(&lh, 26)) + u64::from(le16(&lh, 28));
        if start.checked_add(entry.size).is_none_or(|end| end > self.cd_offset) {
            return Err(TorchSaveError::Corrupt(format!(
                "entry {} data at offset {start} ({} bytes) runs into the central directory at {}",
                entry.name, entry.size, self.cd_offset
            )));
        }
        Ok(start)
    }

    /// A whole small entry, crc-checked (a stored crc of 0 means none was computed).
    pub(super) fn read_small(&self, entry: &ArchiveEntry, max: u64) -> Result<Cow<'a, [u8]>, TorchSaveError> {
        if entry.size > max {
            return Err(TorchSaveError::EntryTooLarge { name: entry.name.clone(), size: entry.size, max });
        }
        let start = self.data_offset(entry)?;
        let body = self.read("entry data", start, entry.size)?;
        let actual = crc32fast::hash(&body);
        // torch ≥ 2.6 saving with `compute_crc32 = False` (and Shardline by default) stores 0.
        if entry.crc32 != NO_CRC32 && actual != entry.crc32 {
            return Err(TorchSaveError::Crc { name: entry.name.clone(), expected: entry.crc32, actual });
        }
        Ok(body)
    }

    fn pickle(&self) -> Result<Value, TorchSaveError> {
        let e = self.require("data.pkl")?;
        let body = self.read_small(e, MAX_PICKLE_LEN)?;
        Ok(pickle::loads(&body)?)
    }
}

/// The central directory of the archive at `[offset, offset + length)` of `src`.
pub fn list_archive<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    length: u64,
) -> Result<Vec<ArchiveEntry>, TorchSaveError> {
    Ok(Archive::open(src, offset, length)?.entries)
}

/// The unpickled `data.pkl` of the `torch.save` archive at `[offset, offset + length)` of `src`
/// (a DCP bytes item).
pub fn read_object_archive<R: ReadAt + ?Sized>(src: &R, offset: u64, length: u64) -> Result<Value, TorchSaveError> {
    let ar = Archive::open(src, offset, length)?;
    ar.pickle()
}

/// What `data.pkl` says about a tensor.
#[derive(Clone)]
struct TensorSpec {
    dtype: DType,
    shape: Vec<u64>,
    strides: Vec<u64>,
    storage_offset: u64,
    storage_key: String,
    storage_bytes: u64,
}

fn not_tensor(msg: impl Into<String>) -> TorchSaveError {
    TorchSaveError::NotATensor(msg.into())
}

fn to_u64(v: &Value, what: &str) -> Result<u64, TorchSaveError> {
    v.as_int()
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| not_tensor(format!("{what}: expected a non-negative int, found {}", v.describe())))
}

fn to_u64s(v: &Value, what: &str) -> Result<Vec<u64>, TorchSaveError> {
    let items = v.as_seq().ok_or_else(|| not_tensor(format!("{what}: expected a tuple, found {}", v.describe())))?;
    items.iter().enumerate().map(|(i, x)| to_u64(x, &format!("{what}[{i}]"))).collect()
}

fn torch_dtype(v: &Value) -> Result<DType, TorchSaveError> {
    match v.as_global() {
        Some(("torch", name)) => {
            DType::from_torch_name(name).ok_or_else(|| TorchSaveError::UnsupportedDtype(format!("torch.{name}")))
        }
        _ => Err(not_tensor(format!("dtype: expected torch.<dtype>, found {}", v.describe()))),
    }
}

fn tensor_spec(root: &Value) -> Result<TensorSpec, TorchSaveError> {
    // Unwrap nn.Parameter: _rebuild_parameter(data, requires_grad, hooks[, state]).
    let mut v = root;
    let (callable, args) = loop {
        // A plain call: torch's unpickler would hand anything applied after it to the tensor.
        let Value::Reduce { callable, args, state: None, list_items, dict_items } = v else {
            return Err(not_tensor(format!("expected a call, found {}", v.describe())));
        };
        if !list_items.is_empty() || !dict_items.is_empty() {
            return Err(not_tensor("the tensor call has items applied to it"));
        }
        match callable.as_global() {
            Some(("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state")) => {
                v = args
                    .as_seq()
                    .and_then(|a| a.first())
                    .ok_or_else(|| not_tensor("_rebuild_parameter without arguments"))?;
            }
            _ => break (callable, args),
        }
    };
    let v3 = match callable.as_global() {
        Some(("torch._utils", "_rebuild_tensor_v2")) => false,
        Some(("torch._utils", "_rebuild_tensor_v3")) => true,
        _ => {
            return Err(not_tensor(format!(
                "expected torch._utils._rebuild_tensor_v2 or _v3, found {}",
                callable.describe()
            )))
        }
    };
    let args =
        args.as_seq().ok_or_else(|| not_tensor(format!("arguments: expected a tuple, found {}", args.describe())))?;
    // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, dtype][, metadata])
    let min_args = if v3 { 7 } else { 6 };
    if !(min_args..=min_args + 1).contains(&args.len()) {
        return Err(not_tensor(format!(
            "{} takes {min_args} or {} arguments, found {}",
            if v3 { "_rebuild_tensor_v3" } else { "_rebuild_tensor_v2" },
            min_args + 1,
            args.len()
        )));
    }
    let arg = |i: usize| args.get(i).unwrap_or(&Value::None);
    if !matches!(arg(4), Value::Bool(_)) {
        return Err(not_tensor(format!("requires_grad: expected a bool, found {}", arg(4).describe())));
    }
    let empty_hooks = matches!(arg(5), Value::Reduce { callable, args, state: None, list_items, dict_items }
        if callable.is_global("collections", "OrderedDict") && **args == Value::Tuple(Vec::new())
            && list_items.is_empty() && dict_items.is_empty());
    if !empty_hooks {
        return Err(not_tensor(format!("backward hooks: expected OrderedDict(), found {}", arg(5).describe())));
    }
    if let Some(meta) = args.get(min_args) {
        if !matches!(meta, Value::None | Value::Dict(_)) {
            return Err(not_tensor(format!("tensor metadata: expected a dict, found {}", meta.describe())));
        }
    }

    // ('storage', storage_type, key, location, numel)
    let Value::PersistentId(pid) = arg(0) else {
        return Err(not_tensor(format!("storage: expected a persistent id, found {}", arg(0).describe())));
    };
    let pid = pid
        .as_seq()
        .filter(|p| p.len() == 5 && p.first().and_then(Value::as_str) == Some("storage"))
        .ok_or_else(|| not_tensor("storage: expected ('storage', type, key, location, numel)"))?;
    let pid_item = |i: usize| pid.get(i).unwrap_or(&Value::None);
    let storage_dtype = match pid_item(1).as_global() {
        // Untyped storage: numel counts bytes.
        Some(("torch.storage" | "torch", "UntypedStorage")) => DType::U8,
        Some(("torch", class)) => DType::from_torch_storage_class(class)
            .ok_or_else(|| TorchSaveError::UnsupportedDtype(format!("torch.{class}")))?,
        _ => {
            return Err(not_tensor(format!(
                "storage type: expected torch.<Type>Storage, found {}",
                pid_item(1).describe()
            )))
        }
    };
    let storage_key = pid_item(2).as_str().ok_or_else(|| not_tensor("storage key: expected a str"))?.to_owned();
    if pid_item(3).as_str().is_none() {
        return Err(not_tensor("storage location: expected a str"));
    }
    let storage_numel = to_u64(pid_item(4), "storage numel")?;
    let storage_bytes =
        storage_numel.checked_mul(storage_dtype.size() as u64).ok_or_else(|| not_tensor("storage size overflows"))?;

    let dtype = if v3 { torch_dtype(arg(6))? } else { storage_dtype };
    let storage_offset = to_u64(arg(1), "storage offset")?;
    let shape = to_u64s(arg(2), "size")?;
    let strides = to_u64s(arg(3), "stride")?;
    if shape.len() != strides.len() {
        return Err(not_tensor(format!("size has {} dims but stride has {}", shape.len(), strides.len())));
    }
    Ok(TensorSpec { dtype, shape, strides, storage_offset, storage_key, storage_bytes })
}

/// torch's `is_contiguous`: sizes of 1 and empty tensors do not constrain strides.
fn is_contiguous(shape: &[u64], strides: &[u64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1u64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 {
            if s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
    }
    true
}

/// Finds the tensor in the `torch.save` archive at `[offset, offset + length)` of `src` (a DCP
/// tensor item) and checks that its bytes are C-contiguous and inside the storage entry.
pub fn read_tensor_archive<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    length: u64,
) -> Result<ArchivedTensor, TorchSaveError> {
    read_tensor_archive_with(src, offset, length, &mut SpecCache::default())
}

/// The tensors that the `data.pkl`s already read describe, by their bytes: the items of one
/// checkpoint repeat a few pickles (one per chunk shape and dtype) hundreds of thousands of
/// times, and the same bytes always describe the same tensor.
#[derive(Default)]
pub struct SpecCache {
    specs: std::collections::HashMap<Vec<u8>, TensorSpec>,
}

/// Pickles kept by a [`SpecCache`]; past that it stops remembering new ones.
const SPEC_CACHE_ENTRIES: usize = 4096;

/// [`read_tensor_archive`], reusing what `cache` already knows of a `data.pkl`.
pub fn read_tensor_archive_with<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    length: u64,
    cache: &mut SpecCache,
) -> Result<ArchivedTensor, TorchSaveError> {
    let ar = Archive::open(src, offset, length)?;
    let body = ar.read_small(ar.require("data.pkl")?, MAX_PICKLE_LEN)?;
    let spec = match cache.specs.get(&*body) {
        Some(spec) => spec.clone(),
        None => {
            let spec = tensor_spec(&pickle::loads(&body)?)?;
            if cache.specs.len() < SPEC_CACHE_ENTRIES {
                cache.specs.insert(body.into_owned(), spec.clone());
            }
            spec
        }
    };
    locate(&ar, spec)
}

/// Whether `v` is a tensor as `torch.save` pickles one (`_rebuild_tensor_v2` of a storage).
pub fn is_tensor_value(v: &Value) -> bool {
    tensor_spec(v).is_ok()
}

/// The tensor `tensor` (a value of the unpickled `data.pkl`, see [`is_tensor_value`]) of the
/// object archive at `[offset, offset + length)` of `src`, located in its storage entry: how a
/// bytes item holding tensors (a Megatron-Core `ShardedObject` of RNG states) is read in place.
pub fn locate_object_tensor<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    length: u64,
    tensor: &Value,
) -> Result<ArchivedTensor, TorchSaveError> {
    let ar = Archive::open(src, offset, length)?;
    locate(&ar, tensor_spec(tensor)?)
}

/// Where `spec`'s bytes are in `ar`, checked to be contiguous and inside its storage entry.
fn locate<R: ReadAt + ?Sized>(ar: &Archive<'_, R>, spec: TensorSpec) -> Result<ArchivedTensor, TorchSaveError> {
    if !is_contiguous(&spec.shape, &spec.strides) {
        return Err(TorchSaveError::NonContiguous { shape: spec.shape, strides: spec.strides });
    }
    let (numel, data_len) = numel_and_bytes(spec.dtype, &spec.shape)
        .ok_or_else(|| TorchSaveError::TooLarge { dtype: spec.dtype, shape: spec.shape.clone() })?;
    let itemsize = spec.dtype.size() as u64;
    let start = spec.storage_offset.checked_mul(itemsize);
    let end = start.and_then(|s| s.checked_add(data_len));
    let (Some(start), Some(end)) = (start, end) else {
        return Err(TorchSaveError::StorageBounds {
            dtype: spec.dtype,
            storage_offset: spec.storage_offset,
            numel,
            storage_bytes: spec.storage_bytes,
        });
    };
    if end > spec.storage_bytes {
        return Err(TorchSaveError::StorageBounds {
            dtype: spec.dtype,
            storage_offset: spec.storage_offset,
            numel,
            storage_bytes: spec.storage_bytes,
        });
    }
    let rel = format!("data/{}", spec.storage_key);
    let entry = ar.require(&rel)?;
    if entry.size != spec.storage_bytes {
        return Err(TorchSaveError::StorageSize {
            key: spec.storage_key,
            name: entry.name.clone(),
            declared: spec.storage_bytes,
            actual: entry.size,
        });
    }
    let entry_start = ar.data_offset(entry)?;
    let whole = start == 0 && data_len == entry.size;
    Ok(ArchivedTensor {
        dtype: spec.dtype,
        shape: spec.shape,
        strides: spec.strides,
        storage_offset: spec.storage_offset,
        data_offset_in_item: entry_start + start,
        data_len,
        data_crc32: (whole && (entry.crc32 != NO_CRC32 || data_len == 0)).then_some(entry.crc32),
    })
}

/// The `torch.save` archive at `[offset, offset + length)` of `src`, rebuilt with its `data.pkl`
/// replaced by `edit(data.pkl)`: every other entry kept, in order (a bytes item edited in place,
/// such as a resharded job's `args`).
pub fn edit_object_archive<R: ReadAt + ?Sized>(
    src: &R,
    offset: u64,
    length: u64,
    edit: impl FnOnce(&[u8]) -> Result<Vec<u8>, TorchSaveError>,
) -> Result<Vec<u8>, TorchSaveError> {
    let ar = Archive::open(src, offset, length)?;
    let pkl_name = format!("{}data.pkl", ar.dir);
    let mut entries: Vec<&ArchiveEntry> = ar.entries.iter().collect();
    entries.sort_by_key(|e| e.local_header_offset);
    let mut edit = Some(edit);
    let mut out = Vec::new();
    let mut records = Vec::new();
    for e in entries {
        let body = ar.read_small(e, MAX_PICKLE_LEN)?;
        let body = match (e.name == pkl_name, edit.take()) {
            (true, Some(f)) => f(&body)?,
            (_, not_used) => {
                edit = not_used;
                body.into_owned()
            }
        };
        super::write::push_entry(&mut out, &mut records, e.name.clone(), &body);
    }
    let cd = super::write::central_directory(&records, out.len() as u64);
    out.extend_from_slice(&cd);
    Ok(out)
}
