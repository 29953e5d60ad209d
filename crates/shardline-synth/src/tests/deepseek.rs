//! DeepSeek-V3 releases in bf16 and block FP8: dimensions, sizes, conversion, data.

use super::*;

fn sources_of(model: &SynthModel) -> Vec<SourceTensor> {
    model
        .tensors()
        .iter()
        .map(|t| SourceTensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
        .collect()
}

/// The mesh of the benchmark: TP 2, DP 2, EP 2, ETP 1.
fn bench_mesh() -> Mesh {
    Mesh { etp: 1, ..Mesh::new(2, 1, 2, 2) }
}

const FP8_PROJECTIONS: [&str; 8] =
    ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

#[test]
fn deepseek_v3_dimensions_split_by_eight_from_1024_up() {
    for width in WIDTHS.iter().filter(|w| w.hidden >= 1024) {
        let d = width.dims(Arch::DeepseekV3, 4);
        let m = d.mla.clone().unwrap();
        let tp_split = [
            d.num_attention_heads,
            d.num_attention_heads * m.v_head_dim,
            d.intermediate_size,
            d.moe_intermediate_size,
            d.shared_expert_intermediate_size,
        ];
        assert!(tp_split.iter().all(|n| n % 8 == 0), "{}: {d:?}", width.hidden);
        assert_eq!((m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim), (128, 64, 128));
        assert!(m.q_lora_rank % 128 == 0 && d.moe_intermediate_size % 128 == 0, "{d:?}");
        assert_eq!(m.kv_lora_rank, 512);
        for format in [WeightFormat::Bf16, WeightFormat::FP8] {
            let model = SynthModel::with_format(Arch::DeepseekV3, d.clone(), format).unwrap();
            let config = ModelConfig::from_json(&model.config_json()).unwrap();
            let mesh = Mesh::new(8, 1, 8, 8);
            let result = build_plan(&config, sources_of(&model), mesh, &PlanOptions::default());
            assert!(result.is_ok(), "{} {format:?}: {:?}", width.hidden, result.err());
        }
    }
    // DeepSeek-V3's own width gives its own ranks and expert width.
    let real = Width { hidden: 7168, ..WIDTHS[WIDTHS.len() - 1] };
    let d = real.dims(Arch::DeepseekV3, 61);
    let m = d.mla.unwrap();
    assert_eq!(
        (m.q_lora_rank, m.kv_lora_rank, d.moe_intermediate_size, d.intermediate_size),
        (1536, 512, 2048, 18_432)
    );
    assert_eq!(d.first_dense_layers, 3);
}

#[test]
fn fp8_is_the_bf16_model_in_about_half_the_bytes() {
    for target in ["4GB", "64GB"] {
        let bytes = parse_size_lenient(target).unwrap();
        let bf16 = SynthModel::for_target(Arch::DeepseekV3, bytes).unwrap();
        let fp8 = SynthModel::for_target_as(Arch::DeepseekV3, WeightFormat::FP8, bytes).unwrap();
        assert_eq!(fp8.dims(), bf16.dims());
        assert_eq!(fp8.format(), WeightFormat::FP8);
        assert!(relative_error(bf16.total_bytes(), bytes) <= CLOSE_FIT, "{target}");
        let sum: u64 = fp8.tensors().iter().map(TensorSpec::byte_len).sum();
        assert_eq!(sum, fp8.total_bytes());
        let ratio = fp8.total_bytes() as f64 / bf16.total_bytes() as f64;
        assert!((0.5..0.6).contains(&ratio), "{target}: {ratio}");
        // Bytes per dtype: 1 per FP8 code, 4 per scale and per bias, 2 for everything else.
        let by_dtype = |dtype: DType| -> u64 {
            fp8.tensors().iter().filter(|t| t.dtype == dtype).map(|t| t.numel() * dtype.size() as u64).sum()
        };
        assert_eq!(by_dtype(DType::F8E4M3) + by_dtype(DType::F32) + by_dtype(DType::BF16), fp8.total_bytes());
    }
}

#[test]
fn deepseek_v3_releases_in_both_formats_convert_to_the_same_checkpoint() {
    let target = 3_000_000;
    let written: Vec<(TempDir, SynthReport)> = [WeightFormat::Bf16, WeightFormat::FP8]
        .into_iter()
        .map(|format| {
            let dir = TempDir::new().unwrap();
            let report = synth_as("deepseek_v3", format, target, dir.path(), 4, &small_shards(), &|_| {}).unwrap();
            (dir, report)
        })
        .collect();
    let [(bf16_dir, bf16), (fp8_dir, fp8)] = &written[..] else { unreachable!() };
    assert_eq!(bf16.dims, fp8.dims);
    assert!(relative_error(bf16.total_bytes, target) <= SIZE_TOLERANCE);
    assert!(fp8.total_bytes < bf16.total_bytes * 3 / 4, "{} of {}", fp8.total_bytes, bf16.total_bytes);
    assert!(bf16.files.len() > 1 && fp8.files.len() > 1);
    let bf16_release = Release::open(bf16_dir.path()).unwrap();
    let fp8_release = Release::open(fp8_dir.path()).unwrap();
    assert_eq!(fp8_release.total_bytes(), fp8.total_bytes);

    // The FP8 release: the bf16 one's tensors, projections in FP8 each with its block scales.
    let bf16_tensors: BTreeMap<String, (DType, Vec<u64>)> =
        bf16_release.tensors().map(|t| (t.info.name.clone(), (t.info.dtype, t.info.shape.clone()))).collect();
    let fp8_tensors: BTreeMap<String, (DType, Vec<u64>)> =
        fp8_release.tensors().map(|t| (t.info.name.clone(), (t.info.dtype, t.info.shape.clone()))).collect();
    let mut quantized = 0;
    for (name, (dtype, shape)) in &bf16_tensors {
        let is_projection = name.starts_with("model.layers.")
            && FP8_PROJECTIONS.iter().any(|p| name.ends_with(&format!(".{p}.weight")));
        let (fp8_dtype, fp8_shape) = &fp8_tensors[name];
        assert_eq!(fp8_shape, shape, "{name}");
        let scales = fp8_tensors.get(&format!("{name}_scale_inv"));
        if is_projection {
            quantized += 1;
            assert_eq!(*fp8_dtype, DType::F8E4M3, "{name}");
            assert_eq!(*dtype, DType::BF16, "{name}");
            let want = vec![shape[0].div_ceil(128), shape[1].div_ceil(128)];
            assert_eq!(scales, Some(&(DType::F32, want)), "{name}");
        } else {
            assert_eq!(fp8_dtype, dtype, "{name}");
            assert!(scales.is_none(), "{name}");
        }
        let want = if name.ends_with(".mlp.gate.e_score_correction_bias") { DType::F32 } else { DType::BF16 };
        assert_eq!(*dtype, want, "{name}");
    }
    assert!(quantized > 0);
    assert_eq!(fp8_tensors.len(), bf16_tensors.len() + quantized);

    // The configs differ only in the quantization.
    let bf16_config = ModelConfig::from_json(bf16_release.config_json()).unwrap();
    let fp8_config = ModelConfig::from_json(fp8_release.config_json()).unwrap();
    assert_eq!(bf16_config.quantization, None);
    assert_eq!(fp8_config.quantization, Some(Quantization::Fp8Block { block: [128, 128] }));
    assert_eq!(ModelConfig { quantization: None, ..fp8_config.clone() }, bf16_config);
    assert_eq!(fp8_config.model_type, "deepseek_v3");
    let first_dense = bf16.dims.first_dense_layers;
    assert!(first_dense >= 1 && bf16.dims.num_layers > first_dense, "{:?}", bf16.dims);

    // Same checkpoint: the same keys, shapes and dtypes; the FP8 one through dequantization.
    for mesh in [Mesh::new(1, 1, 1, 1), bench_mesh()] {
        let a = plan_on(&bf16_release, mesh);
        let b = plan_on(&fp8_release, mesh);
        let outline = |p: &Plan| -> Vec<(String, DType, Vec<u64>)> {
            p.tensors.iter().map(|t| (t.key.clone(), t.dtype, t.shape.clone())).collect()
        };
        assert_eq!(outline(&a), outline(&b), "{mesh}");
        let dequantized = |p: &Plan| {
            p.tensors
                .iter()
                .flat_map(|t| &t.recipe)
                .filter(|r| matches!(r.transform, Transform::DequantFp8 { rows: 128, cols: 128, .. }))
                .count()
        };
        assert_eq!(dequantized(&a), 0);
        assert!(dequantized(&b) > 0);
        assert!(b.tensors.iter().all(|t| t.dtype == DType::BF16 || t.key.ends_with("router.expert_bias")));
    }
}

#[test]
fn fp8_codes_scales_and_biases_are_as_documented() {
    let dir = TempDir::new().unwrap();
    synth_as("deepseek_v3", WeightFormat::FP8, 3_000_000, dir.path(), 9, &SynthOptions::default(), &|_| {}).unwrap();
    let release = Release::open(dir.path()).unwrap();
    let dtypes: BTreeMap<String, DType> = release.tensors().map(|t| (t.info.name.clone(), t.info.dtype)).collect();
    let tensors = tensor_bytes(&release);
    let f32s = |bytes: &[u8]| -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let (mut weights, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    for (name, bytes) in &tensors {
        match dtypes[name] {
            DType::F8E4M3 => {
                assert!(bytes.iter().all(|&b| b & 0x7F != 0x7F), "{name}: NaN code");
                let values: Vec<f32> = bytes.iter().map(|&b| f8e4m3_to_f32(b)).collect();
                assert!(values.iter().all(|v| v.abs() <= 448.0));
                weights.extend(values);
            }
            DType::F32 if name.ends_with("_scale_inv") => scales.extend(f32s(bytes)),
            DType::F32 => biases.extend(f32s(bytes)),
            _ => assert!(bf16_values(bytes).iter().all(|v| v.is_finite()), "{name}"),
        }
    }
    assert!(scales.iter().all(|&s| s.is_finite() && s > 0.0 && (5e-5..4e-4).contains(&s)), "scales");
    let (mean, std) = mean_std(&scales);
    assert!((mean - SCALE_MEAN).abs() < 0.05 * SCALE_MEAN, "scales mean {mean}");
    assert!((std - SCALE_STD).abs() < 0.2 * SCALE_STD, "scales std {std}");
    let (mean, std) = mean_std(&weights);
    assert!(mean.abs() < 1.0, "codes mean {mean}");
    assert!((std - FP8_CODE_STD).abs() < 0.03 * FP8_CODE_STD, "codes std {std}");
    assert!(weights.iter().any(|v| v.abs() >= 256.0), "codes reach the top of the range");
    assert!(!biases.is_empty() && biases.iter().all(|b| b.is_finite() && b.abs() < 0.1), "biases");
    let (mean, std) = mean_std(&biases);
    assert!(mean.abs() < 0.01 && std > 0.005 && std < 0.04, "biases {mean} {std}");
}

#[test]
fn e4m3_rounding() {
    let table = Tables::new();
    let magnitudes: Vec<f32> = (0u8..0x7F).map(f8e4m3_to_f32).collect();
    let magnitudes: [f32; 0x7F] = magnitudes.try_into().unwrap();
    for code in 0u8..=0xFE {
        if code & 0x7F == 0x7F {
            continue;
        }
        let v = f8e4m3_to_f32(code);
        let back = f32_to_e4m3(v, &magnitudes);
        assert!(back == code || (v == 0.0 && back & 0x7F == 0), "{code:#x} → {v} → {back:#x}");
    }
    // Halfway between 1 (0x38) and 1.125 (0x39): to the even code; saturating at 448.
    assert_eq!(f32_to_e4m3(1.0625, &magnitudes), 0x38);
    assert_eq!(f32_to_e4m3(1.1875, &magnitudes), 0x3A);
    assert_eq!(f32_to_e4m3(1000.0, &magnitudes), 0x7E);
    assert_eq!(f32_to_e4m3(-1000.0, &magnitudes), 0xFE);
    assert!(table.fp8.0.iter().all(|&c| c & 0x7F != 0x7F));
    assert!(table.fp8.0.windows(2).all(|w| f8e4m3_to_f32(w[0]) <= f8e4m3_to_f32(w[1])));
}

#[test]
fn mtp_layers_are_written_and_convert() {
    let mut dims = WIDTHS[0].dims(Arch::DeepseekV3, 3);
    dims.mtp_layers = 1;
    for format in [WeightFormat::Bf16, WeightFormat::FP8] {
        let model = SynthModel::with_format(Arch::DeepseekV3, dims.clone(), format).unwrap();
        let names: BTreeSet<&str> = model.tensors().iter().map(|t| t.name.as_str()).collect();
        for name in ["model.layers.3.eh_proj.weight", "model.layers.3.mlp.experts.0.down_proj.weight"] {
            assert!(names.contains(name), "{name}");
        }
        assert!(!names.iter().any(|n| n.starts_with("model.layers.4.")));
        let dir = TempDir::new().unwrap();
        write_release(&model, dir.path(), 0, &small_shards(), &|_| {}).unwrap();
        let release = Release::open(dir.path()).unwrap();
        assert_eq!(ModelConfig::from_json(release.config_json()).unwrap().mtp_layers, 1);
        let plan = plan_on(&release, bench_mesh());
        assert_eq!(plan.unconverted, ["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]);
        assert!(plan.tensors.iter().any(|t| t.key.contains("mtp.layers.0.transformer_layer.self_attention")));
    }
}

#[test]
fn fp8_only_for_deepseek_v3() {
    for arch in Arch::ALL.into_iter().filter(|a| !a.supports_fp8()) {
        let dir = TempDir::new().unwrap();
        let err = synth_as(arch.name(), WeightFormat::FP8, 2_000_000, dir.path(), 0, &SynthOptions::default(), &|_| {})
            .unwrap_err();
        assert!(matches!(err, SynthError::Fp8NotSupported { .. }), "{arch}: {err:?}");
        assert!(err.to_string().contains(arch.name()) && err.to_string().contains("deepseek_v3"), "{err}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }
    assert_eq!(Arch::ALL.iter().filter(|a| a.supports_fp8()).collect::<Vec<_>>(), [&Arch::DeepseekV3]);
    let err = SynthModel::with_format(
        Arch::DeepseekV3,
        WIDTHS[0].dims(Arch::DeepseekV3, 2),
        WeightFormat::Fp8Block { block: [0, 128] },
    )
    .unwrap_err();
    assert!(matches!(err, SynthError::InvalidOption(_)), "{err:?}");
}
