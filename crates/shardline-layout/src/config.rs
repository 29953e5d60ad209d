//! `config.json` of a HuggingFace release → the dimensions the planner needs.
//!
//! Only the fields that decide layouts are read; everything else is ignored. Multimodal releases
//! keep the text model's fields under `text_config`; those are used when present.

use serde_json::Value;

use crate::error::LayoutError;

/// The architecture families Shardline converts. Each has a mapping table in [`crate::arch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `llama`, `mistral`: dense GQA attention + SwiGLU MLP.
    Llama,
    /// `qwen2`: llama with q/k/v biases.
    Qwen2,
    /// `qwen3`: llama with q/k RMSNorms.
    Qwen3,
    /// `qwen3_moe`: qwen3 attention + routed experts.
    Qwen3Moe,
    /// `mixtral`: llama attention + `block_sparse_moe` experts.
    Mixtral,
    /// `qwen3_next`: GDN (fused `in_proj_qkvz`/`in_proj_ba`) + gated attention + experts + shared expert.
    Qwen3Next,
    /// `qwen3_5_text` / `qwen3_5_moe_text`: GDN with split projections + gated attention;
    /// `qwen3_5` / `qwen3_5_moe` releases with a vision tower (`model.visual.*`) convert it as a
    /// Megatron ViT under `vision_model.`, the language model then under `language_model.`.
    Qwen35,
    /// `deepseek_v3`, `kimi_k2`: multi-head latent attention, dense first layers, routed and
    /// shared experts with a score-correction bias, MTP layers after the decoder.
    DeepseekV3,
    /// `glm4_moe` (GLM-4.5/4.6): GQA with biases and optional q/k norms, dense first layers,
    /// routed and shared experts with a score-correction bias, MTP layers after the decoder.
    Glm4Moe,
    /// `qwen3_vl_moe`: Qwen3 MoE attention and packed experts stored `[E, in, out]`, under
    /// `language_model.`, and the vision tower (deepstack mergers included) as a Megatron ViT
    /// under `vision_model.`.
    Qwen3VlMoe,
    /// `gpt_oss`: GQA with biases and attention sinks, a biased router, packed experts with
    /// biases whose fc1 interleaves gate and up rows and stays fused on disk (MXFP4 in releases).
    GptOss,
}

/// Model types accepted in `config.json`, with their family.
pub const SUPPORTED_MODEL_TYPES: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("mistral", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("qwen3_moe", Family::Qwen3Moe),
    ("mixtral", Family::Mixtral),
    ("qwen3_next", Family::Qwen3Next),
    ("qwen3_5_text", Family::Qwen35),
    ("qwen3_5_moe_text", Family::Qwen35),
    ("qwen3_5", Family::Qwen35),
    ("qwen3_5_moe", Family::Qwen35),
    ("deepseek_v3", Family::DeepseekV3),
    ("kimi_k2", Family::DeepseekV3),
    ("glm4_moe", Family::Glm4Moe),
    ("gpt_oss", Family::GptOss),
    ("qwen3_vl_moe", Family::Qwen3VlMoe),
    ("qwen3_vl_moe_text", Family::Qwen3VlMoe),
];

/// Multi-head latent attention dimensions (DeepSeek-V3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaDims {
    /// Rank of the query compression; `None`: queries are projected directly (`q_proj`).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// How the release's weights are quantized (`quantization_config.quant_method`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// Block-wise FP8 e4m3 with float32 `weight_scale_inv` per `[rows, cols]` block.
    Fp8Block { block: [u64; 2] },
    /// MXFP4 (`*_blocks` + `*_scales`, gpt-oss's experts).
    Mxfp4,
    /// A scheme Shardline does not convert (named as the config names it).
    Other(String),
}

/// Gated-DeltaNet (linear attention) dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdnDims {
    pub num_key_heads: u64,
    pub num_value_heads: u64,
    pub key_head_dim: u64,
    pub value_head_dim: u64,
    pub conv_kernel: u64,
}

impl GdnDims {
    /// `qk = nk·dk`.
    pub fn qk(&self) -> u64 {
        self.num_key_heads * self.key_head_dim
    }
    /// `v = nv·dv`.
    pub fn v(&self) -> u64 {
        self.num_value_heads * self.value_head_dim
    }
}

/// A vision tower's dimensions (`vision_config`), for towers Megatron builds as its own ViT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VisionDims {
    /// Transformer blocks (`depth`).
    pub depth: u64,
    pub num_heads: u64,
    pub hidden_size: u64,
}

/// What the planner reads from `config.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    pub model_type: String,
    pub family: Family,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub num_query_groups: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    /// Dense MLP intermediate size (`intermediate_size`), if the model has dense MLPs.
    pub ffn_hidden_size: Option<u64>,
    /// Routed-expert intermediate size.
    pub moe_ffn_hidden_size: Option<u64>,
    /// Shared-expert intermediate size.
    pub shared_expert_ffn_hidden_size: Option<u64>,
    /// Number of routed experts (0 for dense models).
    pub num_experts: u64,
    pub gdn: Option<GdnDims>,
    /// Whether release tensors live under `model.language_model.` (multimodal Qwen3.5 releases).
    pub language_model_prefix: bool,
    /// `vision_config`'s dimensions, when it gives them all.
    pub vision: Option<VisionDims>,
    pub mla: Option<MlaDims>,
    /// MTP layers stored after the decoder (`num_nextn_predict_layers`).
    pub mtp_layers: u64,
    pub quantization: Option<Quantization>,
}

fn get_u64(obj: &Value, key: &str) -> Result<Option<u64>, LayoutError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| LayoutError::Config {
            field: key.to_string(),
            message: format!("expected a non-negative integer, found {v}"),
        }),
    }
}

fn need_u64(obj: &Value, key: &str) -> Result<u64, LayoutError> {
    get_u64(obj, key)?.ok_or_else(|| LayoutError::Config { field: key.to_string(), message: "missing".to_string() })
}

/// Reads `vision_config`: `None` without one or when it lacks a dimension; a dimension that is
/// not a non-negative integer is an error.
fn vision(v: Option<&Value>) -> Result<Option<VisionDims>, LayoutError> {
    let Some(v @ Value::Object(_)) = v else { return Ok(None) };
    let dim = |key: &str| {
        get_u64(v, key).map_err(|e| match e {
            LayoutError::Config { field, message } => {
                LayoutError::Config { field: format!("vision_config.{field}"), message }
            }
            other => other,
        })
    };
    Ok(match (dim("depth")?, dim("num_heads")?, dim("hidden_size")?) {
        (Some(depth), Some(num_heads), Some(hidden_size)) => Some(VisionDims { depth, num_heads, hidden_size }),
        _ => None,
    })
}

/// Reads `quantization_config`: its `quant_method`, and for FP8 the block size.
fn quantization(q: Option<&Value>) -> Result<Option<Quantization>, LayoutError> {
    let Some(q) = q.filter(|q| !q.is_null()) else { return Ok(None) };
    let err = |message: String| LayoutError::Config { field: "quantization_config".into(), message };
    let method =
        q.get("quant_method").and_then(Value::as_str).ok_or_else(|| err("has no `quant_method` string".into()))?;
    if method == "mxfp4" {
        return Ok(Some(Quantization::Mxfp4));
    }
    if method != "fp8" {
        return Ok(Some(Quantization::Other(method.to_string())));
    }
    let block = match q.get("weight_block_size") {
        Some(Value::Array(v)) if v.len() == 2 => {
            let dim = |i: usize| v[i].as_u64().filter(|n| *n > 0);
            match (dim(0), dim(1)) {
                (Some(a), Some(b)) => [a, b],
                _ => {
                    return Err(err(format!(
                        "`weight_block_size` must be two positive integers, found {}",
                        q["weight_block_size"]
                    )))
                }
            }
        }
        other => {
            return Err(err(format!(
                "fp8 without a two-element `weight_block_size` (found {}): only block-wise FP8 is converted",
                other.map_or("nothing".to_string(), Value::to_string)
            )))
        }
    };
    Ok(Some(Quantization::Fp8Block { block }))
}

impl ModelConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<ModelConfig, LayoutError> {
        let root: Value = serde_json::from_str(text).map_err(|e| LayoutError::Config {
            field: "config.json".to_string(),
            message: format!("not valid JSON: {e}"),
        })?;
        let top_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| LayoutError::Config { field: "model_type".to_string(), message: "missing".to_string() })?
            .to_string();
        // Multimodal releases nest the language model's fields.
        let (obj, language_model_prefix) = match root.get("text_config") {
            Some(tc @ Value::Object(_)) => (tc, true),
            _ => (&root, false),
        };
        let model_type = obj.get("model_type").and_then(Value::as_str).unwrap_or(&top_type).to_string();
        let family = SUPPORTED_MODEL_TYPES
            .iter()
            .find(|(name, _)| *name == model_type || *name == top_type)
            .map(|(_, f)| *f)
            .ok_or_else(|| LayoutError::UnknownArchitecture {
                model_type: model_type.clone(),
                supported: SUPPORTED_MODEL_TYPES.iter().map(|(n, _)| *n).collect(),
            })?;

        let hidden_size = need_u64(obj, "hidden_size")?;
        let num_attention_heads = need_u64(obj, "num_attention_heads")?;
        let num_query_groups = get_u64(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_query_groups == 0 || hidden_size == 0 {
            return Err(LayoutError::Config {
                field: "num_attention_heads".to_string(),
                message: "hidden_size, num_attention_heads and num_key_value_heads must be positive".to_string(),
            });
        }
        let head_dim = match get_u64(obj, "head_dim")? {
            Some(d) => d,
            None => hidden_size / num_attention_heads,
        };
        let num_experts = get_u64(obj, "num_experts")?
            .or(get_u64(obj, "num_local_experts")?)
            .or(get_u64(obj, "n_routed_experts")?)
            .unwrap_or(0);
        let mla = match family {
            Family::DeepseekV3 => Some(MlaDims {
                q_lora_rank: get_u64(obj, "q_lora_rank")?,
                kv_lora_rank: need_u64(obj, "kv_lora_rank")?,
                qk_nope_head_dim: need_u64(obj, "qk_nope_head_dim")?,
                qk_rope_head_dim: need_u64(obj, "qk_rope_head_dim")?,
                v_head_dim: need_u64(obj, "v_head_dim")?,
            }),
            _ => None,
        };
        // DeepSeek and GLM size their shared experts as `n_shared_experts` routed ones.
        let shared_expert_ffn_hidden_size = match get_u64(obj, "shared_expert_intermediate_size")? {
            Some(f) => Some(f),
            None => match (get_u64(obj, "n_shared_experts")?, get_u64(obj, "moe_intermediate_size")?) {
                (Some(n), Some(f)) if n > 0 => Some(n * f),
                _ => None,
            },
        };
        let quantization = quantization(root.get("quantization_config").or(obj.get("quantization_config")))?;
        let gdn = match family {
            Family::Qwen3Next | Family::Qwen35 => Some(GdnDims {
                num_key_heads: need_u64(obj, "linear_num_key_heads")?,
                num_value_heads: need_u64(obj, "linear_num_value_heads")?,
                key_head_dim: need_u64(obj, "linear_key_head_dim")?,
                value_head_dim: need_u64(obj, "linear_value_head_dim")?,
                conv_kernel: need_u64(obj, "linear_conv_kernel_dim")?,
            }),
            _ => None,
        };
        let tie = root
            .get("tie_word_embeddings")
            .or(obj.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(ModelConfig {
            model_type,
            family,
            hidden_size,
            num_layers: need_u64(obj, "num_hidden_layers")?,
            num_attention_heads,
            num_query_groups,
            head_dim,
            vocab_size: need_u64(obj, "vocab_size")?,
            tie_word_embeddings: tie,
            // Mixtral's and gpt-oss's experts use `intermediate_size`; they have no dense MLP.
            ffn_hidden_size: if matches!(family, Family::Mixtral | Family::GptOss) {
                None
            } else {
                get_u64(obj, "intermediate_size")?
            },
            moe_ffn_hidden_size: if matches!(family, Family::Mixtral | Family::GptOss) {
                get_u64(obj, "intermediate_size")?
            } else {
                get_u64(obj, "moe_intermediate_size")?
            },
            shared_expert_ffn_hidden_size,
            num_experts,
            gdn,
            language_model_prefix,
            vision: vision(root.get("vision_config"))?,
            mla,
            mtp_layers: match family {
                Family::DeepseekV3 | Family::Glm4Moe => get_u64(obj, "num_nextn_predict_layers")?.unwrap_or(0),
                _ => 0,
            },
            quantization,
        })
    }

    /// Query heads per group (`nh / ng`); `None` when not integral.
    pub fn heads_per_group(&self) -> Option<u64> {
        self.num_attention_heads
            .is_multiple_of(self.num_query_groups)
            .then(|| self.num_attention_heads / self.num_query_groups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_llama_fields() {
        let c = ModelConfig::from_json(
            r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":8,
               "num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":256,"intermediate_size":128}"#,
        )
        .unwrap();
        assert_eq!(c.family, Family::Llama);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.heads_per_group(), Some(4));
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn unknown_architecture_lists_supported() {
        let err = ModelConfig::from_json(r#"{"model_type":"gpt_bigcode"}"#).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("gpt_bigcode") && msg.contains("qwen3_moe"), "{msg}");
    }

    #[test]
    fn multimodal_uses_text_config() {
        let c = ModelConfig::from_json(
            r#"{"model_type":"qwen3_5_moe","tie_word_embeddings":false,"text_config":{"model_type":"qwen3_5_moe_text",
               "hidden_size":64,"num_attention_heads":8,"num_key_value_heads":2,"num_hidden_layers":4,
               "vocab_size":256,"num_experts":8,"moe_intermediate_size":32,"head_dim":8,
               "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,
               "linear_value_head_dim":16,"linear_conv_kernel_dim":4}}"#,
        )
        .unwrap();
        assert_eq!(c.family, Family::Qwen35);
        assert!(c.language_model_prefix);
        assert_eq!(c.gdn.as_ref().unwrap().qk(), 32);
        assert_eq!(c.vision, None);
    }

    #[test]
    fn reads_the_vision_towers_dims() {
        let text = r#""text_config":{"hidden_size":64,"num_attention_heads":8,"num_hidden_layers":2,"vocab_size":256,
            "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,"linear_value_head_dim":16,
            "linear_conv_kernel_dim":4}"#;
        let c = ModelConfig::from_json(&format!(
            r#"{{"model_type":"qwen3_5",{text},"vision_config":{{"depth":3,"num_heads":4,"hidden_size":32}}}}"#
        ))
        .unwrap();
        assert_eq!(c.vision, Some(VisionDims { depth: 3, num_heads: 4, hidden_size: 32 }));
        let err =
            ModelConfig::from_json(&format!(r#"{{"model_type":"qwen3_5",{text},"vision_config":{{"depth":"3"}}}}"#))
                .unwrap_err();
        assert!(err.to_string().contains("vision_config.depth"), "{err}");
    }

    #[test]
    fn wrong_type_names_field() {
        let err = ModelConfig::from_json(r#"{"model_type":"llama","hidden_size":"64"}"#).unwrap_err();
        assert!(err.to_string().contains("hidden_size"));
    }
}
