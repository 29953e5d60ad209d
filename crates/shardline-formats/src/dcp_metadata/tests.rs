//! Round trips, torch-written files, the variants torch versions write, and errors.

use shardline_layout::DType;

use super::encode::{new_instance, write_metadata, write_size, write_tensor_properties, ENCODER_FLUSH_BYTES};
use super::*;
use crate::pickle::{self, PickleWriter};
#[cfg(test)]
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
    let chunk = [&m[..], b"ChunkStorageMetadata\n)\x81}(", &x("offsets"), &size0, &x("sizes"), &size0, b"ub"].concat();
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
            ("big".into(), EntryMeta::Tensor { dtype: DType::F8E5M2, size: vec![1 << 33, 2, 3, 4, 5], chunks: vec![] }),
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
    // planner_data None (torch without a planner mapping), in its dataclass field's place.
    w.str("planner_data").none();
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
    // storage_meta as torch writes it.
    w.str("storage_meta");
    new_instance(&mut w, MD_MODULE, "StorageMeta");
    w.empty_dict().mark().str("checkpoint_id").global("pathlib", "PosixPath").str("/x");
    w.tuple1().reduce().str("save_id").str("u").str("load_id").none();
    w.str("modules").empty_list().setitems().build();
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
        w.mark().global("torch", "float16").global("torch", "strided").bool(false);
        w.global(MD_MODULE, "_MEM_FORMAT_ENCODING").int(2).tuple1().reduce().bool(false).tuple();
    };
    // torch 2.15's field is `strides: tuple[int, ...] | None`; Megatron-Core's saves leave it None.
    let six_without_strides = |w: &mut PickleWriter| {
        w.mark().global("torch", "float16").global("torch", "strided").bool(false);
        w.global(MD_MODULE, "_MEM_FORMAT_ENCODING").int(0).tuple1().reduce().bool(false).none().tuple();
    };
    for (name, pkl) in [
        ("6-tuple with index", variant_pickle(six, true)),
        ("5-tuple without index", variant_pickle(five, false)),
        ("6-tuple, strides None", variant_pickle(six_without_strides, false)),
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
fn refuses_what_torch_cannot_unpickle_into_tensor_properties() {
    // torch's TensorProperties.__setstate__ unpacks a tuple and maps the memory format encoding:
    // a dict state, a None or unknown encoding, or another layout do not load.
    // A 5-tuple state with this layout and memory format encoding (None: a bare None).
    let tuple_state = |layout: &'static str, encoding: Option<i128>| -> Box<dyn Fn(&mut PickleWriter)> {
        Box::new(move |w: &mut PickleWriter| {
            w.mark().global("torch", "float16").global("torch", layout).bool(false);
            match encoding {
                Some(e) => w.global(MD_MODULE, "_MEM_FORMAT_ENCODING").int(e).tuple1().reduce(),
                None => w.none(),
            };
            w.bool(false).tuple();
        })
    };
    let dict_state: Box<dyn Fn(&mut PickleWriter)> = Box::new(|w: &mut PickleWriter| {
        w.empty_dict().mark().str("dtype").global("torch", "float16").str("layout");
        w.global("torch", "strided").setitems();
    });
    let cases = [
        ("memory format None", tuple_state("strided", None), "memory_format"),
        ("memory format 3", tuple_state("strided", Some(3)), "memory_format"),
        ("dict state", dict_state, "5- or 6-tuple"),
        ("sparse layout", tuple_state("sparse_coo", Some(0)), "layout"),
    ];
    for (name, state, want) in cases {
        let err = decode_metadata(&variant_pickle(state, false)).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
    }
}

#[test]
fn refuses_other_classes_fields_and_order() {
    let good = encode_metadata(&rich_metadata());
    let replace = |from: &[u8], to: &[u8]| {
        let at = good.windows(from.len()).position(|w| w == from).expect("pattern in the pickle");
        let mut b = good.clone();
        b.splice(at..at + from.len(), to.iter().copied());
        decode_metadata(&b).unwrap_err().to_string()
    };
    // Another module or class of the same length.
    assert!(replace(
        b"torch.distributed.checkpoint.metadata\nMetadataIndex",
        b"torch.distributed.checkpoint.metadata\nMetadataIndey"
    )
    .contains("expected MetadataIndex"));
    assert!(replace(b"Size", b"Sise").contains("torch.Size"));
    // An unknown field of a dataclass.
    assert!(replace(b"relative_path", b"relative_patH").contains("unexpected field"));
    // Sections out of their dataclass order.
    let mut w = PickleWriter::new();
    w.proto(2);
    new_instance(&mut w, MD_MODULE, "Metadata");
    w.empty_dict().mark().str("storage_data").empty_dict().str("state_dict_metadata").empty_dict();
    w.setitems().build().stop();
    assert!(decode_metadata(w.as_bytes()).unwrap_err().to_string().contains("out of order"));
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

/// Counts the bytes a reader has taken, to see when items are handed over.
struct Tracked<'a> {
    data: &'a [u8],
    pos: std::rc::Rc<std::cell::Cell<usize>>,
}

impl std::io::Read for Tracked<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(4096).min(self.data.len() - self.pos.get());
        buf[..n].copy_from_slice(&self.data[self.pos.get()..self.pos.get() + n]);
        self.pos.set(self.pos.get() + n);
        Ok(n)
    }
}

#[test]
fn streaming_and_whole_readers_agree_and_items_arrive_while_reading() {
    let mut md = rich_metadata();
    md.storage_data.retain(|(k, _)| k.offset.is_some());
    for i in 0..20_000u64 {
        let fqn = format!("layers.{i}.w");
        let chunks = vec![ChunkMeta { offsets: vec![0, 0], sizes: vec![4, 4] }];
        md.state_dict_metadata.push((fqn.clone(), EntryMeta::Tensor { dtype: DType::F32, size: vec![4, 4], chunks }));
        md.storage_data.push((key(&fqn, Some(&[0, 0])), info("__0_0.distcp", i * 64, 64)));
    }
    let torch = std::fs::read(format!("{FIXTURES}/ckpt/.metadata")).unwrap();
    let ours = encode_metadata(&md);
    for bytes in [&ours, &torch] {
        let mut streamed = Vec::new();
        read_metadata(bytes.as_slice(), bytes.as_slice(), bytes.len() as u64, |i| {
            streamed.push(i);
            Ok::<(), DcpMetadataError>(())
        })
        .unwrap();
        assert_eq!(streamed, decode::read_metadata_whole(bytes).unwrap());
    }
    // Items are handed over while reading, every section: the first entry long before the end,
    // and the storage items (the last section) well before the end too.
    let pos = std::rc::Rc::new(std::cell::Cell::new(0));
    let (mut first_at, mut storage_at) = (None, Vec::new());
    let reader = std::io::BufReader::with_capacity(4096, Tracked { data: &ours, pos: pos.clone() });
    read_metadata(ours.as_slice(), reader, ours.len() as u64, |i| {
        first_at.get_or_insert(pos.get());
        if matches!(i, MetadataItem::Storage(..)) {
            storage_at.push(pos.get());
        }
        Ok::<(), DcpMetadataError>(())
    })
    .unwrap();
    let first_at = first_at.unwrap();
    assert!(first_at * 4 < ours.len(), "first item after {first_at} of {} bytes", ours.len());
    let middle = storage_at[storage_at.len() / 2];
    assert!(middle + (ours.len() / 8) < ours.len(), "half the storage items after {middle} of {} bytes", ours.len());
}
