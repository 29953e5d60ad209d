//! Sizes within tolerance, the releases `transformers` wrote, writing, data generation.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};
use shardline_formats::safetensors::{Release, CONFIG_FILE_NAME, SINGLE_FILE_NAME};
use shardline_layout::config::Quantization;
use shardline_layout::recipe::f8e4m3_to_f32;
use shardline_layout::{build_plan, DType, Mesh, ModelConfig, Plan, PlanOptions, SourceTensor, Transform};
use shardline_units::parse_size_lenient;
use tempfile::TempDir;

use crate::*;
use crate::{arch::*, data::*, model::*, write::*};

mod deepseek;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
}

fn small_shards() -> SynthOptions {
    SynthOptions { max_shard_bytes: 256 << 10, ..SynthOptions::default() }
}

/// Every tensor's bytes, by name.
fn tensor_bytes(release: &Release) -> BTreeMap<String, Vec<u8>> {
    release
        .tensors()
        .map(|t| {
            let (file, info) = release.locate(&t.info.name).unwrap();
            let bytes = fs::read(file.path()).unwrap();
            let range = info.file_offset as usize..info.file_end() as usize;
            (info.name.clone(), bytes[range].to_vec())
        })
        .collect()
}

fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap())
        })
        .collect()
}

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
}

fn mean_std(values: &[f32]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = values.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Plans the release with the layout crate's mapping tables on a 1-rank mesh.
fn plan(release: &Release) {
    plan_on(release, Mesh::new(1, 1, 1, 1));
}

/// Plans the release on `mesh`: every tensor is consumed (an unmapped one is an error), and only
/// MTP layers' copies of the embedding and head go unconverted.
fn plan_on(release: &Release, mesh: Mesh) -> Plan {
    let config = ModelConfig::from_json(release.config_json()).unwrap();
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    match build_plan(&config, sources, mesh, &PlanOptions::default()) {
        Ok(plan) => {
            for name in &plan.unconverted {
                assert!(
                    name.ends_with(".embed_tokens.weight") || name.ends_with(".shared_head.head.weight"),
                    "{}: {name} not converted",
                    config.model_type
                );
            }
            plan
        }
        Err(errors) => {
            panic!("{}: {}", config.model_type, errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))
        }
    }
}

// ---- sizes ----

#[test]
fn sizes_are_within_tolerance_for_every_arch_and_target() {
    let targets = [
        "1MB", "2MB", "3MB", "10MB", "33MB", "100MB", "250MB", "1GB", "1.7GB", "4GB", "8GB", "20GB", "64GB", "150GB",
        "500GB", "1TB", "3TB",
    ];
    for arch in Arch::ALL {
        for target in targets {
            let bytes = parse_size_lenient(target).unwrap();
            let model = SynthModel::for_target(arch, bytes).unwrap_or_else(|e| panic!("{arch} {target}: {e}"));
            let error = relative_error(model.total_bytes(), bytes);
            assert!(
                error <= SIZE_TOLERANCE,
                "{arch} {target}: {} bytes ({:.1} %), {:?}",
                model.total_bytes(),
                error * 100.0,
                model.dims()
            );
            let sum: u64 = model.tensors().iter().map(TensorSpec::byte_len).sum();
            assert_eq!(sum, model.total_bytes());
            assert!(model.dims().num_layers >= 1);
            if (10_000_000..=100_000_000_000).contains(&bytes) {
                assert!((8..=128).contains(&model.dims().num_layers), "{arch} {target}: {:?}", model.dims());
            }
            if bytes >= 4_000_000_000 {
                let head_dim = model.dims().mla.as_ref().map_or(model.dims().head_dim, |m| m.qk_nope_head_dim);
                assert_eq!(head_dim, 128, "{arch} {target}");
            }
        }
    }
}

#[test]
fn tiny_target_gives_a_tiny_model() {
    let model = SynthModel::for_target(Arch::Llama, 1_000_000).unwrap();
    assert_eq!(model.dims().hidden_size, 64);
    assert!(model.total_bytes() >= 950_000 && model.total_bytes() <= 1_050_000);
}

#[test]
fn every_arch_has_models_well_below_one_megabyte() {
    for arch in Arch::ALL {
        let err = SynthModel::for_target(arch, 1).unwrap_err();
        let SynthError::TargetTooSmall { minimum, .. } = err else {
            panic!("{arch}: {err:?}");
        };
        assert!(minimum < 600_000, "{arch}: {minimum}");
        let model = SynthModel::for_target(arch, minimum).unwrap();
        assert_eq!(model.total_bytes(), minimum, "{arch}");
    }
}

#[test]
fn impossible_targets_are_errors() {
    for arch in Arch::ALL {
        for target in [0, 1, 10_000] {
            let err = SynthModel::for_target(arch, target).unwrap_err();
            assert!(
                matches!(err, SynthError::TargetTooSmall { minimum, .. } if minimum > target),
                "{arch} {target}: {err:?}"
            );
            assert!(err.to_string().contains(arch.name()), "{err}");
        }
        let err = SynthModel::for_target(arch, u64::MAX).unwrap_err();
        assert!(matches!(err, SynthError::TargetTooLarge { .. }), "{arch}: {err:?}");
    }
}

#[test]
fn invalid_dims_are_errors() {
    let good = WIDTHS[0].dims(Arch::Qwen3Next, 2);
    assert!(SynthModel::new(Arch::Qwen3Next, good.clone()).is_ok());
    let cases: Vec<(ModelDims, &str)> = vec![
        (ModelDims { hidden_size: 0, ..good.clone() }, "hidden_size"),
        (ModelDims { num_key_value_heads: 3, ..good.clone() }, "num_key_value_heads"),
        (ModelDims { linear: None, ..good.clone() }, "linear"),
        (ModelDims { num_experts: 0, ..good.clone() }, "num_experts"),
        (ModelDims { num_experts: 1 << 40, ..good.clone() }, "num_experts"),
        (ModelDims { num_layers: MAX_LAYERS + 1, ..good.clone() }, "layers"),
        (ModelDims { hidden_size: u64::MAX, ..good.clone() }, "hidden_size"),
        (
            ModelDims {
                linear: Some(LinearAttentionDims { num_value_heads: 3, ..good.linear.clone().unwrap() }),
                ..good.clone()
            },
            "linear_num_value_heads",
        ),
    ];
    for (dims, field) in cases {
        let err = SynthModel::new(Arch::Qwen3Next, dims).unwrap_err();
        assert!(matches!(err, SynthError::InvalidDims { .. }) && err.to_string().contains(field), "{field}: {err}");
    }
    let good = WIDTHS[0].dims(Arch::DeepseekV3, 2);
    assert!(SynthModel::new(Arch::DeepseekV3, good.clone()).is_ok());
    let mla = good.mla.clone().unwrap();
    let cases: Vec<(ModelDims, &str)> = vec![
        (ModelDims { mla: None, ..good.clone() }, "latent-attention"),
        (
            ModelDims { mla: Some(LatentAttentionDims { kv_lora_rank: 0, ..mla.clone() }), ..good.clone() },
            "kv_lora_rank",
        ),
        (
            ModelDims { shared_expert_intermediate_size: good.moe_intermediate_size + 1, ..good.clone() },
            "shared_expert",
        ),
        (ModelDims { intermediate_size: 0, ..good.clone() }, "intermediate_size"),
        (ModelDims { mtp_layers: MAX_LAYERS, ..good.clone() }, "layers"),
    ];
    for (dims, field) in cases {
        let err = SynthModel::new(Arch::DeepseekV3, dims).unwrap_err();
        assert!(matches!(err, SynthError::InvalidDims { .. }) && err.to_string().contains(field), "{field}: {err}");
    }
    // Without dense layers, no dense width is needed.
    assert!(
        SynthModel::new(Arch::DeepseekV3, ModelDims { intermediate_size: 0, first_dense_layers: 0, ..good }).is_ok()
    );
}

#[test]
fn unknown_arch_lists_the_supported_ones() {
    let dir = TempDir::new().unwrap();
    let err = synth("gpt_bigcode", 1_000_000, dir.path(), 0, &SynthOptions::default()).unwrap_err();
    assert!(matches!(err, SynthError::UnknownArch { .. }), "{err:?}");
    let msg = err.to_string();
    for name in SUPPORTED_ARCHS {
        assert!(msg.contains(name), "{msg}");
    }
    assert!(msg.contains("gpt_bigcode"), "{msg}");
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    let names: Vec<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
    assert_eq!(names, SUPPORTED_ARCHS);
}

// ---- against the releases transformers wrote ----

#[test]
fn names_shapes_and_config_match_the_transformers_fixtures() {
    for (name, arch) in [
        ("llama", Arch::Llama),
        ("qwen3_moe", Arch::Qwen3Moe),
        ("qwen3_next", Arch::Qwen3Next),
        ("deepseek_v3", Arch::DeepseekV3),
        ("deepseek_v3_fp8", Arch::DeepseekV3),
    ] {
        let release = Release::open(fixture(name)).unwrap();
        let config: Value = serde_json::from_str(release.config_json()).unwrap();
        let model = SynthModel::from_config_json(release.config_json()).unwrap();
        assert_eq!(model.arch(), arch, "{name}");

        let theirs: BTreeMap<&str, (DType, &[u64])> =
            release.tensors().map(|t| (t.info.name.as_str(), (t.info.dtype, t.info.shape.as_slice()))).collect();
        let ours: BTreeMap<&str, (DType, &[u64])> =
            model.tensors().iter().map(|t| (t.name.as_str(), (t.dtype, t.shape.as_slice()))).collect();
        assert_eq!(ours, theirs, "{name}");
        assert_eq!(model.total_bytes(), release.total_bytes(), "{name}");

        // Same fields, and the planner reads the same model from both.
        let our_config: Value = serde_json::from_str(&model.config_json()).unwrap();
        let keys = |v: &Value| -> BTreeSet<String> { v.as_object().unwrap().keys().cloned().collect() };
        assert_eq!(keys(&our_config), keys(&config), "{name}");
        for key in [
            "layer_types",
            "model_type",
            "architectures",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "qk_head_dim",
            "quantization_config",
        ] {
            assert_eq!(our_config.get(key), config.get(key), "{name}: {key}");
        }
        assert_eq!(
            ModelConfig::from_json(&model.config_json()).unwrap(),
            ModelConfig::from_json(release.config_json()).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn a_models_own_config_gives_the_same_model() {
    for arch in Arch::ALL {
        for target in [1_000_000, 300_000_000] {
            let model = SynthModel::for_target(arch, target).unwrap();
            let again = SynthModel::from_config_json(&model.config_json()).unwrap();
            // Dimensions the architecture does not use are not in its config: compare what is.
            assert_eq!((again.arch(), again.format()), (arch, model.format()), "{arch}");
            assert_eq!(again.tensors(), model.tensors(), "{arch}");
            assert_eq!(again.config_json(), model.config_json(), "{arch}");
        }
    }
    let fp8 = SynthModel::for_target_as(Arch::DeepseekV3, WeightFormat::FP8, 10_000_000).unwrap();
    assert_eq!(SynthModel::from_config_json(&fp8.config_json()).unwrap().format(), WeightFormat::FP8);
}

#[test]
fn configs_without_head_dim_or_kv_heads_read_as_transformers_reads_them() {
    let config = json!({"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "intermediate_size": 512, "vocab_size": 1024});
    let model = SynthModel::from_config_json(&config.to_string()).unwrap();
    assert_eq!((model.dims().head_dim, model.dims().num_key_value_heads), (32, 8));
    for (bad, why) in [
        ("[1]".to_string(), "not a JSON object"),
        ("{".to_string(), "EOF"),
        (json!({"hidden_size": 8}).to_string(), "model_type"),
        (json!({"model_type": "gpt2"}).to_string(), "unknown architecture"),
        (json!({"model_type": "qwen3", "hidden_size": 64}).to_string(), "must be positive"),
        (
            json!({"model_type": "deepseek_v3", "quantization_config": {"weight_block_size": [128]}}).to_string(),
            "weight_block_size",
        ),
    ] {
        let err = SynthModel::from_config_json(&bad).unwrap_err().to_string();
        assert!(err.contains(why), "{bad}: {err}");
    }
}

// ---- writing ----

#[test]
fn every_arch_opens_and_plans() {
    for arch in Arch::ALL {
        for options in [SynthOptions::default(), small_shards()] {
            let dir = TempDir::new().unwrap();
            let report = synth(arch.name(), 2_000_000, dir.path(), 1, &options).unwrap();
            let release = Release::open(dir.path()).unwrap();
            assert_eq!(release.total_bytes(), report.total_bytes, "{arch}");
            assert_eq!(release.tensors().len(), report.num_tensors, "{arch}");
            assert!(relative_error(report.total_bytes, 2_000_000) <= SIZE_TOLERANCE);
            assert_eq!(report.files.len(), release.files().len());
            for t in release.tensors() {
                let want = if t.info.name.ends_with("e_score_correction_bias") { DType::F32 } else { DType::BF16 };
                assert_eq!(t.info.dtype, want, "{arch}: {}", t.info.name);
            }
            let sharded = report.files.len() > 1;
            assert_eq!(sharded, options.max_shard_bytes < 2_000_000, "{arch}");
            assert_eq!(report.index.is_some(), sharded);
            assert_eq!(release.index_path().is_some(), sharded);
            if let Some(index) = &report.index {
                let index: Value = serde_json::from_slice(&fs::read(index).unwrap()).unwrap();
                assert_eq!(index["metadata"]["total_size"], json!(report.total_bytes));
                assert_eq!(index["metadata"]["total_parameters"], json!(report.total_parameters));
                let numel: u64 = release.tensors().map(|t| t.info.shape.iter().product::<u64>()).sum();
                assert_eq!(report.total_parameters, numel);
                for file in release.files() {
                    let tensors: u64 = file.tensors().iter().map(|t| t.byte_len).sum();
                    let largest = file.tensors().iter().map(|t| t.byte_len).max().unwrap();
                    assert!(
                        tensors <= options.max_shard_bytes || file.tensors().len() == 1,
                        "{arch}: {} has {tensors} bytes (largest tensor {largest})",
                        file.path().display()
                    );
                }
                let n = report.files.len();
                for (k, path) in report.files.iter().enumerate() {
                    assert_eq!(
                        path.file_name().unwrap().to_str().unwrap(),
                        format!("model-{:05}-of-{n:05}.safetensors", k + 1)
                    );
                }
            }
            for file in release.files() {
                assert_eq!(file.metadata().get("format").map(String::as_str), Some("pt"));
                let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
                assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted by name");
            }
            let config = ModelConfig::from_json(release.config_json()).unwrap();
            assert_eq!(config.model_type, arch.name());
            assert_eq!(config.num_layers, report.dims.num_layers);
            assert_eq!(config.hidden_size, report.dims.hidden_size);
            plan(&release);
            // Nothing but the release.
            for name in dir_files(dir.path()).keys() {
                assert!(is_release_file(name), "{arch}: stray file {name}");
            }
        }
    }
}

#[test]
fn wider_models_plan_too() {
    // Every width of the ladder, planned without writing data, on one rank and on TP 2 × EP 4.
    for arch in Arch::ALL {
        for width in WIDTHS {
            let model = SynthModel::new(arch, width.dims(arch, 4)).unwrap();
            let config = ModelConfig::from_json(&model.config_json()).unwrap();
            let sources: Vec<SourceTensor> = model
                .tensors()
                .iter()
                .map(|t| SourceTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
                .collect();
            let ep = if arch.is_moe() { 4 } else { 1 };
            for mesh in [Mesh::new(1, 1, 1, 1), Mesh::new(2, 1, 4, ep)] {
                let result = build_plan(&config, sources.clone(), mesh, &PlanOptions::default());
                assert!(result.is_ok(), "{arch} {}: {:?}", width.hidden, result.err());
            }
        }
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let runs: Vec<(TempDir, u64)> = [7u64, 7, 8]
        .into_iter()
        .map(|seed| {
            let dir = TempDir::new().unwrap();
            synth("qwen3_next", 1_500_000, dir.path(), seed, &small_shards()).unwrap();
            (dir, seed)
        })
        .collect();
    let files: Vec<_> = runs.iter().map(|(d, _)| dir_files(d.path())).collect();
    assert!(files[0].len() > 3);
    assert_eq!(files[0], files[1], "same seed");
    // Other seed: same files and headers, every tensor's data different.
    assert_eq!(files[0].keys().collect::<Vec<_>>(), files[2].keys().collect::<Vec<_>>());
    let a = tensor_bytes(&Release::open(runs[0].0.path()).unwrap());
    let c = tensor_bytes(&Release::open(runs[2].0.path()).unwrap());
    assert_eq!(a.keys().collect::<Vec<_>>(), c.keys().collect::<Vec<_>>());
    for (name, bytes) in &a {
        assert_ne!(bytes, &c[name], "{name}");
    }
}

#[test]
fn data_does_not_depend_on_sharding_pieces_or_threads() {
    let reference = TempDir::new().unwrap();
    synth("qwen3_5_moe_text", 2_000_000, reference.path(), 3, &SynthOptions::default()).unwrap();
    let expected = tensor_bytes(&Release::open(reference.path()).unwrap());
    for options in [
        SynthOptions { max_shard_bytes: 100_000, threads: 1, piece_bytes: 8, ..SynthOptions::default() },
        SynthOptions { max_shard_bytes: 300_000, threads: 3, piece_bytes: 1000, ..SynthOptions::default() },
        SynthOptions { threads: 2, piece_bytes: 13, ..SynthOptions::default() },
    ] {
        let dir = TempDir::new().unwrap();
        synth("qwen3_5_moe_text", 2_000_000, dir.path(), 3, &options).unwrap();
        assert_eq!(tensor_bytes(&Release::open(dir.path()).unwrap()), expected, "{options:?}");
    }
}

#[test]
fn values_are_finite_and_distributed_as_documented() {
    for (arch, norm_mean) in [("llama", 1.0), ("qwen3_next", 0.0), ("qwen3_5_text", 0.0)] {
        let dir = TempDir::new().unwrap();
        synth(arch, 3_000_000, dir.path(), 11, &SynthOptions::default()).unwrap();
        let tensors = tensor_bytes(&Release::open(dir.path()).unwrap());
        let mut all_norms = Vec::new();
        for (name, bytes) in &tensors {
            let values = bf16_values(bytes);
            assert!(values.iter().all(|v| v.is_finite()), "{arch} {name}");
            let around_one =
                name.ends_with("linear_attn.norm.weight") || name.ends_with("A_log") || name.ends_with("dt_bias");
            if around_one {
                assert!(values.iter().all(|v| (v - 1.0).abs() < 0.1), "{arch} {name}");
            } else if name.ends_with("norm.weight") {
                all_norms.extend(values);
            } else {
                assert!(values.iter().all(|v| v.abs() < 0.1), "{arch} {name}");
            }
        }
        let (mean, std) = mean_std(&all_norms);
        assert!((mean - norm_mean).abs() < 0.005, "{arch}: norms mean {mean}");
        assert!((std - WEIGHT_STD).abs() < 0.003, "{arch}: norms std {std}");
        let embed = bf16_values(&tensors["model.embed_tokens.weight"]);
        let (mean, std) = mean_std(&embed);
        assert!(mean.abs() < 0.001, "{arch}: embedding mean {mean}");
        assert!((std - WEIGHT_STD).abs() < 0.0005, "{arch}: embedding std {std}");
    }
}

#[test]
fn progress_counts_every_tensor_byte() {
    let dir = TempDir::new().unwrap();
    let seen = AtomicU64::new(0);
    let report = synth_with_progress("mixtral", 1_000_000, dir.path(), 0, &small_shards(), &|n| {
        seen.fetch_add(n, Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(seen.load(Ordering::Relaxed), report.total_bytes);
    let on_disk: u64 = report.files.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert_eq!(on_disk, report.file_bytes);
    assert!(report.bytes_per_second() > 0.0);
}

#[test]
fn an_existing_release_is_kept_unless_overwrite() {
    let dir = TempDir::new().unwrap();
    fs::write(dir.path().join("README.md"), "notes").unwrap();
    synth("qwen2", 1_000_000, dir.path(), 0, &small_shards()).unwrap();
    let before = dir_files(dir.path());

    let err = synth("qwen2", 1_000_000, dir.path(), 1, &small_shards()).unwrap_err();
    assert!(matches!(&err, SynthError::OutputNotEmpty { file, .. } if file == CONFIG_FILE_NAME), "{err:?}");
    assert!(err.to_string().contains("overwrite"), "{err}");
    assert_eq!(dir_files(dir.path()), before);

    // What an interrupted run leaves (no config.json) is replaced without asking.
    fs::remove_file(dir.path().join(CONFIG_FILE_NAME)).unwrap();
    fs::write(dir.path().join(".model-00009-of-00009.safetensors.77-0.partial"), "x").unwrap();
    fs::write(dir.path().join(".config.json.77.partial"), "x").unwrap();
    fs::write(dir.path().join(".keep.77.partial"), "x").unwrap();
    synth("qwen2", 1_000_000, dir.path(), 0, &small_shards()).unwrap();
    let mut expected = before.clone();
    expected.insert(".keep.77.partial".into(), b"x".to_vec());
    assert_eq!(dir_files(dir.path()), expected);

    // Overwrite with a single-file release: no stale shard or index stays behind.
    let options = SynthOptions { overwrite: true, ..SynthOptions::default() };
    synth("llama", 1_000_000, dir.path(), 1, &options).unwrap();
    let names: BTreeSet<String> = dir_files(dir.path()).into_keys().collect();
    let expected: BTreeSet<String> =
        [CONFIG_FILE_NAME, SINGLE_FILE_NAME, "README.md", ".keep.77.partial"].into_iter().map(String::from).collect();
    assert_eq!(names, expected);
    let release = Release::open(dir.path()).unwrap();
    assert_eq!(ModelConfig::from_json(release.config_json()).unwrap().model_type, "llama");
}

#[test]
fn a_failed_run_leaves_no_release() {
    let dir = TempDir::new().unwrap();
    // Block the temporary name of config.json: every shard gets written, then the run fails.
    let blocker = dir.path().join(format!(".{CONFIG_FILE_NAME}.{}.partial", std::process::id()));
    fs::create_dir(&blocker).unwrap();
    let err = synth("qwen3", 1_000_000, dir.path(), 0, &small_shards()).unwrap_err();
    assert!(matches!(err, SynthError::Io { .. }), "{err:?}");
    let names: Vec<String> = dir_files_or_dirs(dir.path());
    assert_eq!(names, vec![blocker.file_name().unwrap().to_string_lossy().into_owned()]);
    assert!(Release::open(dir.path()).is_err());
}

fn dir_files_or_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn bad_options_and_output_paths_are_errors() {
    let dir = TempDir::new().unwrap();
    for options in [
        SynthOptions { max_shard_bytes: 0, ..SynthOptions::default() },
        SynthOptions { piece_bytes: 0, ..SynthOptions::default() },
    ] {
        let err = synth("llama", 1_000_000, dir.path(), 0, &options).unwrap_err();
        assert!(matches!(err, SynthError::InvalidOption(_)), "{err:?}");
    }
    let file = dir.path().join("a-file");
    fs::write(&file, "x").unwrap();
    let err = synth("llama", 1_000_000, &file, 0, &SynthOptions::default()).unwrap_err();
    assert!(matches!(err, SynthError::Io { .. }), "{err:?}");
}

// ---- data generation ----

#[test]
fn streams_continue_across_pieces() {
    let tables = Tables::new();
    let mut whole = vec![0u8; 1003];
    for dtype in [DType::BF16, DType::F32, DType::F8E4M3] {
        let sampler = tables.sampler(dtype, Init::Normal);
        TensorStream::new(5, "t").fill(sampler, &mut whole);
        let mut pieces = vec![0u8; 1003];
        let mut stream = TensorStream::new(5, "t");
        for chunk in pieces.chunks_mut(64) {
            stream.fill(sampler, chunk);
        }
        assert_eq!(whole, pieces, "{dtype}");
        let mut other = vec![0u8; 1003];
        TensorStream::new(5, "u").fill(sampler, &mut other);
        assert_ne!(whole, other, "{dtype}");
    }
}

#[test]
fn normal_quantiles_and_bf16_rounding() {
    assert!(inverse_normal_cdf(0.5).abs() < 1e-12);
    assert!((inverse_normal_cdf(0.975) - 1.959_963_985).abs() < 1e-6);
    assert!((inverse_normal_cdf(0.025) + 1.959_963_985).abs() < 1e-6);
    assert!((inverse_normal_cdf(1e-5) + 4.264_890_794).abs() < 1e-6);
    assert_eq!(f32_to_bf16(1.0), 0x3F80);
    assert_eq!(f32_to_bf16(-2.0), 0xC000);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
    assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
    assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
    let tables = Tables::new();
    for table in [&tables.normal, &tables.around_one, &tables.scale] {
        assert!(table.0.iter().all(|&b| b & 0x7F80 != 0x7F80), "finite");
        assert!(table.0.windows(2).all(|w| {
            let v = |b: u16| f32::from_bits(u32::from(b) << 16);
            v(w[0]) <= v(w[1])
        }));
    }
}
