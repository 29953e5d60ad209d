//! `export`: a checkpoint written back as the release it came from. HF → convert → reshard →
//! export gives back the release's tensors byte for byte where the mapping is lossless; what is
//! not (an MTP layer's own copy of the embedding, which Megatron shares; float32 norms a family
//! keeps in bf16) is named and held to its tolerance.

use std::path::Path;

use shardline_layout::recipe::cast_into;
use shardline_layout::DType;

use crate::{bin, convert, fixture, release_tensors as tensors, run, stderr};

fn export(ckpt: &Path, out: &Path, like: &Path, extra: &[&str]) -> std::process::Output {
    run(bin().arg("export").arg(ckpt).arg("--to").arg(out).arg("--like").arg(like).args(extra))
}

#[test]
fn convert_reshard_export_gives_back_the_release() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in [
        "llama",
        "qwen3_moe",
        "qwen3_next",
        "deepseek_v3",
        "glm4_moe",
        "qwen3_vl_moe",
        "qwen3_5_moe_vl",
        "gpt_oss_bf16",
    ] {
        let (a, b, hf) = (
            tmp.path().join(format!("{name}-a")),
            tmp.path().join(format!("{name}-b")),
            tmp.path().join(format!("{name}-hf")),
        );
        let ep = if name == "llama" { 1 } else { 2 };
        convert(&fixture(name), &a, (2, 1, 2, ep), &["--optimizer-state", "--etp", "1"]);
        // A converted checkpoint has no `args`: the source mesh is given.
        let from_mesh = format!("tp=2,dp=2,ep={ep},etp=1");
        let reshard = ["--tp", "1", "--dp", "3", "--vocab-size", "256", "--from-mesh", &from_mesh];
        let o = run(bin().arg("reshard").arg(&a).arg("--to").arg(&b).args(reshard));
        assert!(o.status.success(), "{name}: reshard: {}", stderr(&o));
        let o = export(&b, &hf, &fixture(name), &[]);
        assert!(o.status.success(), "{name}: export: {}", stderr(&o));
        assert!(hf.join("config.json").is_file() && hf.join("model.safetensors").is_file());
        let (want, got) = (tensors(&fixture(name)), tensors(&hf));
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{name}: names");
        for (k, (dtype, shape, bytes)) in &want {
            let (gd, gs, gb) = &got[k];
            assert_eq!((dtype, shape), (gd, gs), "{name}: `{k}` dtype and shape");
            if gb == bytes {
                continue;
            }
            // An MTP layer's embedding and output head: Megatron keeps one, the main model's.
            if k.ends_with(".embed_tokens.weight") && k != "model.embed_tokens.weight"
                || k.ends_with(".shared_head.head.weight")
            {
                let main =
                    if k.ends_with("embed_tokens.weight") { "model.embed_tokens.weight" } else { "lm_head.weight" };
                assert_eq!(gb, &got[main].2, "{name}: `{k}` is the main `{main}`");
                continue;
            }
            // A float32 tensor of a family Megatron keeps in bf16: one rounding to bf16.
            assert_eq!(*dtype, DType::F32, "{name}: `{k}` differs and is not float32");
            let mut rounded = vec![0u8; bytes.len() / 2];
            cast_into(DType::F32, DType::BF16, bytes, &mut rounded);
            let mut back = vec![0u8; bytes.len()];
            cast_into(DType::BF16, DType::F32, &rounded, &mut back);
            assert_eq!(gb, &back, "{name}: `{k}` is not the bf16 rounding of the release's");
        }
    }
}

#[test]
fn the_release_s_other_files_come_along() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let like = tmp.path().join("like");
    std::fs::create_dir(&like).expect("mkdir");
    for e in std::fs::read_dir(fixture("llama")).expect("list") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), like.join(e.file_name())).expect("copy");
    }
    std::fs::write(like.join("tokenizer.json"), b"{\"version\": \"1.0\"}").expect("tokenizer");
    std::fs::write(like.join("generation_config.json"), b"{}").expect("generation config");
    let (a, hf) = (tmp.path().join("a"), tmp.path().join("hf"));
    convert(&fixture("llama"), &a, (1, 1, 2, 1), &[]);
    let o = export(&a, &hf, &like, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        assert_eq!(std::fs::read(hf.join(f)).expect(f), std::fs::read(like.join(f)).expect(f), "{f}");
    }
    assert!(!hf.join("model.safetensors.index.json").exists(), "one file needs no index");
    let staging = tmp.path().join(".hf.partial");
    assert!(!staging.exists());
}

#[test]
fn files_are_cut_at_the_size_asked_with_an_index() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, hf) = (tmp.path().join("a"), tmp.path().join("hf"));
    convert(&fixture("qwen3_moe"), &a, (1, 1, 2, 1), &[]);
    let o = export(&a, &hf, &fixture("qwen3_moe"), &["--max-file-size", "100KB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("model.safetensors.index.json")).expect("index")).expect("json");
    let map = index["weight_map"].as_object().expect("weight_map");
    let files: std::collections::BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    assert!(files.len() > 2, "{files:?}");
    for f in &files {
        let len = std::fs::metadata(hf.join(f)).expect("file").len();
        assert!(len <= 100_000 + 4096, "{f}: {len} bytes");
    }
    assert_eq!(map.len(), tensors(&fixture("qwen3_moe")).len());
    assert_eq!(tensors(&hf), tensors(&fixture("qwen3_moe")));
}

#[test]
fn what_cannot_be_exported_is_refused_and_nothing_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, hf) = (tmp.path().join("a"), tmp.path().join("hf"));
    convert(&fixture("deepseek_v3_fp8"), &a, (1, 1, 1, 1), &[]);
    let o = export(&a, &hf, &fixture("deepseek_v3_fp8"), &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("would have to be re-encoded as block-scaled FP8"), "{}", stderr(&o));
    // Named once, however many blocks it has.
    assert_eq!(stderr(&o).matches("`model.layers.0.mlp.up_proj.weight` would").count(), 1, "{}", stderr(&o));
    assert!(!hf.exists());
    // A checkpoint of another model.
    let o = export(&a, &hf, &fixture("llama"), &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("the checkpoint has no tensor for"), "{}", stderr(&o));
    assert!(!hf.exists());
}

/// Tensors large enough that their runs are copied by the kernel (`copy_file_range`), not
/// through the writers' buffers: a synthetic release, resharded with a TP change and exported.
#[test]
fn large_runs_copied_by_the_kernel_give_the_same_bytes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (release, a, b, c, hf) = (
        tmp.path().join("release"),
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
        tmp.path().join("hf"),
    );
    let o = run(bin().args(["synth", "--arch", "llama", "--size", "24MB"]).arg(&release));
    assert!(o.status.success(), "{}", stderr(&o));
    convert(&release, &a, (1, 1, 2, 1), &["--optimizer-state"]);
    let to = |src: &Path, dst: &Path, tp: &str, dp: &str, from: &str| {
        let args = ["--tp", tp, "--dp", dp, "--from-mesh", from];
        let o = run(bin().arg("reshard").arg(src).arg("--to").arg(dst).args(args));
        assert!(o.status.success(), "{}", stderr(&o));
    };
    to(&a, &b, "2", "3", "tp=1,dp=2");
    to(&b, &c, "1", "2", "tp=2,dp=3");
    for entry in std::fs::read_dir(&a).expect("list") {
        let name = entry.expect("entry").file_name();
        assert!(std::fs::read(a.join(&name)).expect("a") == std::fs::read(c.join(&name)).expect("c"), "{name:?}");
    }
    let o = export(&b, &hf, &release, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(tensors(&hf), tensors(&release));
}

/// An export split in parts — weight file `i` written by part `i mod parts`, the parts in any
/// order, then committed — is the export written whole, byte for byte (more parts than files
/// included: a part may write none). A commit with a weight file missing or cut short names it
/// and puts nothing in place.
#[test]
fn an_export_in_parts_is_the_whole_export() {
    use shardline_formats::execute::Progress;
    use shardline_ops::{plan_export_of, ExportRequest};

    let tmp = tempfile::tempdir().expect("tempdir");
    let (release, ckpt, whole) = (tmp.path().join("release"), tmp.path().join("ckpt"), tmp.path().join("whole"));
    let o = run(bin().args(["synth", "--arch", "llama", "--size", "24MB"]).arg(&release));
    assert!(o.status.success(), "{}", stderr(&o));
    convert(&release, &ckpt, (1, 1, 2, 1), &["--optimizer-state"]);
    let o = export(&ckpt, &whole, &release, &["--max-file-size", "6MB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = crate::file_bytes(&whole);
    let weights = want.keys().filter(|n| n.ends_with(".safetensors")).count();
    assert!(weights >= 4, "{:?}", want.keys());

    for parts in [3u64, weights as u64 + 2] {
        let split = tmp.path().join(format!("split-{parts}"));
        let request = ExportRequest {
            ckpt: ckpt.clone(),
            to: split.clone(),
            like: Some(release.clone()),
            prefix: "model.module.".into(),
            etp: None,
            max_file_bytes: 6_000_000,
            overwrite: true,
            threads: 1,
        };
        let planned = plan_export_of(&request).expect("plan");
        let progress = Progress::default();
        let mut written = Vec::new();
        for part in (1..parts).rev() {
            written.extend(planned.write_part((part, parts), &progress).expect("a part"));
        }
        // Part 0 has not run: its first file is missing.
        let e = planned.commit().expect_err("a commit without part 0");
        assert!(e.to_string().contains("model-00001-of-") && e.to_string().contains("not complete"), "{e}");
        assert!(!split.exists(), "a refused commit put the export in place");
        written.extend(planned.write_part((0, parts), &progress).expect("part 0"));
        written.sort();
        let mut names: Vec<&String> = want.keys().filter(|n| n.ends_with(".safetensors")).collect();
        names.sort();
        assert_eq!(written.iter().collect::<Vec<_>>(), names, "each weight file written by exactly one part");
        // A weight file cut short (a writer killed after its rename cannot do that, a disk can).
        let staged = tmp.path().join(format!(".split-{parts}.partial"));
        let second = staged.join(names[1]);
        let len = std::fs::metadata(&second).expect("the second file").len();
        std::fs::OpenOptions::new().write(true).open(&second).expect("open").set_len(len - 1).expect("cut");
        let e = planned.commit().expect_err("a commit with a file cut short");
        assert!(e.to_string().contains(names[1].as_str()) && e.to_string().contains("not complete"), "{e}");
        planned.write_part((1, parts), &progress).expect("part 1 again");
        planned.commit().expect("commit");
        let got = crate::file_bytes(&split);
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
        for (name, bytes) in &want {
            assert!(&got[name] == bytes, "parts={parts}: `{name}` differs from the whole export's");
        }
    }
}
