//! Reading: the real fixtures, and bad files and releases, one test per defect.

use super::*;

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
    write_file(&path, &[("first", DType::F32, &[4], &[0; 16]), ("second", DType::F32, &[4], &[0; 16])], &no_metadata())
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
    let header =
        r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
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
