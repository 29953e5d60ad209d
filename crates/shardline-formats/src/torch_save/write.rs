//! Writing `torch.save` archives: a streamed tensor item, or a small object.

use shardline_layout::DType;

use super::*;
use crate::pickle::PickleWriter;
// Writing

/// Whether and how an entry uses zip64.
#[derive(Clone, Debug)]
pub(super) struct EntryRecord {
    pub(super) name: String,
    pub(super) crc32: u32,
    pub(super) size: u64,
    pub(super) local_header_offset: u64,
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
pub(super) fn local_header(entry: &EntryRecord, header_offset: u64, align: u64) -> Vec<u8> {
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
pub(super) const LOCAL_CRC_FIELD: u64 = 14;

/// Appends a small entry (header and body, unaligned) to `out`.
pub(super) fn push_entry(out: &mut Vec<u8>, entries: &mut Vec<EntryRecord>, name: String, body: &[u8]) {
    push_aligned(out, entries, name, body, 1);
}

/// Appends a storage entry, its data 64-byte aligned as torch aligns it (and the strict reader
/// requires).
pub(super) fn push_storage_entry(out: &mut Vec<u8>, entries: &mut Vec<EntryRecord>, name: String, body: &[u8]) {
    push_aligned(out, entries, name, body, DATA_ALIGNMENT);
}

fn push_aligned(out: &mut Vec<u8>, entries: &mut Vec<EntryRecord>, name: String, body: &[u8], alignment: u64) {
    let entry = EntryRecord {
        name,
        crc32: crc32fast::hash(body),
        size: body.len() as u64,
        local_header_offset: out.len() as u64,
    };
    out.extend_from_slice(&local_header(&entry, entry.local_header_offset, alignment));
    out.extend_from_slice(body);
    entries.push(entry);
}

/// The central directory starting at `cd_offset`, then the zip64 end records if needed, then
/// the end-of-central-directory record.
pub(super) fn central_directory(entries: &[EntryRecord], cd_offset: u64) -> Vec<u8> {
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
pub(super) fn numel_and_bytes(dtype: DType, shape: &[u64]) -> Option<(u64, u64)> {
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
pub(super) fn tensor_pickle(dtype: DType, shape: &[u64], numel: u64, nbytes: u64) -> Vec<u8> {
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
    /// An instance of `module.class` made by `cls.__new__(cls)` and given `state` as its
    /// attributes (`NEWOBJ` + `BUILD`, as pickle stores an `argparse.Namespace`).
    Object {
        module: String,
        class: String,
        state: Vec<(String, PyObject)>,
    },
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
        PyObject::Object { module, class, state } => {
            w.global(module, class).empty_tuple().newobj();
            write_object(w, &PyObject::Dict(state.clone()));
            w.build();
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
    encode_pickle_archive(&object_pickle(value))
}

/// The `torch.save` archive of an object whose pickle (`data.pkl`, no tensors) is `pkl`.
pub fn encode_pickle_archive(pkl: &[u8]) -> Vec<u8> {
    encode_archive_with_storages(pkl, &[])
}

/// The `torch.save` archive of an object whose pickle `pkl` refers to the storages `storages`
/// (`(key, bytes)`: the pickle's persistent ids name them by key, each stored as `data/<key>`).
pub fn encode_archive_with_storages(pkl: &[u8], storages: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut entries = Vec::new();
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/data.pkl"), pkl);
    for (key, bytes) in storages {
        push_storage_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/data/{key}"), bytes);
    }
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/byteorder"), b"little");
    push_entry(&mut out, &mut entries, format!("{ARCHIVE_DIR}/version"), b"3\n");
    let cd = central_directory(&entries, out.len() as u64);
    out.extend_from_slice(&cd);
    out
}
