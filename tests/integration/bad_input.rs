//! Bad input gets a clear error, a non-zero exit, and no output that looks complete.

use std::path::{Path, PathBuf};

use crate::{bin, convert, fixture, run, stderr};

/// Copies a fixture into a scratch dir so a test can corrupt it.
fn copy_fixture(name: &str, dst: &Path) -> PathBuf {
    let to = dst.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// Runs convert, expects exit 2 with `needle` in stderr and no `.metadata` in the output.
fn expect_failure(from: &Path, out: &Path, mesh: &[&str], needle: &str) {
    let o = run(bin().args(["convert", "--from"]).arg(from).arg("--to").arg(out).args(mesh));
    assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    assert!(!out.join(".metadata").exists(), "a failed convert must not leave .metadata");
    if out.exists() {
        let leftovers: Vec<_> = std::fs::read_dir(out).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(leftovers.is_empty(), "failed convert left {leftovers:?}");
    }
}

fn shard(dir: &Path) -> PathBuf {
    dir.join("model-00001-of-00002.safetensors")
}

#[test]
fn truncated_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let f = shard(&src);
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 1000).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &["--tp", "1"], "model-00001-of-00002.safetensors");
}

#[test]
fn header_length_beyond_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let f = shard(&src);
    let mut b = std::fs::read(&f).unwrap();
    b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&f, &b).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "header");
}

#[test]
fn lying_header_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let f = shard(&src);
    let b = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
    // k_proj claims [16, 65]: shape × dtype no longer matches its byte range.
    let lied = header.replacen("\"shape\":[16,64]", "\"shape\":[16,65]", 1);
    assert_ne!(lied, header);
    let mut out = b[..8].to_vec();
    out.extend_from_slice(lied.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&f, &out).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "model-00001-of-00002.safetensors");
}

#[test]
fn unknown_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let f = shard(&src);
    let b = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap();
    let lied = header.replacen("\"dtype\":\"BF16\"", "\"dtype\":\"Q4\"  ", 1);
    let mut out = b[..8].to_vec();
    out.extend_from_slice(lied.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&f, &out).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "Q4");
}

#[test]
fn missing_shard_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    std::fs::remove_file(src.join("model-00002-of-00002.safetensors")).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "model-00002-of-00002.safetensors");
}

#[test]
fn key_in_index_but_not_in_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let idx = src.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap();
    let text = text.replacen(
        "\"weight_map\": {",
        "\"weight_map\": {\n    \"model.layers.9.ghost.weight\": \"model-00001-of-00002.safetensors\",",
        1,
    );
    std::fs::write(&idx, text).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "model.layers.9.ghost.weight");
}

#[test]
fn unknown_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    let cfg = src.join("config.json");
    let text =
        std::fs::read_to_string(&cfg).unwrap().replace("\"model_type\": \"llama\"", "\"model_type\": \"gpt_bigcode\"");
    std::fs::write(&cfg, text).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "unknown architecture `gpt_bigcode`");
}

#[test]
fn indivisible_mesh_names_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    // llama has 2 KV heads: tp 4 needs Megatron's replicated-KV path.
    expect_failure(&fixture("llama"), &tmp.path().join("a"), &["--tp", "4"], "num_query_groups (2) < tp (4)");
    // 8 experts cannot be split over ep 3.
    expect_failure(
        &fixture("qwen3_moe"),
        &tmp.path().join("b"),
        &["--dp", "3", "--ep", "3"],
        "num_experts (8) is not divisible by ep (3)",
    );
    // GDN: nv/tp = 4/2 = 2 is not divisible by cp 4.
    expect_failure(
        &fixture("qwen3_next"),
        &tmp.path().join("c"),
        &["--tp", "2", "--cp", "4"],
        "not divisible by cp (4)",
    );
    // ep on a dense model.
    expect_failure(
        &fixture("llama"),
        &tmp.path().join("d"),
        &["--dp", "2", "--ep", "2"],
        "ep (2) > 1 but `llama` has no experts",
    );
}

#[test]
fn unmapped_tensor_is_an_error_not_a_silent_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("llama", tmp.path());
    // Rename a tensor in both the header and the index to something no table maps.
    let f = src.join("model-00002-of-00002.safetensors");
    let b = std::fs::read(&f).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(b[8..8 + n].to_vec()).unwrap().replace("lm_head.weight", "lm_hxad.weight");
    let mut out = b[..8].to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&f, &out).unwrap();
    let idx = src.join("model.safetensors.index.json");
    std::fs::write(&idx, std::fs::read_to_string(&idx).unwrap().replace("lm_head.weight", "lm_hxad.weight")).unwrap();
    expect_failure(&src, &tmp.path().join("out"), &[], "lm_hxad.weight");
}

#[test]
fn existing_checkpoint_is_not_clobbered() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    convert(&fixture("llama"), &out, (1, 1, 2, 1), &[]);
    let o = run(bin().args(["convert", "--from"]).arg(fixture("llama")).arg("--to").arg(&out));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    assert!(out.join(".metadata").exists(), "the existing checkpoint stays intact");
    convert(&fixture("llama"), &out, (1, 1, 1, 1), &["--overwrite"]);
    assert!(!out.join("__1_0.distcp").exists(), "old rank files are gone");
}

#[test]
fn full_disk_leaves_no_checkpoint() {
    // A file-size limit makes writes fail mid-file, like a full disk (EFBIG instead of ENOSPC).
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let script = format!(
        "trap '' XFSZ; ulimit -f 64; exec '{}' convert --from '{}' --to '{}' --dp 2",
        env!("CARGO_BIN_EXE_shardline"),
        fixture("llama").display(),
        out.display()
    );
    let o = std::process::Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("rank file") && err.contains("__"), "{err}");
    // Nothing is left, not even the directory the convert created.
    assert!(
        !out.exists(),
        "{:?}",
        std::fs::read_dir(&out).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    // Into a directory that was there before, the same failure leaves the directory, empty.
    std::fs::create_dir(&out).unwrap();
    let o = std::process::Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let leftovers: Vec<_> = std::fs::read_dir(&out).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn validate_of_an_interrupted_write_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    convert(&fixture("llama"), &out, (1, 1, 2, 1), &[]);
    std::fs::remove_file(out.join(".metadata")).unwrap();
    let o = run(bin().arg("validate").arg(&out).arg("--against").arg(fixture("llama")));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no `.metadata`"), "{}", stderr(&o));
}

/// Rewrites `config.json` of a copied fixture with `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

#[test]
fn unknown_quantization_scheme_names_it_and_the_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("deepseek_v3_fp8", tmp.path());
    edit_config(&src, |c| c["quantization_config"]["quant_method"] = "awq".into());
    expect_failure(&src, &tmp.path().join("out"), &[], "quantization `awq` is not supported");
    let err = stderr(&run(bin().args(["convert", "--from"]).arg(&src).arg("--to").arg(tmp.path().join("o2"))));
    assert!(err.contains("model.layers.*.mlp.experts.*.gate_proj.weight_scale_inv"), "{err}");
}

#[test]
fn fp8_block_size_other_than_the_scales_say_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("deepseek_v3_fp8", tmp.path());
    // The scales were made for blocks of 16: blocks of 32 give other scale shapes.
    edit_config(&src, |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([32, 32]));
    expect_failure(&src, &tmp.path().join("out"), &[], "in blocks of [32, 32]");
}

#[test]
fn fp8_weight_without_its_scales_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let src = copy_fixture("deepseek_v3_fp8", tmp.path());
    // Rename one scale tensor in its file's header and the index (same length, so the file stays
    // well formed): its weight loses its scales.
    let (from, to) = ("layers.0.mlp.down_proj.weight_scale_inv", "layers.0.mlp.down_proj.weight_scale_iXX");
    for e in std::fs::read_dir(&src).unwrap() {
        let path = e.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let text = bytes.windows(from.len()).position(|w| w == from.as_bytes());
        if let Some(at) = text {
            let mut b = bytes.clone();
            b[at..at + from.len()].copy_from_slice(to.as_bytes());
            std::fs::write(&path, b).unwrap();
        }
    }
    expect_failure(
        &src,
        &tmp.path().join("out"),
        &[],
        "F8_E4M3 weight without its `model.layers.0.mlp.down_proj.weight_scale_inv`",
    );
}

/// Sets byte `index` of tensor `name`'s data in safetensors file `path`.
fn patch_tensor_byte(path: &Path, name: &str, index: u64, value: u8) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header[name]["data_offsets"][0].as_u64().expect("tensor in header");
    bytes[8 + n + (start + index) as usize] = value;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn mxfp4_scale_out_of_range_is_an_error_and_nothing_is_written() {
    for bad in [255u8, 253] {
        let tmp = tempfile::tempdir().unwrap();
        let src = copy_fixture("gpt_oss", tmp.path());
        patch_tensor_byte(&src.join("model.safetensors"), "model.layers.1.mlp.experts.down_proj_scales", 7, bad);
        expect_failure(
            &src,
            &tmp.path().join("out"),
            &[],
            &format!("`model.module.decoder.layers.1.mlp.experts.linear_fc2.weight0`: MXFP4 scale {bad}"),
        );
    }
}

#[test]
fn fp8_synth_and_bench_only_for_deepseek_v3() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    for args in [
        &["synth", "--arch", "qwen3_moe", "--fp8", "--size", "2MB"][..],
        &["bench", "--arch", "llama", "--fp8", "--size", "2MB", "--repeat", "1", "--work"][..],
    ] {
        let o = run(bin().args(args).arg(&out));
        assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("--fp8 is only for --arch deepseek_v3"), "{err}");
        assert!(!out.exists(), "a refused {} wrote {}", args[0], out.display());
    }
}
