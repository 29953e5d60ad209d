//! Opening a DCP checkpoint: every chunk located once, file names shared, a key filter that
//! keeps only what it accepts, and a `.metadata` whose storage items do not match its chunks
//! refused with the key and offsets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardline_layout::{build_plan, Mesh, ModelConfig, PlanOptions, SourceTensor};

use super::*;
use crate::dcp_metadata::{decode_metadata, encode_metadata, Metadata, StorageKey};
use crate::execute::{write_checkpoint, ExecuteOptions, Progress};
use crate::safetensors::Release;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
}

/// The tiny Llama at tp2·dp2 with optimizer state, written to a fresh directory.
fn written() -> tempfile::TempDir {
    let release = Release::open(fixture("llama")).unwrap();
    let config = ModelConfig::from_json(release.config_json()).unwrap();
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 2 };
    let options = PlanOptions { optimizer_state: true, ..PlanOptions::default() };
    let plan = build_plan(&config, sources, mesh, &options).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&plan, &release, dir.path(), &ExecuteOptions::default(), &Progress::default()).unwrap();
    dir
}

fn edit_metadata(dir: &Path, edit: impl FnOnce(&mut Metadata)) {
    let path = dir.join(".metadata");
    let mut md = decode_metadata(&fs::read(&path).unwrap()).unwrap();
    edit(&mut md);
    fs::write(&path, encode_metadata(&md)).unwrap();
}

#[test]
fn every_chunk_is_located_once_and_file_names_are_shared() {
    let dir = written();
    let ckpt = open_checkpoint(dir.path()).unwrap();
    let md = decode_metadata(&fs::read(dir.path().join(".metadata")).unwrap()).unwrap();
    let chunks: usize = ckpt.tensors.iter().map(|t| t.chunks.len()).sum();
    assert_eq!(chunks + ckpt.objects.len(), md.storage_data.len());
    for (key, info) in &md.storage_data {
        let Some(offsets) = &key.offset else { continue };
        let t = ckpt.tensors.iter().find(|t| t.key == key.fqn).unwrap();
        let c = t.chunks.iter().find(|c| &c.offsets == offsets).unwrap();
        assert_eq!(&*c.file, info.relative_path);
        // The data starts inside the item's archive and ends within it.
        assert!(c.data_offset > info.offset && c.data_offset + c.data_len <= info.offset + info.length);
    }
    let all: Vec<&Arc<str>> = ckpt.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| &c.file)).collect();
    let first = all.iter().find(|f| f.as_ref() == "__0_0.distcp").unwrap();
    for f in all.iter().filter(|f| f.as_ref() == "__0_0.distcp") {
        assert!(Arc::ptr_eq(f, first), "one allocation per file name, not one per chunk");
    }
    assert!(ckpt.tensors.windows(2).all(|w| w[0].key < w[1].key));
    assert_eq!(ckpt.planner_data.len(), md.planner_data.len());
}

#[test]
fn a_key_filter_keeps_only_what_it_accepts() {
    let dir = written();
    let all = open_checkpoint(dir.path()).unwrap();
    let model = open_checkpoint_keys(dir.path(), |k| !k.starts_with("optimizer.")).unwrap();
    assert!(model.tensors.len() < all.tensors.len());
    assert!(model.tensors.iter().all(|t| !t.key.starts_with("optimizer.")));
    assert!(model.planner_data.keys().all(|k| !k.starts_with("optimizer.")));
    let kept: Vec<&StoredTensor> = all.tensors.iter().filter(|t| !t.key.starts_with("optimizer.")).collect();
    assert_eq!(model.tensors.iter().collect::<Vec<_>>(), kept);
}

#[test]
fn storage_items_that_do_not_match_the_chunks_are_refused() {
    type Edit = fn(&mut Metadata);
    let cases: [(&str, Edit); 4] = [
        ("no storage entry for chunk", |md| {
            md.storage_data.remove(3);
        }),
        ("no chunk of state_dict_metadata names", |md| {
            let (k, info) = md.storage_data[0].clone();
            let offsets = k.offset.map(|o| o.iter().map(|x| x + 1).collect());
            md.storage_data.push((StorageKey { fqn: k.fqn, offset: offsets }, info));
        }),
        ("names this item twice", |md| {
            let dup = md.storage_data[5].clone();
            md.storage_data.push(dup);
        }),
        ("state_dict_metadata does not have", |md| {
            let (k, info) = md.storage_data[0].clone();
            md.storage_data.push((StorageKey { fqn: format!("{}.ghost", k.fqn), offset: k.offset }, info));
        }),
    ];
    for (want, edit) in cases {
        let dir = written();
        edit_metadata(dir.path(), edit);
        let err = open_checkpoint(dir.path()).unwrap_err().to_string();
        assert!(err.contains(want), "expected `{want}`, got: {err}");
    }
}

#[test]
fn storage_ranges_of_the_model_are_all_a_filtered_open_reads() {
    let dir = written();
    let model = |k: &str| k.starts_with("model.");
    let ranges = storage_ranges(&dir.path().join(".metadata"), model).unwrap();
    // A sparse copy: every rank file at its size, zero but for the ranges.
    let sparse = tempfile::tempdir().unwrap();
    fs::copy(dir.path().join(".metadata"), sparse.path().join(".metadata")).unwrap();
    let (mut kept, mut total) = (0u64, 0u64);
    for e in fs::read_dir(dir.path()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let full = fs::read(e.path()).unwrap();
        total += full.len() as u64;
        let mut copy = vec![0u8; full.len()];
        for &(start, end) in ranges.get(&name).map(Vec::as_slice).unwrap_or_default() {
            copy[start as usize..end as usize].copy_from_slice(&full[start as usize..end as usize]);
            kept += end - start;
        }
        fs::write(sparse.path().join(&name), copy).unwrap();
    }
    // The moments are two thirds of the tensor bytes: far less than the files are kept.
    assert!(kept > 0 && kept * 2 < total, "kept {kept} of {total} bytes");
    let want = open_checkpoint_keys(dir.path(), model).unwrap();
    let got = open_checkpoint_keys(sparse.path(), model).unwrap();
    assert_eq!(got.tensors, want.tensors);
    assert!(!got.tensors.is_empty() && got.tensors.iter().all(|t| model(&t.key)));
    for c in got.tensors.iter().flat_map(|t| &t.chunks) {
        let (a, b) = (fs::read(dir.path().join(&*c.file)).unwrap(), fs::read(sparse.path().join(&*c.file)).unwrap());
        let data = c.data_offset as usize..(c.data_offset + c.data_len) as usize;
        assert_eq!(a[data.clone()], b[data]);
    }
    // Opening every key reads the moments' framing, which the sparse copy does not hold.
    assert!(open_checkpoint(sparse.path()).is_err());
}
