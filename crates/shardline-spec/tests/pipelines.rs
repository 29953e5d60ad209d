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
        "reshard-export.yaml",
        "load-check.yaml",
        "torch-dist.yaml",
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
        let mut order: Vec<StepKind> = run.topo_order().iter().map(|s| s.kind).collect();
        order.dedup();
        use StepKind::*;
        let expected = if name == "reshard-export.yaml" {
            vec![
                HfDownload,
                MegatronShard,
                MegatronSplitFused,
                CheckpointValidate,
                CheckpointReshard,
                CheckpointValidate,
                CheckpointExport,
                StoreUpload,
            ]
        } else if name == "torch-dist.yaml" {
            // torch_dist keeps SwiGLU fc1 whole: nothing to split; the seed is also exported back
            // and translated to fsdp_dtensor and back.
            vec![
                HfDownload,
                MegatronShard,
                CheckpointValidate,
                StoreUpload,
                CheckpointExport,
                StoreUpload,
                CheckpointReshard,
                CheckpointValidate,
                CheckpointReshard,
                CheckpointValidate,
            ]
        } else if name == "torchtitan.yaml" {
            // torchtitan never fuses: nothing to split; the seed is also resharded for another DP
            // degree (validated and uploaded) and exported back.
            vec![
                HfDownload,
                MegatronShard,
                CheckpointValidate,
                CheckpointReshard,
                CheckpointValidate,
                StoreUpload,
                CheckpointExport,
                StoreUpload,
            ]
        } else if name == "load-check.yaml" {
            vec![HfDownload, MegatronShard, MegatronSplitFused, CheckpointValidate, StoreUpload, Command]
        } else {
            vec![HfDownload, MegatronShard, MegatronSplitFused, CheckpointValidate, StoreUpload]
        };
        assert_eq!(order, expected, "{file}: the example's steps run in this order");
        for upload in run.steps.iter().filter(|s| s.kind == StepKind::StoreUpload) {
            let StepConfig::StoreUpload { to } = &upload.config else { unreachable!() };
            assert!(to.contains("/run-0001"), "{file}: uploads under the run id, got {to}");
        }
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

#[test]
fn the_reshard_export_example_moves_a_checkpoint_between_meshes() {
    use shardline_spec::{CheckpointSource, RngPolicyName};
    let text = std::fs::read_to_string(common::repo_root().join("pipelines/reshard-export.yaml")).unwrap();
    let (pipeline, diags) = lint("pipelines/reshard-export.yaml", &text, &common::disk_context());
    assert!(diags.is_empty(), "{}", render_all(&diags, &text));
    let run = pipeline.unwrap().instantiate(&[("checkpoint_dest".into(), "s3://ckpts".into())], "r1").unwrap();
    let shard = run.step("shard").unwrap().config.mesh().unwrap();
    let reshard = run.step("reshard").unwrap();
    let mesh = reshard.config.mesh().unwrap();
    assert_ne!(shard, mesh, "the example reshards to another mesh");
    assert_eq!((mesh.tp, mesh.cp, mesh.dp, mesh.ep, mesh.etp), (2, 1, 2, 2, 1));
    let StepConfig::CheckpointReshard { source, rng, vocab_size, from_mesh, .. } = &reshard.config else {
        unreachable!()
    };
    assert_eq!((source, rng, vocab_size, from_mesh), (&None, &RngPolicyName::FromRank0, &None, &None));
    let StepConfig::CheckpointExport { like, etp, max_file_size, .. } = &run.step("export").unwrap().config else {
        unreachable!()
    };
    assert_eq!((like, etp, *max_file_size), (&None, &None, 5_000_000_000));
    let StepConfig::StoreUpload { to } = &run.step("upload-checkpoint").unwrap().config else { unreachable!() };
    assert_eq!(to, "s3://ckpts/r1/checkpoint");
    let _ = CheckpointSource::Local { path: "/x".into() };
}

#[test]
fn reshard_fields_resolve_with_their_defaults() {
    use shardline_spec::{CheckpointSource, RngPolicyName};
    let text = "apiVersion: shardline/v1
kind: Pipeline
name: r
steps:
  - {id: a, uses: checkpoint.reshard, with: {path: s3://b/ckpt, tp: 2, dp: 4, rng: drop, from_mesh: \"dp=8, tp=1\"}}
  - {id: b, uses: checkpoint.reshard, needs: [a], with: {path: ckpt/iter_1, tp: 4, dp: 2, vocab_size: 151936}}
  - {id: c, uses: checkpoint.export, needs: [b], with: {like: /r, max_file_size: 2GiB}}
";
    let (pipeline, diags) = lint("r.yaml", text, &shardline_spec::LintContext::new());
    assert!(diags.is_empty(), "{}", render_all(&diags, text));
    let run = pipeline.unwrap().instantiate(&[], "r1").unwrap();
    let StepConfig::CheckpointReshard { source, tp, etp, cp, ep, rng, from_mesh, .. } = &run.step("a").unwrap().config
    else {
        unreachable!()
    };
    assert_eq!(source, &Some(CheckpointSource::ObjectStore { url: "s3://b/ckpt".into() }));
    assert_eq!((*tp, *etp, *cp, *ep, *rng), (2, 2, 1, 1, RngPolicyName::Drop));
    assert_eq!(from_mesh.as_deref(), Some("tp=1,cp=1,dp=8,ep=1,etp=1"), "canonical spelling");
    let StepConfig::CheckpointReshard { source, vocab_size, .. } = &run.step("b").unwrap().config else {
        unreachable!()
    };
    assert_eq!(source, &Some(CheckpointSource::Local { path: "ckpt/iter_1".into() }));
    assert_eq!(*vocab_size, Some(151936));
    let StepConfig::CheckpointExport { max_file_size, .. } = &run.step("c").unwrap().config else { unreachable!() };
    assert_eq!(*max_file_size, 2 << 30);
    // The stored form reads back.
    let json = serde_json::to_value(&run).unwrap();
    let back: shardline_spec::ResolvedPipeline = serde_json::from_value(json).unwrap();
    assert_eq!(back, run);
}
