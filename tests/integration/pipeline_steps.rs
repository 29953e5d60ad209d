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
