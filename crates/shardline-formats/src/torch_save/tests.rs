//! Archives written here and by torch, read back; corruptions refused.

use super::read::{le32, Archive};
use super::write::{central_directory, push_entry, push_storage_entry, tensor_pickle, LOCAL_CRC_FIELD};
use super::*;
use crate::pickle::{self, PickleWriter, Value};

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
    ar.read_small(&e, MAX_PICKLE_LEN).unwrap().into_owned()
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

    let names: Vec<String> = list_archive(&bytes, 0, bytes.len() as u64).unwrap().into_iter().map(|e| e.name).collect();
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
    push_entry(&mut out, &mut entries, format!("{dir}version"), b"3\n");
    // The storage record starts 64-byte aligned, as torch writes it.
    push_storage_entry(&mut out, &mut entries, format!("{dir}data/0"), storage);
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
    // The local header still has the right crc, so the two disagree.
    let err = read_tensor_archive(&bad, 0, bad.len() as u64).unwrap_err();
    assert!(matches!(err, TorchSaveError::Corrupt(ref m) if m.contains("crc or sizes differ")), "{err}");
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
    push_entry(&mut out, &mut entries, "a/version".into(), b"3\n");
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

#[test]
fn an_entry_marked_as_a_directory_is_refused() {
    // miniz extracts nothing from an entry whose external attributes carry the DOS directory bit,
    // so torch reads zeros where data.pkl was.
    let mut ar = encode_tensor_archive(DType::F32, &[2], &[0u8; 8]).unwrap();
    let cd = ar.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
    ar[cd + 38] |= 0x10;
    let err = read_tensor_archive(&ar, 0, ar.len() as u64).unwrap_err();
    assert!(err.to_string().contains("marked as a directory"), "{err}");
}

#[test]
fn structure_torch_walks_is_checked_field_by_field() {
    let good = encode_tensor_archive(DType::F32, &[2], &[0u8; 8]).unwrap();
    read_tensor_archive(&good, 0, good.len() as u64).unwrap();
    let at =
        |pat: &[u8], nth: usize| good.windows(pat.len()).enumerate().filter(|(_, w)| *w == pat).nth(nth).unwrap().0;
    let local_version = at(b"PK\x03\x04", 2); // data.pkl, byteorder, version, data/0
    let central_version = at(b"PK\x01\x02", 2);
    let version_body = at(b"3\n", 0);
    let eocd = at(b"PK\x05\x06", 0);
    let cases: [(&str, usize, u8, &str); 9] = [
        ("local name", local_version + 30, b'V', "name differs"),
        ("local name length", local_version + 26, 0x10, ""),
        ("local method", local_version + 8, 8, "method"),
        ("local flags", local_version + 6, 1, "flags"),
        ("central name", central_version + 46 + 8, b'V', "not a record torch writes"),
        ("central disk", central_version + 34, 1, "another disk"),
        ("version record", version_body, b'x', "archive/version"),
        ("entries on this disk", eocd + 8, 1, "multi-disk"),
        ("end comment length", eocd + 20, 1, ""),
    ];
    for (what, offset, value, want) in cases {
        let mut bad = good.clone();
        bad[offset] ^= value;
        let err = read_tensor_archive(&bad, 0, bad.len() as u64).expect_err(what).to_string();
        assert!(err.contains(want), "{what}: {err}");
    }
}

#[test]
fn a_version_torch_cannot_parse_is_refused() {
    for (body, ok) in
        [(&b"3\n"[..], true), (b"10", true), (b"-\n", false), (b"0\n", false), (b"11\n", false), (b"", false)]
    {
        let mut out = Vec::new();
        let mut entries = Vec::new();
        push_entry(&mut out, &mut entries, "a/data.pkl".into(), &object_pickle(&PyObject::None));
        push_entry(&mut out, &mut entries, "a/version".into(), body);
        let cd = central_directory(&entries, out.len() as u64);
        out.extend_from_slice(&cd);
        let got = read_object_archive(&out, 0, out.len() as u64);
        assert_eq!(got.is_ok(), ok, "{body:?}: {got:?}");
    }
}
