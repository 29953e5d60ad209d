//! The `config.json` of a model, as `transformers` writes it.

use serde_json::{json, Map, Value};

use crate::arch::*;
use crate::*;

/// The fields `transformers` 5 writes for the architecture's config class (keys sorted by the
/// JSON map).
pub(crate) fn config_value(arch: Arch, d: &ModelDims) -> Value {
    let mut c = Map::new();
    let mut set = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    let qwen = !matches!(arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
    set("architectures", json!([arch.class_name()]));
    set("model_type", json!(arch.name()));
    set("dtype", json!("bfloat16"));
    set("transformers_version", json!(TRANSFORMERS_VERSION));
    set("hidden_size", json!(d.hidden_size));
    set("num_hidden_layers", json!(d.num_layers));
    set("num_attention_heads", json!(d.num_attention_heads));
    set("num_key_value_heads", json!(d.num_key_value_heads));
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
