//! The architectures and the dimensions of their models: the ladder of widths shaped like real
//! models that the size fitting chooses from.

use std::fmt;
use std::str::FromStr;

use crate::*;

/// The architectures a synthetic release can have, named by their `config.json` `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    Mistral,
    /// Llama with q/k/v biases.
    Qwen2,
    /// Llama with q/k RMSNorms.
    Qwen3,
    /// Qwen3 attention with routed experts (`mlp.experts.E.*`, router `mlp.gate`).
    Qwen3Moe,
    /// Llama attention with `block_sparse_moe` experts (`w1`, `w2`, `w3`).
    Mixtral,
    /// Hybrid: Gated DeltaNet (fused `in_proj_qkvz`/`in_proj_ba`) and gated attention, experts and
    /// a shared expert.
    Qwen3Next,
    /// Hybrid: Gated DeltaNet with split projections and gated attention, dense MLP.
    Qwen35Text,
    /// [`Arch::Qwen35Text`] with packed experts and a shared expert.
    Qwen35MoeText,
    /// Multi-head latent attention; the first `first_k_dense_replace` layers dense, the others
    /// routed experts with a float32 score-correction bias and a shared expert; optionally
    /// multi-token-prediction layers after the decoder. The one architecture whose releases can
    /// also be written with block-FP8 weights (see [`WeightFormat`]).
    DeepseekV3,
}

/// Every `model_type` [`synth`] accepts.
pub const SUPPORTED_ARCHS: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "deepseek_v3",
];

impl Arch {
    /// Every architecture, in the order of [`SUPPORTED_ARCHS`].
    pub const ALL: [Arch; 10] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Mixtral,
        Arch::Qwen3Next,
        Arch::Qwen35Text,
        Arch::Qwen35MoeText,
        Arch::DeepseekV3,
    ];

    /// The `model_type` of `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Mixtral => "mixtral",
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35Text => "qwen3_5_text",
            Arch::Qwen35MoeText => "qwen3_5_moe_text",
            Arch::DeepseekV3 => "deepseek_v3",
        }
    }

    /// The class `save_pretrained` records under `architectures`.
    pub(crate) fn class_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Qwen3Next => "Qwen3NextForCausalLM",
            Arch::Qwen35Text => "Qwen3_5ForCausalLM",
            Arch::Qwen35MoeText => "Qwen3_5MoeForCausalLM",
            Arch::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    /// Whether layers alternate Gated DeltaNet and full attention.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText)
    }

    /// Whether the model has routed experts (in every layer, but for DeepSeek-V3's first dense
    /// layers).
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Mixtral | Arch::Qwen3Next | Arch::Qwen35MoeText | Arch::DeepseekV3)
    }

    /// Whether releases of this architecture can be written with block-FP8 weights, as
    /// DeepSeek-V3 is published.
    pub fn supports_fp8(self) -> bool {
        self == Arch::DeepseekV3
    }

    pub(crate) fn has_shared_expert(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35MoeText)
    }

    pub(crate) fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText)
    }

    /// Whether the decoder's RMSNorms compute `x · (1 + w)` (weights stored around 0).
    pub(crate) fn zero_centred_norms(self) -> bool {
        self.is_hybrid()
    }

    /// The vocabulary of the architecture's real releases.
    fn real_vocab(self) -> u64 {
        match self {
            Arch::Llama => 128_256,
            Arch::Mistral => 32_768,
            Arch::Qwen2 => 152_064,
            Arch::Mixtral => 32_000,
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3Next => 151_936,
            Arch::Qwen35Text | Arch::Qwen35MoeText => 248_320,
            Arch::DeepseekV3 => 129_280,
        }
    }

    /// Whether layer `layer` is a full-attention layer (always, for non-hybrid models).
    pub fn is_full_attention(self, layer: u64) -> bool {
        !self.is_hybrid() || layer % FULL_ATTENTION_INTERVAL == FULL_ATTENTION_INTERVAL - 1
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arch {
    type Err = SynthError;

    fn from_str(name: &str) -> Result<Arch, SynthError> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| SynthError::UnknownArch { arch: name.to_string(), supported: SUPPORTED_ARCHS.to_vec() })
    }
}

/// Gated DeltaNet (linear attention) dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearAttentionDims {
    pub num_key_heads: u64,
    pub num_value_heads: u64,
    pub key_head_dim: u64,
    pub value_head_dim: u64,
    pub conv_kernel: u64,
}

/// Multi-head latent attention dimensions (DeepSeek-V3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatentAttentionDims {
    /// Rank of the query compression (`q_a_proj` rows).
    pub q_lora_rank: u64,
    /// Rank of the key/value compression (`kv_a_proj_with_mqa` rows, without the rope part).
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// The dimensions of a synthetic model, named like `config.json` fields. Fields an architecture
/// does not use are ignored (and left out of its `config.json`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelDims {
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    /// Dense MLP width; for Mixtral, the width of every expert.
    pub intermediate_size: u64,
    pub vocab_size: u64,
    pub num_experts: u64,
    /// Width of a routed expert (not Mixtral).
    pub moe_intermediate_size: u64,
    pub shared_expert_intermediate_size: u64,
    /// Required by hybrid architectures.
    pub linear: Option<LinearAttentionDims>,
    /// Required by DeepSeek-V3 (whose `head_dim` is `qk_rope_head_dim` and whose
    /// `num_key_value_heads` is `num_attention_heads`, as its config has them).
    pub mla: Option<LatentAttentionDims>,
    /// DeepSeek-V3: the first layers have a dense MLP (`first_k_dense_replace`).
    pub first_dense_layers: u64,
    /// DeepSeek-V3: multi-token-prediction layers stored after the decoder
    /// (`num_nextn_predict_layers`), each a routed-expert decoder layer with its own norms,
    /// `eh_proj`, and copies of the embedding and output head.
    pub mtp_layers: u64,
}

impl ModelDims {
    /// Experts each token is routed to, as the real configs set it (2 of 8 … 10 of 512).
    pub(crate) fn experts_per_token(&self, arch: Arch) -> u64 {
        match arch {
            Arch::Mixtral => 2.min(self.num_experts),
            _ => (self.num_experts / 16).clamp(2, 10).min(self.num_experts),
        }
    }
}

/// One width of the size ladder; the layer count and the vocabulary are fitted afterwards.
pub(crate) struct Width {
    pub(crate) hidden: u64,
    pub(crate) head_dim: u64,
    pub(crate) kv_heads: u64,
    pub(crate) intermediate: u64,
    /// `None`: the architecture's real vocabulary.
    pub(crate) vocab: Option<u64>,
    pub(crate) experts: u64,
    pub(crate) moe_intermediate: u64,
    /// `(linear_num_key_heads, linear_num_value_heads, linear_{key,value}_head_dim)`.
    pub(crate) linear: (u64, u64, u64),
}

/// Widths from narrowest to widest, shaped like real models of that width (Llama-3.2-3B at
/// 3072, Llama-3-8B at 4096, Qwen3-14B at 5120, Llama-3-70B at 8192). From 1024 up: head_dim 128,
/// GQA, real vocabularies, 64–128 routed experts of 3/8 of the hidden size (Qwen3-30B-A3B has
/// 768 at 2048), GDN with 128-dim heads and twice as many value heads as key heads (16/32 at
/// 2048, as Qwen3-Next and Qwen3.5-35B-A3B). Narrower widths scale everything down, with made-up
/// vocabularies. DeepSeek-V3 takes its dimensions from the width as [`Width::dims`] describes.
pub(crate) const WIDTHS: &[Width] = &[
    Width {
        hidden: 64,
        head_dim: 16,
        kv_heads: 2,
        intermediate: 128,
        vocab: Some(512),
        experts: 8,
        moe_intermediate: 32,
        linear: (2, 4, 16),
    },
    Width {
        hidden: 128,
        head_dim: 32,
        kv_heads: 2,
        intermediate: 352,
        vocab: Some(2048),
        experts: 8,
        moe_intermediate: 48,
        linear: (2, 4, 32),
    },
    Width {
        hidden: 256,
        head_dim: 64,
        kv_heads: 2,
        intermediate: 704,
        vocab: Some(8192),
        experts: 16,
        moe_intermediate: 96,
        linear: (2, 4, 64),
    },
    Width {
        hidden: 512,
        head_dim: 64,
        kv_heads: 4,
        intermediate: 1408,
        vocab: Some(32_768),
        experts: 32,
        moe_intermediate: 192,
        linear: (4, 8, 64),
    },
    Width {
        hidden: 1024,
        head_dim: 128,
        kv_heads: 4,
        intermediate: 2816,
        vocab: None,
        experts: 64,
        moe_intermediate: 384,
        linear: (8, 16, 128),
    },
    Width {
        hidden: 2048,
        head_dim: 128,
        kv_heads: 4,
        intermediate: 6144,
        vocab: None,
        experts: 128,
        moe_intermediate: 768,
        linear: (16, 32, 128),
    },
    Width {
        hidden: 3072,
        head_dim: 128,
        kv_heads: 8,
        intermediate: 8192,
        vocab: None,
        experts: 128,
        moe_intermediate: 1152,
        linear: (24, 48, 128),
    },
    Width {
        hidden: 4096,
        head_dim: 128,
        kv_heads: 8,
        intermediate: 14_336,
        vocab: None,
        experts: 128,
        moe_intermediate: 1536,
        linear: (32, 64, 128),
    },
    Width {
        hidden: 5120,
        head_dim: 128,
        kv_heads: 8,
        intermediate: 17_408,
        vocab: None,
        experts: 128,
        moe_intermediate: 1920,
        linear: (40, 80, 128),
    },
    Width {
        hidden: 8192,
        head_dim: 128,
        kv_heads: 8,
        intermediate: 28_672,
        vocab: None,
        experts: 128,
        moe_intermediate: 3072,
        linear: (64, 128, 128),
    },
];

/// `x` rounded to the nearest multiple of `m`, at least `m`.
fn round_to(x: u64, m: u64) -> u64 {
    (x.saturating_add(m / 2) / m).max(1) * m
}

impl Width {
    /// The dimensions of an `arch` model of this width with `num_layers` decoder layers.
    ///
    /// DeepSeek-V3 (hidden 7168; heads of `qk_nope_head_dim` 128, `qk_rope_head_dim` 64 and
    /// `v_head_dim` 128; `q_lora_rank` 1536, `kv_lora_rank` 512; experts 2048 wide, one shared;
    /// a dense MLP nine experts wide; three dense layers) is scaled to the width: `hidden /
    /// head_dim` heads of the width's head_dim (rope half of it), `q_lora_rank` 3/14 and expert
    /// width 2/7 of the hidden size, `kv_lora_rank` half of it up to 512, the width's expert
    /// count, three dense layers from 4096 up and one below, no MTP layer. From 1024 up, ranks and
    /// widths are multiples of 128 (whole FP8 blocks, as in the real model; at 7168 this gives
    /// exactly its 1536 and 2048), so every dimension tensor parallelism splits (heads, expert
    /// and dense MLP widths) is a multiple of 8.
    pub(crate) fn dims(&self, arch: Arch, num_layers: u64) -> ModelDims {
        if arch == Arch::DeepseekV3 {
            return self.deepseek_v3_dims(num_layers);
        }
        let (nk, nv, d) = self.linear;
        ModelDims {
            hidden_size: self.hidden,
            num_layers,
            num_attention_heads: self.hidden / self.head_dim,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate,
            vocab_size: self.vocab.unwrap_or_else(|| arch.real_vocab()),
            num_experts: if arch == Arch::Mixtral { 8 } else { self.experts },
            moe_intermediate_size: self.moe_intermediate,
            shared_expert_intermediate_size: self.moe_intermediate,
            linear: arch.is_hybrid().then_some(LinearAttentionDims {
                num_key_heads: nk,
                num_value_heads: nv,
                key_head_dim: d,
                value_head_dim: d,
                conv_kernel: 4,
            }),
            mla: None,
            first_dense_layers: 0,
            mtp_layers: 0,
        }
    }

    fn deepseek_v3_dims(&self, num_layers: u64) -> ModelDims {
        let h = self.hidden;
        let step = if h >= 1024 { 128 } else { 8 };
        let heads = h / self.head_dim;
        let expert = round_to(h * 2 / 7, step);
        let mla = LatentAttentionDims {
            q_lora_rank: round_to(h * 3 / 14, step),
            kv_lora_rank: (h / 2).min(512),
            qk_nope_head_dim: self.head_dim,
            qk_rope_head_dim: self.head_dim / 2,
            v_head_dim: self.head_dim,
        };
        ModelDims {
            hidden_size: h,
            num_layers,
            num_attention_heads: heads,
            num_key_value_heads: heads,
            head_dim: mla.qk_rope_head_dim,
            intermediate_size: 9 * expert,
            vocab_size: self.vocab.unwrap_or_else(|| Arch::DeepseekV3.real_vocab()),
            num_experts: self.experts,
            moe_intermediate_size: expert,
            shared_expert_intermediate_size: expert,
            linear: None,
            mla: Some(mla),
            first_dense_layers: if h >= 4096 { 3 } else { 1 },
            mtp_layers: 0,
        }
    }
}
