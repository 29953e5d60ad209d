//! Every pipeline in `pipelines/` lints with zero diagnostics (errors and warnings) against the
//! real model configs where they are bundled, and instantiates with its defaults.

mod common;

use shardline_spec::{lint, render_all, StepConfig, StepKind};

#[test]
fn every_example_pipeline_is_clean() {
    let dir = common::repo_root().join("pipelines");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("pipelines/") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            names.push(path.file_name().unwrap().to_string_lossy().into_owned());
        }
    }
    names.sort();
    for expected in [
        "demo.yaml",
        "llama.yaml",
        "mixtral.yaml",
        "qwen2.yaml",
        "qwen3-5-moe.yaml",
        "qwen3-moe.yaml",
        "qwen3-next.yaml",
        "deepseek-v3-fp8.yaml",
        "hub-deepseek-v3.yaml",
        "hub-glm45.yaml",
        "hub-gpt-oss.yaml",
        "hub-qwen3-vl-moe.yaml",
    ] {
        assert!(names.iter().any(|n| n == expected), "pipelines/{expected} is missing");
    }
    let ctx = common::disk_context();
    for name in &names {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let file = format!("pipelines/{name}");
        let (pipeline, diags) = lint(&file, &text, &ctx);
        assert!(diags.is_empty(), "{}", render_all(&diags, &text));
        let pipeline = pipeline.expect("a clean lint gives a pipeline");
        let run =
            pipeline.instantiate_with(&[], "run-0001", &ctx).unwrap_or_else(|d| panic!("{}", render_all(&d, &text)));
        let order: Vec<StepKind> = run.topo_order().iter().map(|s| s.kind).collect();
        assert_eq!(
            order,
            StepKind::ALL.to_vec(),
            "{file}: every example runs download → shard → split → validate → upload"
        );
        let upload = run.steps.iter().find(|s| s.kind == StepKind::StoreUpload).unwrap();
        let StepConfig::StoreUpload { to } = &upload.config else { unreachable!() };
        assert!(to.ends_with("/run-0001"), "{file}: uploads under the run id, got {to}");
    }
}

#[test]
fn the_demo_is_tiny_qwen3_next_on_tp2_dp4() {
    let text = std::fs::read_to_string(common::repo_root().join("pipelines/demo.yaml")).unwrap();
    let (pipeline, diags) = lint("pipelines/demo.yaml", &text, &common::disk_context());
    assert!(diags.is_empty(), "{}", render_all(&diags, &text));
    let run = pipeline.unwrap().instantiate(&[], "r1").unwrap();
    let shard = run.step("shard").unwrap();
    assert_eq!(shard.config.mesh().map(|m| (m.tp, m.dp, m.world())), Some((2, 4, 8)));
    assert_eq!(run.source_of("validate").unwrap().to_str(), Some("tests/fixtures/hf-tiny/qwen3_next"));
    let StepConfig::StoreUpload { to } = &run.step("upload").unwrap().config else { unreachable!() };
    assert_eq!(to, "file://.shardline/out/r1");
}
