//! A validation split into parts by rank file, as workers that share no disk run it: the parts
//! add up to the whole, each part needs only the release byte ranges `part_ranges` lists, a
//! corrupted file fails its own part alone, and a file left out (or counted twice) is caught when
//! the parts' fingerprints are summed against `.metadata`'s.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;

use shardline_formats::execute::{Progress, SourceMap};
use shardline_formats::safetensors::Release;
use shardline_formats::verify::{part_ranges, parts_agree, verify_checkpoint, Scope, VerifyOptions, VerifyReport};
use shardline_layout::{build_plan, Mesh, ModelConfig, Plan, PlanOptions, SourceTensor};

use crate::{convert, fixture};

/// The release's tensors as a validation expects them (the mesh does not matter for these).
fn reference(release: &Release) -> Plan {
    let config = ModelConfig::from_json(release.config_json()).expect("config");
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let options = PlanOptions { vocab_divisible_by: 1, optimizer_state: true, ..PlanOptions::default() };
    build_plan(&config, sources, Mesh::new(1, 1, 1, 1), &options).expect("reference plan")
}

fn verify(dir: &Path, release: &Release, reference: &Plan, scope: Scope<'_>) -> VerifyReport {
    let prefix = PlanOptions::default().optimizer_prefix;
    let options = VerifyOptions { optional_prefix: Some(&prefix), threads: 2, scope };
    verify_checkpoint(dir, release, reference, &options, &Progress::default()).expect("verify")
}

fn rank_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read checkpoint")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".distcp"))
        .collect();
    names.sort();
    names
}

/// A copy of `src` in `dst` holding only the safetensors headers, the other (small) files and
/// the byte ranges `keep` of each safetensors file (by `paths`' index); zeros elsewhere.
fn sparse_copy(src: &Path, dst: &Path, paths: &[std::path::PathBuf], keep: &[shardline_formats::execute::ByteRange]) {
    fs::create_dir_all(dst).expect("mkdir");
    for e in fs::read_dir(src).expect("read release") {
        let name = e.expect("entry").file_name();
        let (from, to) = (src.join(&name), dst.join(&name));
        if !name.to_string_lossy().ends_with(".safetensors") {
            fs::copy(&from, &to).expect("copy");
            continue;
        }
        let bytes = fs::read(&from).expect("read");
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let mut out = vec![0u8; bytes.len()];
        out[..header].copy_from_slice(&bytes[..header]);
        let index = paths.iter().position(|p| p.file_name() == Some(&name)).expect("a file of the source map");
        for r in keep.iter().filter(|r| r.file == index) {
            out[r.start as usize..r.end as usize].copy_from_slice(&bytes[r.start as usize..r.end as usize]);
        }
        fs::File::create(&to).expect("create").write_all_at(&out, 0).expect("write");
    }
}

fn parts_add_up(name: &str, mesh: (u64, u64, u64, u64)) {
    let tmp = tempfile::tempdir().expect("tmp");
    let (src, ckpt) = (fixture(name), tmp.path().join("ckpt"));
    convert(&src, &ckpt, mesh, &["--optimizer-state"]);
    let release = Release::open(&src).expect("release");
    let reference = reference(&release);
    let whole = verify(&ckpt, &release, &reference, Scope::Whole);
    assert!(whole.ok() && whole.bytes_checked > 0, "{:?}", whole.findings);
    assert_eq!(whole.held, whole.declared);

    let declared = verify(&ckpt, &release, &reference, Scope::Declared);
    assert!(declared.ok(), "{:?}", declared.findings);
    assert_eq!((declared.declared, declared.bytes_checked, declared.tensors), (whole.declared, 0, whole.tensors));

    let paths: Vec<_> =
        SourceMap::new(&reference, &release).expect("sources").file_paths().map(Path::to_path_buf).collect();
    let release_bytes: u64 = paths.iter().map(|p| fs::metadata(p).expect("stat").len()).sum();
    let (mut held, mut bytes) = (Vec::new(), 0);
    for file in rank_files(&ckpt) {
        let files = BTreeSet::from([file.clone()]);
        let part = verify(&ckpt, &release, &reference, Scope::Files(&files));
        assert!(part.ok(), "{file}: {:?}", part.findings);
        assert!(part.held.count > 0, "{file} holds items");
        // The part compares with nothing but the ranges it lists: zeros elsewhere change nothing.
        let ranges = part_ranges(&ckpt, &release, &reference, &files).expect("ranges");
        let needed: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        assert!(needed < release_bytes, "{file}: {needed} of {release_bytes} release bytes");
        let sparse_dir = tmp.path().join(format!("release-for-{file}"));
        sparse_copy(&src, &sparse_dir, &paths, &ranges);
        let sparse = Release::open(&sparse_dir).expect("sparse release");
        let again = verify(&ckpt, &sparse, &reference, Scope::Files(&files));
        assert!(again.ok(), "{file} against its ranges alone: {:?}", again.findings);
        assert_eq!((again.held, again.bytes_checked), (part.held, part.bytes_checked));
        held.push(part.held);
        bytes += part.bytes_checked;
    }
    assert_eq!(bytes, whole.bytes_checked);
    assert_eq!(parts_agree(&declared, held.iter().copied()), None);
    assert!(parts_agree(&declared, held[1..].iter().copied()).is_some(), "a file left out");
    assert!(parts_agree(&declared, held.iter().chain(&held[..1]).copied()).is_some(), "a file counted twice");
}

#[test]
fn parts_by_rank_file_add_up_to_the_whole_and_read_only_their_ranges() {
    parts_add_up("llama", (2, 1, 3, 1));
    // Block-FP8 weights: a dequantized chunk's ranges are its whole weight and scales.
    parts_add_up("deepseek_v3_fp8", (1, 1, 4, 2));
}

#[test]
fn a_corrupted_file_fails_its_own_part_alone() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (src, ckpt) = (fixture("qwen3_moe"), tmp.path().join("ckpt"));
    convert(&src, &ckpt, (2, 1, 2, 1), &[]);
    let f = ckpt.join("__3_0.distcp");
    let mut bytes = fs::read(&f).expect("read");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x55;
    fs::write(&f, &bytes).expect("write");
    let release = Release::open(&src).expect("release");
    let reference = reference(&release);
    for file in rank_files(&ckpt) {
        let files = BTreeSet::from([file.clone()]);
        let part = verify(&ckpt, &release, &reference, Scope::Files(&files));
        assert_eq!(part.ok(), file != "__3_0.distcp", "{file}: {:?}", part.findings);
        if !part.ok() {
            assert!(part.findings[0].message.contains("__3_0.distcp"), "{:?}", part.findings);
        }
    }
}
