//! Instantiation: overrides, interpolation, defaults, topological order, hashes, JSON.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use shardline_spec::{
    lint, parse_override, render_all, ConcurrencyLimit, LintContext, OutputFormatName, OverflowPolicy, Pipeline,
    ResolvedPipeline, Resources, Retention, Retry, RunLimits, StepConfig, StepKind,
};

const SPEC: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: qwen3-moe-nightly
description: optional text
params:
  source: {type: path, default: tests/fixtures/hf-tiny/qwen3_moe}
  tp: {type: int, default: 2}
  fmt: {type: string, default: dcp, enum: [dcp, dcp-safetensors]}
  scratch: {type: size, default: 20GiB}
  backoff: {type: duration, default: 10s}
  keep: {type: bool, default: false}
steps:
  - id: download
    uses: hf.download
    with: {path: "${{ params.source }}"}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: "${{ params.tp }}", cp: 1, dp: 4, ep: 2, etp: 2, format: "${{ params.fmt }}", prefix: model.module., optimizer_state: false, vocab_divisible_by: 128, keep: "${{ params.keep }}"}
    resources: {cpus: 2, memory: 4GiB, gpus: 0, scratch: "${{ params.scratch }}"}
    retry: {attempts: 3, backoff: "${{ params.backoff }}"}
    timeout: 2h
    cache: true
  - id: split
    uses: megatron.split_fused
    needs: [shard]
  - id: validate
    uses: checkpoint.validate
    needs: [split]
  - id: upload
    uses: store.upload
    needs: [validate]
    with: {to: "file:///var/lib/shardline/out/${{ params.fmt }}/${{ run.id }}"}
"#;

fn pipeline(text: &str) -> Pipeline {
    let (p, diags) = lint("spec.yaml", text, &common::disk_context());
    assert!(diags.is_empty(), "{}", render_all(&diags, text));
    p.unwrap()
}

fn set(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn errors(p: &Pipeline, overrides: &[(&str, &str)], run_id: &str, source: &str) -> String {
    let diags = p.instantiate(&set(overrides), run_id).expect_err("expected errors");
    render_all(&diags, source)
}

#[test]
fn defaults_fill_every_field() {
    let run = pipeline(SPEC).instantiate(&[], "run-7").unwrap();
    assert_eq!(run.name, "qwen3-moe-nightly");
    let download = run.step("download").unwrap();
    assert_eq!(
        download.config,
        StepConfig::HfDownload {
            source: shardline_spec::DownloadSource::Local { path: PathBuf::from("tests/fixtures/hf-tiny/qwen3_moe") }
        }
    );
    assert_eq!(download.resources, Resources { cpus: 1, memory_bytes: 1 << 30, gpus: 0, scratch_bytes: 0 });
    assert_eq!(download.retry, Retry { attempts: 3, lost: 10, backoff: Duration::from_secs(5) });
    assert_eq!(download.timeout, Duration::from_secs(6 * 3600));
    assert!(download.cache);
    let shard = run.step("shard").unwrap();
    assert_eq!(
        shard.config,
        StepConfig::MegatronShard {
            tp: 2,
            cp: 1,
            dp: 4,
            ep: 2,
            etp: 2,
            format: OutputFormatName::Dcp,
            target: "fsdp_dtensor".into(),
            torchtitan_version: String::new(),
            prefix: "model.module.".into(),
            optimizer_state: false,
            vocab_divisible_by: 128,
            keep: false
        }
    );
    assert_eq!(shard.resources, Resources { cpus: 2, memory_bytes: 4 << 30, gpus: 0, scratch_bytes: 20 << 30 });
    assert_eq!(shard.retry, Retry { attempts: 3, lost: 10, backoff: Duration::from_secs(10) });
    assert_eq!(shard.timeout, Duration::from_secs(7200));
    assert_eq!(run.step("split").unwrap().config, StepConfig::MegatronSplitFused { keep: false });
    assert_eq!(run.step("validate").unwrap().config, StepConfig::CheckpointValidate {});
    assert_eq!(
        run.step("upload").unwrap().config,
        StepConfig::StoreUpload { to: "file:///var/lib/shardline/out/dcp/run-7".into() }
    );
    assert_eq!(run.source_of("validate"), Some(std::path::Path::new("tests/fixtures/hf-tiny/qwen3_moe")));
    assert_eq!(
        serde_json::to_string(&run.params).unwrap(),
        r#"{"backoff":"10s","fmt":"dcp","keep":false,"scratch":"20GiB","source":"tests/fixtures/hf-tiny/qwen3_moe","tp":2}"#
    );
}

#[test]
fn etp_defaults_to_tp_after_overrides() {
    let text = SPEC.replace("etp: 2, ", "");
    let run = pipeline(&text).instantiate(&set(&[("tp", "1")]), "r").unwrap();
    let Some(mesh) = run.step("shard").unwrap().config.mesh() else { unreachable!() };
    assert_eq!((mesh.tp, mesh.etp), (1, 1));
}

#[test]
fn overrides_are_typed_and_interpolated() {
    let p = pipeline(SPEC);
    let run = p
        .instantiate(
            &set(&[
                ("tp", "1"),
                ("fmt", "dcp-safetensors"),
                ("scratch", "512MiB"),
                ("backoff", "1m30s"),
                ("keep", "true"),
                ("source", "/data/models/Qwen3-30B-A3B"),
            ]),
            "20260101-abc",
        )
        .unwrap();
    let StepConfig::MegatronShard { tp, format, keep, .. } = run.step("shard").unwrap().config.clone() else {
        unreachable!()
    };
    assert_eq!((tp, format, keep), (1, OutputFormatName::DcpSafetensors, true));
    assert_eq!(run.step("shard").unwrap().resources.scratch_bytes, 512 << 20);
    assert_eq!(run.step("shard").unwrap().retry.backoff, Duration::from_secs(90));
    assert_eq!(run.params["backoff"], "90s");
    assert_eq!(
        run.step("upload").unwrap().config,
        StepConfig::StoreUpload { to: "file:///var/lib/shardline/out/dcp-safetensors/20260101-abc".into() }
    );
    assert_eq!(run.source_of("upload").unwrap().to_str(), Some("/data/models/Qwen3-30B-A3B"));
    // The last of repeated overrides wins.
    let run = p.instantiate(&set(&[("tp", "1"), ("tp", "2")]), "r").unwrap();
    assert_eq!(run.step("shard").unwrap().config.mesh().unwrap().tp, 2);
}

#[test]
fn bad_overrides_name_the_param_and_its_type() {
    let p = pipeline(SPEC);
    insta::assert_snapshot!(errors(&p, &[("tp", "two"), ("fmt", "dcp-safetensor"), ("tpp", "2"), ("scratch", "4G")], "r", SPEC), @r#"
        error: `--set tpp=2`: the pipeline has no param `tpp`
         --> spec.yaml (params.tpp)
          = hint: did you mean `tp`?

        error: `--set tp=two`: expected int, found "two"
         --> spec.yaml:7:3 (params.tp)
          |
        7 |   tp: {type: int, default: 2}
          |   ^^
          = note: param `tp` is declared here as `int`

        error: `--set fmt=dcp-safetensor`: `dcp-safetensor` is not one of `dcp`, `dcp-safetensors`
         --> spec.yaml:8:3 (params.fmt)
          |
        8 |   fmt: {type: string, default: dcp, enum: [dcp, dcp-safetensors]}
          |   ^^^
          = hint: did you mean `dcp-safetensors`?

        error: `--set scratch=4G`: invalid size "4G": unknown unit `G` in `4G`
         --> spec.yaml:9:3 (params.scratch)
          |
        9 |   scratch: {type: size, default: 20GiB}
          |   ^^^^^^^
          = note: param `scratch` is declared here as `size`
          = hint: write `GiB` (powers of 1024) or `GB` (powers of 1000); units are case-sensitive

        error: `spec.yaml`: 4 errors
    "#);
}

#[test]
fn overrides_are_checked_like_defaults() {
    let p = pipeline(SPEC);
    // An override is checked where the param is used: tp must be at least 1.
    insta::assert_snapshot!(errors(&p, &[("tp", "0")], "r", SPEC), @r#"
        error: `tp`: must be at least 1, found 0
          --> spec.yaml:19:16 (steps[1].with.tp)
           |
        19 |     with: {tp: "${{ params.tp }}", cp: 1, dp: 4, ep: 2, etp: 2, format: "${{ params.fmt }}", prefix:…
           |                ^^^^^^^^^^^^^^^^^^
           = note: the value `0` comes from `--set tp=0`

        error: `spec.yaml`: 1 error
    "#);
    // With the model at hand, tp = 4 exceeds the tiny model's 2 KV groups.
    let diags = p.instantiate_with(&set(&[("tp", "4")]), "r", &common::disk_context()).unwrap_err();
    insta::assert_snapshot!(render_all(&diags, SPEC), @r#"
        error: num_query_groups (2) < tp (4): Megatron's replicated-KV path is not supported; use tp ≤ 2
          --> spec.yaml:19:16 (steps[1].with.tp)
           |
        19 |     with: {tp: "${{ params.tp }}", cp: 1, dp: 4, ep: 2, etp: 2, format: "${{ params.fmt }}", prefix:…
           |                ^^^^^^^^^^^^^^^^^^
           = note: `tp` = 4 comes from `--set tp=4`
           = note: mesh tp4·cp1·dp4·ep2·etp2, model `qwen3_moe` at `tests/fixtures/hf-tiny/qwen3_moe`
           = hint: `tp` values that fit this model and the rest of the mesh: 1, 2

        error: `spec.yaml`: 1 error
    "#);
    // Without it, only the mesh's own arithmetic is checked, and tp = 4 is fine.
    assert!(p.instantiate_with(&set(&[("tp", "4")]), "r", &LintContext::new()).is_ok());
}

#[test]
fn params_without_default_must_be_set_and_run_ids_are_one_path_segment() {
    let text = SPEC.replace("tp: {type: int, default: 2}", "tp: {type: int}");
    let p = pipeline(&text);
    insta::assert_snapshot!(errors(&p, &[], "../../etc", &text), @r#"
        error: invalid run id "../../etc"
         --> spec.yaml (run.id)
          = hint: run ids are one path segment: letters, digits, `.`, `_` and `-`

        error: param `tp` has no default and is not set
         --> spec.yaml:7:3 (params.tp)
          |
        7 |   tp: {type: int}
          |   ^^
          = hint: pass `--set tp=<int>`

        error: `spec.yaml`: 2 errors
    "#);
    assert!(p.instantiate(&set(&[("tp", "2")]), "run_1.retry-2").is_ok());
}

#[test]
fn topological_order_is_deterministic() {
    let text = r#"apiVersion: shardline/v1
kind: Pipeline
name: order
steps:
  - {id: upload, uses: store.upload, needs: [split-b], with: {to: /out}}
  - {id: validate-a, uses: checkpoint.validate, needs: [split-a]}
  - {id: split-b, uses: megatron.split_fused, needs: [shard-b]}
  - {id: shard-a, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 1}}
  - {id: split-a, uses: megatron.split_fused, needs: [shard-a]}
  - {id: shard-b, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 2}}
  - {id: download, uses: hf.download, with: {path: /m}}
"#;
    let run = pipeline(text).instantiate(&[], "r").unwrap();
    let order: Vec<&str> = run.topo_order().iter().map(|s| s.id.as_str()).collect();
    assert_eq!(order, ["download", "shard-a", "split-a", "validate-a", "shard-b", "split-b", "upload"]);
    let pos = |id: &str| order.iter().position(|s| *s == id).unwrap();
    for s in &run.steps {
        for n in &s.needs {
            assert!(pos(n) < pos(&s.id), "{} before {}", n, s.id);
        }
    }
    let up: Vec<&str> = run.upstream("upload").iter().map(|s| s.id.as_str()).collect();
    assert_eq!(up, ["download", "shard-b", "split-b"]);
}

#[test]
fn spec_hash_is_stable_and_canonical() {
    let p = pipeline(SPEC);
    let a = p.instantiate(&[], "run-1").unwrap();
    let b = p.instantiate(&[], "run-2").unwrap();
    assert_eq!(a.spec_hash, b.spec_hash, "the run id does not change the spec hash");
    assert_eq!(a.spec_hash.len(), 64);
    // Pinned: a change to the canonical form is a change to every cache key.
    insta::assert_snapshot!(a.spec_hash, @"5e8a9aa392690febd8dfb0a5de63319168036ebe15ddf9e7f4e2aa062650437f");

    // Same spec written differently: key order, flow vs block, explicit defaults, comments,
    // step order, an override equal to the default.
    let reordered = r#"# comment
kind: Pipeline
apiVersion: shardline/v1
name: qwen3-moe-nightly
description: another description does not matter
params:
  keep: {default: false, type: bool}
  backoff: {type: duration, default: 10000ms}
  scratch: {type: size, default: 20480MiB}
  fmt: {type: string, enum: [dcp, dcp-safetensors], default: dcp}
  tp: {type: int, default: 2}
  source: {type: path, default: tests/fixtures/hf-tiny/qwen3_moe}
steps:
  - id: upload
    uses: store.upload
    needs: [validate]
    with: {to: "file:///var/lib/shardline/out/${{ params.fmt }}/${{ run.id }}"}
    resources: {cpus: 1, memory: 1GiB}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with:
      dp: 4
      tp: "${{ params.tp }}"
      ep: 2
      etp: 2
      format: "${{ params.fmt }}"
      keep: "${{ params.keep }}"
    resources: {scratch: "${{ params.scratch }}", memory: 4096MiB, cpus: 2}
    retry: {backoff: "${{ params.backoff }}"}
    timeout: 120m
  - id: download
    uses: hf.download
    with: {path: "${{ params.source }}"}
    timeout: 6h
  - {id: validate, uses: checkpoint.validate, needs: [split]}
  - {id: split, uses: megatron.split_fused, needs: [shard], with: {keep: false}}
"#;
    let c = pipeline(reordered).instantiate(&set(&[("tp", "2")]), "run-3").unwrap();
    assert_eq!(a.spec_hash, c.spec_hash);

    // A change of value, param or name changes it.
    let d = p.instantiate(&set(&[("tp", "1")]), "run-1").unwrap();
    assert_ne!(a.spec_hash, d.spec_hash);
    let e = pipeline(&SPEC.replace("name: qwen3-moe-nightly", "name: other")).instantiate(&[], "run-1").unwrap();
    assert_ne!(a.spec_hash, e.spec_hash);
    let f = pipeline(&SPEC.replace("timeout: 2h", "timeout: 3h")).instantiate(&[], "run-1").unwrap();
    assert_ne!(a.spec_hash, f.spec_hash);
}

#[test]
fn step_hashes_chain_and_see_the_run_id_only_where_it_is_used() {
    let p = pipeline(SPEC);
    let a = p.instantiate(&[], "run-1").unwrap();
    let b = p.instantiate(&[], "run-2").unwrap();
    for id in ["download", "shard", "split", "validate"] {
        assert_eq!(a.step_hash(id), b.step_hash(id), "{id} does not use the run id");
    }
    assert_ne!(a.step_hash("upload"), b.step_hash("upload"), "upload writes under the run id");
    // A change upstream changes every step downstream.
    let c = p.instantiate(&set(&[("source", "/other")]), "run-1").unwrap();
    for id in ["download", "shard", "split", "validate", "upload"] {
        assert_ne!(a.step_hash(id), c.step_hash(id), "{id}");
    }
    assert_eq!(a.step_hash("nope"), None);
}

#[test]
fn resolved_pipeline_round_trips_through_json() {
    let run = pipeline(SPEC).instantiate(&[], "run-1").unwrap();
    let json = serde_json::to_string_pretty(&run).unwrap();
    let back: ResolvedPipeline = serde_json::from_str(&json).unwrap();
    assert_eq!(back, run);
    let shard = &serde_json::to_value(&run).unwrap()["steps"][1];
    assert_eq!(shard["kind"], "megatron.shard");
    assert_eq!(shard["config"]["kind"], "megatron.shard");
    assert_eq!(shard["config"]["format"], "dcp");
    assert_eq!(shard["resources"]["memory_bytes"], 4u64 << 30);
}

#[test]
fn step_kinds_and_formats_parse_by_their_dotted_names() {
    for k in StepKind::ALL {
        assert_eq!(k.as_str().parse::<StepKind>().unwrap(), k);
        assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
    }
    let err = "megatron.shrad".parse::<StepKind>().unwrap_err();
    assert!(err.to_string().contains("`megatron.shard`"), "{err}");
    assert_eq!("dcp-safetensors".parse::<OutputFormatName>().unwrap(), OutputFormatName::DcpSafetensors);
    assert_eq!(parse_override("tp=4").unwrap(), ("tp".to_string(), "4".to_string()));
    assert_eq!(parse_override("to=a=b").unwrap(), ("to".to_string(), "a=b".to_string()));
    assert!(parse_override("tp").is_err());
    assert!(parse_override("=4").is_err());
}

#[test]
fn locations_of_key_paths() {
    let p = pipeline(SPEC);
    let loc = p.location("steps[1].with.tp").unwrap();
    assert_eq!((loc.line, loc.column), (19, 16));
    assert_eq!(p.location("params.tp.default").map(|l| l.line), Some(7));
    assert_eq!(p.location("steps[9]"), None);
}

const HUB_SPEC: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: hub
params:
  revision: {type: string, default: main}
  weights: {type: string, default: "*.safetensors"}
steps:
  - id: download
    uses: hf.download
    with:
      repo: Qwen/Qwen3-0.6B
      revision: "${{ params.revision }}"
      allow: ["*.json", "${{ params.weights }}"]
      ignore: "original/"
  - id: local
    uses: hf.download
    with: {path: /data/models/llama}
"#;

#[test]
fn hub_download_fields_resolve_with_defaults_and_params() {
    let run = pipeline(HUB_SPEC).instantiate(&[("revision".into(), "v1.0".into())], "run-1").unwrap();
    let download = run.step("download").unwrap();
    assert_eq!(
        download.config,
        StepConfig::HfDownload {
            source: shardline_spec::DownloadSource::Hub {
                repo: "Qwen/Qwen3-0.6B".into(),
                revision: "v1.0".into(),
                allow: vec!["*.json".into(), "*.safetensors".into()],
                ignore: vec!["original/".into()],
                endpoint: None,
            }
        }
    );
    // A Hub source has no local path; the local step keeps its own.
    assert_eq!(run.source_of("download"), None);
    assert_eq!(run.source_of("local").unwrap().to_str(), Some("/data/models/llama"));

    // The JSON stored with a run reads back as the same config; a local source keeps the form it
    // had before Hub sources existed (so step hashes of existing pipelines do not change).
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["steps"][1]["config"], serde_json::json!({"kind": "hf.download", "path": "/data/models/llama"}));
    assert_eq!(json["steps"][0]["config"]["repo"], "Qwen/Qwen3-0.6B");
    assert!(json["steps"][0]["config"].get("endpoint").is_none());
    let back: shardline_spec::ResolvedPipeline = serde_json::from_value(json).unwrap();
    assert_eq!(back, run);

    // Defaults: revision `main`, empty patterns; an explicit endpoint loses its trailing slash.
    let text = "apiVersion: shardline/v1\nkind: Pipeline\nname: hub\nsteps:\n  - {id: d, uses: hf.download, with: {repo: gpt2, endpoint: \"http://127.0.0.1:9/\"}}\n";
    let run = pipeline(text).instantiate(&[], "run-2").unwrap();
    assert_eq!(
        run.step("d").unwrap().config,
        StepConfig::HfDownload {
            source: shardline_spec::DownloadSource::Hub {
                repo: "gpt2".into(),
                revision: "main".into(),
                allow: vec![],
                ignore: vec![],
                endpoint: Some("http://127.0.0.1:9".into()),
            }
        }
    );
}

#[test]
fn hub_revision_from_set_is_checked() {
    let diags = pipeline(HUB_SPEC).instantiate(&[("revision".into(), "../main".into())], "run-1").unwrap_err();
    assert_eq!(diags.len(), 1, "{diags:?}");
    assert_eq!(diags[0].path, "steps[0].with.revision");
    assert!(diags[0].message.contains("invalid revision"), "{}", diags[0].message);
}

const OBJECT_STORE_SPEC: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: object-store
params:
  bucket: {type: string, default: models}
steps:
  - id: download
    uses: hf.download
    with: {path: "s3://${{ params.bucket }}/llama/v1"}
  - id: from-file
    uses: hf.download
    with: {path: "file:///data/releases/llama"}
  - id: local
    uses: hf.download
    with: {path: /data/models/llama}
"#;

#[test]
fn object_store_sources_resolve_to_urls() {
    let run = pipeline(OBJECT_STORE_SPEC).instantiate(&[("bucket".into(), "releases".into())], "run-1").unwrap();
    let source = |id: &str| match &run.step(id).unwrap().config {
        StepConfig::HfDownload { source } => source.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        source("download"),
        shardline_spec::DownloadSource::ObjectStore { url: "s3://releases/llama/v1".into() }
    );
    assert_eq!(
        source("from-file"),
        shardline_spec::DownloadSource::ObjectStore { url: "file:///data/releases/llama".into() }
    );
    assert_eq!(source("local"), shardline_spec::DownloadSource::Local { path: "/data/models/llama".into() });
    // An object-store source has no local path to validate against at lint time.
    assert_eq!(run.source_of("download"), None);
    // Stored with the run as `url`, read back as the same config.
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["steps"][0]["config"], serde_json::json!({"kind": "hf.download", "url": "s3://releases/llama/v1"}));
    let back: shardline_spec::ResolvedPipeline = serde_json::from_value(json).unwrap();
    assert_eq!(back, run);
    // A param that leaves the URL without a bucket is reported when the run is instantiated.
    let err = pipeline(OBJECT_STORE_SPEC).instantiate(&[("bucket".into(), "".into())], "run-2").unwrap_err();
    let text = format!("{err:?}");
    assert!(text.contains("has no bucket"), "{text}");
}

/// `retry.lost`: typed, interpolated, in the step's hash — but at its default the hashes are the
/// ones specs had before the field existed (the pinned spec hash above does not set it).
#[test]
fn lost_budget_is_read_hashed_and_defaulted() {
    let p = pipeline(SPEC);
    let a = p.instantiate(&[], "run-1").unwrap();
    let explicit = pipeline(&SPEC.replace(
        "retry: {attempts: 3, backoff: \"${{ params.backoff }}\"}",
        "retry: {attempts: 3, lost: 10, backoff: \"${{ params.backoff }}\"}",
    ))
    .instantiate(&[], "run-1")
    .unwrap();
    assert_eq!(explicit.spec_hash, a.spec_hash, "lost: 10 is the default");
    assert_eq!(explicit.step_hash("shard"), a.step_hash("shard"));

    let text = SPEC
        .replace(
            "  keep: {type: bool, default: false}\n",
            "  keep: {type: bool, default: false}\n  lost: {type: int, default: 4}\n",
        )
        .replace(
            "retry: {attempts: 3, backoff: \"${{ params.backoff }}\"}",
            "retry: {attempts: 3, lost: \"${{ params.lost }}\", backoff: \"${{ params.backoff }}\"}",
        );
    assert_ne!(text, SPEC);
    let p4 = pipeline(&text);
    let b = p4.instantiate(&[], "run-1").unwrap();
    assert_eq!(b.step("shard").unwrap().retry, Retry { attempts: 3, lost: 4, backoff: Duration::from_secs(10) });
    assert_eq!(b.step("download").unwrap().retry.lost, 10);
    assert_ne!(b.spec_hash, a.spec_hash);
    assert_ne!(b.step_hash("shard"), a.step_hash("shard"), "lost is part of the step's hash");
    assert_eq!(b.step_hash("download"), a.step_hash("download"));
    let c = p4.instantiate(&set(&[("lost", "7")]), "run-1").unwrap();
    assert_eq!(c.step("shard").unwrap().retry.lost, 7);
    assert_ne!(c.step_hash("shard"), b.step_hash("shard"));
    let zero = errors(&p4, &[("lost", "0")], "run-1", &text);
    assert!(zero.contains("`lost`: must be at least 1, found 0"), "{zero}");

    // A resolved pipeline stored before the field existed reads back with the default.
    let mut stored = serde_json::to_value(&a).unwrap();
    assert!(stored.to_string().find("\"lost\"").is_none(), "the default is not written: {stored}");
    stored["steps"][1]["retry"] = serde_json::json!({"attempts": 2, "backoff": {"secs": 1, "nanos": 0}});
    let old: ResolvedPipeline = serde_json::from_value(stored).unwrap();
    assert_eq!(old.steps[1].retry, Retry { attempts: 2, lost: 10, backoff: Duration::from_secs(1) });
    let written = serde_json::to_value(&b).unwrap();
    let back: ResolvedPipeline = serde_json::from_value(written).unwrap();
    assert_eq!(back.step("shard").unwrap().retry.lost, 4);
}

/// `concurrency`, `pool` and `priority`: read into the resolved pipeline, in its hash only when
/// set (the pinned spec hash above has none of them), absent from older stored pipelines.
#[test]
fn run_limits_are_read_and_hashed_only_when_set() {
    let a = pipeline(SPEC).instantiate(&[], "run-1").unwrap();
    assert!(a.limits.is_default());
    assert!(!serde_json::to_string(&a).unwrap().contains("limits"), "the default is not written");
    let with = |extra: &str| {
        let text = SPEC.replacen("\nparams:", &format!("\n{extra}\nparams:"), 1);
        assert_ne!(text, SPEC);
        pipeline(&text).instantiate(&[], "run-1").unwrap()
    };
    let short = with("concurrency: 1");
    assert_eq!(short.limits.concurrency, Some(ConcurrencyLimit { limit: 1, overflow: OverflowPolicy::Queue }));
    let long = with("concurrency: {limit: 2, overflow: cancel-previous}\npool: gpu-big\npriority: -5");
    assert_eq!(
        long.limits,
        RunLimits {
            concurrency: Some(ConcurrencyLimit { limit: 2, overflow: OverflowPolicy::CancelPrevious }),
            pool: Some("gpu-big".into()),
            priority: -5,
        }
    );
    assert_ne!(short.spec_hash, a.spec_hash);
    assert_ne!(long.spec_hash, short.spec_hash);
    assert_eq!(long.step_hash("shard"), a.step_hash("shard"), "limits do not change what a step computes");
    let back: ResolvedPipeline = serde_json::from_value(serde_json::to_value(&long).unwrap()).unwrap();
    assert_eq!(back.limits, long.limits);
}

/// `retention`: read into the resolved pipeline in its canonical spelling, in the spec hash only
/// when set (the pinned spec hash above has none), never in a step's hash, absent from older
/// stored pipelines.
#[test]
fn retention_is_read_and_hashed_only_when_set() {
    let a = pipeline(SPEC).instantiate(&[], "run-1").unwrap();
    assert!(a.retention.is_default());
    assert!(!serde_json::to_string(&a).unwrap().contains("retention"), "the default is not written");
    let with = |extra: &str| {
        let text = SPEC.replacen("\nparams:", &format!("\n{extra}\nparams:"), 1);
        pipeline(&text).instantiate(&[], "run-1").unwrap()
    };
    let week = with("retention: {runs: 7d}");
    assert_eq!(week.retention, Retention { runs: Some(Duration::from_secs(7 * 86_400)) });
    let hours = with("retention:\n  runs: 168h");
    assert_eq!(hours.retention, week.retention, "one duration, however it is spelt");
    assert_eq!(hours.spec_hash, week.spec_hash, "hashed in its canonical spelling");
    assert_ne!(week.spec_hash, a.spec_hash);
    assert_ne!(with("retention: {runs: 1d}").spec_hash, week.spec_hash);
    for step in ["download", "shard", "validate", "upload"] {
        assert_eq!(week.step_hash(step), a.step_hash(step), "retention does not change what `{step}` computes");
    }
    let stored = serde_json::to_value(&week).unwrap();
    assert_eq!(stored["retention"], serde_json::json!({"runs": "7d"}));
    let back: ResolvedPipeline = serde_json::from_value(stored).unwrap();
    assert_eq!(back.retention, week.retention);
    let mut old = serde_json::to_value(&a).unwrap();
    old.as_object_mut().unwrap().remove("retention");
    assert!(serde_json::from_value::<ResolvedPipeline>(old).unwrap().retention.is_default());
}

#[test]
fn command_steps_resolve_their_argv_env_and_workdir() {
    let text =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/valid/command.yaml"))
            .unwrap();
    let run = pipeline(&text).instantiate(&set(&[("threads", "8")]), "run-9").unwrap();
    let check = run.step("check").unwrap();
    assert_eq!(check.kind, StepKind::Command);
    let StepConfig::Command { run: argv, shell, env, inherit, workdir } = &check.config else { unreachable!() };
    assert_eq!(argv, &["python3", "scripts/check.py", "--threads", "8", "--run=run-9"]);
    assert!(!shell);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(env, [("MODE", "strict"), ("OMP_NUM_THREADS", "8")]);
    assert_eq!((inherit.as_slice(), workdir.as_deref()), (&["HF_TOKEN".to_string()][..], Some("tools".as_ref())));
    assert_eq!((check.resources.gpus, check.timeout), (1, Duration::from_secs(600)));
    let StepConfig::Command { run: script, shell: true, env, workdir: None, .. } = &run.step("report").unwrap().config
    else {
        unreachable!()
    };
    assert_eq!((script.len(), env.len()), (1, 0));
    // The resolved form round-trips through the JSON stored with a run.
    let back: ResolvedPipeline = serde_json::from_value(serde_json::to_value(&run).unwrap()).unwrap();
    assert_eq!(back, run);
}

#[test]
fn a_torch_dist_shard_has_no_prefix_and_refuses_what_it_cannot_write() {
    let spec = r#"
apiVersion: shardline/v1
kind: Pipeline
name: td
steps:
  - {id: download, uses: hf.download, with: {repo: org/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 2, dp: 1, target: torch_dist}}
  - {id: validate, uses: checkpoint.validate, needs: [shard]}
"#;
    let run = pipeline(spec).instantiate(&[], "run-1").unwrap();
    match &run.step("shard").unwrap().config {
        StepConfig::MegatronShard { target, prefix, .. } => {
            assert_eq!((target.as_str(), prefix.as_str()), ("torch_dist", ""))
        }
        other => panic!("{other:?}"),
    }
    let bad = r#"
apiVersion: shardline/v1
kind: Pipeline
name: td
steps:
  - {id: download, uses: hf.download, with: {repo: org/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 2, dp: 1, target: torch_dist, format: dcp-safetensors, optimizer_state: true}}
  - {id: split, uses: megatron.split_fused, needs: [shard]}
"#;
    let (_, diags) = lint("td.yaml", bad, &common::disk_context());
    let targets: Vec<&str> = diags.iter().filter(|d| d.code == "target").map(|d| d.path.as_str()).collect();
    assert_eq!(targets, ["steps[1].with.format", "steps[1].with.optimizer_state", "steps[2].needs"], "{diags:#?}");
    assert!(diags.iter().any(|d| d.message.contains("`format: dcp-safetensors` does not apply")), "{diags:#?}");
}

#[test]
fn a_torchtitan_shard_has_no_prefix_and_refuses_what_it_cannot_write() {
    let spec = r#"
apiVersion: shardline/v1
kind: Pipeline
name: tt
steps:
  - {id: download, uses: hf.download, with: {repo: org/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 4, target: torchtitan, torchtitan_version: 2025-12}}
"#;
    let run = pipeline(spec).instantiate(&[], "run-1").unwrap();
    match &run.step("shard").unwrap().config {
        StepConfig::MegatronShard { target, prefix, torchtitan_version, .. } => {
            assert_eq!((target.as_str(), prefix.as_str(), torchtitan_version.as_str()), ("torchtitan", "", "2025-12"))
        }
        other => panic!("{other:?}"),
    }
    let bad = r#"
apiVersion: shardline/v1
kind: Pipeline
name: tt
steps:
  - {id: download, uses: hf.download, with: {repo: org/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 2, cp: 2, dp: 1, target: torchtitan, format: dcp-safetensors, optimizer_state: true, prefix: x.}}
  - {id: split, uses: megatron.split_fused, needs: [shard]}
  - {id: other, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 1, torchtitan_version: main}}
"#;
    let (_, diags) = lint("tt.yaml", bad, &common::disk_context());
    let targets: Vec<&str> = diags.iter().filter(|d| d.code == "target").map(|d| d.path.as_str()).collect();
    assert_eq!(
        targets,
        [
            "steps[1].with",
            "steps[1].with.format",
            "steps[1].with.optimizer_state",
            "steps[1].with.prefix",
            "steps[2].needs",
            "steps[3].with.torchtitan_version"
        ],
        "{diags:#?}"
    );
    assert!(
        diags.iter().any(|d| d.message.contains("got cp 2, etp 2: torchtitan has no expert tensor parallelism")),
        "{diags:#?}"
    );
}

#[test]
fn an_export_of_a_resharded_automodel_save_needs_no_like_when_the_save_describes_its_release() {
    let base = std::env::temp_dir().join(format!("shardline-lint-automodel-{}", std::process::id()));
    let save = base.join("epoch_0_step_2");
    let spec = |path: &str| {
        format!(
            "apiVersion: shardline/v1\nkind: Pipeline\nname: am\nsteps:\n  - {{id: reshard, uses: checkpoint.reshard, \
             with: {{path: {path}, tp: 1, dp: 2}}}}\n  - {{id: export, uses: checkpoint.export, needs: [reshard]}}\n"
        )
    };
    let missing = |text: &str| {
        let (_, diags) = lint("am.yaml", text, &LintContext::new().with_base_dir(&base));
        diags.iter().filter(|d| d.code == "missing-source").count()
    };
    // Not there, or there without `model/.hf_metadata/`: no release to follow.
    std::fs::create_dir_all(save.join("model")).unwrap();
    assert_eq!(missing(&spec("epoch_0_step_2")), 1);
    std::fs::create_dir_all(save.join("model/.hf_metadata")).unwrap();
    std::fs::write(save.join("model/.hf_metadata/fqn_to_file_index_mapping.json"), "{}").unwrap();
    assert_eq!(missing(&spec("epoch_0_step_2")), 0);
    assert_eq!(missing(&spec("elsewhere")), 1);
    std::fs::remove_dir_all(&base).unwrap();
}
