//! `pipelines/reshard-export.yaml` with the real binary (`shardline run`, embedded SQLite store,
//! in-process workers): the resharded checkpoint it uploads has the target mesh's rank files and
//! passes `shardline validate --against` the release, and the HF release it exports and uploads
//! holds the release's tensors byte for byte.

use std::path::Path;

use crate::{bin, fixture, release_tensors as tensors, run, stderr, stdout};

#[test]
fn the_reshard_export_example_runs_and_its_outputs_check_out() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("out");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/reshard-export.yaml");
    let dest = format!("file://{}", out.display());
    let o = run(bin()
        .current_dir(tmp.path())
        .arg("run")
        .arg(&spec)
        .args(["--set", &format!("model={}", fixture("qwen3_moe").display())])
        .args(["--set", &format!("checkpoint_dest={dest}")])
        .args(["--set", &format!("hf_dest={dest}")]));
    assert!(o.status.success(), "run: {}{}", stdout(&o), stderr(&o));
    let runs: Vec<_> = std::fs::read_dir(&out).expect("uploads").map(|e| e.expect("entry").path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let (ckpt, hf) = (runs[0].join("checkpoint"), runs[0].join("hf"));

    // tp2·dp2: four rank files and .metadata (and the publish manifest).
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .expect("checkpoint")
        .map(|e| e.expect("e").file_name().to_string_lossy().into())
        .collect();
    names.sort();
    let want = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "shardline-manifest.json"];
    assert_eq!(names, want);
    let o = run(bin().arg("validate").arg(&ckpt).arg("--against").arg(fixture("qwen3_moe")).args(["--etp", "1"]));
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));

    let (want, got) = (tensors(&fixture("qwen3_moe")), tensors(&hf));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, w) in &want {
        assert!(&got[name] == w, "`{name}`: the exported tensor differs from the release's");
    }
}

/// `pipelines/torch-dist.yaml`: the shard step writes a Megatron save directory whose rank
/// tasks and commit run as for fsdp_dtensor, the validate step reads it through its tracker,
/// the upload publishes the tracker and the checkpoint it names, and the export step gives the
/// release back from it.
#[test]
fn the_torch_dist_example_writes_validates_and_uploads_a_save_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("out");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/torch-dist.yaml");
    let o = run(bin()
        .current_dir(tmp.path())
        .arg("run")
        .arg(&spec)
        .args(["--set", &format!("model={}", fixture("qwen3_moe").display())])
        .args(["--set", &format!("dest=file://{}", out.display())]));
    assert!(o.status.success(), "run: {}{}", stdout(&o), stderr(&o));
    let run_out = format!("{}{}", stdout(&o), stderr(&o));
    let runs: Vec<_> = std::fs::read_dir(&out).expect("uploads").map(|e| e.expect("entry").path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let root = &runs[0].join("megatron");
    assert_eq!(std::fs::read_to_string(root.join("latest_checkpointed_iteration.txt")).expect("tracker"), "release");
    let mut names: Vec<String> = std::fs::read_dir(root.join("release"))
        .expect("release/")
        .map(|e| e.expect("e").file_name().to_string_lossy().into())
        .collect();
    names.sort();
    // tp2·dp2·ep2: 4 ranks; the objects of rank 0 (dense modules, EP rank 0's experts) and of
    // rank 2 (EP rank 1's experts) in their second files.
    let want = [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__2_1.distcp",
        "__3_0.distcp",
        "common.pt",
        "metadata.json",
    ];
    assert_eq!(names, want);
    let o = run(bin().arg("validate").arg(root).arg("--against").arg(fixture("qwen3_moe")));
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));
    // The translation to fsdp_dtensor ran and was validated (its step would have failed the run):
    // a task per target rank file (4) and the commit.
    assert!(run_out.contains("translate: 5/5") && run_out.contains("validate-translated: 1/1"), "{run_out}");
    // ... and back to torch_dist (2 ranks), validated again.
    assert!(run_out.contains("back: 3/3") && run_out.contains("validate-back: 1/1"), "{run_out}");
    // The export step read the torch_dist checkpoint back to the release, byte for byte.
    let (want, got) = (tensors(&fixture("qwen3_moe")), tensors(&runs[0].join("hf")));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, w) in &want {
        assert!(&got[name] == w, "`{name}`: the exported tensor differs from the release's");
    }
}

/// `pipelines/torchtitan.yaml`: the shard step writes torchtitan's seed `step-0/` (4 FSDP2
/// ranks), the validate step recognises it by its keys, the upload publishes it, and the export
/// step gives the release back from it byte for byte; the reshard step re-tiles it for 3 ranks
/// under the same `step-0/`, which validates against the release too.
#[test]
fn the_torchtitan_example_writes_validates_uploads_and_exports_a_seed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("out");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/torchtitan.yaml");
    let o = run(bin()
        .current_dir(tmp.path())
        .arg("run")
        .arg(&spec)
        .args(["--set", &format!("model={}", fixture("llama").display())])
        .args(["--set", &format!("dest=file://{}", out.display())]));
    assert!(o.status.success(), "run: {}{}", stdout(&o), stderr(&o));
    let runs: Vec<_> = std::fs::read_dir(&out).expect("uploads").map(|e| e.expect("entry").path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let seed = runs[0].join("torchtitan").join("step-0");
    let mut names: Vec<String> = std::fs::read_dir(&seed)
        .expect("step-0/")
        .map(|e| e.expect("e").file_name().to_string_lossy().into())
        .collect();
    names.sort();
    assert_eq!(names, [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]);
    let o = run(bin().arg("inspect").arg("--json").arg(runs[0].join("torchtitan")));
    assert!(o.status.success(), "inspect: {}", stderr(&o));
    let listed = stdout(&o);
    assert!(
        listed.contains("\"layers.0.attention.qkv_linear.wq.weight\"") && listed.contains("\"lm_head.weight\""),
        "{listed}"
    );
    let o = run(bin().arg("validate").arg(&seed).arg("--against").arg(fixture("llama")));
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));
    let resharded = runs[0].join("torchtitan-dp3").join("step-0");
    let mut names: Vec<String> = std::fs::read_dir(&resharded)
        .expect("the resharded step-0/")
        .map(|e| e.expect("e").file_name().to_string_lossy().into())
        .collect();
    names.sort();
    assert_eq!(names, [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]);
    let o = run(bin().arg("validate").arg(&resharded).arg("--against").arg(fixture("llama")));
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));
    let (want, got) = (tensors(&fixture("llama")), tensors(&runs[0].join("hf")));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (name, w) in &want {
        assert!(&got[name] == w, "`{name}`: the exported tensor differs from the release's");
    }
}
