//! Golden conversions: every fixture at several meshes (uneven and empty FSDP shards included),
//! validated bit-exactly, with rank files and chunk metadata as the plan says.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{bin, convert, fixture, run, stderr, stdout};

const MESHES_DENSE: &[(u64, u64, u64, u64)] = &[(1, 1, 1, 1), (2, 1, 4, 1), (2, 2, 2, 1), (1, 1, 8, 1), (2, 1, 3, 1)];
const MESHES_MOE: &[(u64, u64, u64, u64)] = &[(1, 1, 1, 1), (2, 1, 4, 1), (2, 2, 2, 2), (1, 1, 8, 4), (1, 1, 3, 1)];

fn inspect(dir: &std::path::Path) -> Value {
    let o = run(bin().arg("inspect").arg(dir).arg("--json"));
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("inspect json")
}

fn validate(dir: &std::path::Path, fixture_dir: &std::path::Path) -> Value {
    let o = run(bin().arg("validate").arg(dir).arg("--against").arg(fixture_dir).arg("--json"));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {} {}", stdout(&o), stderr(&o)));
    assert!(o.status.success(), "validate failed: {v:#}");
    v
}

fn check_fixture(name: &str, meshes: &[(u64, u64, u64, u64)]) {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture(name);
    let mut digests_by_mesh: Vec<BTreeMap<String, u64>> = Vec::new();
    for &mesh in meshes {
        let (tp, cp, dp, _) = mesh;
        let out = tmp.path().join(format!("{name}-{mesh:?}"));
        convert(&src, &out, mesh, &[]);
        // One rank file per rank of the target job, and the commit marker.
        let world = tp * cp * dp;
        assert!(out.join(".metadata").is_file());
        for r in 0..world {
            assert!(out.join(format!("__{r}_0.distcp")).is_file(), "{mesh:?}: rank {r} file");
        }
        assert_eq!(std::fs::read_dir(&out).unwrap().count() as u64, world + 1, "{mesh:?}: no stray files");
        let v = validate(&out, &src);
        assert_eq!(v["ok"], true);
        assert!(v["bytes_checked"].as_u64().unwrap() > 0);
        // Every chunk lies in its global shape; each key is tiled (validate proved it), and the
        // total stored bytes per key equal the global size.
        let ins = inspect(&out);
        let mut sizes = BTreeMap::new();
        for t in ins["tensors"].as_array().unwrap() {
            let shape: Vec<u64> = t["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            sizes.insert(t["key"].as_str().unwrap().to_string(), shape.iter().product::<u64>());
        }
        digests_by_mesh.push(sizes);
    }
    // Key sets and global sizes agree across meshes except for vocab padding.
    let first = &digests_by_mesh[0];
    for other in &digests_by_mesh[1..] {
        assert_eq!(first.keys().collect::<Vec<_>>(), other.keys().collect::<Vec<_>>());
        for (k, n) in first {
            if !(k.ends_with("word_embeddings.weight") || k.ends_with("output_layer.weight")) {
                assert_eq!(other[k], *n, "{k}");
            }
        }
    }
}

#[test]
fn llama_converts_and_validates_at_five_meshes() {
    check_fixture("llama", MESHES_DENSE);
}

#[test]
fn qwen3_moe_converts_and_validates_at_five_meshes() {
    check_fixture("qwen3_moe", MESHES_MOE);
}

#[test]
fn qwen3_next_converts_and_validates_at_five_meshes() {
    // GDN sections must divide by cp: nv/tp = 4/2 = 2 is fine for cp 2.
    check_fixture("qwen3_next", MESHES_MOE);
}

#[test]
fn qwen3_5_moe_vl_converts_and_validates_at_five_meshes() {
    // Its vision tower is TP-split: 2 vision heads, 2 key/value heads and 2 GDN key heads over tp 2;
    // 4 experts over ep 4.
    check_fixture("qwen3_5_moe_vl", MESHES_MOE);
}

#[test]
fn qwen3_vl_moe_converts_and_validates_at_five_meshes() {
    // Its vision tower is Megatron's ViT, TP-split: 4 vision heads and 2 key/value heads over
    // tp 2; its deepstack merger split as the final one; 4 experts over ep 4.
    check_fixture("qwen3_vl_moe", MESHES_MOE);
}

#[test]
fn dcp_safetensors_format_validates() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama", "qwen3_next"] {
        let out = tmp.path().join(name);
        convert(&fixture(name), &out, (2, 1, 2, 1), &["--format", "dcp-safetensors"]);
        assert!(!out.join(".metadata").exists());
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 4);
        let v = validate(&out, &fixture(name));
        assert_eq!(v["ok"], true);
    }
}

#[test]
fn dry_run_prints_the_plan_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never");
    let o = run(bin()
        .args(["convert", "--dry-run", "--json", "--from"])
        .arg(fixture("qwen3_next"))
        .arg("--to")
        .arg(&out)
        .args(["--tp", "2", "--dp", "4"]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.exists());
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["world"], 8);
    assert_eq!(v["bytes_per_rank"].as_array().unwrap().len(), 8);
    let keys: Vec<&str> = v["tensors"].as_array().unwrap().iter().map(|t| t["key"].as_str().unwrap()).collect();
    assert!(keys.contains(&"model.module.decoder.layers.0.self_attention.in_proj.weight.alpha"));
    assert!(keys.contains(&"model.module.decoder.layers.3.self_attention.linear_qkv.weight"));
    let split = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == "model.module.decoder.layers.0.mlp.shared_experts.linear_fc1.weight_v")
        .unwrap();
    assert_eq!(split["split_from"], "decoder.layers.0.mlp.shared_experts.linear_fc1.weight");
    // Gated attention: linear_qkv of layer 3 holds ng·(2·hpg+2)·d = 2·(2·4+2)·8 = 160 rows.
    let qkv = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == "model.module.decoder.layers.3.self_attention.linear_qkv.weight")
        .unwrap();
    assert_eq!(qkv["shape"], serde_json::json!([160, 64]));
    // Human output too.
    let o = run(bin().args(["convert", "--dry-run", "--from"]).arg(fixture("llama")).args(["--tp", "2", "--dp", "2"]));
    assert!(o.status.success());
    assert!(stdout(&o).contains("bytes per rank"));
}

#[test]
fn optimizer_state_follows_parameters_and_validates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("opt");
    convert(&fixture("llama"), &out, (2, 1, 2, 1), &["--optimizer-state"]);
    let ins = inspect(&out);
    let tensors = ins["tensors"].as_array().unwrap();
    let param = tensors.iter().find(|t| t["key"] == "model.module.decoder.layers.0.mlp.linear_fc1.weight_w").unwrap();
    let state = tensors
        .iter()
        .find(|t| t["key"] == "optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight_w.exp_avg")
        .unwrap();
    assert_eq!(state["dtype"], "F32");
    assert_eq!(state["shape"], param["shape"]);
    let offs = |t: &Value| {
        let mut v: Vec<String> =
            t["chunks"].as_array().unwrap().iter().map(|c| format!("{}{}", c["offsets"], c["sizes"])).collect();
        v.sort();
        v
    };
    assert_eq!(offs(state), offs(param));
    assert_eq!(validate(&out, &fixture("llama"))["ok"], true);
}

#[test]
fn validate_detects_a_flipped_byte_and_names_the_place() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("c");
    convert(&fixture("llama"), &out, (2, 1, 2, 1), &[]);
    // Flip one byte near the end of rank 3's file (inside the last tensor's data).
    let f = out.join("__3_0.distcp");
    let mut bytes = std::fs::read(&f).unwrap();
    let ins = inspect(&out);
    let _ = ins;
    let pos = bytes.len() / 2;
    bytes[pos] ^= 0x55;
    std::fs::write(&f, &bytes).unwrap();
    let o = run(bin().arg("validate").arg(&out).arg("--against").arg(fixture("llama")));
    // Either the item no longer parses, or its bytes differ: both are failures with a precise report.
    assert!(!o.status.success());
    let text = format!("{}{}", stdout(&o), stderr(&o));
    assert!(text.contains("__3_0.distcp"), "{text}");
}

#[test]
fn zip_crc32_is_optional_and_both_forms_validate() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama", "qwen3_moe"] {
        let src = fixture(name);
        let plain = tmp.path().join(format!("{name}-plain"));
        let crc = tmp.path().join(format!("{name}-crc"));
        let mesh = if name == "llama" { (2, 1, 2, 1) } else { (2, 1, 2, 2) };
        convert(&src, &plain, mesh, &["--optimizer-state"]);
        convert(&src, &crc, mesh, &["--optimizer-state", "--zip-crc32"]);
        for dir in [&plain, &crc] {
            let v = validate(dir, &src);
            assert_eq!(v["ok"], true, "{}", dir.display());
        }
        // Same files, same sizes, same .metadata: only CRC fields differ.
        assert_eq!(std::fs::read(plain.join(".metadata")).unwrap(), std::fs::read(crc.join(".metadata")).unwrap());
        let names = |d: &std::path::Path| {
            let mut v: Vec<(String, u64)> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap())
                .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&plain), names(&crc));
        // Every zip entry's stored CRC-32 is 0 without the flag and right with it.
        for (dir, computed) in [(&plain, false), (&crc, true)] {
            let (checked, zero) = check_zip_crcs(dir);
            assert!(checked > 0);
            if computed {
                assert_eq!(zero, 0, "{name}: --zip-crc32 left CRC fields at 0");
            } else {
                assert_eq!(zero, checked, "{name}: without --zip-crc32 every data CRC is 0");
            }
        }
    }
}

/// Walks every rank file's local zip headers; checks each tensor data entry's stored CRC-32
/// against its bytes when non-zero. Returns (data entries seen, entries with CRC 0).
fn check_zip_crcs(dir: &std::path::Path) -> (usize, usize) {
    let (mut seen, mut zero) = (0, 0);
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("distcp") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let le16 = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
        let le32 = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let mut at = 0;
        while at + 30 <= bytes.len() {
            if le32(at) != 0x0403_4b50 {
                at += 1;
                continue;
            }
            let (crc, size, name_len, extra_len) =
                (le32(at + 14), le32(at + 18) as usize, le16(at + 26), le16(at + 28));
            let name = String::from_utf8_lossy(&bytes[at + 30..at + 30 + name_len]).into_owned();
            let data = at + 30 + name_len + extra_len;
            if name.contains("/data/") {
                seen += 1;
                if crc == 0 {
                    zero += 1;
                } else {
                    let got = crc32(&bytes[data..data + size]);
                    assert_eq!(crc, got, "{}: entry at {at}", path.display());
                }
            }
            at = data + size;
        }
    }
    (seen, zero)
}

/// Plain CRC-32 (IEEE), bitwise: the tests need no more.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0xEDB8_8320 } else { c >> 1 };
        }
    }
    !c
}

#[test]
fn archs_lists_the_families_and_prints_a_mapping_table() {
    let o = run(bin().arg("archs"));
    assert!(o.status.success(), "{}", stderr(&o));
    let list = stdout(&o);
    for name in ["llama", "qwen3_next", "deepseek_v3", "kimi_k2", "glm4_moe"] {
        assert!(list.lines().any(|l| l.starts_with(&format!("{name} "))), "{name} missing from:\n{list}");
    }
    let o = run(bin().args(["archs", "deepseek_v3"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    let lines: Vec<&str> = table.lines().collect();
    let at = lines.iter().position(|l| *l == "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight").expect(&table);
    assert_eq!(
        lines[at + 1].trim(),
        "→ decoder.layers.{L}.self_attention.linear_kv_down_proj.weight  (copy, TP replicated; as BF16)"
    );
    assert!(table.contains("→ decoder.layers.{L}.mlp.router.expert_bias  (copy, TP replicated; as F32)"), "{table}");
    let o = run(bin().args(["archs", "gpt_bigcode"]));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown architecture `gpt_bigcode`"), "{}", stderr(&o));
}

#[test]
fn validate_of_gpt_oss_needs_the_expert_tp_it_was_written_with() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    let o = convert(&fixture("gpt_oss"), &out, (2, 1, 2, 2), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Written with etp = tp = 2: validated as such it is exact; as etp 1, fc1 rows differ and
    // validate says what to check.
    let ok = run(bin().arg("validate").arg(&out).arg("--against").arg(fixture("gpt_oss")).args(["--etp", "2"]));
    assert!(ok.status.success(), "{}{}", stdout(&ok), stderr(&ok));
    let wrong = run(bin().arg("validate").arg(&out).arg("--against").arg(fixture("gpt_oss")));
    assert_eq!(wrong.status.code(), Some(1));
    let text = stdout(&wrong);
    assert!(text.contains("experts.linear_fc1.weight") && text.contains("--etp"), "{text}");
}
