//! The 2025 families (archs-2025.md §3.1, §3.3, §5): DeepSeek-V3 / Kimi-K2 MLA, GLM-4.5, the MTP
//! layers both store after the decoder, the float32 expert bias, and unmapped tensors reported
//! by pattern. Expected TP placements are the table's, written out here by hand.

use shardline_layout::arch::TpMode;
use shardline_layout::recipe::Transform;
use shardline_layout::{build_plan, DType, LayoutError, Mesh, ModelConfig, Plan, PlanOptions, RowBlock, SourceTensor};

const H: u64 = 16;
const NH: u64 = 4;
/// MLA dims: nope, rope and value head dims, query and key-value latent ranks.
const DN: u64 = 4;
const DR: u64 = 2;
const DV: u64 = 4;
const QL: u64 = 8;
const KVL: u64 = 8;

fn src(name: &str, dtype: DType, shape: &[u64]) -> SourceTensor {
    SourceTensor { name: name.to_string(), dtype, shape: shape.to_vec() }
}

fn deepseek_config(model_type: &str, extra: &str) -> String {
    format!(
        r#"{{"model_type":"{model_type}","hidden_size":{H},"num_attention_heads":{NH},"num_key_value_heads":{NH},
        "num_hidden_layers":2,"vocab_size":32,"intermediate_size":8,"moe_intermediate_size":4,
        "n_routed_experts":4,"n_shared_experts":1,"first_k_dense_replace":1,"q_lora_rank":{QL},
        "kv_lora_rank":{KVL},"qk_nope_head_dim":{DN},"qk_rope_head_dim":{DR},"v_head_dim":{DV},
        "num_nextn_predict_layers":1{extra}}}"#
    )
}

/// A DeepSeek-V3 release: layer 0 dense, layer 1 MoE, layer 2 = MTP layer 0 (MoE).
fn deepseek_sources(bias: DType) -> Vec<SourceTensor> {
    let b = DType::BF16;
    let mut s = vec![
        src("model.embed_tokens.weight", b, &[32, H]),
        src("lm_head.weight", b, &[32, H]),
        src("model.norm.weight", b, &[H]),
    ];
    for l in 0..3 {
        let p = format!("model.layers.{l}.");
        for (n, shape) in [
            ("input_layernorm.weight", vec![H]),
            ("post_attention_layernorm.weight", vec![H]),
            ("self_attn.q_a_proj.weight", vec![QL, H]),
            ("self_attn.q_a_layernorm.weight", vec![QL]),
            ("self_attn.q_b_proj.weight", vec![NH * (DN + DR), QL]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![KVL + DR, H]),
            ("self_attn.kv_a_layernorm.weight", vec![KVL]),
            ("self_attn.kv_b_proj.weight", vec![NH * (DN + DV), KVL]),
            ("self_attn.o_proj.weight", vec![H, NH * DV]),
        ] {
            s.push(src(&format!("{p}{n}"), b, &shape));
        }
        if l == 0 {
            s.push(src(&format!("{p}mlp.gate_proj.weight"), b, &[8, H]));
            s.push(src(&format!("{p}mlp.up_proj.weight"), b, &[8, H]));
            s.push(src(&format!("{p}mlp.down_proj.weight"), b, &[H, 8]));
            continue;
        }
        s.push(src(&format!("{p}mlp.gate.weight"), b, &[4, H]));
        s.push(src(&format!("{p}mlp.gate.e_score_correction_bias"), bias, &[4]));
        for e in 0..4 {
            s.push(src(&format!("{p}mlp.experts.{e}.gate_proj.weight"), b, &[4, H]));
            s.push(src(&format!("{p}mlp.experts.{e}.up_proj.weight"), b, &[4, H]));
            s.push(src(&format!("{p}mlp.experts.{e}.down_proj.weight"), b, &[H, 4]));
        }
        s.push(src(&format!("{p}mlp.shared_experts.gate_proj.weight"), b, &[4, H]));
        s.push(src(&format!("{p}mlp.shared_experts.up_proj.weight"), b, &[4, H]));
        s.push(src(&format!("{p}mlp.shared_experts.down_proj.weight"), b, &[H, 4]));
    }
    let m = "model.layers.2.";
    for n in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"] {
        s.push(src(&format!("{m}{n}"), b, &[H]));
    }
    s.push(src(&format!("{m}eh_proj.weight"), b, &[H, 2 * H]));
    s.push(src(&format!("{m}embed_tokens.weight"), b, &[32, H]));
    s.push(src(&format!("{m}shared_head.head.weight"), b, &[32, H]));
    s
}

fn plan(config: &str, sources: Vec<SourceTensor>, mesh: Mesh) -> Result<Plan, Vec<LayoutError>> {
    build_plan(&ModelConfig::from_json(config).expect("config"), sources, mesh, &PlanOptions::default())
}

fn tensor<'a>(plan: &'a Plan, key: &str) -> &'a shardline_layout::OutputTensor {
    plan.tensors.iter().find(|t| t.key == format!("model.module.{key}")).unwrap_or_else(|| panic!("no key {key}"))
}

#[test]
fn mla_projections_are_placed_as_megatron_declares_them() {
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 1 };
    for model_type in ["deepseek_v3", "kimi_k2"] {
        let p = plan(&deepseek_config(model_type, ""), deepseek_sources(DType::F32), mesh).expect("plan");
        let a = "decoder.layers.1.self_attention.";
        for (key, mode) in [
            ("linear_q_down_proj.weight", TpMode::Replicated),
            ("linear_q_up_proj.layer_norm_weight", TpMode::Replicated),
            ("linear_q_up_proj.weight", TpMode::Column),
            ("linear_kv_down_proj.weight", TpMode::Replicated),
            ("linear_kv_up_proj.layer_norm_weight", TpMode::Replicated),
            ("linear_kv_up_proj.weight", TpMode::Column),
            ("linear_proj.weight", TpMode::Row),
        ] {
            assert_eq!(tensor(&p, &format!("{a}{key}")).tp_mode, mode, "{model_type} {key}");
        }
        // MLA keeps a real input norm; dense layer 0 has the fused MLP norm, MoE layer 1 the
        // pre-MLP norm.
        assert_eq!(tensor(&p, "decoder.layers.0.input_layernorm.weight").tp_mode, TpMode::Replicated);
        tensor(&p, "decoder.layers.0.mlp.linear_fc1.layer_norm_weight");
        tensor(&p, "decoder.layers.1.pre_mlp_layernorm.weight");
        // The q_b rows (per head `[nope; rope]`) split by heads: TP rank r holds heads [2r, 2r+2).
        let q_up = tensor(&p, &format!("{a}linear_q_up_proj.weight"));
        assert_eq!(q_up.local_shape(), vec![NH / 2 * (DN + DR), QL]);
        assert_eq!(tensor(&p, "decoder.layers.1.mlp.router.expert_bias").dtype, DType::F32);
    }
}

#[test]
fn mtp_layers_after_the_decoder_become_mtp_layers_and_share_the_embedding() {
    let mesh = Mesh { tp: 1, cp: 1, dp: 2, ep: 1, etp: 1 };
    let p = plan(&deepseek_config("deepseek_v3", ""), deepseek_sources(DType::F32), mesh).expect("plan");
    let keys: Vec<&str> = p.tensors.iter().map(|t| t.key.as_str()).collect();
    assert!(!keys.iter().any(|k| k.contains("decoder.layers.2.")), "an MTP layer became decoder layer 2");
    for key in [
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.final_layernorm.weight",
        "mtp.layers.0.transformer_layer.input_layernorm.weight",
        "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight",
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
        "mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight3_w",
        "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc2.weight",
    ] {
        tensor(&p, key);
    }
    assert_eq!(tensor(&p, "mtp.layers.0.eh_proj.weight").tp_mode, TpMode::Column);
    assert_eq!(
        p.unconverted,
        vec!["model.layers.2.embed_tokens.weight".to_string(), "model.layers.2.shared_head.head.weight".to_string()]
    );
    // Without `num_nextn_predict_layers` the layer is not expected: its tensors are unmapped.
    let no_mtp = deepseek_config("deepseek_v3", "")
        .replace(r#""num_nextn_predict_layers":1"#, r#""num_nextn_predict_layers":0"#);
    let err = plan(&no_mtp, deepseek_sources(DType::F32), mesh).expect_err("unmapped MTP layer");
    let text = err.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(text.contains("model.layers.*.mlp.experts.*.gate_proj.weight × 4"), "{text}");
}

#[test]
fn a_bf16_expert_bias_is_cast_to_float32_and_f32_norms_to_bf16() {
    let mesh = Mesh { tp: 1, cp: 1, dp: 1, ep: 1, etp: 1 };
    let mut sources = deepseek_sources(DType::BF16);
    sources.iter_mut().filter(|s| s.name == "model.norm.weight").for_each(|s| s.dtype = DType::F32);
    let p = plan(&deepseek_config("deepseek_v3", ""), sources, mesh).expect("plan");
    let bias = tensor(&p, "decoder.layers.1.mlp.router.expert_bias");
    assert_eq!(bias.dtype, DType::F32);
    assert!(bias.recipe.iter().all(|b| b.transform == Transform::Cast(DType::BF16)));
    let norm = tensor(&p, "decoder.final_layernorm.weight");
    assert_eq!(norm.dtype, DType::BF16);
    assert!(norm.recipe.iter().all(|b| b.transform == Transform::Cast(DType::F32)));
    // Tensors already in the target dtype are copied as they are.
    assert!(tensor(&p, "embedding.word_embeddings.weight").recipe.iter().all(|b| b.transform == Transform::Identity));
}

#[test]
fn glm45_uses_biased_gqa_with_qk_norms_and_shares_the_mtp_scheme() {
    let config = r#"{"model_type":"glm4_moe","hidden_size":16,"num_attention_heads":4,"num_key_value_heads":2,
        "head_dim":4,"num_hidden_layers":1,"vocab_size":32,"intermediate_size":8,"moe_intermediate_size":4,
        "n_routed_experts":2,"n_shared_experts":1,"first_k_dense_replace":0,"num_nextn_predict_layers":1}"#;
    let b = DType::BF16;
    let mut s = vec![
        src("model.embed_tokens.weight", b, &[32, 16]),
        src("lm_head.weight", b, &[32, 16]),
        src("model.norm.weight", b, &[16]),
    ];
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        for (n, shape) in [
            ("input_layernorm.weight", vec![16]),
            ("post_attention_layernorm.weight", vec![16]),
            ("self_attn.q_proj.weight", vec![16, 16]),
            ("self_attn.k_proj.weight", vec![8, 16]),
            ("self_attn.v_proj.weight", vec![8, 16]),
            ("self_attn.q_proj.bias", vec![16]),
            ("self_attn.k_proj.bias", vec![8]),
            ("self_attn.v_proj.bias", vec![8]),
            ("self_attn.q_norm.weight", vec![4]),
            ("self_attn.k_norm.weight", vec![4]),
            ("self_attn.o_proj.weight", vec![16, 16]),
            ("mlp.gate.weight", vec![2, 16]),
            ("mlp.shared_experts.gate_proj.weight", vec![4, 16]),
            ("mlp.shared_experts.up_proj.weight", vec![4, 16]),
            ("mlp.shared_experts.down_proj.weight", vec![16, 4]),
        ] {
            s.push(src(&format!("{p}{n}"), b, &shape));
        }
        s.push(src(&format!("{p}mlp.gate.e_score_correction_bias"), DType::F32, &[2]));
        for e in 0..2 {
            s.push(src(&format!("{p}mlp.experts.{e}.gate_proj.weight"), b, &[4, 16]));
            s.push(src(&format!("{p}mlp.experts.{e}.up_proj.weight"), b, &[4, 16]));
            s.push(src(&format!("{p}mlp.experts.{e}.down_proj.weight"), b, &[16, 4]));
        }
    }
    for n in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"] {
        s.push(src(&format!("model.layers.1.{n}"), b, &[16]));
    }
    s.push(src("model.layers.1.eh_proj.weight", b, &[16, 32]));
    let mesh = Mesh { tp: 2, cp: 1, dp: 1, ep: 1, etp: 2 };
    let p = plan(config, s, mesh).expect("plan");
    for prefix in ["decoder.layers.0.", "mtp.layers.0.transformer_layer."] {
        let qkv = tensor(&p, &format!("{prefix}self_attention.linear_qkv.weight"));
        assert_eq!((qkv.shape.clone(), qkv.tp_mode), (vec![32, 16], TpMode::Column));
        assert_eq!(tensor(&p, &format!("{prefix}self_attention.linear_qkv.bias")).shape, vec![32]);
        assert_eq!(tensor(&p, &format!("{prefix}self_attention.q_layernorm.weight")).tp_mode, TpMode::Replicated);
        assert_eq!(tensor(&p, &format!("{prefix}mlp.router.expert_bias")).dtype, DType::F32);
    }
    assert!(p.unconverted.is_empty());
}

#[test]
fn quantization_config_is_read() {
    use shardline_layout::config::Quantization;
    let with =
        |q: &str| ModelConfig::from_json(&deepseek_config("deepseek_v3", &format!(r#","quantization_config":{q}"#)));
    let fp8 = with(r#"{"quant_method":"fp8","fmt":"e4m3","weight_block_size":[128,128]}"#).expect("fp8");
    assert_eq!(fp8.quantization, Some(Quantization::Fp8Block { block: [128, 128] }));
    let awq = with(r#"{"quant_method":"awq","bits":4}"#).expect("awq");
    assert_eq!(awq.quantization, Some(Quantization::Other("awq".into())));
    let err = with(r#"{"quant_method":"fp8","weight_block_size":[128]}"#).expect_err("bad block");
    assert!(err.to_string().contains("weight_block_size"), "{err}");
}

#[test]
fn block_fp8_weights_are_dequantized_to_bf16_and_their_scales_consumed() {
    let q = r#","quantization_config":{"quant_method":"fp8","weight_block_size":[4,4]}"#;
    let mut sources = deepseek_sources(DType::F32);
    let mut scales = Vec::new();
    for s in sources.iter_mut().filter(|s| s.name.ends_with("_proj.weight") && s.name.contains(".layers.")) {
        s.dtype = DType::F8E4M3;
        let shape = [s.shape[0].div_ceil(4), s.shape[1].div_ceil(4)];
        scales.push(src(&format!("{}_scale_inv", s.name), DType::F32, &shape));
    }
    sources.extend(scales);
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 2 };
    let p = plan(&deepseek_config("deepseek_v3", q), sources.clone(), mesh).expect("plan");
    let q_up = tensor(&p, "decoder.layers.1.self_attention.linear_q_up_proj.weight");
    assert_eq!(q_up.dtype, DType::BF16);
    let scale_id = p.sources.iter().position(|s| s.name.ends_with("layers.1.self_attn.q_b_proj.weight_scale_inv"));
    let want = Transform::DequantFp8 { scale: scale_id.expect("scale source") as u32, rows: 4, cols: 4 };
    assert!(q_up.recipe.iter().all(|b| b.transform == want), "{:?}", q_up.recipe);
    assert!(!p.tensors.iter().any(|t| t.key.contains("scale_inv")));

    // A scale of the wrong shape names both tensors and the block.
    let mut bad = sources.clone();
    let s = bad.iter_mut().find(|s| s.name.ends_with("layers.0.self_attn.o_proj.weight_scale_inv")).expect("scale");
    s.shape[1] += 1;
    let err = plan(&deepseek_config("deepseek_v3", q), bad, mesh).expect_err("bad scale shape");
    let text = err.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(text.contains("o_proj.weight_scale_inv") && text.contains("in blocks of [4, 4]"), "{text}");
}

fn gpt_oss_config(quant: &str) -> String {
    format!(
        r#"{{"model_type":"gpt_oss","hidden_size":64,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":8,
        "num_hidden_layers":1,"vocab_size":32,"intermediate_size":96,"num_local_experts":2{quant}}}"#
    )
}

/// One gpt-oss layer; its experts as MXFP4 blocks and scales, or in the bf16 layout.
fn gpt_oss_sources(mxfp4: bool) -> Vec<SourceTensor> {
    let b = DType::BF16;
    let mut s = vec![
        src("model.embed_tokens.weight", b, &[32, 64]),
        src("lm_head.weight", b, &[32, 64]),
        src("model.norm.weight", b, &[64]),
    ];
    let p = "model.layers.0.";
    for (n, shape) in [
        ("input_layernorm.weight", vec![64]),
        ("post_attention_layernorm.weight", vec![64]),
        ("self_attn.q_proj.weight", vec![64, 64]),
        ("self_attn.k_proj.weight", vec![16, 64]),
        ("self_attn.v_proj.weight", vec![16, 64]),
        ("self_attn.q_proj.bias", vec![64]),
        ("self_attn.k_proj.bias", vec![16]),
        ("self_attn.v_proj.bias", vec![16]),
        ("self_attn.o_proj.weight", vec![64, 64]),
        ("self_attn.o_proj.bias", vec![64]),
        ("self_attn.sinks", vec![8]),
        ("mlp.router.weight", vec![2, 64]),
        ("mlp.router.bias", vec![2]),
        ("mlp.experts.gate_up_proj_bias", vec![2, 192]),
        ("mlp.experts.down_proj_bias", vec![2, 64]),
    ] {
        s.push(src(&format!("{p}{n}"), b, &shape));
    }
    let x = format!("{p}mlp.experts.");
    if mxfp4 {
        s.push(src(&format!("{x}gate_up_proj_blocks"), DType::U8, &[2, 192, 2, 16]));
        s.push(src(&format!("{x}gate_up_proj_scales"), DType::U8, &[2, 192, 2]));
        s.push(src(&format!("{x}down_proj_blocks"), DType::U8, &[2, 64, 3, 16]));
        s.push(src(&format!("{x}down_proj_scales"), DType::U8, &[2, 64, 3]));
    } else {
        s.push(src(&format!("{x}gate_up_proj"), b, &[2, 64, 192]));
        s.push(src(&format!("{x}down_proj"), b, &[2, 96, 64]));
    }
    s
}

#[test]
fn gpt_oss_keeps_fc1_fused_in_the_expert_tp_layout_and_dequantizes_mxfp4() {
    let quant = r#","quantization_config":{"quant_method":"mxfp4"}"#;
    for etp in [1u64, 2] {
        let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp };
        let p = plan(&gpt_oss_config(quant), gpt_oss_sources(true), mesh).expect("plan");
        let fc1 = tensor(&p, "decoder.layers.0.mlp.experts.linear_fc1.weight1");
        assert_eq!((fc1.shape.clone(), fc1.dtype, fc1.tp_mode), (vec![192, 64], DType::BF16, TpMode::Column));
        // Global rows: per ETP rank r, its gate rows (even source rows) then its up rows (odd).
        let mut rows = Vec::new();
        for b in &fc1.recipe {
            let (_, first) = b.source.expect("rows of the blocks");
            rows.extend((0..b.rows).map(|k| first + k * u64::from(b.stride) - 192));
        }
        let f = 96 / etp;
        let want: Vec<u64> = (0..etp)
            .flat_map(|r| (r * f..(r + 1) * f).map(|j| 2 * j).chain((r * f..(r + 1) * f).map(|j| 2 * j + 1)))
            .collect();
        assert_eq!(rows, want, "etp {etp}");
        assert!(matches!(fc1.recipe[0].transform, Transform::DequantMxfp4 { .. }));
        assert!(!p.tensors.iter().any(|t| t.key.ends_with("weight1_w") || t.key.ends_with("bias1_v")));
        let fc2 = tensor(&p, "decoder.layers.0.mlp.experts.linear_fc2.weight1");
        assert_eq!((fc2.shape.clone(), fc2.tp_mode), (vec![64, 96], TpMode::Row));
        assert_eq!(tensor(&p, "decoder.layers.0.mlp.experts.linear_fc1.bias1").shape, vec![192]);
        assert_eq!(tensor(&p, "decoder.layers.0.mlp.experts.linear_fc2.bias1").tp_mode, TpMode::Replicated);
        assert_eq!(tensor(&p, "decoder.layers.0.self_attention.core_attention.softmax_offset").tp_mode, TpMode::Column);
        assert_eq!(tensor(&p, "decoder.layers.0.self_attention.linear_proj.bias").tp_mode, TpMode::Replicated);
    }
    // An odd expert-TP width cannot split MXFP4 bytes.
    let odd = gpt_oss_config(quant).replace(r#""intermediate_size":96"#, r#""intermediate_size":98"#);
    let err = plan(&odd, gpt_oss_sources(true), Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 }).expect_err("odd width");
    assert!(err.iter().any(|e| e.to_string().contains("98 / 2 is odd")), "{err:?}");
    // The bf16 expert layout [E, in, out]: Megatron's rows are the columns of each expert matrix.
    let p = plan(&gpt_oss_config(""), gpt_oss_sources(false), Mesh { tp: 1, cp: 1, dp: 1, ep: 1, etp: 1 })
        .expect("bf16 experts");
    let fc1 = tensor(&p, "decoder.layers.0.mlp.experts.linear_fc1.weight1");
    assert_eq!(fc1.shape, vec![192, 64]);
    let base = 64 * 192;
    assert_eq!(
        fc1.recipe,
        vec![
            RowBlock::transposed(fc1.recipe[0].source.unwrap().0, base, 96, 192, 2),
            RowBlock::transposed(fc1.recipe[0].source.unwrap().0, base + 1, 96, 192, 2)
        ]
    );
    let fc2 = tensor(&p, "decoder.layers.0.mlp.experts.linear_fc2.weight1");
    assert_eq!((fc2.shape.clone(), fc2.tp_mode), (vec![64, 96], TpMode::Row));
    assert_eq!(fc2.recipe, vec![RowBlock::transposed(fc2.recipe[0].source.unwrap().0, 96 * 64, 64, 64, 1)]);
}

#[test]
fn qwen3_vl_moe_converts_its_vision_tower_and_transposes_its_experts() {
    let config = r#"{"model_type":"qwen3_vl_moe","tie_word_embeddings":false,"text_config":{"model_type":"qwen3_vl_moe_text",
        "hidden_size":16,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":4,"num_hidden_layers":1,
        "vocab_size":32,"num_experts":2,"moe_intermediate_size":6},
        "vision_config":{"depth":2,"hidden_size":8,"num_heads":2,"intermediate_size":12,"deepstack_visual_indexes":[0]}}"#;
    let b = DType::BF16;
    let lm = "model.language_model.";
    let mut s = vec![
        src(&format!("{lm}embed_tokens.weight"), b, &[32, 16]),
        src("lm_head.weight", b, &[32, 16]),
        src(&format!("{lm}norm.weight"), b, &[16]),
    ];
    s.extend(vit_sources(1));
    for (n, shape) in [
        ("input_layernorm.weight", vec![16]),
        ("post_attention_layernorm.weight", vec![16]),
        ("self_attn.q_proj.weight", vec![16, 16]),
        ("self_attn.k_proj.weight", vec![8, 16]),
        ("self_attn.v_proj.weight", vec![8, 16]),
        ("self_attn.o_proj.weight", vec![16, 16]),
        ("self_attn.q_norm.weight", vec![4]),
        ("self_attn.k_norm.weight", vec![4]),
        ("mlp.gate.weight", vec![2, 16]),
        ("mlp.experts.gate_up_proj", vec![2, 16, 12]),
        ("mlp.experts.down_proj", vec![2, 6, 16]),
    ] {
        s.push(src(&format!("{lm}layers.0.{n}"), b, &shape));
    }
    let p = plan(config, s, Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 }).expect("plan");
    assert!(p.unconverted.is_empty(), "{:?}", p.unconverted);
    // The vision tower: Megatron's ViT as Megatron-Bridge main maps it (Qwen3.5's), TP-split,
    // the GELU fc1 whole; the deepstack merger under the ViT's `decoder.`, split as the merger.
    for (key, mode, shape) in [
        ("decoder.layers.1.self_attention.linear_qkv.weight", TpMode::Column, vec![24, 8]),
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", TpMode::Replicated, vec![8]),
        ("decoder.layers.0.self_attention.linear_proj.weight", TpMode::Row, vec![8, 8]),
        ("decoder.layers.1.mlp.linear_fc1.weight", TpMode::Column, vec![12, 8]),
        ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", TpMode::Replicated, vec![8]),
        ("decoder.layers.0.mlp.linear_fc2.bias", TpMode::Replicated, vec![8]),
        ("merger.patch_norm.weight", TpMode::Replicated, vec![8]),
        ("merger.linear_fc1.weight", TpMode::Column, vec![32, 32]),
        ("patch_embed.proj.weight", TpMode::Replicated, vec![8, 3, 2, 2, 2]),
        ("decoder.deepstack_merger_list.0.patch_norm.weight", TpMode::Replicated, vec![32]),
        ("decoder.deepstack_merger_list.0.patch_norm.bias", TpMode::Replicated, vec![32]),
        ("decoder.deepstack_merger_list.0.linear_fc1.weight", TpMode::Column, vec![32, 32]),
        ("decoder.deepstack_merger_list.0.linear_fc1.bias", TpMode::Column, vec![32]),
        ("decoder.deepstack_merger_list.0.linear_fc2.weight", TpMode::Row, vec![16, 32]),
        ("decoder.deepstack_merger_list.0.linear_fc2.bias", TpMode::Replicated, vec![16]),
    ] {
        let t = tensor(&p, &format!("vision_model.{key}"));
        assert_eq!((t.tp_mode, &t.shape), (mode, &shape), "{key}");
    }
    assert!(!p
        .tensors
        .iter()
        .any(|t| t.key.contains("vision_model") && (t.key.ends_with("_w") || t.key.ends_with("_v"))));
    assert!(!p.tensors.iter().any(|t| t.key.contains("vision_model.blocks.")));
    // qkv: HF [q; k; v] (8 rows each) → per head [q_h; k_h; v_h] (4 rows each).
    let qkv = tensor(&p, "vision_model.decoder.layers.0.self_attention.linear_qkv.bias");
    let starts: Vec<u64> = qkv.recipe.iter().map(|b| b.source.unwrap().1).collect();
    assert_eq!(starts, vec![0, 8, 16, 4, 12, 20]);
    // The language model under `language_model.`; experts' halves are contiguous transposed columns.
    tensor(&p, "language_model.embedding.word_embeddings.weight");
    let w = tensor(&p, "language_model.decoder.layers.0.mlp.experts.linear_fc1.weight1_v");
    assert_eq!(w.shape, vec![6, 16]);
    let id = w.recipe[0].source.unwrap().0;
    assert_eq!(w.recipe, vec![RowBlock::transposed(id, 16 * 12 + 6, 6, 12, 1)]);
    assert_eq!(tensor(&p, "language_model.decoder.layers.0.mlp.experts.linear_fc2.weight0").shape, vec![16, 6]);
}

/// A Megatron-ViT release tower (`model.visual.*`): two blocks of `HV` = 8 (2 heads of 4 when
/// `vision_config` says so), a merger to width 16, and `deepstack` deepstack mergers (Qwen3-VL).
fn vit_sources(deepstack: usize) -> Vec<SourceTensor> {
    let b = DType::BF16;
    let mut s = vec![
        src("model.visual.patch_embed.proj.weight", b, &[8, 3, 2, 2, 2]),
        src("model.visual.patch_embed.proj.bias", b, &[8]),
        src("model.visual.pos_embed.weight", b, &[16, 8]),
    ];
    for j in 0..2 {
        let v = format!("model.visual.blocks.{j}.");
        for (n, shape) in [
            ("norm1.weight", vec![8]),
            ("norm1.bias", vec![8]),
            ("norm2.weight", vec![8]),
            ("norm2.bias", vec![8]),
            ("attn.qkv.weight", vec![24, 8]),
            ("attn.qkv.bias", vec![24]),
            ("attn.proj.weight", vec![8, 8]),
            ("attn.proj.bias", vec![8]),
            ("mlp.linear_fc1.weight", vec![12, 8]),
            ("mlp.linear_fc1.bias", vec![12]),
            ("mlp.linear_fc2.weight", vec![8, 12]),
            ("mlp.linear_fc2.bias", vec![8]),
        ] {
            s.push(src(&format!("{v}{n}"), b, &shape));
        }
    }
    for (n, shape) in [
        ("norm.weight", vec![8]),
        ("norm.bias", vec![8]),
        ("linear_fc1.weight", vec![32, 32]),
        ("linear_fc1.bias", vec![32]),
        ("linear_fc2.weight", vec![16, 32]),
        ("linear_fc2.bias", vec![16]),
    ] {
        s.push(src(&format!("model.visual.merger.{n}"), b, &shape));
        // A deepstack merger is built like the final one, its norm over the merged width.
        let shape = if n.starts_with("norm.") { vec![32] } else { shape };
        for k in 0..deepstack {
            s.push(src(&format!("model.visual.deepstack_merger_list.{k}.{n}"), b, &shape));
        }
    }
    s
}

/// A Qwen3.5 MoE release with one GDN layer (`{lm}` the language model's prefix) and, with
/// `vision`, a vision tower of two blocks of `HV` = 8 (2 heads of 4).
fn qwen35_sources(lm: &str, vision: bool) -> Vec<SourceTensor> {
    let b = DType::BF16;
    let mut s = vec![
        src(&format!("{lm}embed_tokens.weight"), b, &[32, 16]),
        src("lm_head.weight", b, &[32, 16]),
        src(&format!("{lm}norm.weight"), b, &[16]),
    ];
    let la = format!("{lm}layers.0.linear_attn.");
    for (n, shape) in [
        ("in_proj_qkv.weight", vec![32, 16]),
        ("in_proj_z.weight", vec![16, 16]),
        ("in_proj_b.weight", vec![4, 16]),
        ("in_proj_a.weight", vec![4, 16]),
        ("conv1d.weight", vec![32, 1, 4]),
        ("A_log", vec![4]),
        ("dt_bias", vec![4]),
        ("norm.weight", vec![4]),
        ("out_proj.weight", vec![16, 16]),
    ] {
        s.push(src(&format!("{la}{n}"), b, &shape));
    }
    for (n, shape) in [
        ("input_layernorm.weight", vec![16]),
        ("post_attention_layernorm.weight", vec![16]),
        ("mlp.gate.weight", vec![2, 16]),
        ("mlp.experts.gate_up_proj", vec![2, 12, 16]),
        ("mlp.experts.down_proj", vec![2, 16, 6]),
    ] {
        s.push(src(&format!("{lm}layers.0.{n}"), b, &shape));
    }
    if vision {
        s.extend(vit_sources(0));
    }
    s
}

fn qwen35_config(model_type: &str, vision_heads: u64) -> String {
    let text = r#""hidden_size":16,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":4,"num_hidden_layers":1,
        "vocab_size":32,"num_experts":2,"moe_intermediate_size":6,"linear_num_key_heads":2,"linear_num_value_heads":4,
        "linear_key_head_dim":4,"linear_value_head_dim":4,"linear_conv_kernel_dim":4"#;
    if model_type.ends_with("_text") {
        return format!(r#"{{"model_type":"{model_type}",{text}}}"#);
    }
    format!(
        r#"{{"model_type":"{model_type}","tie_word_embeddings":false,"text_config":{{"model_type":"{model_type}_text",{text}}},
        "vision_config":{{"depth":2,"hidden_size":8,"num_heads":{vision_heads},"intermediate_size":12}}}}"#
    )
}

#[test]
fn qwen35_converts_its_vision_tower_as_a_megatron_vit() {
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 1 };
    let p = plan(&qwen35_config("qwen3_5_moe", 2), qwen35_sources("model.language_model.", true), mesh).expect("plan");
    assert!(p.unconverted.is_empty(), "{:?}", p.unconverted);
    // The language model under `language_model.`, its table unchanged.
    for key in ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"] {
        tensor(&p, &format!("language_model.{key}"));
    }
    tensor(&p, "language_model.decoder.layers.0.self_attention.in_proj.weight.alpha");
    tensor(&p, "language_model.decoder.layers.0.mlp.experts.linear_fc1.weight1_v");
    // The tower: TP-split as Megatron's ViT layers are; fc1 (GELU) whole.
    let v = "vision_model.decoder.layers.1.";
    for (key, mode, shape) in [
        ("self_attention.linear_qkv.weight", TpMode::Column, vec![24, 8]),
        ("self_attention.linear_qkv.bias", TpMode::Column, vec![24]),
        ("self_attention.linear_qkv.layer_norm_weight", TpMode::Replicated, vec![8]),
        ("self_attention.linear_qkv.layer_norm_bias", TpMode::Replicated, vec![8]),
        ("self_attention.linear_proj.weight", TpMode::Row, vec![8, 8]),
        ("self_attention.linear_proj.bias", TpMode::Replicated, vec![8]),
        ("mlp.linear_fc1.weight", TpMode::Column, vec![12, 8]),
        ("mlp.linear_fc1.bias", TpMode::Column, vec![12]),
        ("mlp.linear_fc1.layer_norm_weight", TpMode::Replicated, vec![8]),
        ("mlp.linear_fc1.layer_norm_bias", TpMode::Replicated, vec![8]),
        ("mlp.linear_fc2.weight", TpMode::Row, vec![8, 12]),
        ("mlp.linear_fc2.bias", TpMode::Replicated, vec![8]),
    ] {
        let t = tensor(&p, &format!("{v}{key}"));
        assert_eq!((t.tp_mode, &t.shape), (mode, &shape), "{key}");
    }
    assert!(!p.tensors.iter().any(|t| t.key.ends_with("linear_fc1.weight_w") && t.key.contains("vision_model")));
    for (key, mode) in [
        ("patch_embed.proj.weight", TpMode::Replicated),
        ("patch_embed.proj.bias", TpMode::Replicated),
        ("pos_embed.weight", TpMode::Replicated),
        ("merger.patch_norm.weight", TpMode::Replicated),
        ("merger.patch_norm.bias", TpMode::Replicated),
        ("merger.linear_fc1.weight", TpMode::Column),
        ("merger.linear_fc1.bias", TpMode::Column),
        ("merger.linear_fc2.weight", TpMode::Row),
        ("merger.linear_fc2.bias", TpMode::Replicated),
    ] {
        assert_eq!(tensor(&p, &format!("vision_model.{key}")).tp_mode, mode, "{key}");
    }
    // qkv: HF [q; k; v] (8 rows each) → per head [q_h; k_h; v_h] (4 rows each).
    let qkv = tensor(&p, &format!("{v}self_attention.linear_qkv.weight"));
    let id = qkv.recipe[0].source.unwrap().0;
    assert_eq!(p.sources[id].name, "model.visual.blocks.1.attn.qkv.weight");
    let starts: Vec<u64> = qkv.recipe.iter().map(|b| b.source.unwrap().1).collect();
    assert_eq!(starts, vec![0, 8, 16, 4, 12, 20]);
    assert!(qkv.recipe.iter().all(|b| b.rows == 4));
}

#[test]
fn qwen35_without_a_tower_converts_as_before_and_the_tower_splits_whole_heads() {
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 1 };
    // Text-only releases, and a multimodal config whose release has no `model.visual.*`: the
    // language model at the top, as Megatron's GPT model keeps it.
    for (model_type, lm) in
        [("qwen3_5_moe_text", "model."), ("qwen3_5_moe", "model.language_model."), ("qwen3_5", "model.language_model.")]
    {
        let p = plan(&qwen35_config(model_type, 2), qwen35_sources(lm, false), mesh).expect("plan");
        tensor(&p, "embedding.word_embeddings.weight");
        tensor(&p, "decoder.layers.0.self_attention.in_proj.weight.alpha");
        assert!(!p.tensors.iter().any(|t| t.key.contains("language_model") || t.key.contains("vision_model")));
    }
    // One vision head does not split over two TP ranks; without vision dims the tower cannot be
    // planned; a tower tensor the table does not know is unmapped, not skipped.
    let err = plan(&qwen35_config("qwen3_5_moe", 1), qwen35_sources("model.language_model.", true), mesh)
        .expect_err("1 head at tp 2");
    assert!(
        err.iter().any(|e| e.to_string().contains("vision_config.num_heads (1) is not divisible by tp (2)")),
        "{err:?}"
    );
    let no_dims = qwen35_config("qwen3_5_moe", 2).replace(r#""depth":2,"#, "");
    let err = plan(&no_dims, qwen35_sources("model.language_model.", true), mesh).expect_err("no depth");
    assert!(err.iter().any(|e| e.to_string().contains("`vision_config`")), "{err:?}");
    let mut s = qwen35_sources("model.language_model.", true);
    s.push(src("model.visual.deepstack_merger_list.0.norm.weight", DType::BF16, &[32]));
    let err = plan(&qwen35_config("qwen3_5_moe", 2), s, mesh).expect_err("unknown tower tensor");
    assert!(err.iter().any(|e| e.to_string().contains("model.visual.deepstack_merger_list.*.norm.weight")), "{err:?}");
}

#[test]
fn qwen35_dense_and_its_mtp_layer_sit_under_language_model_beside_a_tower() {
    let b = DType::BF16;
    let lm = "model.language_model.";
    let mut s: Vec<SourceTensor> = qwen35_sources(lm, true)
        .into_iter()
        .filter(|t| !t.name.contains(".mlp.gate") && !t.name.contains("experts"))
        .collect();
    for (n, shape) in [("gate_proj.weight", [6, 16]), ("up_proj.weight", [6, 16]), ("down_proj.weight", [16, 6])] {
        s.push(src(&format!("{lm}layers.0.mlp.{n}"), b, &shape));
    }
    // The MTP head as Qwen3.5 releases store it: top-level `mtp.*`, a gated-attention layer.
    for (n, shape) in [
        ("fc.weight", vec![16, 32]),
        ("pre_fc_norm_embedding.weight", vec![16]),
        ("pre_fc_norm_hidden.weight", vec![16]),
        ("norm.weight", vec![16]),
        ("layers.0.input_layernorm.weight", vec![16]),
        ("layers.0.post_attention_layernorm.weight", vec![16]),
        ("layers.0.self_attn.q_proj.weight", vec![32, 16]),
        ("layers.0.self_attn.k_proj.weight", vec![8, 16]),
        ("layers.0.self_attn.v_proj.weight", vec![8, 16]),
        ("layers.0.self_attn.o_proj.weight", vec![16, 16]),
        ("layers.0.self_attn.q_norm.weight", vec![4]),
        ("layers.0.self_attn.k_norm.weight", vec![4]),
        ("layers.0.mlp.gate_proj.weight", vec![6, 16]),
        ("layers.0.mlp.up_proj.weight", vec![6, 16]),
        ("layers.0.mlp.down_proj.weight", vec![16, 6]),
    ] {
        s.push(src(&format!("mtp.{n}"), b, &shape));
    }
    let config =
        qwen35_config("qwen3_5", 2).replace(r#""num_experts":2,"moe_intermediate_size":6"#, r#""intermediate_size":6"#);
    let p = plan(&config, s, Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 1 }).expect("plan");
    assert!(p.unconverted.is_empty(), "{:?}", p.unconverted);
    tensor(&p, "language_model.decoder.layers.0.mlp.linear_fc1.weight_w");
    tensor(&p, "language_model.decoder.layers.0.mlp.linear_fc1.layer_norm_weight");
    tensor(&p, "language_model.mtp.layers.0.eh_proj.weight");
    tensor(&p, "language_model.mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight");
    tensor(&p, "language_model.mtp.layers.0.transformer_layer.mlp.linear_fc1.weight_v");
    tensor(&p, "vision_model.decoder.layers.0.mlp.linear_fc1.weight");
    assert!(p
        .tensors
        .iter()
        .all(|t| t.key.starts_with("model.module.language_model.") || t.key.starts_with("model.module.vision_model.")));
}
