//! Reading Megatron-LM's `torch_dist` checkpoints as Megatron-Core itself writes them: the
//! fixtures under `tests/fixtures/torch-dist-*` were saved by megatron-core 0.16.1 on CPU
//! (`tests/python/megatron_fixture.py`); their `.metadata` carries Megatron's `all_local_plans`
//! and torch 2.15's `strides = None`, and the save directory is named by its tracker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{bin, run, stderr, stdout};

fn torch_dist_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// `inspect --json` of `dir`: key → global shape, and the bytes items.
fn inspect(dir: &std::path::Path) -> (BTreeMap<String, Vec<u64>>, Vec<String>) {
    let o = run(bin().arg("inspect").arg(dir).arg("--json"));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("inspect json");
    let shapes = v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| {
            let shape = t["shape"].as_array().expect("shape").iter().map(|d| d.as_u64().expect("dim")).collect();
            (t["key"].as_str().expect("key").to_string(), shape)
        })
        .collect();
    let objects =
        v["bytes_items"].as_array().expect("bytes items").iter().map(|k| k.as_str().expect("key").into()).collect();
    (shapes, objects)
}

#[test]
fn inspect_reads_what_megatron_core_wrote_through_its_tracker() {
    // Shapes as Megatron-Core 0.16.1 saved tiny Llama (2 layers, hidden 64, 8/2 heads, ffn 128).
    let (shapes, objects) = inspect(&torch_dist_fixture("torch-dist-llama-tp2"));
    let want: BTreeMap<String, Vec<u64>> = [
        ("embedding.word_embeddings.weight", vec![256, 64]),
        ("output_layer.weight", vec![256, 64]),
        ("decoder.final_layernorm.weight", vec![64]),
        ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", vec![2, 64]),
        ("decoder.layers.self_attention.linear_qkv.weight", vec![2, 96, 64]),
        ("decoder.layers.self_attention.linear_proj.weight", vec![2, 64, 64]),
        ("decoder.layers.mlp.linear_fc1.layer_norm_weight", vec![2, 64]),
        ("decoder.layers.mlp.linear_fc1.weight", vec![2, 256, 64]),
        ("decoder.layers.mlp.linear_fc2.weight", vec![2, 64, 128]),
    ]
    .into_iter()
    .map(|(k, s)| (k.to_string(), s))
    .collect();
    assert_eq!(shapes, want);
    let mut objects = objects;
    objects.sort();
    let modules = ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"];
    let mut want: Vec<String> = (0..2)
        .flat_map(|l| modules.iter().map(move |m| format!("decoder.layers.{m}._extra_state/shard_{l}_2")))
        .collect();
    want.sort();
    assert_eq!(objects, want);

    // The MoE save: experts stacked under `experts.experts.` with layer and expert axes.
    let (shapes, _) = inspect(&torch_dist_fixture("torch-dist-qwen3_moe-tp1ep2").join("release"));
    assert_eq!(shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"].len(), 4, "{shapes:?}");
    assert_eq!(shapes["decoder.layers.mlp.router.weight"][..2], [2, 8]);
}

#[test]
fn a_tracker_naming_nothing_is_refused_with_its_content() {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::write(tmp.path().join("latest_checkpointed_iteration.txt"), "last-good\n").expect("tracker");
    let o = run(bin().arg("inspect").arg(tmp.path()));
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("neither `release` nor an iteration number") && stderr(&o).contains("last-good"),
        "{}",
        stderr(&o)
    );
    // An iteration names `iter_%07d`.
    std::fs::write(tmp.path().join("latest_checkpointed_iteration.txt"), "1200").expect("tracker");
    let o = run(bin().arg("inspect").arg(tmp.path()));
    assert!(stderr(&o).contains("iter_0001200"), "{}", stderr(&o));
}

#[test]
fn inspect_summarises_the_common_state_and_classifies_every_item() {
    let o = run(bin().arg("inspect").arg(torch_dist_fixture("torch-dist-llama-tp2")).args(["--json", "--summary"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("inspect json");
    let t = &v["training"];
    // From `common.pt`, as Megatron-Core's megatron/training would save it.
    assert_eq!(t["checkpoint_version"], "3.0");
    assert_eq!(t["iteration"], "0");
    assert!(t["common"]["content_metadata"].as_str().expect("content_metadata").contains("singleton_local_shards"));
    assert!(t["common"]["args"].as_str().expect("args").contains("tensor_model_parallel_size=2"));
    // Nine parameters, eight `_extra_state` objects, nothing not understood.
    assert_eq!(t["parameters"]["tensors"], 9);
    assert_eq!(t["unknown"].as_array().map(Vec::len), Some(0), "{t}");
    assert_eq!(t["objects"].as_object().map(|o| o.len()), Some(8));
}

/// `shardline convert --target torch_dist` of the tiny release `hf` into `out` on `mesh`.
fn convert_torch_dist(hf: &str, out: &Path, mesh: &[&str]) {
    let o = run(bin()
        .arg("convert")
        .arg("--from")
        .arg(crate::fixture(hf))
        .arg("--to")
        .arg(out)
        .args(mesh)
        .args(["--target", "torch_dist"]));
    assert_eq!(o.status.code(), Some(0), "convert {hf}: {}", stderr(&o));
}

/// `shardline reshard SRC --to OUT` on `mesh`, writing `target`.
fn reshard_as(src: &Path, out: &Path, mesh: &[&str], target: &str) {
    let o = run(bin().arg("reshard").arg(src).arg("--to").arg(out).args(mesh).args(["--target", target]));
    assert_eq!(o.status.code(), Some(0), "reshard {} → {target}: {}", src.display(), stderr(&o));
}

/// The checkpoint directory a save directory's tracker names.
fn named_checkpoint(root: &Path) -> PathBuf {
    match std::fs::read_to_string(root.join("latest_checkpointed_iteration.txt")).expect("tracker").as_str() {
        "release" => root.join("release"),
        n => root.join(format!("iter_{:07}", n.parse::<u64>().expect("iteration"))),
    }
}

/// Asserts that the rank files and `.metadata` of the save directory `got` are those of `want`,
/// byte for byte.
fn assert_same_dcp_files(want: &Path, got: &Path, what: &str) {
    let (want, got) = (named_checkpoint(want), named_checkpoint(got));
    for entry in std::fs::read_dir(&want).expect("checkpoint directory") {
        let name = entry.expect("entry").file_name().to_string_lossy().into_owned();
        if name.ends_with(".distcp") || name == ".metadata" || name == "metadata.json" {
            let (a, b) = (std::fs::read(want.join(&name)), std::fs::read(got.join(&name)));
            assert!(a.expect("read") == b.expect("written"), "{what} {name}: differs from convert's");
        }
    }
}

/// `torch_dist → fsdp_dtensor → torch_dist` loses nothing: the result's `.metadata` and rank
/// files are byte for byte those `convert --target torch_dist` writes on that mesh (the common
/// state is pickled again, so it is compared by what `inspect` reads of it), and a `torch_dist`
/// checkpoint reshards as itself to another mesh, validating against the release.
#[test]
fn torch_dist_round_trips_through_fsdp_dtensor_and_reshards_as_itself() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (hf, mesh) in [
        ("llama", &["--tp", "2", "--dp", "2"][..]),
        ("qwen3_moe", &["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"][..]),
        ("deepseek_v3", &["--tp", "2", "--dp", "2"][..]),
    ] {
        let dir = tmp.path().join(hf);
        let (seed, fsdp, back, moved) = (dir.join("seed"), dir.join("fsdp"), dir.join("back"), dir.join("moved"));
        convert_torch_dist(hf, &seed, mesh);
        reshard_as(&seed, &fsdp, &["--tp", "1", "--dp", "2"], "fsdp_dtensor");
        reshard_as(&fsdp, &back, mesh, "torch_dist");
        assert_eq!(std::fs::read_to_string(back.join("latest_checkpointed_iteration.txt")).unwrap(), "release");
        assert_same_dcp_files(&seed, &back, hf);
        let summary = |d: &Path| {
            let o = run(bin().arg("inspect").arg(d).arg("--json"));
            let v: Value = serde_json::from_slice(&o.stdout).expect("json");
            v["training"]["objects"].clone()
        };
        assert_eq!(summary(&seed), summary(&back), "{hf}: the common state changed");
        // torch_dist to torch_dist on another mesh.
        reshard_as(&seed, &moved, &["--tp", "1", "--dp", "4"], "torch_dist");
        let o = run(bin().arg("validate").arg(&moved).arg("--against").arg(crate::fixture(hf)));
        assert_eq!(o.status.code(), Some(0), "{hf}: {}", stdout(&o));
    }
}

#[test]
fn publish_takes_a_megatron_save_directory_whole_and_its_tracker_commits_last() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dest = tmp.path().join("p");
    let o =
        run(bin().arg("publish").arg(torch_dist_fixture("torch-dist-llama-tp2")).arg("--to").arg(&dest).arg("--json"));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let tracker = std::fs::read_to_string(dest.join("latest_checkpointed_iteration.txt")).expect("tracker");
    assert_eq!(tracker.trim(), "release");
    for name in [".metadata", "metadata.json", "common.pt", "__0_0.distcp", "__1_1.distcp"] {
        assert!(dest.join("release").join(name).is_file(), "{name} not published");
    }
    // The published save directory is the checkpoint: validate reads it through its tracker.
    let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny/llama");
    let o = run(bin().arg("validate").arg(&dest).arg("--against").arg(&hf));
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    let o = run(bin().arg("verify-destination").arg(&dest).arg("--json"));
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
    // A save directory whose tracker names nothing is refused, nothing published.
    let broken = tmp.path().join("broken");
    std::fs::create_dir_all(broken.join("release")).expect("mkdir");
    std::fs::write(broken.join("latest_checkpointed_iteration.txt"), "12").expect("tracker");
    let o = run(bin().arg("publish").arg(&broken).arg("--to").arg(tmp.path().join("q")));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(!tmp.path().join("q").exists(), "something was published");
}

#[test]
fn validate_proves_megatron_cores_own_checkpoints_bit_exact_and_names_a_changed_key() {
    for (fixture, hf) in [("torch-dist-llama-tp2", "llama"), ("torch-dist-qwen3_moe-tp1ep2", "qwen3_moe")] {
        let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny").join(hf);
        let o = run(bin().arg("validate").arg(torch_dist_fixture(fixture)).arg("--against").arg(&hf).arg("--json"));
        assert_eq!(o.status.code(), Some(0), "{fixture}: {}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(v["tensors"], if fixture.contains("moe") { 12 } else { 9 }, "{v}");
    }
    // One stored element of layer 1's fc2 changed: the stacked key is named, at its global index.
    let tmp = tempfile::tempdir().expect("tempdir");
    let copy = tmp.path().join("ckpt");
    let src = torch_dist_fixture("torch-dist-llama-tp2");
    std::fs::create_dir_all(copy.join("release")).expect("mkdir");
    std::fs::copy(src.join("latest_checkpointed_iteration.txt"), copy.join("latest_checkpointed_iteration.txt"))
        .expect("copy");
    for e in std::fs::read_dir(src.join("release")).expect("list") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), copy.join("release").join(e.file_name())).expect("copy");
    }
    let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny/llama");
    let md = shardline_formats::checkpoint::open_checkpoint(&copy.join("release")).expect("open");
    let fc2 = md.tensors.iter().find(|t| t.key == "decoder.layers.mlp.linear_fc2.weight").expect("fc2");
    let chunk = fc2.chunks.iter().find(|c| c.offsets == [1, 0, 64]).expect("layer 1, TP rank 1");
    let path = copy.join("release").join(&*chunk.file);
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[chunk.data_offset as usize] ^= 0x40;
    std::fs::write(&path, bytes).expect("write");
    let o = run(bin().arg("validate").arg(&copy).arg("--against").arg(&hf));
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("`decoder.layers.mlp.linear_fc2.weight`: chunk offsets [1, 0, 64]")
            && out.contains("global index [1, 0, 64]"),
        "{out}"
    );
}

/// Megatron-Core's own `torch_dist` checkpoints translated to `fsdp_dtensor` on another mesh:
/// every tensor byte equals `convert --target fsdp_dtensor` of the same release on that mesh
/// (each rank file `convert` writes is the translated file's first bytes; rank 0's then holds
/// the carried common state), and the result validates bit-exactly against the release.
#[test]
fn megatron_cores_torch_dist_translates_to_what_convert_writes_byte_for_byte() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (fixture, hf, mesh) in [
        ("torch-dist-llama-tp2", "llama", &["--tp", "2", "--dp", "2"][..]),
        ("torch-dist-qwen3_moe-tp1ep2", "qwen3_moe", &["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"][..]),
    ] {
        let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny").join(hf);
        let (translated, converted) =
            (tmp.path().join(format!("{fixture}-t")), tmp.path().join(format!("{fixture}-c")));
        let o =
            run(bin().arg("reshard").arg(torch_dist_fixture(fixture)).arg("--to").arg(&translated).args(mesh).args([
                "--target",
                "fsdp_dtensor",
                "--json",
            ]));
        assert_eq!(o.status.code(), Some(0), "{fixture}: {}", stderr(&o));
        assert!(stderr(&o).contains("`_extra_state` objects left out"), "{}", stderr(&o));
        let o = run(bin().arg("convert").arg("--from").arg(&hf).arg("--to").arg(&converted).args(mesh));
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        for rank in 0..4 {
            let name = format!("__{rank}_0.distcp");
            let (c, t) = (
                std::fs::read(converted.join(&name)).expect("convert"),
                std::fs::read(translated.join(&name)).expect("translated"),
            );
            assert!(
                t.len() >= c.len() && t[..c.len()] == c[..],
                "{fixture} {name}: the tensor bytes differ from convert's"
            );
            assert_eq!(t.len() > c.len(), rank == 0, "{fixture} {name}: only rank 0 carries the common state");
        }
        let o = run(bin().arg("validate").arg(&translated).arg("--against").arg(&hf).args(["--etp", "1"]));
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
        let o = run(bin().arg("inspect").arg(&translated).arg("--json"));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let objects = v["training"]["objects"].as_object().expect("objects");
        assert!(objects.contains_key("args") && objects.contains_key("iteration"), "{v}");
    }
}

/// gpt-oss: Megatron-FSDP keeps its expert fc1 whole, fused in a layout of the expert-TP size,
/// where torch_dist stores `[gate; up]` (the experts' fc1 biases mark the kind). Translated for
/// expert-TP 1 and 2, the rank files hold what `convert` writes for that mesh, and validate;
/// `export` gives the release back, and the way back to `torch_dist` is convert's byte for byte.
#[test]
fn gpt_oss_fused_expert_fc1_translates_for_the_target_expert_tp() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let seed = tmp.path().join("seed");
    convert_torch_dist("gpt_oss_bf16", &seed, &["--tp", "2"]);
    for etp in ["1", "2"] {
        let mesh = ["--tp", "2", "--dp", "2", "--etp", etp];
        let (translated, converted) = (tmp.path().join(format!("t{etp}")), tmp.path().join(format!("c{etp}")));
        reshard_as(&seed, &translated, &mesh, "fsdp_dtensor");
        let o = run(bin()
            .arg("convert")
            .arg("--from")
            .arg(crate::fixture("gpt_oss_bf16"))
            .arg("--to")
            .arg(&converted)
            .args(mesh));
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        for rank in 0..4 {
            let name = format!("__{rank}_0.distcp");
            let (c, t) =
                (std::fs::read(converted.join(&name)).unwrap(), std::fs::read(translated.join(&name)).unwrap());
            assert!(t.len() >= c.len() && t[..c.len()] == c[..], "etp {etp} {name}: differs from convert's");
        }
        let o = run(bin()
            .arg("validate")
            .arg(&translated)
            .arg("--against")
            .arg(crate::fixture("gpt_oss_bf16"))
            .args(["--etp", etp]));
        assert_eq!(o.status.code(), Some(0), "etp {etp}: {}", stdout(&o));
    }
    let hf = tmp.path().join("hf");
    let o = run(bin().arg("export").arg(&seed).arg("--to").arg(&hf).arg("--like").arg(crate::fixture("gpt_oss_bf16")));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (want, got) = (crate::release_tensors(&crate::fixture("gpt_oss_bf16")), crate::release_tensors(&hf));
    assert!(want == got, "the export of gpt-oss's torch_dist checkpoint differs from the release");
    // And back to torch_dist, from expert-TP 2 to 1: the halves read out of the fused layout are
    // joined as `[gate; up]`, exactly as convert writes them.
    let (back, want) = (tmp.path().join("back"), tmp.path().join("want"));
    reshard_as(&tmp.path().join("t2"), &back, &["--tp", "2", "--dp", "1", "--etp", "1"], "torch_dist");
    convert_torch_dist("gpt_oss_bf16", &want, &["--tp", "2", "--dp", "1", "--etp", "1"]);
    assert_same_dcp_files(&want, &back, "gpt-oss back to torch_dist");
}

/// `export` of Megatron-Core's own `torch_dist` checkpoints gives the release back: the same
/// names, dtypes, shapes and bytes.
#[test]
fn megatron_cores_torch_dist_exports_back_to_the_release() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (fixture, hf) in [("torch-dist-llama-tp2", "llama"), ("torch-dist-qwen3_moe-tp1ep2", "qwen3_moe")] {
        let out = tmp.path().join(fixture);
        let o = run(bin()
            .arg("export")
            .arg(torch_dist_fixture(fixture))
            .arg("--to")
            .arg(&out)
            .arg("--like")
            .arg(crate::fixture(hf)));
        assert_eq!(o.status.code(), Some(0), "{fixture}: {}", stderr(&o));
        let (want, got) = (crate::release_tensors(&crate::fixture(hf)), crate::release_tensors(&out));
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{fixture}");
        for (name, w) in &want {
            assert!(&got[name] == w, "{fixture} `{name}`: the exported tensor differs from the release's");
        }
    }
}

/// A torch_dist seed is a release checkpoint, whose optimizer state Megatron-LM never reads:
/// `--optimizer-state` is refused with that reason, and nothing is written.
#[test]
fn a_torch_dist_seed_with_optimizer_state_is_refused_with_the_reason() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny/llama");
    let out = tmp.path().join("seed");
    let o = run(bin().arg("convert").arg("--from").arg(&hf).arg("--to").arg(&out).args([
        "--tp",
        "1",
        "--target",
        "torch_dist",
        "--optimizer-state",
    ]));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("never reads optimizer state from a release checkpoint"), "{}", stderr(&o));
    assert!(!out.exists(), "something was written");
}

/// A checkpoint Megatron-Core wrote itself, translated to `fsdp_dtensor` and back to
/// `torch_dist`, is what `convert --target torch_dist` writes from the release on that mesh, rank
/// files and `.metadata` byte for byte: nothing of the model was lost on the way.
#[test]
fn megatron_cores_own_checkpoint_goes_to_fsdp_dtensor_and_back_losing_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (fixture, hf, mesh) in [
        ("torch-dist-llama-tp2", "llama", &["--tp", "2", "--dp", "1"][..]),
        ("torch-dist-qwen3_moe-tp1ep2", "qwen3_moe", &["--tp", "1", "--dp", "2", "--ep", "2"][..]),
    ] {
        let (fsdp, back, seed) =
            (tmp.path().join(format!("{hf}-f")), tmp.path().join(format!("{hf}-b")), tmp.path().join(hf));
        reshard_as(&torch_dist_fixture(fixture), &fsdp, &["--tp", "1", "--dp", "2"], "fsdp_dtensor");
        reshard_as(&fsdp, &back, mesh, "torch_dist");
        convert_torch_dist(hf, &seed, mesh);
        assert_same_dcp_files(&seed, &back, fixture);
    }
}
