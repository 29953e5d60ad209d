//! The `config.json` of a model, as `transformers` writes it.

use serde_json::{json, Map, Value};

use crate::arch::*;
use crate::*;

/// The fields `transformers` 5 writes for the architecture's config class (keys sorted by the
/// JSON map), and the `quantization_config` of an FP8 release.
pub(crate) fn config_value(arch: Arch, d: &ModelDims, format: WeightFormat) -> Value {
    if arch == Arch::DeepseekV3 {
        return deepseek_v3_config(d, format);
    }
    let mut c = Map::new();
    let mut set = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    let qwen = !matches!(arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
    common_fields(arch, d, &mut set);
    set("vocab_size", json!(d.vocab_size));
    set("hidden_act", json!("silu"));
    set("attention_dropout", json!(0.0));
    set("initializer_range", json!(0.02));
    set("tie_word_embeddings", json!(false));
    set("use_cache", json!(true));
    set("pad_token_id", Value::Null);
    if arch != Arch::Qwen2 {
        set("head_dim", json!(d.head_dim));
    }
    if arch != Arch::Qwen35MoeText {
        set("intermediate_size", json!(d.intermediate_size));
    }
    if qwen {
        set("bos_token_id", Value::Null);
        set("eos_token_id", Value::Null);
        set("rms_norm_eps", json!(1e-6));
    } else {
        set("bos_token_id", json!(1));
        set("eos_token_id", json!(2));
        set("rms_norm_eps", json!(1e-5));
    }
    if matches!(
        arch,
        Arch::Llama | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText
    ) {
        set("attention_bias", json!(false));
    }
    let rope_theta = match arch {
        Arch::Llama => 500_000.0,
        Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText => 10_000_000.0,
        _ => 1_000_000.0,
    };
    let mut rope = json!({"rope_theta": rope_theta, "rope_type": "default"});
    if arch.is_hybrid() {
        rope["partial_rotary_factor"] = json!(0.25);
    }
    set("rope_parameters", rope);
    set(
        "max_position_embeddings",
        json!(match arch {
            Arch::Llama => 8192,
            Arch::Qwen3 | Arch::Qwen3Moe => 40_960,
            Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText => 262_144,
            _ => 32_768,
        }),
    );
    match arch {
        Arch::Llama => {
            set("mlp_bias", json!(false));
            set("pretraining_tp", json!(1));
        }
        Arch::Mistral | Arch::Mixtral => set("sliding_window", Value::Null),
        Arch::Qwen2 | Arch::Qwen3 => {
            set("sliding_window", Value::Null);
            set("use_sliding_window", json!(false));
            set("max_window_layers", json!(d.num_layers));
            set("layer_types", json!(vec!["full_attention"; d.num_layers as usize]));
        }
        Arch::Qwen3Moe => {
            set("sliding_window", Value::Null);
            set("use_sliding_window", json!(false));
        }
        _ => {}
    }
    if arch.is_moe() {
        set("num_experts_per_tok", json!(d.experts_per_token(arch)));
        set("output_router_logits", json!(false));
        set("router_aux_loss_coef", json!(if arch == Arch::Mixtral { 0.02 } else { 0.001 }));
        match arch {
            Arch::Mixtral => {
                set("num_local_experts", json!(d.num_experts));
                set("router_jitter_noise", json!(0.0));
            }
            // transformers 5 saves Qwen3-MoE's expert count as `num_local_experts`.
            Arch::Qwen3Moe => set("num_local_experts", json!(d.num_experts)),
            _ => set("num_experts", json!(d.num_experts)),
        }
        if arch != Arch::Mixtral {
            set("moe_intermediate_size", json!(d.moe_intermediate_size));
        }
        if matches!(arch, Arch::Qwen3Moe | Arch::Qwen3Next) {
            set("decoder_sparse_step", json!(1));
            set("mlp_only_layers", json!([]));
            set("norm_topk_prob", json!(arch == Arch::Qwen3Next));
        }
    }
    if arch.has_shared_expert() {
        set("shared_expert_intermediate_size", json!(d.shared_expert_intermediate_size));
    }
    if let (true, Some(l)) = (arch.is_hybrid(), &d.linear) {
        set("linear_conv_kernel_dim", json!(l.conv_kernel));
        set("linear_key_head_dim", json!(l.key_head_dim));
        set("linear_value_head_dim", json!(l.value_head_dim));
        set("linear_num_key_heads", json!(l.num_key_heads));
        set("linear_num_value_heads", json!(l.num_value_heads));
        let types: Vec<&str> = (0..d.num_layers)
            .map(|i| if arch.is_full_attention(i) { "full_attention" } else { "linear_attention" })
            .collect();
        set("layer_types", json!(types));
    }
    Value::Object(c)
}

/// The fields every architecture's config has, as `transformers` writes them.
fn common_fields(arch: Arch, d: &ModelDims, set: &mut impl FnMut(&str, Value)) {
    set("architectures", json!([arch.class_name()]));
    set("model_type", json!(arch.name()));
    set("dtype", json!("bfloat16"));
    set("transformers_version", json!(TRANSFORMERS_VERSION));
    set("hidden_size", json!(d.hidden_size));
    set("num_hidden_layers", json!(d.num_layers));
    set("num_attention_heads", json!(d.num_attention_heads));
    set("num_key_value_heads", json!(d.num_key_value_heads));
}

/// DeepSeek-V3's config (`DeepseekV3Config`), with the real model's routing and rope settings
/// but for the group counts, which follow the expert count (8 groups, top 4, from 32 experts up).
fn deepseek_v3_config(d: &ModelDims, format: WeightFormat) -> Value {
    let arch = Arch::DeepseekV3;
    let e = d.num_experts;
    let n_group = (1..=(e / 4).clamp(1, 8)).rev().find(|g| e.is_multiple_of(*g)).unwrap_or(1);
    // Present: checked when the model was made.
    let mla = d.mla.clone().unwrap_or_default();
    let mut c = Map::new();
    let mut set = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    common_fields(arch, d, &mut set);
    set("head_dim", json!(d.head_dim));
    set("vocab_size", json!(d.vocab_size));
    set("intermediate_size", json!(d.intermediate_size));
    set("moe_intermediate_size", json!(d.moe_intermediate_size));
    set("n_routed_experts", json!(e));
    set("n_shared_experts", json!(d.shared_expert_intermediate_size / d.moe_intermediate_size.max(1)));
    set("num_experts_per_tok", json!(d.experts_per_token(arch)));
    set("n_group", json!(n_group));
    set("topk_group", json!((n_group / 2).max(1)));
    set("norm_topk_prob", json!(true));
    set("routed_scaling_factor", json!(2.5));
    set("first_k_dense_replace", json!(d.first_dense_layers));
    set("num_nextn_predict_layers", json!(d.mtp_layers));
    set("q_lora_rank", json!(mla.q_lora_rank));
    set("kv_lora_rank", json!(mla.kv_lora_rank));
    set("qk_nope_head_dim", json!(mla.qk_nope_head_dim));
    set("qk_rope_head_dim", json!(mla.qk_rope_head_dim));
    set("qk_head_dim", json!(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
    set("v_head_dim", json!(mla.v_head_dim));
    set("hidden_act", json!("silu"));
    set("attention_bias", json!(false));
    set("attention_dropout", json!(0.0));
    set("initializer_range", json!(0.02));
    set("rms_norm_eps", json!(1e-6));
    set("rope_interleave", json!(true));
    set("rope_parameters", json!({"rope_theta": 10_000.0, "rope_type": "default"}));
    set("max_position_embeddings", json!(163_840));
    set("bos_token_id", json!(0));
    set("eos_token_id", json!(1));
    set("pad_token_id", Value::Null);
    set("pretraining_tp", json!(1));
    set("output_router_logits", json!(false));
    set("tie_word_embeddings", json!(false));
    set("use_cache", json!(true));
    if let WeightFormat::Fp8Block { block } = format {
        set(
            "quantization_config",
            json!({
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
                "weight_block_size": block,
            }),
        );
    }
    Value::Object(c)
}

/// The dimensions a `config.json` gives, read as `transformers` reads them: the expert count under
/// any of its names (`num_experts`, `num_local_experts`, `n_routed_experts`), `head_dim`
/// defaulting to `hidden_size / num_attention_heads` and `num_key_value_heads` to
/// `num_attention_heads`. Missing fields are 0, which [`SynthModel::with_format`] refuses where
/// the architecture needs them.
pub(crate) fn dims_from_config(c: &Map<String, Value>) -> ModelDims {
    let get = |k: &str| c.get(k).and_then(Value::as_u64).unwrap_or(0);
    let heads = get("num_attention_heads");
    let head_dim = match get("head_dim") {
        0 => get("hidden_size").checked_div(heads).unwrap_or(0),
        d => d,
    };
    ModelDims {
        hidden_size: get("hidden_size"),
        num_layers: get("num_hidden_layers"),
        num_attention_heads: heads,
        num_key_value_heads: c.get("num_key_value_heads").and_then(Value::as_u64).unwrap_or(heads),
        head_dim,
        intermediate_size: get("intermediate_size"),
        vocab_size: get("vocab_size"),
        num_experts: get("num_experts").max(get("num_local_experts")).max(get("n_routed_experts")),
        moe_intermediate_size: get("moe_intermediate_size"),
        shared_expert_intermediate_size: get("shared_expert_intermediate_size")
            .max(get("n_shared_experts").saturating_mul(get("moe_intermediate_size"))),
        linear: c.contains_key("linear_num_key_heads").then(|| LinearAttentionDims {
            num_key_heads: get("linear_num_key_heads"),
            num_value_heads: get("linear_num_value_heads"),
            key_head_dim: get("linear_key_head_dim"),
            value_head_dim: get("linear_value_head_dim"),
            conv_kernel: get("linear_conv_kernel_dim"),
        }),
        mla: c.contains_key("kv_lora_rank").then(|| LatentAttentionDims {
            q_lora_rank: get("q_lora_rank"),
            kv_lora_rank: get("kv_lora_rank"),
            qk_nope_head_dim: get("qk_nope_head_dim"),
            qk_rope_head_dim: get("qk_rope_head_dim"),
            v_head_dim: get("v_head_dim"),
        }),
        first_dense_layers: get("first_k_dense_replace"),
        mtp_layers: get("num_nextn_predict_layers"),
    }
}

/// The weight format a `config.json` declares: block FP8 when its `quantization_config` has a
/// `weight_block_size`, else bf16.
pub(crate) fn format_from_config(c: &Map<String, Value>) -> Result<WeightFormat, SynthError> {
    let Some(block) = c.get("quantization_config").and_then(|q| q.get("weight_block_size")) else {
        return Ok(WeightFormat::Bf16);
    };
    match block.as_array().map(|b| b.iter().map(Value::as_u64).collect::<Vec<_>>()).as_deref() {
        Some([Some(rows), Some(cols)]) => Ok(WeightFormat::Fp8Block { block: [*rows, *cols] }),
        _ => Err(SynthError::InvalidConfig(format!(
            "`quantization_config.weight_block_size` is {block}, not [rows, cols]"
        ))),
    }
}
