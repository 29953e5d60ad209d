//! Mapping tables: which HF tensors become which Megatron parameters, and how.
//!
//! The tables are data. `{L}` stands for a layer index and `{E}` for an expert index. A rule
//! applies to a layer when its guard tensor exists in the release (by default its first source),
//! which is how one table serves layers of different types (attention vs GDN, dense vs MoE).
//! Names follow the Transformer-Engine layer spec (fused `layer_norm_weight`s) and grouped experts.

use crate::config::Family;
use crate::dtype::DType;

/// How a Megatron parameter is split across tensor-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TpMode {
    /// Split on dim 0 (column-parallel linear, vocab-parallel embedding, GDN per-head vectors).
    Column,
    /// Split on dim 1 (row-parallel linear).
    Row,
    /// Identical on every TP rank (norms, router).
    Replicated,
}

/// How the source tensors combine into the parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The tensor as it is.
    Copy(TpMode),
    /// `weight − 1`, for zero-centred RMSNorms (computed as torch computes it in the dtype).
    ZeroCentered(TpMode),
    /// Column-parallel vocab tensor, padded with zero rows to a multiple of `divisor·tp`.
    Vocab,
    /// q, k, v interleaved per query group (with output-gate heads when q_proj has 2·nh·d rows).
    Qkv,
    /// gate, up → `_w`, `_v`.
    GatedMlp,
    /// Qwen3-Next `in_proj_qkvz`, `in_proj_ba` → `.query .key .value .z .beta .alpha`.
    GdnInProjQkvz,
    /// Qwen3.5 `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` → the same six sections.
    GdnInProjSplit,
    /// GDN `conv1d.weight [2qk+v, 1, K]` → `.query .key .value`.
    GdnConv1d,
    /// Packed experts `gate_up_proj [E, 2F, H]` → per expert `_w`, `_v`.
    PackedGatedExperts,
    /// Packed experts `down_proj [E, H, F]` → per expert, row-parallel.
    PackedExpertsDown,
    /// No Megatron tensor: the release tensor is consumed and reported as not converted (an MTP
    /// layer's copies of the embedding and output layer, which Megatron's MTP shares).
    NotConverted,
    /// gpt-oss MXFP4 `gate_up_proj_blocks [E, 2F, H/32, 16]` + `_scales [E, 2F, H/32]` → per
    /// expert fc1 `[2F, H]`: gate = even rows, up = odd rows, kept fused on disk (not SwiGLU, so
    /// Megatron does not split it), hence `[gate_r; up_r]` per expert-TP rank.
    Mxfp4GateUp,
    /// gpt-oss `gate_up_proj_bias [E, 2F]` → per expert fc1 bias, interleaved like the weight.
    InterleavedGateUpBias,
    /// gpt-oss MXFP4 `down_proj_blocks [E, H, F/32, 16]` + `_scales` → per expert fc2 `[H, F]`.
    Mxfp4Down,
    /// Packed per-expert rows `[E, X]` → expert `E`'s `[X]` (gpt-oss `down_proj_bias`).
    PackedExpertRow(TpMode),
    /// gpt-oss's bf16 experts `gate_up_proj [E, H, 2F]` → per expert fc1 `[2F, H]`, transposed:
    /// gate = even columns, up = odd columns, fused on disk like [`Kind::Mxfp4GateUp`].
    TransposedGateUp,
    /// gpt-oss's bf16 experts `down_proj [E, F, H]` → per expert fc2 `[H, F]`, transposed.
    TransposedDown,
    /// Qwen3-VL-MoE's experts `gate_up_proj [E, H, 2F]` → per expert `_w` = columns `[0, F)`
    /// transposed, `_v` = columns `[F, 2F)` transposed (contiguous halves, not interleaved).
    TransposedGatedExperts,
    /// A vision tower's fused `qkv` (weight `[3·Hv, Hv]` or bias `[3·Hv]`, HF's `[q; k; v]`, one
    /// key/value head per query head) → per head `[q_h; k_h; v_h]`, column-parallel; heads and
    /// `Hv` from `vision_config` (Megatron-Bridge `ConcatenatedQKVMapping`).
    VisionQkv,
}

/// One line of a mapping table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Megatron parameter name (without the checkpoint prefix).
    pub megatron: &'static str,
    /// HF tensor names, in the order the kind expects them.
    pub hf: &'static [&'static str],
    pub kind: Kind,
    /// HF tensor whose presence selects this rule for a layer (default: `hf[0]`).
    pub guard: Option<&'static str>,
    /// Whether the rule is instantiated per expert (`{E}`) and lives on the expert mesh.
    pub expert: bool,
    /// The dtype Megatron keeps the parameter in, whatever the release holds (the router's
    /// float32 `expert_bias`); else the family's (see [`output_dtype`]).
    pub dtype: Option<DType>,
}

const fn rule(megatron: &'static str, kind: Kind, hf: &'static [&'static str]) -> Rule {
    Rule { megatron, hf, kind, guard: None, expert: false, dtype: None }
}

const fn guarded(megatron: &'static str, kind: Kind, hf: &'static [&'static str], guard: &'static str) -> Rule {
    Rule { megatron, hf, kind, guard: Some(guard), expert: false, dtype: None }
}

const fn expert(megatron: &'static str, kind: Kind, hf: &'static [&'static str]) -> Rule {
    Rule { megatron, hf, kind, guard: None, expert: true, dtype: None }
}

const fn in_dtype(megatron: &'static str, kind: Kind, hf: &'static [&'static str], dtype: DType) -> Rule {
    Rule { megatron, hf, kind, guard: None, expert: false, dtype: Some(dtype) }
}

use Kind::*;
use TpMode::*;

const EMBEDDING: &[Rule] = &[
    rule("embedding.word_embeddings.weight", Vocab, &["model.embed_tokens.weight"]),
    rule("output_layer.weight", Vocab, &["lm_head.weight"]),
    rule("decoder.final_layernorm.weight", Copy(Replicated), &["model.norm.weight"]),
];

const ATTENTION: &[Rule] = &[
    rule(
        "decoder.layers.{L}.self_attention.linear_qkv.weight",
        Qkv,
        &[
            "model.layers.{L}.self_attn.q_proj.weight",
            "model.layers.{L}.self_attn.k_proj.weight",
            "model.layers.{L}.self_attn.v_proj.weight",
        ],
    ),
    guarded(
        "decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight",
        Copy(Replicated),
        &["model.layers.{L}.input_layernorm.weight"],
        "model.layers.{L}.self_attn.q_proj.weight",
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_proj.weight",
        Copy(Row),
        &["model.layers.{L}.self_attn.o_proj.weight"],
    ),
];

const QKV_BIAS: &[Rule] = &[rule(
    "decoder.layers.{L}.self_attention.linear_qkv.bias",
    Qkv,
    &[
        "model.layers.{L}.self_attn.q_proj.bias",
        "model.layers.{L}.self_attn.k_proj.bias",
        "model.layers.{L}.self_attn.v_proj.bias",
    ],
)];

const QK_NORM: &[Rule] = &[
    rule(
        "decoder.layers.{L}.self_attention.q_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.q_norm.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.k_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.k_norm.weight"],
    ),
];

const DENSE_MLP: &[Rule] = &[
    rule(
        "decoder.layers.{L}.mlp.linear_fc1.weight",
        GatedMlp,
        &["model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"],
    ),
    guarded(
        "decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
        Copy(Replicated),
        &["model.layers.{L}.post_attention_layernorm.weight"],
        "model.layers.{L}.mlp.gate_proj.weight",
    ),
    rule("decoder.layers.{L}.mlp.linear_fc2.weight", Copy(Row), &["model.layers.{L}.mlp.down_proj.weight"]),
];

const MOE: &[Rule] = &[
    rule("decoder.layers.{L}.mlp.router.weight", Copy(Replicated), &["model.layers.{L}.mlp.gate.weight"]),
    guarded(
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.post_attention_layernorm.weight"],
        "model.layers.{L}.mlp.gate.weight",
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        GatedMlp,
        &["model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        Copy(Row),
        &["model.layers.{L}.mlp.experts.{E}.down_proj.weight"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        PackedGatedExperts,
        &["model.layers.{L}.mlp.experts.gate_up_proj"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        PackedExpertsDown,
        &["model.layers.{L}.mlp.experts.down_proj"],
    ),
];

const MIXTRAL_MOE: &[Rule] = &[
    rule("decoder.layers.{L}.mlp.router.weight", Copy(Replicated), &["model.layers.{L}.block_sparse_moe.gate.weight"]),
    guarded(
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.post_attention_layernorm.weight"],
        "model.layers.{L}.block_sparse_moe.gate.weight",
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        GatedMlp,
        &[
            "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
            "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
        ],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        Copy(Row),
        &["model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"],
    ),
];

const SHARED_EXPERT: &[Rule] = &[
    rule(
        "decoder.layers.{L}.mlp.shared_experts.linear_fc1.weight",
        GatedMlp,
        &["model.layers.{L}.mlp.shared_expert.gate_proj.weight", "model.layers.{L}.mlp.shared_expert.up_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.mlp.shared_experts.linear_fc2.weight",
        Copy(Row),
        &["model.layers.{L}.mlp.shared_expert.down_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.mlp.shared_experts.gate_weight",
        Copy(Replicated),
        &["model.layers.{L}.mlp.shared_expert_gate.weight"],
    ),
];

const GDN_COMMON: &[Rule] = &[
    guarded(
        "decoder.layers.{L}.self_attention.in_proj.layer_norm_weight",
        Copy(Replicated),
        &["model.layers.{L}.input_layernorm.weight"],
        "model.layers.{L}.linear_attn.conv1d.weight",
    ),
    rule("decoder.layers.{L}.self_attention.conv1d.weight", GdnConv1d, &["model.layers.{L}.linear_attn.conv1d.weight"]),
    rule("decoder.layers.{L}.self_attention.A_log", Copy(Column), &["model.layers.{L}.linear_attn.A_log"]),
    rule("decoder.layers.{L}.self_attention.dt_bias", Copy(Column), &["model.layers.{L}.linear_attn.dt_bias"]),
    rule(
        "decoder.layers.{L}.self_attention.out_proj.weight",
        Copy(Row),
        &["model.layers.{L}.linear_attn.out_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.out_norm.weight",
        ZeroCentered(Replicated),
        &["model.layers.{L}.linear_attn.norm.weight"],
    ),
];

const GDN_QKVZ: &[Rule] = &[rule(
    "decoder.layers.{L}.self_attention.in_proj.weight",
    GdnInProjQkvz,
    &["model.layers.{L}.linear_attn.in_proj_qkvz.weight", "model.layers.{L}.linear_attn.in_proj_ba.weight"],
)];

const GDN_SPLIT: &[Rule] = &[rule(
    "decoder.layers.{L}.self_attention.in_proj.weight",
    GdnInProjSplit,
    &[
        "model.layers.{L}.linear_attn.in_proj_qkv.weight",
        "model.layers.{L}.linear_attn.in_proj_z.weight",
        "model.layers.{L}.linear_attn.in_proj_b.weight",
        "model.layers.{L}.linear_attn.in_proj_a.weight",
    ],
)];

/// gpt-oss attention extras: the output projection's bias (replicated: the bias of a
/// row-parallel linear) and the attention sinks (Megatron `softmax_offset`, split by heads).
const GPT_OSS_ATTENTION: &[Rule] = &[
    rule(
        "decoder.layers.{L}.self_attention.linear_proj.bias",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.o_proj.bias"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.core_attention.softmax_offset",
        Copy(Column),
        &["model.layers.{L}.self_attn.sinks"],
    ),
];

/// gpt-oss MoE: a biased router and packed experts with biases (archs-2025.md §3.4).
const GPT_OSS_MOE: &[Rule] = &[
    rule("decoder.layers.{L}.mlp.router.weight", Copy(Replicated), &["model.layers.{L}.mlp.router.weight"]),
    rule("decoder.layers.{L}.mlp.router.bias", Copy(Replicated), &["model.layers.{L}.mlp.router.bias"]),
    guarded(
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.post_attention_layernorm.weight"],
        "model.layers.{L}.mlp.router.weight",
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        Mxfp4GateUp,
        &["model.layers.{L}.mlp.experts.gate_up_proj_blocks", "model.layers.{L}.mlp.experts.gate_up_proj_scales"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.bias{E}",
        InterleavedGateUpBias,
        &["model.layers.{L}.mlp.experts.gate_up_proj_bias"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        Mxfp4Down,
        &["model.layers.{L}.mlp.experts.down_proj_blocks", "model.layers.{L}.mlp.experts.down_proj_scales"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.bias{E}",
        PackedExpertRow(Replicated),
        &["model.layers.{L}.mlp.experts.down_proj_bias"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        TransposedGateUp,
        &["model.layers.{L}.mlp.experts.gate_up_proj"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        TransposedDown,
        &["model.layers.{L}.mlp.experts.down_proj"],
    ),
];

/// Qwen3-VL-MoE: router and packed experts in the release layout `[E, in, out]`.
const QWEN3_VL_MOE: &[Rule] = &[
    rule("decoder.layers.{L}.mlp.router.weight", Copy(Replicated), &["model.layers.{L}.mlp.gate.weight"]),
    guarded(
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.post_attention_layernorm.weight"],
        "model.layers.{L}.mlp.gate.weight",
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        TransposedGatedExperts,
        &["model.layers.{L}.mlp.experts.gate_up_proj"],
    ),
    expert(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        TransposedDown,
        &["model.layers.{L}.mlp.experts.down_proj"],
    ),
];

/// Routed experts' score-correction bias: a float32 buffer of Megatron's router.
const EXPERT_BIAS: &[Rule] = &[in_dtype(
    "decoder.layers.{L}.mlp.router.expert_bias",
    Copy(Replicated),
    &["model.layers.{L}.mlp.gate.e_score_correction_bias"],
    DType::F32,
)];

/// Shared experts as DeepSeek and GLM name them (`shared_experts`, no gate).
const SHARED_EXPERTS: &[Rule] = &[
    rule(
        "decoder.layers.{L}.mlp.shared_experts.linear_fc1.weight",
        GatedMlp,
        &["model.layers.{L}.mlp.shared_experts.gate_proj.weight", "model.layers.{L}.mlp.shared_experts.up_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.mlp.shared_experts.linear_fc2.weight",
        Copy(Row),
        &["model.layers.{L}.mlp.shared_experts.down_proj.weight"],
    ),
];

/// Multi-head latent attention (DeepSeek-V3, Kimi-K2). The down projections are Megatron
/// `TELinear(parallel_mode="duplicated")`: replicated across TP; the up projections split by
/// heads (their rows are per head, `[nope; rope]` or `[nope; v]`, kept as they are).
const MLA: &[Rule] = &[
    guarded(
        "decoder.layers.{L}.input_layernorm.weight",
        Copy(Replicated),
        &["model.layers.{L}.input_layernorm.weight"],
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_q_down_proj.weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.q_a_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_q_up_proj.layer_norm_weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.q_a_layernorm.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_q_up_proj.weight",
        Copy(Column),
        &["model.layers.{L}.self_attn.q_b_proj.weight"],
    ),
    // Models without `q_lora_rank` project queries directly.
    rule(
        "decoder.layers.{L}.self_attention.linear_q_proj.weight",
        Copy(Column),
        &["model.layers.{L}.self_attn.q_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_kv_down_proj.weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_kv_up_proj.layer_norm_weight",
        Copy(Replicated),
        &["model.layers.{L}.self_attn.kv_a_layernorm.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_kv_up_proj.weight",
        Copy(Column),
        &["model.layers.{L}.self_attn.kv_b_proj.weight"],
    ),
    rule(
        "decoder.layers.{L}.self_attention.linear_proj.weight",
        Copy(Row),
        &["model.layers.{L}.self_attn.o_proj.weight"],
    ),
];

/// The MTP layers DeepSeek-V3 and GLM-4.5 store after the decoder (`model.layers.{N+k}`); their
/// decoder sub-layer reuses the decoder tables (see [`MtpStyle::AfterDecoder`]).
const MTP_AFTER_DECODER: &[Rule] = &[
    rule("mtp.layers.{L}.enorm.weight", Copy(Replicated), &["model.layers.{L}.enorm.weight"]),
    rule("mtp.layers.{L}.hnorm.weight", Copy(Replicated), &["model.layers.{L}.hnorm.weight"]),
    rule("mtp.layers.{L}.eh_proj.weight", Copy(Column), &["model.layers.{L}.eh_proj.weight"]),
    rule("mtp.layers.{L}.final_layernorm.weight", Copy(Replicated), &["model.layers.{L}.shared_head.norm.weight"]),
    rule("mtp.layers.{L}.embed_tokens", NotConverted, &["model.layers.{L}.embed_tokens.weight"]),
    rule("mtp.layers.{L}.shared_head.head", NotConverted, &["model.layers.{L}.shared_head.head.weight"]),
];

/// Multi-token-prediction head of Qwen3-Next (`mtp.*`); its transformer layer reuses the decoder
/// tables with the `mtp.layers.{L}.` prefixes (see [`MtpStyle::Separate`]).
const MTP_HEAD: &[Rule] = &[
    rule("mtp.layers.0.eh_proj.weight", Copy(Column), &["mtp.fc.weight"]),
    rule("mtp.layers.0.enorm.weight", Copy(Replicated), &["mtp.pre_fc_norm_embedding.weight"]),
    rule("mtp.layers.0.hnorm.weight", Copy(Replicated), &["mtp.pre_fc_norm_hidden.weight"]),
    rule("mtp.layers.0.final_layernorm.weight", Copy(Replicated), &["mtp.norm.weight"]),
];

/// The Megatron ViT Megatron-Bridge builds for Qwen3-VL and Qwen3.5 (NVIDIA-NeMo/Megatron-Bridge
/// 067f987d): blocks, merger, patch and position embeddings. Qwen3.5: qwen35_vl_bridge.py
/// `_get_vision_mappings` L71-142, used by both `Qwen35VLMoEBridge` L231-281 and `Qwen35VLBridge`
/// L350-367, the ViT from qwen35_vl_provider.py `_qwen35_build_vision_encoder_spec` L587-612.
/// Qwen3-VL: qwen3_vl_bridge.py `Qwen3VLMoEBridge.mapping_registry` L284-399 (the same vision
/// lines L320-345 and L379-395, which `Qwen3VLBridge` L111-198 repeats), the ViT from
/// modelling_qwen3_vl/model.py L347-370 (Megatron-Bridge 0.3.1 embedded transformers' HF module
/// instead, archs-2025.md §3.5; main no longer does). Either way the TE ViT layer spec and a
/// `TENorm` / `TEColumnParallelLinear` / `TERowParallelLinear` merger, so the tower is TP-split
/// like a decoder: AutoMapping's module classes (param_mapping.py L1399-1520) make `linear_qkv`
/// and `linear_fc1` column, `linear_proj` and `linear_fc2` row (their 1-D biases replicated,
/// `RowParallelMapping` L1111-1269), norms replicated; patch and position embeddings are
/// `ReplicatedMapping`s. `{L}` is a vision block (`vision_config.depth`). The release tensors are
/// transformers 5.24's `Qwen3_5MoeVisionModel` (modeling_qwen3_5_moe.py L1051-1262; the dense
/// `Qwen3_5VisionModel`, modeling_qwen3_5.py L941-1150, has the same) or `Qwen3VLMoeVisionModel`.
/// The MLP is GELU (`gated_linear_unit = False`, modelling_qwen3_vl/transformer_config.py L114),
/// and Megatron-Core as Megatron-Bridge pins it (NVIDIA/Megatron-LM 2a75ac12,
/// transformer/fsdp_dtensor_checkpoint.py `handle_swiglu_in_state_dict` L194-388) splits
/// `linear_fc1` only in `TransformerLayer`s with `gated_linear_unit`: the vision fc1 stays whole
/// on disk (Megatron-Core 0.16.1 split it by key alone, hence 0.3.1's `_w`/`_v`, archs-2025.md §3.5).
const MEGATRON_VIT: &[Rule] = &[
    rule("vision_model.patch_embed.proj.weight", Copy(Replicated), &["model.visual.patch_embed.proj.weight"]),
    rule("vision_model.patch_embed.proj.bias", Copy(Replicated), &["model.visual.patch_embed.proj.bias"]),
    rule("vision_model.pos_embed.weight", Copy(Replicated), &["model.visual.pos_embed.weight"]),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight",
        Copy(Replicated),
        &["model.visual.blocks.{L}.norm1.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_qkv.layer_norm_bias",
        Copy(Replicated),
        &["model.visual.blocks.{L}.norm1.bias"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_qkv.weight",
        VisionQkv,
        &["model.visual.blocks.{L}.attn.qkv.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_qkv.bias",
        VisionQkv,
        &["model.visual.blocks.{L}.attn.qkv.bias"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_proj.weight",
        Copy(Row),
        &["model.visual.blocks.{L}.attn.proj.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.self_attention.linear_proj.bias",
        Copy(Replicated),
        &["model.visual.blocks.{L}.attn.proj.bias"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
        Copy(Replicated),
        &["model.visual.blocks.{L}.norm2.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc1.layer_norm_bias",
        Copy(Replicated),
        &["model.visual.blocks.{L}.norm2.bias"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc1.weight",
        Copy(Column),
        &["model.visual.blocks.{L}.mlp.linear_fc1.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc1.bias",
        Copy(Column),
        &["model.visual.blocks.{L}.mlp.linear_fc1.bias"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc2.weight",
        Copy(Row),
        &["model.visual.blocks.{L}.mlp.linear_fc2.weight"],
    ),
    rule(
        "vision_model.decoder.layers.{L}.mlp.linear_fc2.bias",
        Copy(Replicated),
        &["model.visual.blocks.{L}.mlp.linear_fc2.bias"],
    ),
    rule("vision_model.merger.patch_norm.weight", Copy(Replicated), &["model.visual.merger.norm.weight"]),
    rule("vision_model.merger.patch_norm.bias", Copy(Replicated), &["model.visual.merger.norm.bias"]),
    rule("vision_model.merger.linear_fc1.weight", Copy(Column), &["model.visual.merger.linear_fc1.weight"]),
    rule("vision_model.merger.linear_fc1.bias", Copy(Column), &["model.visual.merger.linear_fc1.bias"]),
    rule("vision_model.merger.linear_fc2.weight", Copy(Row), &["model.visual.merger.linear_fc2.weight"]),
    rule("vision_model.merger.linear_fc2.bias", Copy(Replicated), &["model.visual.merger.linear_fc2.bias"]),
];

/// Qwen3-VL's deepstack mergers (Megatron-Bridge 067f987d, qwen3_vl_bridge.py L333-339): one
/// per `vision_config.deepstack_visual_indexes` entry, under the ViT's `decoder.`
/// (modelling_qwen3_vl/transformer_block.py L89-100), built like the final merger
/// (`Qwen3VLVisionPatchMerger`, modelling_qwen3_vl/utils.py L112-180, its norm over the
/// spatially merged width) and TP-split as it is. `{L}` is a merger, fewer than the blocks.
const DEEPSTACK_MERGERS: &[Rule] = &[
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.patch_norm.weight",
        Copy(Replicated),
        &["model.visual.deepstack_merger_list.{L}.norm.weight"],
    ),
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.patch_norm.bias",
        Copy(Replicated),
        &["model.visual.deepstack_merger_list.{L}.norm.bias"],
    ),
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.linear_fc1.weight",
        Copy(Column),
        &["model.visual.deepstack_merger_list.{L}.linear_fc1.weight"],
    ),
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.linear_fc1.bias",
        Copy(Column),
        &["model.visual.deepstack_merger_list.{L}.linear_fc1.bias"],
    ),
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.linear_fc2.weight",
        Copy(Row),
        &["model.visual.deepstack_merger_list.{L}.linear_fc2.weight"],
    ),
    rule(
        "vision_model.decoder.deepstack_merger_list.{L}.linear_fc2.bias",
        Copy(Replicated),
        &["model.visual.deepstack_merger_list.{L}.linear_fc2.bias"],
    ),
];

/// Where a release keeps its multi-token-prediction layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtpStyle {
    /// Under `mtp.layers.{k}.` (Qwen3-Next, Qwen3.5).
    Separate,
    /// As decoder layers `model.layers.{N+k}.` after the `N` decoder layers (DeepSeek-V3,
    /// GLM-4.5; `num_nextn_predict_layers` of them).
    AfterDecoder,
}

impl MtpStyle {
    /// Prefix pair `(megatron, hf)` that re-targets a decoder-layer rule at MTP layer `{L}`.
    pub fn prefixes(self) -> (&'static str, &'static str) {
        match self {
            MtpStyle::Separate => ("mtp.layers.{L}.transformer_layer.", "mtp.layers.{L}."),
            MtpStyle::AfterDecoder => ("mtp.layers.{L}.transformer_layer.", "model.layers.{L}."),
        }
    }
}

/// The tables of a family, and where its decoder-layer rules also apply to MTP layers.
pub fn tables(family: Family) -> (&'static [&'static [Rule]], Option<MtpStyle>) {
    match family {
        Family::Llama => (&[EMBEDDING, ATTENTION, DENSE_MLP], None),
        Family::Qwen2 => (&[EMBEDDING, ATTENTION, QKV_BIAS, DENSE_MLP], None),
        Family::Qwen3 => (&[EMBEDDING, ATTENTION, QK_NORM, DENSE_MLP], None),
        Family::Qwen3Moe => (&[EMBEDDING, ATTENTION, QK_NORM, MOE, DENSE_MLP], None),
        Family::Mixtral => (&[EMBEDDING, ATTENTION, MIXTRAL_MOE], None),
        Family::Qwen3Next => (
            &[EMBEDDING, ATTENTION, QK_NORM, GDN_COMMON, GDN_QKVZ, MOE, SHARED_EXPERT, DENSE_MLP, MTP_HEAD],
            Some(MtpStyle::Separate),
        ),
        Family::Qwen35 => (
            &[EMBEDDING, ATTENTION, QK_NORM, GDN_COMMON, GDN_SPLIT, MOE, SHARED_EXPERT, DENSE_MLP, MTP_HEAD],
            Some(MtpStyle::Separate),
        ),
        Family::DeepseekV3 => (
            &[EMBEDDING, MLA, DENSE_MLP, MOE, EXPERT_BIAS, SHARED_EXPERTS, MTP_AFTER_DECODER],
            Some(MtpStyle::AfterDecoder),
        ),
        Family::Glm4Moe => (
            &[EMBEDDING, ATTENTION, QKV_BIAS, QK_NORM, DENSE_MLP, MOE, EXPERT_BIAS, SHARED_EXPERTS, MTP_AFTER_DECODER],
            Some(MtpStyle::AfterDecoder),
        ),
        Family::GptOss => (&[EMBEDDING, ATTENTION, QKV_BIAS, GPT_OSS_ATTENTION, GPT_OSS_MOE], None),
        Family::Qwen3VlMoe => (&[EMBEDDING, ATTENTION, QKV_BIAS, QK_NORM, QWEN3_VL_MOE, DENSE_MLP], None),
    }
}

/// The dtype every parameter of the family is kept in on disk unless its rule says otherwise
/// (`None`: the release's). Megatron-Bridge loads DeepSeek-V3 and GLM-4.5 into bf16 models.
pub fn output_dtype(family: Family) -> Option<DType> {
    match family {
        Family::DeepseekV3 | Family::Glm4Moe | Family::GptOss => Some(DType::BF16),
        _ => None,
    }
}

/// Whether attention of this family may carry output-gate heads in `q_proj`.
pub fn has_gated_attention(family: Family) -> bool {
    matches!(family, Family::Qwen3Next | Family::Qwen35)
}

/// Where a family's language-model keys live in Megatron, before the table's names, when the
/// release holds no vision tower (Qwen3-VL's model wraps its decoder as `language_model` always;
/// with a tower, [`VisionTower::language_prefix`] says).
pub fn megatron_prefix(family: Family) -> &'static str {
    match family {
        Family::Qwen3VlMoe => "language_model.",
        _ => "",
    }
}

/// A family's vision tower: Megatron's own ViT, mapped by the rules of `tables` (full names,
/// `{L}` a vision block or merger). It converts when the release holds a tensor under
/// `hf_prefix`; the language model then lives under `language_prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VisionTower {
    pub hf_prefix: &'static str,
    pub megatron_prefix: &'static str,
    pub language_prefix: &'static str,
    pub tables: &'static [&'static [Rule]],
}

/// The vision tower of a family whose releases may hold one.
pub fn vision_tower(family: Family) -> Option<VisionTower> {
    let tower = |tables| VisionTower {
        hf_prefix: "model.visual.",
        megatron_prefix: "vision_model.",
        language_prefix: "language_model.",
        tables,
    };
    match family {
        // Megatron-Bridge 067f987d, qwen3_vl_bridge.py L301-345: the language model under
        // `language_model.`, the vision tower (with its deepstack mergers) under `vision_model.`.
        Family::Qwen3VlMoe => Some(tower(&[MEGATRON_VIT, DEEPSTACK_MERGERS])),
        // Megatron-Bridge 067f987d, qwen35_vl_bridge.py L270-280 and L362-366: the language model
        // under `language_model.` (MTP layers included), the vision tower under `vision_model.`.
        Family::Qwen35 => Some(tower(&[MEGATRON_VIT])),
        _ => None,
    }
}

/// Prefixes of release tensors that are knowingly not converted (reported by name, never dropped
/// silently): the vision tower of multimodal releases.
pub const UNCONVERTED_PREFIXES: &[&str] = &["model.visual.", "visual."];

/// Why a release tensor the plan lists as unconverted has no Megatron tensor.
pub fn why_not_converted(name: &str) -> &'static str {
    if UNCONVERTED_PREFIXES.iter().any(|p| name.starts_with(p) || name.contains(".visual.")) {
        "vision tower"
    } else if name.ends_with(".embed_tokens.weight") || name.ends_with(".shared_head.head.weight") {
        "an MTP layer's copy of the embedding or output layer, which Megatron's MTP shares"
    } else {
        "not converted"
    }
}

/// One line of a family's mapping table as `shardline archs <model_type>` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableLine {
    /// HF tensor patterns (`{L}` layer, `{E}` expert), in the order the kind takes them.
    pub hf: Vec<&'static str>,
    pub megatron: &'static str,
    /// How the sources combine (`copy`, `qkv`, `gated`, …).
    pub kind: &'static str,
    /// `column` (dim 0), `row` (dim 1), `replicated`, or `—` for what is not converted.
    pub tp: &'static str,
    /// Value transform or dtype, when any (`cast → F32`, `weight − 1`, …).
    pub transform: String,
    pub expert: bool,
}

/// The mapping table of `family`, line by line, in table order.
pub fn describe(family: Family) -> Vec<TableLine> {
    let (tables, _) = tables(family);
    let tower: &[&[Rule]] = vision_tower(family).map_or(&[], |t| t.tables);
    let tp = |m: TpMode| match m {
        Column => "column",
        Row => "row",
        Replicated => "replicated",
    };
    tables
        .iter()
        .chain(tower)
        .flat_map(|t| t.iter())
        .map(|r| {
            let (kind, split, transform) = match r.kind {
                Copy(m) => ("copy", tp(m), String::new()),
                ZeroCentered(m) => ("copy", tp(m), "weight − 1 (zero-centred norm)".to_string()),
                Vocab => ("copy", "column", "vocab rows padded with zeros".to_string()),
                Qkv => ("qkv", "column", "q/k/v interleaved per query group".to_string()),
                GatedMlp => ("gated", "column", "gate → _w, up → _v".to_string()),
                GdnInProjQkvz | GdnInProjSplit => ("gdn", "column", "→ .query .key .value .z .beta .alpha".to_string()),
                GdnConv1d => ("gdn", "column", "→ .query .key .value".to_string()),
                PackedGatedExperts => ("packed", "column", "expert rows → _w, _v".to_string()),
                PackedExpertsDown => ("packed", "row", "expert rows".to_string()),
                NotConverted => ("none", "—", "not converted (Megatron shares the main one)".to_string()),
                Mxfp4GateUp => (
                    "mxfp4",
                    "column",
                    "MXFP4 → bf16; gate = even rows, up = odd rows; fused: [gate_r; up_r] per ETP rank".to_string(),
                ),
                InterleavedGateUpBias => (
                    "packed",
                    "column",
                    "gate = even, up = odd elements; fused: [gate_r; up_r] per ETP rank".to_string(),
                ),
                Mxfp4Down => ("mxfp4", "row", "MXFP4 → bf16, expert rows".to_string()),
                PackedExpertRow(m) => ("packed", tp(m), "expert row".to_string()),
                TransposedGateUp => (
                    "packed",
                    "column",
                    "transposed; gate = even columns, up = odd columns; fused: [gate_r; up_r] per ETP rank".to_string(),
                ),
                TransposedDown => ("packed", "row", "transposed expert matrix".to_string()),
                TransposedGatedExperts => {
                    ("packed", "column", "transposed; columns [0, F) → _w, [F, 2F) → _v".to_string())
                }
                VisionQkv => ("qkv", "column", "fused [q; k; v] → per head [q_h; k_h; v_h]".to_string()),
            };
            let transform = match r.dtype.or(output_dtype(family)) {
                Some(d) if r.kind != NotConverted => {
                    if transform.is_empty() {
                        format!("as {d}")
                    } else {
                        format!("{transform}; as {d}")
                    }
                }
                _ => transform,
            };
            TableLine { hf: r.hf.to_vec(), megatron: r.megatron, kind, tp: split, transform, expert: r.expert }
        })
        .collect()
}
