//! Writing then reading back, interoperability with the reference implementation, properties;
//! `reading` has the fixtures and the bad inputs.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::header::*;
use super::release::*;
use super::writer::*;
use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};
use shardline_layout::DType;
use tempfile::TempDir;

mod reading;

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
        FileLayout::new(shapes.iter().map(|(n, s)| (n.as_str(), DType::BF16, s.as_slice())), &no_metadata()).unwrap();
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
    let err =
        FileLayout::new([("a", DType::U8, &[1u64][..]), ("a", DType::U8, &[1u64][..])], &no_metadata()).unwrap_err();
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
        if let Ok(header) = parse_header(Path::new("fuzz.safetensors"), json.as_slice(), json.len() as u64, file_len) {
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
