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

use std::io;

use shardline_layout::DType;
use thiserror::Error;

use crate::pickle::{self, PickleError, PickleWriter, Value};

/// The directory inside the archive. torch uses `archive`; readers take whatever the first
/// entry's directory is.
pub const ARCHIVE_DIR: &str = "archive";

/// Alignment of the tensor data relative to the start of the archive (torch's
/// `.storage_alignment`).
pub const DATA_ALIGNMENT: u64 = 64;

/// Largest `data.pkl` the reader accepts.
const MAX_PICKLE_LEN: u64 = 64 << 20;
/// Largest central directory the reader accepts (a torch archive has a handful of entries).
const MAX_CENTRAL_DIRECTORY_LEN: u64 = 16 << 20;
/// Sizes and offsets at or above this need zip64 records.
const ZIP64_THRESHOLD: u64 = 0xFFFF_FFFF;

const SIG_LOCAL: u32 = 0x0403_4b50;
const SIG_CENTRAL: u32 = 0x0201_4b50;
const SIG_EOCD: u32 = 0x0605_4b50;
const SIG_EOCD64: u32 = 0x0606_4b50;
const SIG_EOCD64_LOCATOR: u32 = 0x0706_4b50;
const LOCAL_HEADER_LEN: u64 = 30;
const CENTRAL_HEADER_LEN: usize = 46;
const EOCD_LEN: u64 = 22;
const EOCD64_LEN: u64 = 56;
const EOCD64_LOCATOR_LEN: u64 = 20;
const EXTRA_ZIP64: u16 = 0x0001;
/// torch's padding extra field, the bytes `FB`.
const EXTRA_PADDING: u16 = 0x4246;
const VERSION_DEFAULT: u16 = 20;
const VERSION_ZIP64: u16 = 45;
/// 1980-01-01, the earliest DOS date.
const DOS_DATE: u16 = (1 << 5) | 1;

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

// ------------------------------------------------------------------------------------------------
// Writing

/// Whether and how an entry uses zip64.
#[derive(Clone, Debug)]
struct EntryRecord {
    name: String,
    crc32: u32,
    size: u64,
    local_header_offset: u64,
}

impl EntryRecord {
    fn zip64(&self) -> bool {
        self.size >= ZIP64_THRESHOLD || self.local_header_offset >= ZIP64_THRESHOLD
    }
}

fn put_u16(b: &mut Vec<u8>, v: u16) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
/// `v` as a 32-bit zip field: the value, or 0xFFFFFFFF when it lives in a zip64 record.
fn field32(v: u64) -> u32 {
    u32::try_from(v).ok().filter(|&v| v != u32::MAX).unwrap_or(u32::MAX)
}
fn len16(n: usize) -> u16 {
    // Names and extra fields are constants of this module, far below 64 KiB.
    u16::try_from(n).unwrap_or(u16::MAX)
}

/// A local file header at `header_offset`, padded with an `FB` extra field so the entry data
/// starts at a multiple of `align` (no padding when `align` is 1).
fn local_header(entry: &EntryRecord, header_offset: u64, align: u64) -> Vec<u8> {
    let zip64 = entry.size >= ZIP64_THRESHOLD;
    let mut extra = Vec::new();
    if zip64 {
        put_u16(&mut extra, EXTRA_ZIP64);
        put_u16(&mut extra, 16);
        put_u64(&mut extra, entry.size); // uncompressed
        put_u64(&mut extra, entry.size); // compressed
    }
    let unpadded = header_offset + LOCAL_HEADER_LEN + entry.name.len() as u64 + extra.len() as u64;
    let mut pad = (align - unpadded % align) % align;
    if pad != 0 && pad < 4 {
        pad += align; // an extra field needs at least its 4-byte header
    }
    if pad != 0 {
        put_u16(&mut extra, EXTRA_PADDING);
        put_u16(&mut extra, len16((pad - 4) as usize));
        extra.resize(extra.len() + (pad - 4) as usize, b'Z');
    }
    let mut b = Vec::with_capacity(LOCAL_HEADER_LEN as usize + entry.name.len() + extra.len());
    put_u32(&mut b, SIG_LOCAL);
    put_u16(&mut b, if zip64 { VERSION_ZIP64 } else { VERSION_DEFAULT });
    put_u16(&mut b, 0); // flags: sizes and crc are in this header
    put_u16(&mut b, 0); // method: stored
    put_u16(&mut b, 0); // time
    put_u16(&mut b, DOS_DATE);
    put_u32(&mut b, entry.crc32);
    put_u32(&mut b, field32(entry.size));
    put_u32(&mut b, field32(entry.size));
    put_u16(&mut b, len16(entry.name.len()));
    put_u16(&mut b, len16(extra.len()));
    b.extend_from_slice(entry.name.as_bytes());
    b.extend_from_slice(&extra);
    b
}

/// The crc-32 field of an entry whose writer did not compute it (torch's `compute_crc32 = False`
/// writes 0; so do archives streamed by the executor without `zip_crc32`). Readers skip the check.
pub const NO_CRC32: u32 = 0;

/// Offset of the crc-32 field within a local file header.
const LOCAL_CRC_FIELD: u64 = 14;

/// Appends a small entry (header and body, unaligned) to `out`.
fn push_entry(out: &mut Vec<u8>, entries: &mut Vec<EntryRecord>, name: String, body: &[u8]) {
    let entry = EntryRecord {
        name,
        crc32: crc32fast::hash(body),
        size: body.len() as u64,
        local_header_offset: out.len() as u64,
    };
    out.extend_from_slice(&local_header(&entry, entry.local_header_offset, 1));
    out.extend_from_slice(body);
    entries.push(entry);
}

/// The central directory starting at `cd_offset`, then the zip64 end records if needed, then
/// the end-of-central-directory record.
fn central_directory(entries: &[EntryRecord], cd_offset: u64) -> Vec<u8> {
    let mut b = Vec::new();
    for e in entries {
        let mut extra = Vec::new();
        if e.zip64() {
            let mut fields = Vec::new();
            if e.size >= ZIP64_THRESHOLD {
                put_u64(&mut fields, e.size);
                put_u64(&mut fields, e.size);
            }
            if e.local_header_offset >= ZIP64_THRESHOLD {
                put_u64(&mut fields, e.local_header_offset);
            }
            put_u16(&mut extra, EXTRA_ZIP64);
            put_u16(&mut extra, len16(fields.len()));
            extra.extend_from_slice(&fields);
        }
        let version = if e.zip64() { VERSION_ZIP64 } else { VERSION_DEFAULT };
        put_u32(&mut b, SIG_CENTRAL);
        put_u16(&mut b, version); // made by (MS-DOS attributes)
        put_u16(&mut b, version); // needed
        put_u16(&mut b, 0); // flags
        put_u16(&mut b, 0); // stored
        put_u16(&mut b, 0); // time
        put_u16(&mut b, DOS_DATE);
        put_u32(&mut b, e.crc32);
        put_u32(&mut b, field32(e.size));
        put_u32(&mut b, field32(e.size));
        put_u16(&mut b, len16(e.name.len()));
        put_u16(&mut b, len16(extra.len()));
        put_u16(&mut b, 0); // comment
        put_u16(&mut b, 0); // disk
        put_u16(&mut b, 0); // internal attributes
        put_u32(&mut b, 0); // external attributes
        put_u32(&mut b, field32(e.local_header_offset));
        b.extend_from_slice(e.name.as_bytes());
        b.extend_from_slice(&extra);
    }
    let cd_size = b.len() as u64;
    let count = entries.len() as u64;
    let eocd64_offset = cd_offset.saturating_add(cd_size);
    let zip64 = entries.iter().any(EntryRecord::zip64)
        || cd_offset >= ZIP64_THRESHOLD
        || cd_size >= ZIP64_THRESHOLD
        || eocd64_offset >= ZIP64_THRESHOLD;
    if zip64 {
        put_u32(&mut b, SIG_EOCD64);
        put_u64(&mut b, EOCD64_LEN - 12); // size of the rest of the record
        put_u16(&mut b, VERSION_ZIP64);
        put_u16(&mut b, VERSION_ZIP64);
        put_u32(&mut b, 0); // this disk
        put_u32(&mut b, 0); // disk of the central directory
        put_u64(&mut b, count);
        put_u64(&mut b, count);
        put_u64(&mut b, cd_size);
        put_u64(&mut b, cd_offset);
        put_u32(&mut b, SIG_EOCD64_LOCATOR);
        put_u32(&mut b, 0);
        put_u64(&mut b, eocd64_offset);
        put_u32(&mut b, 1); // total disks
    }
    let count16 = u16::try_from(count).unwrap_or(u16::MAX);
    put_u32(&mut b, SIG_EOCD);
    put_u16(&mut b, 0);
    put_u16(&mut b, 0);
    put_u16(&mut b, count16);
    put_u16(&mut b, count16);
    put_u32(&mut b, field32(cd_size));
    put_u32(&mut b, field32(cd_offset));
    put_u16(&mut b, 0); // comment
    b
}

/// Elements of `shape` and bytes of a `dtype` tensor of that shape.
fn numel_and_bytes(dtype: DType, shape: &[u64]) -> Option<(u64, u64)> {
    let numel = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    let bytes = numel.checked_mul(dtype.size() as u64)?;
    Some((numel, bytes))
}

/// torch's contiguous strides: `stride[i] = prod(max(shape[j], 1) for j > i)`.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// The `data.pkl` of a contiguous tensor whose storage is entry `data/0`.
fn tensor_pickle(dtype: DType, shape: &[u64], numel: u64, nbytes: u64) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.proto(2);
    let storage_class = dtype.torch_storage_class();
    match storage_class {
        Some(_) => w.global("torch._utils", "_rebuild_tensor_v2"),
        None => w.global("torch._utils", "_rebuild_tensor_v3"),
    };
    w.mark();
    // The storage, as a persistent id: ('storage', storage_type, key, location, numel).
    w.mark().str("storage");
    match storage_class {
        Some(class) => w.global("torch", class).str("0").str("cpu").int(numel.into()),
        None => w.global("torch.storage", "UntypedStorage").str("0").str("cpu").int(nbytes.into()),
    };
    w.tuple().binpersid();
    w.int(0); // storage offset
    w.int_tuple(shape);
    w.int_tuple(&contiguous_strides(shape));
    w.bool(false); // requires_grad
    w.global("collections", "OrderedDict").empty_tuple().reduce(); // backward hooks
    if storage_class.is_none() {
        w.global("torch", dtype.torch_name());
    }
    w.tuple().reduce().stop();
    w.into_bytes()
}

/// The layout of a `torch.save` archive of one contiguous tensor, computed before any tensor
/// byte is known: `prefix() ++ data ++ suffix(crc32(data))` is the whole archive, with the crc
/// also patched into the prefix at [`TensorArchive::crc_offset`].
#[derive(Clone, Debug)]
pub struct TensorArchive {
    dtype: DType,
    shape: Vec<u64>,
    prefix: Vec<u8>,
    data_len: u64,
    crc_offset: u64,
    entries: Vec<EntryRecord>,
}

impl TensorArchive {
    /// Lays out the archive for a `dtype` tensor of `shape` (`[]` for a 0-d tensor).
    ///
    /// A shape whose byte size does not fit in a `u64` (no real data can have it) saturates
    /// [`TensorArchive::data_len`] at `u64::MAX`; [`TensorArchive::try_new`] reports it instead.
    pub fn new(dtype: DType, shape: &[u64]) -> TensorArchive {
        let numel = shape.iter().fold(1u64, |acc, &d| acc.saturating_mul(d));
        let data_len = numel.saturating_mul(dtype.size() as u64);
        Self::layout(dtype, shape, numel, data_len)
    }

    /// [`TensorArchive::new`], with an error for shapes larger than 2^64 bytes.
    pub fn try_new(dtype: DType, shape: &[u64]) -> Result<TensorArchive, TorchSaveError> {
        let (numel, data_len) =
            numel_and_bytes(dtype, shape).ok_or(TorchSaveError::TooLarge { dtype, shape: shape.to_vec() })?;
        Ok(Self::layout(dtype, shape, numel, data_len))
    }

    fn layout(dtype: DType, shape: &[u64], numel: u64, data_len: u64) -> TensorArchive {
        let mut prefix = Vec::new();
        let mut entries = Vec::new();
        let pkl = tensor_pickle(dtype, shape, numel, data_len);
        push_entry(&mut prefix, &mut entries, format!("{ARCHIVE_DIR}/data.pkl"), &pkl);
        push_entry(&mut prefix, &mut entries, format!("{ARCHIVE_DIR}/byteorder"), b"little");
        push_entry(&mut prefix, &mut entries, format!("{ARCHIVE_DIR}/version"), b"3\n");
        let data = EntryRecord {
            name: format!("{ARCHIVE_DIR}/data/0"),
            crc32: 0,
            size: data_len,
            local_header_offset: prefix.len() as u64,
        };
        let crc_offset = data.local_header_offset + LOCAL_CRC_FIELD;
        prefix.extend_from_slice(&local_header(&data, data.local_header_offset, DATA_ALIGNMENT));
        entries.push(data);
        TensorArchive { dtype, shape: shape.to_vec(), prefix, data_len, crc_offset, entries }
    }

    /// The tensor's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Everything before the tensor data, with a zero crc in the data entry's local header.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// The prefix with `data_crc` already in place (for callers that know the crc up front).
    pub fn prefix_with_crc(&self, data_crc: u32) -> Vec<u8> {
        let mut p = self.prefix.clone();
        let at = self.crc_offset as usize;
        if let Some(field) = p.get_mut(at..at + 4) {
            field.copy_from_slice(&data_crc.to_le_bytes());
        }
        p
    }

    /// Offset of the tensor data in the archive (= `prefix().len()`, a multiple of 64).
    pub fn data_offset(&self) -> u64 {
        self.prefix.len() as u64
    }

    /// Bytes of tensor data: `numel * itemsize`.
    pub fn data_len(&self) -> u64 {
        self.data_len
    }

    /// Offset in the archive of the 4-byte little-endian crc-32 field of the data entry's local
    /// header, to patch once the data has been streamed.
    pub fn crc_offset(&self) -> u64 {
        self.crc_offset
    }

    /// The central directory and end records that follow the data, for data with crc-32
    /// `data_crc` (zip64 records when the data reaches 4 GiB).
    pub fn suffix(&self, data_crc: u32) -> Vec<u8> {
        let mut entries = self.entries.clone();
        if let Some(last) = entries.last_mut() {
            last.crc32 = data_crc;
        }
        central_directory(&entries, self.data_offset().saturating_add(self.data_len))
    }

    /// Length of the whole archive.
    pub fn total_len(&self) -> u64 {
        self.data_offset().saturating_add(self.data_len).saturating_add(self.suffix(0).len() as u64)
    }
}

/// The whole archive for a tensor whose little-endian, C-contiguous bytes are `data`.
pub fn encode_tensor_archive(dtype: DType, shape: &[u64], data: &[u8]) -> Result<Vec<u8>, TorchSaveError> {
    let layout = TensorArchive::try_new(dtype, shape)?;
    if layout.data_len() != data.len() as u64 {
        return Err(TorchSaveError::DataLength {
            dtype,
            shape: shape.to_vec(),
            want: layout.data_len(),
            got: data.len() as u64,
        });
    }
    let crc = crc32fast::hash(data);
    let mut out = layout.prefix_with_crc(crc);
    out.extend_from_slice(data);
    out.extend_from_slice(&layout.suffix(crc));
    Ok(out)
}

/// A small Python value, as stored in DCP bytes items.
#[derive(Clone, Debug, PartialEq)]
pub enum PyObject {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<PyObject>),
    Tuple(Vec<PyObject>),
    /// A dict with `str` keys, in insertion order.
    Dict(Vec<(String, PyObject)>),
}

fn write_object(w: &mut PickleWriter, v: &PyObject) {
    match v {
        PyObject::None => {
            w.none();
        }
        PyObject::Bool(b) => {
            w.bool(*b);
        }
        PyObject::Int(i) => {
            w.int(*i);
        }
        PyObject::Float(f) => {
            w.float(*f);
        }
        PyObject::Str(s) => {
            w.str(s);
        }
        PyObject::List(items) => {
            w.empty_list();
            if !items.is_empty() {
                w.mark();
                for i in items {
                    write_object(w, i);
                }
                w.appends();
            }
        }
        PyObject::Tuple(items) => {
            if items.is_empty() {
                w.empty_tuple();
            } else {
                w.mark();
                for i in items {
                    write_object(w, i);
                }
                w.tuple();
            }
        }
        PyObject::Dict(items) => {
            w.empty_dict();
            if !items.is_empty() {
                w.mark();
                for (k, v) in items {
                    w.str(k);
                    write_object(w, v);
                }
                w.setitems();
            }
        }
    }
}

/// The protocol-2 pickle of `value`, as `torch.save` puts it in `data.pkl`.
pub fn object_pickle(value: &PyObject) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.proto(2);
    write_object(&mut w, value);
    w.stop();
    w.into_bytes()
}

/// `torch.save(value)`: an archive with `data.pkl`, `byteorder` and `version`.
pub fn encode_object_archive(value: &PyObject) -> Vec<u8> {
    let mut out = Vec::new();
    let mut entries = Vec::new();
    let pkl = object_pickle(value);
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/data.pkl"), &pkl);
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/byteorder"), b"little");
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/version"), b"3\n");
    let cd = central_directory(&entries, out.len() as u64);
    out.extend_from_slice(&cd);
    out
}

// ------------------------------------------------------------------------------------------------
// Reading

/// Random-access reads (positional, like `pread`).
pub trait ReadAt {
    /// Fills `buf` from absolute position `offset`, or fails (short data is an error).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
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
}

impl ReadAt for Vec<u8> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }
}

/// One entry of an archive's central directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchiveEntry {
    pub name: String,
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
struct Archive<'a, R: ReadAt + ?Sized> {
    src: &'a R,
    base: u64,
    len: u64,
    entries: Vec<ArchiveEntry>,
    /// `<dir>/` of the first entry.
    dir: String,
    /// Where the central directory starts; entry data must end before it.
    cd_offset: u64,
}

fn le16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}
fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}
fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

impl<'a, R: ReadAt + ?Sized> Archive<'a, R> {
    fn read(&self, what: &'static str, offset: u64, len: u64) -> Result<Vec<u8>, TorchSaveError> {
        offset.checked_add(len).filter(|&e| e <= self.len).ok_or_else(|| {
            TorchSaveError::Corrupt(format!(
                "{what} at offset {offset} ({len} bytes) runs past the end of the {}-byte item",
                self.len
            ))
        })?;
        let n =
            usize::try_from(len).map_err(|_| TorchSaveError::Corrupt(format!("{what} of {len} bytes is too large")))?;
        let mut buf = vec![0u8; n];
        let abs = self
            .base
            .checked_add(offset)
            .ok_or_else(|| TorchSaveError::Corrupt(format!("{what} offset {offset} overflows")))?;
        self.src.read_exact_at(&mut buf, abs).map_err(|source| TorchSaveError::Io { what, offset, source })?;
        Ok(buf)
    }

    fn open(src: &'a R, base: u64, len: u64) -> Result<Self, TorchSaveError> {
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
        if le16(eocd, 4) != 0 || le16(eocd, 6) != 0 {
            return Err(TorchSaveError::Corrupt("multi-disk archives are not supported".into()));
        }

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
                count = le64(&e64, 32);
                cd_size = le64(&e64, 40);
                cd_offset = le64(&e64, 48);
                cd_end_limit = e64_offset;
            }
        }

        if cd_offset.checked_add(cd_size).is_none_or(|end| end > cd_end_limit) {
            return Err(TorchSaveError::Corrupt(format!(
                "central directory at offset {cd_offset} ({cd_size} bytes) overlaps the end \
                 records at {cd_end_limit}"
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
            let method = le16(header, 10);
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
            let name = String::from_utf8_lossy(name).into_owned();
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
            ar.entries.push(ArchiveEntry { name, method, crc32, compressed_size, size, local_header_offset });
            pos = next;
        }
        // torch takes the archive directory from the first entry.
        let first = ar.entries.first().ok_or_else(|| TorchSaveError::Corrupt("archive has no entries".into()))?;
        let dir = first
            .name
            .split_once('/')
            .map(|(d, _)| d)
            .ok_or_else(|| TorchSaveError::Corrupt(format!("first entry {} is not in a directory", first.name)))?;
        ar.dir = format!("{dir}/");
        Ok(ar)
    }

    fn entry(&self, rel: &str) -> Option<&ArchiveEntry> {
        let full = format!("{}{rel}", self.dir);
        self.entries.iter().find(|e| e.name == full)
    }

    fn require(&self, rel: &str) -> Result<&ArchiveEntry, TorchSaveError> {
        self.entry(rel).ok_or_else(|| TorchSaveError::MissingEntry(format!("{}{rel}", self.dir)))
    }

    /// Offset in the item of `entry`'s data, checked to be stored and in bounds.
    fn data_offset(&self, entry: &ArchiveEntry) -> Result<u64, TorchSaveError> {
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
    fn read_small(&self, entry: &ArchiveEntry, max: u64) -> Result<Vec<u8>, TorchSaveError> {
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

    fn check_byteorder(&self) -> Result<(), TorchSaveError> {
        if let Some(e) = self.entry("byteorder") {
            let body = self.read_small(e, 16)?;
            if body != b"little" {
                return Err(TorchSaveError::ByteOrder(String::from_utf8_lossy(&body).into_owned()));
            }
        }
        Ok(())
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
    ar.check_byteorder()?;
    ar.pickle()
}

/// What `data.pkl` says about a tensor.
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
        let Value::Reduce { callable, args, .. } = v else {
            return Err(not_tensor(format!("expected a call, found {}", v.describe())));
        };
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
    let min_args = if v3 { 7 } else { 6 };
    if args.len() < min_args {
        return Err(not_tensor(format!(
            "{} takes at least {min_args} arguments, found {}",
            if v3 { "_rebuild_tensor_v3" } else { "_rebuild_tensor_v2" },
            args.len()
        )));
    }
    let arg = |i: usize| args.get(i).unwrap_or(&Value::None);

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
    let ar = Archive::open(src, offset, length)?;
    ar.check_byteorder()?;
    let spec = tensor_spec(&ar.pickle()?)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/torch-written");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
    }

    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    /// The raw `data.pkl` of an archive, via the reader's own plumbing.
    fn data_pkl(bytes: &[u8], offset: u64, length: u64) -> Vec<u8> {
        let ar = Archive::open(bytes, offset, length).unwrap();
        let e = ar.require("data.pkl").unwrap().clone();
        ar.read_small(&e, MAX_PICKLE_LEN).unwrap()
    }

    #[test]
    fn tensor_pickle_matches_the_brief_byte_for_byte() {
        let ours = tensor_pickle(DType::BF16, &[3, 4], 12, 24);
        let want: &[u8] = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage\
ctorch\nBFloat16Storage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQK\x00K\x03K\x04\x86K\x04K\
\x01\x86\x89ccollections\nOrderedDict\n)Rt\x52.";
        assert_eq!(ours, want);
    }

    #[test]
    fn tensor_archive_layout() {
        let data = bf16_bytes(&(0..12).map(|i| i as f32).collect::<Vec<_>>());
        let layout = TensorArchive::new(DType::BF16, &[3, 4]);
        assert_eq!(layout.data_len(), 24);
        assert_eq!(layout.data_offset() % DATA_ALIGNMENT, 0);
        assert_eq!(layout.data_offset(), layout.prefix().len() as u64);
        let bytes = encode_tensor_archive(DType::BF16, &[3, 4], &data).unwrap();
        assert_eq!(bytes.len() as u64, layout.total_len());
        let crc = crc32fast::hash(&data);
        let at = layout.crc_offset() as usize;
        assert_eq!(bytes[at..at + 4], crc.to_le_bytes());
        assert_eq!(&bytes[..4], b"PK\x03\x04");
        // Streaming assembly gives the same bytes.
        let mut streamed = layout.prefix().to_vec();
        streamed.extend_from_slice(&data);
        streamed.extend_from_slice(&layout.suffix(crc));
        streamed[at..at + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(streamed, bytes);
        // No zip64 records in a small archive: the end record follows the directory directly.
        assert!(!bytes.windows(4).any(|w| w == SIG_EOCD64.to_le_bytes()));
        assert_eq!(&bytes[bytes.len() - 22..bytes.len() - 18], b"PK\x05\x06");

        let names: Vec<String> =
            list_archive(&bytes, 0, bytes.len() as u64).unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["archive/data.pkl", "archive/byteorder", "archive/version", "archive/data/0"]);

        let t = read_tensor_archive(&bytes, 0, bytes.len() as u64).unwrap();
        assert_eq!(
            t,
            ArchivedTensor {
                dtype: DType::BF16,
                shape: vec![3, 4],
                strides: vec![4, 1],
                storage_offset: 0,
                data_offset_in_item: layout.data_offset(),
                data_len: 24,
                data_crc32: Some(crc),
            }
        );
        let off = t.data_offset_in_item as usize;
        assert_eq!(&bytes[off..off + 24], data.as_slice());
    }

    #[test]
    fn alignment_holds_for_every_name_length_and_shape() {
        for dims in 0..8usize {
            let shape: Vec<u64> = (0..dims as u64).map(|d| d * 1000 + 1).collect();
            for dtype in DType::ALL {
                let layout = TensorArchive::new(dtype, &shape);
                assert_eq!(layout.data_offset() % 64, 0, "{dtype} {shape:?}");
            }
        }
    }

    #[test]
    fn zero_d_and_empty_tensors() {
        let bytes = encode_tensor_archive(DType::F32, &[], &2.5f32.to_le_bytes()).unwrap();
        let t = read_tensor_archive(&bytes, 0, bytes.len() as u64).unwrap();
        assert_eq!((t.shape.clone(), t.strides.clone(), t.data_len), (vec![], vec![], 4));
        let off = t.data_offset_in_item as usize;
        assert_eq!(bytes[off..off + 4], 2.5f32.to_le_bytes());

        let bytes = encode_tensor_archive(DType::I64, &[2, 0, 3], &[]).unwrap();
        let t = read_tensor_archive(&bytes, 0, bytes.len() as u64).unwrap();
        assert_eq!((t.shape, t.strides, t.data_len), (vec![2, 0, 3], vec![3, 3, 1], 0));
    }

    #[test]
    fn data_length_is_checked() {
        let err = encode_tensor_archive(DType::F32, &[2], &[0u8; 7]).unwrap_err();
        assert!(matches!(err, TorchSaveError::DataLength { want: 8, got: 7, .. }), "{err}");
        assert!(matches!(TensorArchive::try_new(DType::F64, &[1 << 62, 4]), Err(TorchSaveError::TooLarge { .. })));
        assert_eq!(TensorArchive::new(DType::F64, &[1 << 62, 4]).data_len(), u64::MAX);
    }

    /// Serves `prefix ++ zeros(data_len) ++ suffix` without allocating the zeros.
    struct Sparse {
        prefix: Vec<u8>,
        data_len: u64,
        suffix: Vec<u8>,
    }

    impl ReadAt for Sparse {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            let total = self.prefix.len() as u64 + self.data_len + self.suffix.len() as u64;
            if offset + buf.len() as u64 > total {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let suffix_start = self.prefix.len() as u64 + self.data_len;
            for (i, b) in buf.iter_mut().enumerate() {
                let p = offset + i as u64;
                *b = if p < self.prefix.len() as u64 {
                    self.prefix[p as usize]
                } else if p >= suffix_start {
                    self.suffix[(p - suffix_start) as usize]
                } else {
                    0
                };
            }
            Ok(())
        }
    }

    #[test]
    fn zip64_for_large_data() {
        for data_len in [0xFFFF_FFFFu64, 5 << 30] {
            let layout = TensorArchive::new(DType::U8, &[data_len]);
            assert_eq!(layout.data_offset() % 64, 0);
            let suffix = layout.suffix(0x1234_5678);
            // Central directory (4 entries, one with a 20-byte zip64 extra), zip64 end record,
            // locator, end record.
            let names_len: usize =
                ["data.pkl", "byteorder", "version", "data/0"].iter().map(|n| "archive/".len() + n.len()).sum();
            assert_eq!(suffix.len(), 4 * 46 + names_len + 20 + 56 + 20 + 22);
            let end = &suffix[suffix.len() - 22..];
            assert_eq!(le32(end, 16), u32::MAX, "cd offset lives in the zip64 record");
            let src = Sparse { prefix: layout.prefix_with_crc(0x1234_5678), data_len, suffix };
            let total = layout.total_len();
            let t = read_tensor_archive(&src, 0, total).unwrap();
            assert_eq!(t.shape, vec![data_len]);
            assert_eq!(t.data_len, data_len);
            assert_eq!(t.data_offset_in_item, layout.data_offset());
            assert_eq!(t.data_crc32, Some(0x1234_5678));
            let entries = list_archive(&src, 0, total).unwrap();
            let data = entries.iter().find(|e| e.name == "archive/data/0").unwrap();
            assert_eq!((data.size, data.compressed_size), (data_len, data_len));
        }
        // Data just below 4 GiB: no zip64 entry fields, but the central directory starts beyond
        // 4 GiB, so the end records are zip64.
        let layout = TensorArchive::new(DType::U8, &[0xFFFF_FFFE]);
        assert!(!layout.prefix().windows(4).any(|w| w == [1, 0, 16, 0]));
        let suffix = layout.suffix(0);
        assert!(!suffix.windows(4).any(|w| w == [1, 0, 16, 0]));
        assert!(suffix.windows(4).any(|w| w == SIG_EOCD64.to_le_bytes()));
        let src = Sparse { prefix: layout.prefix().to_vec(), data_len: 0xFFFF_FFFE, suffix };
        let t = read_tensor_archive(&src, 0, layout.total_len()).unwrap();
        assert_eq!(t.data_len, 0xFFFF_FFFE);
        // Everything below 4 GiB: plain end record.
        let layout = TensorArchive::new(DType::U8, &[0xFFFF_0000]);
        let suffix = layout.suffix(0);
        assert!(!suffix.windows(4).any(|w| w == SIG_EOCD64.to_le_bytes()));
        let src = Sparse { prefix: layout.prefix().to_vec(), data_len: 0xFFFF_0000, suffix };
        assert!(read_tensor_archive(&src, 0, layout.total_len()).is_ok());
    }

    #[test]
    fn items_inside_a_larger_file() {
        let a = encode_tensor_archive(DType::F32, &[2], &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let b = encode_object_archive(&PyObject::Int(0));
        let mut file = vec![0xAAu8; 5];
        file.extend_from_slice(&a);
        file.extend_from_slice(&b);
        let t = read_tensor_archive(&file, 5, a.len() as u64).unwrap();
        assert_eq!(t.data_offset_in_item, TensorArchive::new(DType::F32, &[2]).data_offset());
        let v = read_object_archive(&file, 5 + a.len() as u64, b.len() as u64).unwrap();
        assert_eq!(v, Value::Int(0));
        // A range that does not end at an end record is rejected.
        assert!(read_tensor_archive(&file, 5, a.len() as u64 + 1).is_err());

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.distcp");
        std::fs::write(&path, &file).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        assert_eq!(read_tensor_archive(&f, 5, a.len() as u64).unwrap(), t);
    }

    #[test]
    fn object_archives() {
        let v = PyObject::Dict(vec![
            ("lr".into(), PyObject::Float(0.1)),
            ("betas".into(), PyObject::Tuple(vec![PyObject::Float(0.9), PyObject::Float(0.999)])),
            ("params".into(), PyObject::List(vec![PyObject::Str("w".into())])),
            ("amsgrad".into(), PyObject::Bool(false)),
            ("foreach".into(), PyObject::None),
            ("empty".into(), PyObject::List(vec![])),
            ("step".into(), PyObject::Int(1 << 40)),
        ]);
        let bytes = encode_object_archive(&v);
        let read = read_object_archive(&bytes, 0, bytes.len() as u64).unwrap();
        let f = |x: f64| Value::Float(x);
        assert_eq!(
            read,
            Value::Dict(vec![
                (Value::Str("lr".into()), f(0.1)),
                (Value::Str("betas".into()), Value::Tuple(vec![f(0.9), f(0.999)])),
                (Value::Str("params".into()), Value::List(vec![Value::Str("w".into())])),
                (Value::Str("amsgrad".into()), Value::Bool(false)),
                (Value::Str("foreach".into()), Value::None),
                (Value::Str("empty".into()), Value::List(vec![])),
                (Value::Str("step".into()), Value::Int(1 << 40)),
            ])
        );
        assert_eq!(object_pickle(&PyObject::Float(3.0)), b"\x80\x02G\x40\x08\0\0\0\0\0\0.");
        // A bytes item is not a tensor.
        assert!(matches!(read_tensor_archive(&bytes, 0, bytes.len() as u64), Err(TorchSaveError::NotATensor(_))));
    }

    // Offsets of the items in ckpt/__0_0.distcp, from the torch-written ckpt/.metadata.
    const LR: (u64, u64) = (0, 1261);
    const ITERATION: (u64, u64) = (1261, 1261);
    const W: (u64, u64) = (2522, 1577);
    const F8: (u64, u64) = (4099, 1577);
    const STEP: (u64, u64) = (5676, 1577);

    #[test]
    fn reads_torch_written_items() {
        let file = fixture("ckpt/__0_0.distcp");
        let t = read_tensor_archive(&file, W.0, W.1).unwrap();
        assert_eq!((t.dtype, t.shape.clone(), t.strides.clone()), (DType::BF16, vec![3, 4], vec![4, 1]));
        assert_eq!((t.storage_offset, t.data_len), (0, 24));
        let data = &file[(W.0 + t.data_offset_in_item) as usize..][..24];
        assert_eq!(data, bf16_bytes(&(0..12).map(|i| i as f32).collect::<Vec<_>>()).as_slice());
        assert_eq!(t.data_crc32, Some(crc32fast::hash(data)));
        assert_eq!(t.data_offset_in_item % 64, 0);

        let t = read_tensor_archive(&file, F8.0, F8.1).unwrap();
        assert_eq!((t.dtype, t.shape.clone(), t.data_len), (DType::F8E4M3, vec![3], 3));
        let data = &file[(F8.0 + t.data_offset_in_item) as usize..][..3];
        assert_eq!(data, [0x30, 0xB8, 0x40]); // 0.5, -1.0, 2.0 in e4m3fn

        let t = read_tensor_archive(&file, STEP.0, STEP.1).unwrap();
        assert_eq!((t.dtype, t.shape.clone(), t.data_len), (DType::F32, vec![], 4));
        let data = &file[(STEP.0 + t.data_offset_in_item) as usize..][..4];
        assert_eq!(data, 2.5f32.to_le_bytes());

        assert_eq!(read_object_archive(&file, LR.0, LR.1).unwrap(), Value::Float(0.1));
        assert_eq!(read_object_archive(&file, ITERATION.0, ITERATION.1).unwrap(), Value::Int(7));
        // torch.save's pickles of these values are byte-identical to ours.
        assert_eq!(data_pkl(&file, LR.0, LR.1), object_pickle(&PyObject::Float(0.1)));
        assert_eq!(data_pkl(&file, ITERATION.0, ITERATION.1), object_pickle(&PyObject::Int(7)));
    }

    #[test]
    fn our_tensor_pickles_mean_what_torch_writes() {
        // torch adds BINPUT memo opcodes; the unpickled values must be identical.
        let file = fixture("ckpt/__0_0.distcp");
        for ((off, len), dtype, shape, numel) in
            [(W, DType::BF16, &[3u64, 4][..], 12u64), (F8, DType::F8E4M3, &[3][..], 3), (STEP, DType::F32, &[][..], 1)]
        {
            let theirs = pickle::loads(&data_pkl(&file, off, len)).unwrap();
            let nbytes = numel * dtype.size() as u64;
            let ours = pickle::loads(&tensor_pickle(dtype, shape, numel, nbytes)).unwrap();
            assert_eq!(ours, theirs, "{dtype}");
        }
    }

    #[test]
    fn torch_written_view_and_transposed() {
        let view = fixture("view.pt");
        let t = read_tensor_archive(&view, 0, view.len() as u64).unwrap();
        assert_eq!((t.dtype, t.shape.clone(), t.storage_offset, t.data_len), (DType::F32, vec![3], 2, 12));
        assert_eq!(t.data_crc32, None);
        let data = &view[t.data_offset_in_item as usize..][..12];
        let want: Vec<u8> = [2.0f32, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(data, want.as_slice());

        let tr = fixture("transposed.pt");
        let err = read_tensor_archive(&tr, 0, tr.len() as u64).unwrap_err();
        assert!(
            matches!(&err, TorchSaveError::NonContiguous { shape, strides } if *shape == [4, 3] && *strides == [1, 4]),
            "{err}"
        );
    }

    /// An archive with a hand-written `data.pkl` and storage entry, under directory `dir`.
    fn custom_archive(dir: &str, pkl: &[u8], storage: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut entries = Vec::new();
        push_entry(&mut out, &mut entries, format!("{dir}data.pkl"), pkl);
        push_entry(&mut out, &mut entries, format!("{dir}data/0"), storage);
        let cd = central_directory(&entries, out.len() as u64);
        out.extend_from_slice(&cd);
        out
    }

    fn v2_pickle(class: &str, numel: i128, offset: i128, shape: &[u64], strides: &[u64]) -> Vec<u8> {
        let mut w = PickleWriter::new();
        w.proto(2).global("torch._utils", "_rebuild_tensor_v2").mark();
        w.mark().str("storage").global("torch", class).str("0").str("cpu").int(numel).tuple();
        w.binpersid().int(offset);
        w.int_tuple(shape);
        w.int_tuple(strides);
        w.bool(false).global("collections", "OrderedDict").empty_tuple().reduce();
        w.tuple().reduce().stop();
        w.into_bytes()
    }

    #[test]
    fn any_directory_name_and_storage_checks() {
        let pkl = v2_pickle("FloatStorage", 4, 1, &[3], &[1]);
        let ar = custom_archive("checkpoint/", &pkl, &[0u8; 16]);
        let t = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap();
        assert_eq!((t.storage_offset, t.data_len), (1, 12));

        let pkl = v2_pickle("FloatStorage", 4, 2, &[3], &[1]);
        let ar = custom_archive("x/", &pkl, &[0u8; 16]);
        let err = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::StorageBounds { storage_offset: 2, .. }), "{err}");

        let pkl = v2_pickle("FloatStorage", 4, 0, &[4], &[1]);
        let ar = custom_archive("x/", &pkl, &[0u8; 12]);
        let err = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::StorageSize { declared: 16, actual: 12, .. }), "{err}");

        let pkl = v2_pickle("ComplexFloatStorage", 4, 0, &[4], &[1]);
        let ar = custom_archive("x/", &pkl, &[0u8; 16]);
        let err = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::UnsupportedDtype(_)), "{err}");

        // Size-1 dims do not constrain strides (torch's is_contiguous).
        let pkl = v2_pickle("FloatStorage", 3, 0, &[1, 3, 1], &[99, 1, 7]);
        let ar = custom_archive("x/", &pkl, &[0u8; 12]);
        assert!(read_tensor_archive(&ar, 0, ar.len() as u64).is_ok());

        let pkl = v2_pickle("FloatStorage", 3, 0, &[3], &[1]);
        let ar = custom_archive("", &pkl, &[0u8; 12]);
        let err = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap_err();
        assert!(err.to_string().contains("not in a directory"), "{err}");
    }

    /// Zeroes every crc-32 field (local headers and central directory), as torch ≥ 2.6 writes
    /// them with `torch.serialization.config.save.compute_crc32 = False`.
    fn without_crcs(mut bytes: Vec<u8>) -> Vec<u8> {
        let mut at = 0;
        while at + 4 <= bytes.len() {
            let field = match &bytes[at..at + 4] {
                b"PK\x03\x04" => Some(at + LOCAL_CRC_FIELD as usize),
                b"PK\x01\x02" => Some(at + 16),
                _ => None,
            };
            if let Some(f) = field {
                bytes[f..f + 4].fill(0);
            }
            at += 1;
        }
        bytes
    }

    #[test]
    fn archives_without_crcs_read_like_torch_reads_them() {
        let data = bf16_bytes(&[1.0, -2.0, 3.5, 0.25]);
        let good = encode_tensor_archive(DType::BF16, &[2, 2], &data).unwrap();
        let zeroed = without_crcs(good.clone());
        assert_ne!(zeroed, good);
        let a = read_tensor_archive(&good, 0, good.len() as u64).unwrap();
        let b = read_tensor_archive(&zeroed, 0, zeroed.len() as u64).unwrap();
        assert_eq!(a.data_crc32, Some(crc32fast::hash(&data)));
        // A stored 0 is "not computed", not a mismatch, and not reported as the data's crc.
        assert_eq!(b.data_crc32, None);
        assert_eq!(
            (b.dtype, &b.shape, b.data_offset_in_item, b.data_len),
            (a.dtype, &a.shape, a.data_offset_in_item, a.data_len)
        );
        // The streamed form with crc 0 (the executor's default) is the zeroed archive's data entry.
        let layout = TensorArchive::new(DType::BF16, &[2, 2]);
        let mut streamed = layout.prefix().to_vec();
        streamed.extend_from_slice(&data);
        streamed.extend_from_slice(&layout.suffix(NO_CRC32));
        let s = read_tensor_archive(&streamed, 0, streamed.len() as u64).unwrap();
        assert_eq!((s.data_crc32, s.data_len), (None, 8));
        // An empty tensor's crc is 0 for real.
        let empty = encode_tensor_archive(DType::F32, &[0], &[]).unwrap();
        assert_eq!(read_tensor_archive(&empty, 0, empty.len() as u64).unwrap().data_crc32, Some(0));
        // A wrong non-zero crc is still an error (the central directory's, which readers use;
        // data.pkl is its first entry).
        let mut bad = good.clone();
        let cd = bad.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
        bad[cd + 16] ^= 1;
        assert!(matches!(read_tensor_archive(&bad, 0, bad.len() as u64), Err(TorchSaveError::Crc { .. })));
    }

    #[test]
    fn corrupt_archives_are_errors() {
        let good = encode_tensor_archive(DType::F32, &[2], &[0u8; 8]).unwrap();
        // Every truncation, from the end or the front.
        for n in 0..good.len() {
            assert!(read_tensor_archive(&good, 0, n as u64).is_err(), "first {n} bytes accepted");
            assert!(read_tensor_archive(&good[n + 1..], 0, (good.len() - n - 1) as u64).is_err());
        }
        // A flipped byte in data.pkl fails its crc.
        let mut bad = good.clone();
        bad[60] ^= 1; // inside data.pkl (its data starts at 30 + len("archive/data.pkl"))
        let err = read_tensor_archive(&bad, 0, bad.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::Crc { .. }), "{err}");
        // Big endian is refused.
        let mut out = Vec::new();
        let mut entries = Vec::new();
        push_entry(&mut out, &mut entries, "a/data.pkl".into(), &object_pickle(&PyObject::None));
        push_entry(&mut out, &mut entries, "a/byteorder".into(), b"big");
        let cd = central_directory(&entries, out.len() as u64);
        out.extend_from_slice(&cd);
        let err = read_object_archive(&out, 0, out.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::ByteOrder(ref s) if s == "big"), "{err}");
        // No data.pkl.
        let mut out = Vec::new();
        let mut entries = Vec::new();
        push_entry(&mut out, &mut entries, "a/version".into(), b"3\n");
        let cd = central_directory(&entries, out.len() as u64);
        out.extend_from_slice(&cd);
        let err = read_object_archive(&out, 0, out.len() as u64).unwrap_err();
        assert!(matches!(err, TorchSaveError::MissingEntry(ref s) if s == "a/data.pkl"), "{err}");
        // Raw bytes (what torch refuses too).
        assert!(matches!(read_tensor_archive(&[0u8; 64][..], 0, 64), Err(TorchSaveError::NotZip(_))));
    }

    proptest::proptest! {
        #[test]
        fn mutated_archives_never_panic(pos in 0usize..2000, byte in proptest::prelude::any::<u8>()) {
            let mut b = fixture("ckpt/__0_0.distcp")[W.0 as usize..(W.0 + W.1) as usize].to_vec();
            let i = pos % b.len();
            b[i] = byte;
            let _ = read_tensor_archive(&b, 0, b.len() as u64);
            let _ = read_object_archive(&b, 0, b.len() as u64);
        }

        #[test]
        fn tensor_archives_round_trip(
            dtype_idx in 0usize..12,
            shape in proptest::collection::vec(0u64..5, 0..4),
        ) {
            let dtype = DType::ALL[dtype_idx];
            let layout = TensorArchive::new(dtype, &shape);
            let data: Vec<u8> = (0..layout.data_len()).map(|i| i as u8).collect();
            let bytes = encode_tensor_archive(dtype, &shape, &data).unwrap();
            let t = read_tensor_archive(&bytes, 0, bytes.len() as u64).unwrap();
            proptest::prop_assert_eq!(t.dtype, dtype);
            proptest::prop_assert_eq!(&t.shape, &shape);
            proptest::prop_assert_eq!(t.data_offset_in_item % 64, 0);
            let off = t.data_offset_in_item as usize;
            proptest::prop_assert_eq!(&bytes[off..off + data.len()], data.as_slice());
        }
    }
}
