//! torchtitan's seed checkpoint (`step-0/`): the release's tensors under torchtitan's native
//! names, as its state-dict adapters' `from_hf` gives them (fsdp2-frameworks.md §2), FSDP2-sharded
//! over the data-parallel ranks.
//!
//! Unlike Megatron's layouts nothing is fused or split by tensor parallelism: every key is one
//! release tensor (or, for routed experts, one per expert stacked on a new leading axis), its
//! rows possibly reordered (Llama's q/k RoPE permutation) and its values cast to the seed's
//! dtype (fp32, torchtitan's training and export dtype). FSDP2's `Shard(0)` gives rank `j` of
//! `D` rows `[j·q, (j+1)·q)` of dim 0 clipped to the tensor, `q = ceil(rows / D)` (`torch.chunk`,
//! trailing ranks short or empty): the same arithmetic as Megatron-FSDP's one-parameter buckets.

use std::collections::BTreeMap;

use super::build::Inventory;
use super::quant::Fp8Scales;
use super::*;
use crate::config::{Family, ModelConfig, Quantization};
use crate::error::LayoutError;
use crate::recipe::{can_cast, RowBlock, Transform, MXFP4_BLOCK};

mod tp;

pub(crate) use tp::{dense_mesh_tiling, is_routed_experts, sparse_mesh_tiling, tp_split, uneven_split};

/// Which torchtitan's names a seed is written for: its native key names changed three times in
/// 2026 (fsdp2-frameworks.md §2.2). Each row is the torchtitan of a commit that renamed model
/// keys, read off that commit's model code (`torchtitan/models/common/`); a torchtitan between
/// two rows writes the earlier row's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TorchtitanVersion {
    /// torchtitan since 3101b42f9 (2026-07-16, `routed_experts.inner_experts`), torchtitan 0.3.0:
    /// `qkv_linear.{wq,wk,wv}`, `lm_head`, `w1_EFD`/`w3_EFD`/`w2_EDF`, `expert_bias_E`.
    #[default]
    Main,
    /// 200100e7d (2026-05-27, shape suffixes): `moe.experts.{w1_EFD,w2_EDF,w3_EFD}`,
    /// `moe.expert_bias_E`.
    V2026_05_27,
    /// 786e26f8e (2026-04-27, chunked loss): `output` became `lm_head`.
    V2026_04_27,
    /// ad7a86533 (2026-04-16, fused-QKV attention): `attention.{wq,wk,wv}` moved under
    /// `attention.qkv_linear` (fusion was off by default until after its save hooks split the
    /// model keys again, so default models kept three keys).
    V2026_04_16,
    /// torchtitan before its 2026 renames (36a4b6942, 2025-12-17; torchtitan 0.2.2):
    /// `attention.{wq,wk,wv}`, `output`, `moe.experts.{w1,w2,w3}`, `moe.expert_bias`.
    V2025_12,
}

impl TorchtitanVersion {
    /// The spellings `--torchtitan-version` accepts, with what each means: the row's date, the
    /// commit that made it, or a torchtitan release with its names.
    pub const NAMES: &'static [(&'static str, TorchtitanVersion)] = &[
        ("main", TorchtitanVersion::Main),
        ("0.3.0", TorchtitanVersion::Main),
        ("2026-07-16", TorchtitanVersion::Main),
        ("3101b42f9", TorchtitanVersion::Main),
        ("2026-05-27", TorchtitanVersion::V2026_05_27),
        ("200100e7d", TorchtitanVersion::V2026_05_27),
        ("2026-04-27", TorchtitanVersion::V2026_04_27),
        ("786e26f8e", TorchtitanVersion::V2026_04_27),
        ("2026-04-16", TorchtitanVersion::V2026_04_16),
        ("ad7a86533", TorchtitanVersion::V2026_04_16),
        ("2025-12", TorchtitanVersion::V2025_12),
        ("0.2.2", TorchtitanVersion::V2025_12),
    ];

    pub fn parse(name: &str) -> Option<TorchtitanVersion> {
        Self::NAMES.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    pub fn name(self) -> &'static str {
        match self {
            TorchtitanVersion::Main => "main",
            TorchtitanVersion::V2026_05_27 => "2026-05-27",
            TorchtitanVersion::V2026_04_27 => "2026-04-27",
            TorchtitanVersion::V2026_04_16 => "2026-04-16",
            TorchtitanVersion::V2025_12 => "2025-12",
        }
    }

    /// Whether this torchtitan has the rename of `row` (rows are ordered by date).
    fn since(self, row: TorchtitanVersion) -> bool {
        let date = |v: TorchtitanVersion| match v {
            TorchtitanVersion::Main => 5,
            TorchtitanVersion::V2026_05_27 => 4,
            TorchtitanVersion::V2026_04_27 => 3,
            TorchtitanVersion::V2026_04_16 => 2,
            TorchtitanVersion::V2025_12 => 1,
        };
        date(self) >= date(row)
    }

    /// The native name of `part` of layer `{L}`, or of the model.
    fn key(self, part: Part) -> &'static str {
        use TorchtitanVersion as V;
        let main = self == V::Main;
        match part {
            Part::Embed => "tok_embeddings.weight",
            Part::Output if self.since(V::V2026_04_27) => "lm_head.weight",
            Part::Output => "output.weight",
            Part::Norm => "norm.weight",
            Part::Q if self.since(V::V2026_04_16) => "layers.{L}.attention.qkv_linear.wq.weight",
            Part::K if self.since(V::V2026_04_16) => "layers.{L}.attention.qkv_linear.wk.weight",
            Part::V if self.since(V::V2026_04_16) => "layers.{L}.attention.qkv_linear.wv.weight",
            Part::Q => "layers.{L}.attention.wq.weight",
            Part::K => "layers.{L}.attention.wk.weight",
            Part::V => "layers.{L}.attention.wv.weight",
            Part::O => "layers.{L}.attention.wo.weight",
            Part::QNorm => "layers.{L}.attention.q_norm.weight",
            Part::KNorm => "layers.{L}.attention.k_norm.weight",
            Part::AttentionNorm => "layers.{L}.attention_norm.weight",
            Part::FfnNorm => "layers.{L}.ffn_norm.weight",
            Part::W1 => "layers.{L}.feed_forward.w1.weight",
            Part::W2 => "layers.{L}.feed_forward.w2.weight",
            Part::W3 => "layers.{L}.feed_forward.w3.weight",
            Part::Router => "layers.{L}.moe.router.gate.weight",
            Part::ExpertsW1 if main => "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
            Part::ExpertsW2 if main => "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
            Part::ExpertsW3 if main => "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
            Part::ExpertsW1 if self.since(V::V2026_05_27) => "layers.{L}.moe.experts.w1_EFD",
            Part::ExpertsW2 if self.since(V::V2026_05_27) => "layers.{L}.moe.experts.w2_EDF",
            Part::ExpertsW3 if self.since(V::V2026_05_27) => "layers.{L}.moe.experts.w3_EFD",
            Part::ExpertsW1 => "layers.{L}.moe.experts.w1",
            Part::ExpertsW2 => "layers.{L}.moe.experts.w2",
            Part::ExpertsW3 => "layers.{L}.moe.experts.w3",
            Part::ExpertBias if self.since(V::V2026_05_27) => "layers.{L}.moe.expert_bias_E",
            Part::ExpertBias => "layers.{L}.moe.expert_bias",
            // DeepSeek-V3 (torchtitan's `deepseek_v3` adapter, main only).
            Part::MlaWq => "layers.{L}.attention.wq.weight",
            Part::MlaWqA => "layers.{L}.attention.wq_a.weight",
            Part::MlaWqB => "layers.{L}.attention.wq_b.weight",
            Part::MlaWkvA => "layers.{L}.attention.wkv_a.weight",
            Part::MlaKvNorm => "layers.{L}.attention.kv_norm.weight",
            Part::MlaWkvB => "layers.{L}.attention.wkv_b.weight",
            Part::SharedW1 => "layers.{L}.moe.shared_experts.w1.weight",
            Part::SharedW2 => "layers.{L}.moe.shared_experts.w2.weight",
            Part::SharedW3 => "layers.{L}.moe.shared_experts.w3.weight",
            Part::Enorm => "layers.{L}.enorm.weight",
            Part::Hnorm => "layers.{L}.hnorm.weight",
            Part::EhProj => "layers.{L}.eh_proj.weight",
            Part::MtpNorm => "layers.{L}.mtp_norm.weight",
            // gpt-oss (torchtitan's `gpt_oss` model, main only).
            Part::QBias => "layers.{L}.attention.qkv_linear.wq.bias",
            Part::KBias => "layers.{L}.attention.qkv_linear.wk.bias",
            Part::VBias => "layers.{L}.attention.qkv_linear.wv.bias",
            Part::OBias => "layers.{L}.attention.wo.bias",
            Part::Sinks => "layers.{L}.attention.sinks",
            Part::RouterBias => "layers.{L}.moe.router.gate.bias",
            Part::Mlp1Weight => "layers.{L}.moe.routed_experts.inner_experts.mlp1_weight_EGD",
            Part::Mlp1Bias => "layers.{L}.moe.routed_experts.inner_experts.mlp1_bias_EG",
            Part::Mlp2Weight => "layers.{L}.moe.routed_experts.inner_experts.mlp2_weight_EDF",
            Part::Mlp2Bias => "layers.{L}.moe.routed_experts.inner_experts.mlp2_bias_ED",
        }
    }
}

/// What a seed is written as: whose names, in which dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TorchtitanTarget {
    pub version: TorchtitanVersion,
    /// The dtype of every parameter (torchtitan trains and seeds in fp32). The load-balancing
    /// bias of routed experts is fp32 whatever this is, as torchtitan keeps it.
    pub dtype: DType,
}

impl Default for TorchtitanTarget {
    fn default() -> Self {
        TorchtitanTarget { version: TorchtitanVersion::Main, dtype: DType::F32 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Embed,
    Output,
    Norm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    AttentionNorm,
    FfnNorm,
    W1,
    W2,
    W3,
    Router,
    ExpertsW1,
    ExpertsW2,
    ExpertsW3,
    ExpertBias,
    MlaWq,
    MlaWqA,
    MlaWqB,
    MlaWkvA,
    MlaKvNorm,
    MlaWkvB,
    SharedW1,
    SharedW2,
    SharedW3,
    Enorm,
    Hnorm,
    EhProj,
    MtpNorm,
    QBias,
    KBias,
    VBias,
    OBias,
    Sinks,
    RouterBias,
    Mlp1Weight,
    Mlp1Bias,
    Mlp2Weight,
    Mlp2Bias,
}

/// A decoder layer of the release: one of torchtitan's `layers`, or (DeepSeek-V3's layers after
/// the decoder) one of its `mtp_layers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layer {
    Main(u64),
    Mtp(u64),
}

/// The families Shardline seeds torchtitan with, and the torchtitan model each becomes.
fn torchtitan_model(config: &ModelConfig) -> Option<&'static str> {
    match (config.family, config.model_type.as_str()) {
        (Family::Llama, "llama") => Some("llama3"),
        (Family::Qwen3, _) => Some("qwen3"),
        (Family::Qwen3Moe, _) => Some("qwen3 (MoE)"),
        (Family::DeepseekV3, "deepseek_v3") => Some("deepseek_v3"),
        // torchtitan's `kimi_k2_7` without its vision encoder (Moonlight, a text-only Kimi-K2):
        // its adapter hands every language-model key to the DeepSeek-V3 one.
        (Family::DeepseekV3, "kimi_k2") => Some("kimi_k2_7 (text)"),
        (Family::GptOss, _) => Some("gpt_oss"),
        _ => None,
    }
}

/// Plans `sources` as torchtitan's seed for `dp` FSDP2 ranks.
pub(super) fn build_torchtitan_plan(
    config: &ModelConfig,
    sources: Vec<SourceTensor>,
    mesh: Mesh,
    target: TorchtitanTarget,
    options: &PlanOptions,
) -> Result<Plan, Vec<LayoutError>> {
    // torchtitan has no expert tensor parallelism: under EP its routed experts leave TP, and
    // its sparse mesh `(efsdp, ep)` spans every rank, so `ep` divides `dp·tp` (parallel_dims.py).
    let mut errors = Vec::new();
    if mesh.cp > 1 {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: cp = {}: context parallelism keeps no parameter shard of its own (FSDP2 shards \
             over dp, TP over tp, routed experts over ep); write the seed without it, DCP places it on load",
            mesh.cp
        )));
    }
    if mesh.etp != 1 && mesh.etp != mesh.tp {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: etp = {}: torchtitan has no expert tensor parallelism (routed experts are \
             TP-split with the dense layers without EP, and leave TP under EP); leave --etp out",
            mesh.etp
        )));
    }
    let mesh = Mesh { etp: 1, ..mesh };
    errors.extend(mesh.check());
    if mesh.ep > 1 && !config.num_experts.is_multiple_of(mesh.ep) {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: ep = {} does not divide the model's {} routed experts",
            mesh.ep, config.num_experts
        )));
    }
    let Some(_) = torchtitan_model(config) else {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: no torchtitan seed for `{}` (Shardline writes llama, qwen3, qwen3_moe, deepseek_v3, \
             kimi_k2 and gpt_oss)",
            config.model_type
        )));
        return Err(errors);
    };
    if matches!(config.family, Family::DeepseekV3 | Family::GptOss) && target.version != TorchtitanVersion::Main {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: {} is written for torchtitan main only, not {}",
            config.model_type,
            target.version.name()
        )));
    }
    // Block-FP8 weights are dequantized (as torchtitan's quantized HF reader does); another
    // scheme is an error naming it.
    let fp8 = Fp8Scales::find(config, &Inventory::new(&sources, config.language_model_prefix), &mut errors);
    // torchtitan reads gpt-oss's MXFP4 experts through torch's quantized HF reader (its adapter
    // maps the `*_blocks` keys only): dequantized, as here.
    match (&config.quantization, config.family) {
        (Some(Quantization::Mxfp4), Family::GptOss) => {}
        (Some(Quantization::Mxfp4), _) => errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: an MXFP4 `{}` release has no torchtitan reader",
            config.model_type
        ))),
        (_, Family::GptOss) => errors.push(LayoutError::Mesh(
            "--target torchtitan: torchtitan's gpt_oss reads the MXFP4 release (its adapter maps the experts' \
             `*_blocks`, dequantized on load); convert that one"
                .into(),
        )),
        _ => {}
    }
    if !matches!(target.dtype, DType::F32 | DType::BF16) {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: parameters are written as float32 or bfloat16, not {}",
            target.dtype
        )));
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut b = Builder {
        config,
        sources: &sources,
        target,
        mesh,
        rank_bytes: vec![0; usize::try_from(mesh.world()).unwrap_or(0)],
        by_name: BTreeMap::new(),
        used: vec![false; sources.len()],
        tensors: Vec::new(),
        unconverted: Vec::new(),
        fp8,
        errors,
    };
    for (i, s) in sources.iter().enumerate() {
        b.by_name.insert(s.name.as_str(), i);
    }
    b.plan_model();
    let Builder { used, mut tensors, mut errors, unconverted, .. } = b;
    let names: Vec<String> = sources
        .iter()
        .zip(&used)
        .filter(|(s, used)| !**used && !s.name.ends_with(".rotary_emb.inv_freq"))
        .map(|(s, _)| s.name.clone())
        .collect();
    if !names.is_empty() {
        errors.push(LayoutError::Unmapped { model_type: format!("{} (torchtitan)", config.model_type), names });
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    tensors.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(Plan { mesh, options: options.clone(), model_type: config.model_type.clone(), sources, tensors, unconverted })
}

struct Builder<'a> {
    config: &'a ModelConfig,
    sources: &'a [SourceTensor],
    target: TorchtitanTarget,
    mesh: Mesh,
    /// Bytes planned per rank so far, to spread the writing of TP replicas.
    rank_bytes: Vec<u64>,
    by_name: BTreeMap<&'a str, usize>,
    used: Vec<bool>,
    tensors: Vec<OutputTensor>,
    /// Release tensors consumed but not written: an MTP layer's copies of the embedding and
    /// output layer, which torchtitan's MTP shares with the model.
    unconverted: Vec<String>,
    /// A block-FP8 release's weights and their scales.
    fp8: Option<Fp8Scales>,
    errors: Vec<LayoutError>,
}

impl Builder<'_> {
    fn plan_model(&mut self) {
        let c = self.config;
        let h = c.hidden_size;
        if c.family == Family::Llama && !c.head_dim.is_multiple_of(2) {
            self.errors.push(LayoutError::Config {
                field: "head_dim".into(),
                message: format!("{} is odd: torchtitan's RoPE permutation pairs the rows of each head", c.head_dim),
            });
            return;
        }
        self.copy(Part::Embed, None, "model.embed_tokens.weight", &[c.vocab_size, h]);
        // Tied embeddings: torchtitan's `from_hf` copies the embedding to the output projection.
        let output = if self.by_name.contains_key("lm_head.weight") || !c.tie_word_embeddings {
            "lm_head.weight"
        } else {
            "model.embed_tokens.weight"
        };
        self.copy(Part::Output, None, output, &[c.vocab_size, h]);
        self.copy(Part::Norm, None, "model.norm.weight", &[h]);
        let mtp = (0..c.mtp_layers).map(Layer::Mtp);
        for layer in (0..c.num_layers).map(Layer::Main).chain(mtp) {
            self.decoder_layer(layer);
        }
    }

    /// The HF name of `rest` in `layer` (MTP layers follow the decoder's in HF numbering).
    fn hf(&self, layer: Layer, rest: &str) -> String {
        let index = match layer {
            Layer::Main(l) => l,
            Layer::Mtp(i) => self.config.num_layers + i,
        };
        format!("model.layers.{index}.{rest}")
    }

    fn decoder_layer(&mut self, layer: Layer) {
        let c = self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_query_groups);
        let l = Some(layer);
        if c.family == Family::DeepseekV3 {
            self.mla(layer);
        } else {
            let (q, k) = (self.hf(layer, "self_attn.q_proj.weight"), self.hf(layer, "self_attn.k_proj.weight"));
            if c.family == Family::Llama {
                // HF → torchtitan: `w.view(n, 2, hd/2, D).transpose(1, 2)` per head (the
                // adapter's `_reverse_permute`), on the whole tensor.
                self.rope_permuted(Part::Q, layer, &q, nh, hd, h);
                self.rope_permuted(Part::K, layer, &k, nkv, hd, h);
            } else {
                self.copy(Part::Q, l, &q, &[nh * hd, h]);
                self.copy(Part::K, l, &k, &[nkv * hd, h]);
            }
            self.copy(Part::V, l, &self.hf(layer, "self_attn.v_proj.weight"), &[nkv * hd, h]);
            self.copy(Part::O, l, &self.hf(layer, "self_attn.o_proj.weight"), &[h, nh * hd]);
            if c.family == Family::GptOss {
                for (part, name, n) in [
                    (Part::QBias, "self_attn.q_proj.bias", nh * hd),
                    (Part::KBias, "self_attn.k_proj.bias", nkv * hd),
                    (Part::VBias, "self_attn.v_proj.bias", nkv * hd),
                    (Part::OBias, "self_attn.o_proj.bias", h),
                    (Part::Sinks, "self_attn.sinks", nh),
                ] {
                    self.copy(part, l, &self.hf(layer, name), &[n]);
                }
            }
            if matches!(c.family, Family::Qwen3 | Family::Qwen3Moe) {
                self.copy(Part::QNorm, l, &self.hf(layer, "self_attn.q_norm.weight"), &[hd]);
                self.copy(Part::KNorm, l, &self.hf(layer, "self_attn.k_norm.weight"), &[hd]);
            }
        }
        self.copy(Part::AttentionNorm, l, &self.hf(layer, "input_layernorm.weight"), &[h]);
        self.copy(Part::FfnNorm, l, &self.hf(layer, "post_attention_layernorm.weight"), &[h]);
        // A layer is sparse when the release holds its router (Qwen3-MoE's `mlp_only_layers`,
        // DeepSeek-V3's first dense layers).
        if c.family == Family::GptOss {
            self.gpt_oss_experts(layer);
        } else if c.num_experts > 0 && self.by_name.contains_key(self.hf(layer, "mlp.gate.weight").as_str()) {
            self.experts(layer);
        } else {
            let f = c.ffn_hidden_size.unwrap_or(0);
            self.copy(Part::W1, l, &self.hf(layer, "mlp.gate_proj.weight"), &[f, h]);
            self.copy(Part::W3, l, &self.hf(layer, "mlp.up_proj.weight"), &[f, h]);
            self.copy(Part::W2, l, &self.hf(layer, "mlp.down_proj.weight"), &[h, f]);
        }
        if let Layer::Mtp(_) = layer {
            self.copy(Part::Enorm, l, &self.hf(layer, "enorm.weight"), &[h]);
            self.copy(Part::Hnorm, l, &self.hf(layer, "hnorm.weight"), &[h]);
            self.copy(Part::EhProj, l, &self.hf(layer, "eh_proj.weight"), &[h, 2 * h]);
            self.copy(Part::MtpNorm, l, &self.hf(layer, "shared_head.norm.weight"), &[h]);
            // torchtitan's MTP shares the model's embedding and output projection.
            for rest in ["embed_tokens.weight", "shared_head.head.weight"] {
                let name = self.hf(layer, rest);
                if let Some(&id) = self.by_name.get(name.as_str()) {
                    self.used[id] = true;
                    self.unconverted.push(name);
                }
            }
        }
    }

    /// DeepSeek-V3's multi-head latent attention, unfused and unpermuted (torchtitan's MLA
    /// applies RoPE to the rope part of each head as HF stores it).
    fn mla(&mut self, layer: Layer) {
        let c = self.config;
        let Some(m) = c.mla.clone() else {
            self.errors.push(LayoutError::Config { field: "kv_lora_rank".into(), message: "missing".into() });
            return;
        };
        let (h, nh, l) = (c.hidden_size, c.num_attention_heads, Some(layer));
        let q_rows = nh * (m.qk_nope_head_dim + m.qk_rope_head_dim);
        match m.q_lora_rank {
            Some(r) => {
                self.copy(Part::MlaWqA, l, &self.hf(layer, "self_attn.q_a_proj.weight"), &[r, h]);
                self.copy(Part::QNorm, l, &self.hf(layer, "self_attn.q_a_layernorm.weight"), &[r]);
                self.copy(Part::MlaWqB, l, &self.hf(layer, "self_attn.q_b_proj.weight"), &[q_rows, r]);
            }
            None => self.copy(Part::MlaWq, l, &self.hf(layer, "self_attn.q_proj.weight"), &[q_rows, h]),
        }
        let kv = m.kv_lora_rank;
        let kv_a = self.hf(layer, "self_attn.kv_a_proj_with_mqa.weight");
        self.copy(Part::MlaWkvA, l, &kv_a, &[kv + m.qk_rope_head_dim, h]);
        self.copy(Part::MlaKvNorm, l, &self.hf(layer, "self_attn.kv_a_layernorm.weight"), &[kv]);
        let kv_b_rows = nh * (m.qk_nope_head_dim + m.v_head_dim);
        self.copy(Part::MlaWkvB, l, &self.hf(layer, "self_attn.kv_b_proj.weight"), &[kv_b_rows, kv]);
        self.copy(Part::O, l, &self.hf(layer, "self_attn.o_proj.weight"), &[h, nh * m.v_head_dim]);
    }

    /// Routed experts stacked on a leading expert axis, without transpose (`w1_EFD[e]` is
    /// expert `e`'s `gate_proj`), the router, shared experts where the model has them, and the
    /// load-balancing bias torchtitan's MoE keeps as a persistent fp32 buffer: DeepSeek-V3's
    /// `e_score_correction_bias`, else zeros.
    fn experts(&mut self, layer: Layer) {
        let c = self.config;
        let (h, e, l) = (c.hidden_size, c.num_experts, Some(layer));
        let f = c.moe_ffn_hidden_size.unwrap_or(0);
        self.copy(Part::Router, l, &self.hf(layer, "mlp.gate.weight"), &[e, h]);
        for (part, proj, shape) in [
            (Part::ExpertsW1, "gate_proj", [f, h]),
            (Part::ExpertsW3, "up_proj", [f, h]),
            (Part::ExpertsW2, "down_proj", [h, f]),
        ] {
            let names: Vec<String> =
                (0..e).map(|x| self.hf(layer, &format!("mlp.experts.{x}.{proj}.weight"))).collect();
            let Some(ids) = names.iter().map(|n| self.source(n, &shape)).collect::<Option<Vec<_>>>() else { continue };
            let Some(dtype) = self.out_dtype(ids[0]) else { continue };
            let recipe = ids.iter().map(|&id| self.block(id, 0, 1)).collect();
            self.push_routed_experts(part, l, dtype, vec![e, shape[0], shape[1]], recipe);
        }
        if let Some(fs) = c.shared_expert_ffn_hidden_size.filter(|_| c.family == Family::DeepseekV3) {
            self.copy(Part::SharedW1, l, &self.hf(layer, "mlp.shared_experts.gate_proj.weight"), &[fs, h]);
            self.copy(Part::SharedW3, l, &self.hf(layer, "mlp.shared_experts.up_proj.weight"), &[fs, h]);
            self.copy(Part::SharedW2, l, &self.hf(layer, "mlp.shared_experts.down_proj.weight"), &[h, fs]);
        }
        let bias = self.hf(layer, "mlp.gate.e_score_correction_bias");
        if c.family == Family::DeepseekV3 {
            let Some(id) = self.source(&bias, &[e]) else { return };
            let from = self.sources[id].dtype;
            let transform = if from == DType::F32 { Transform::Identity } else { Transform::Cast(from) };
            let block = RowBlock { transform, ..RowBlock::copy(id, 0, e) };
            self.push(Part::ExpertBias, l, DType::F32, vec![e], vec![block]);
        } else {
            let zeros = RowBlock { rows: e, source: None, transform: Transform::Identity, stride: 1 };
            self.push(Part::ExpertBias, l, DType::F32, vec![e], vec![zeros]);
        }
    }

    /// gpt-oss's MoE (torchtitan's `GptOssGroupedExperts`): the biased router, the experts'
    /// MXFP4 `gate_up_proj` and `down_proj` dequantized whole as `mlp1_weight_EGD [E, 2F, D]` and
    /// `mlp2_weight_EDF [E, D, F]` (the release's layout: gate and up rows stay interleaved), their
    /// packed biases, and the zero load-balancing bias torchtitan's MoE keeps.
    fn gpt_oss_experts(&mut self, layer: Layer) {
        let c = self.config;
        let (h, e, l) = (c.hidden_size, c.num_experts, Some(layer));
        let f = c.moe_ffn_hidden_size.unwrap_or(0);
        self.copy(Part::Router, l, &self.hf(layer, "mlp.router.weight"), &[e, h]);
        self.copy(Part::RouterBias, l, &self.hf(layer, "mlp.router.bias"), &[e]);
        for (part, proj, rows, cols) in
            [(Part::Mlp1Weight, "gate_up_proj", 2 * f, h), (Part::Mlp2Weight, "down_proj", h, f)]
        {
            let blocks = self.hf(layer, &format!("mlp.experts.{proj}_blocks"));
            let scales = self.hf(layer, &format!("mlp.experts.{proj}_scales"));
            let groups = cols / MXFP4_BLOCK;
            if !cols.is_multiple_of(MXFP4_BLOCK) {
                self.errors.push(LayoutError::Config {
                    field: "hidden_size".into(),
                    message: format!("{cols} is not a whole number of MXFP4 blocks of {MXFP4_BLOCK}"),
                });
                continue;
            }
            let (Some(b), Some(s)) =
                (self.source(&blocks, &[e, rows, groups, MXFP4_BLOCK / 2]), self.source(&scales, &[e, rows, groups]))
            else {
                continue;
            };
            // Output row `x` (expert `x`) is source row `x` of the blocks: `rows·cols / 2` bytes.
            let dequant =
                RowBlock { transform: Transform::DequantMxfp4 { scales: s as u32 }, ..RowBlock::copy(b, 0, e) };
            let key = self.key(part, l);
            self.push_routed_experts_keyed(key, self.target.dtype, vec![e, rows, cols], vec![dequant]);
        }
        for (part, proj, n) in [(Part::Mlp1Bias, "gate_up_proj_bias", 2 * f), (Part::Mlp2Bias, "down_proj_bias", h)] {
            let Some(id) = self.source(&self.hf(layer, &format!("mlp.experts.{proj}")), &[e, n]) else { continue };
            let Some(dtype) = self.out_dtype(id) else { continue };
            let recipe = vec![self.block(id, 0, e)];
            let key = self.key(part, l);
            self.push_routed_experts_keyed(key, dtype, vec![e, n], recipe);
        }
        let zeros = RowBlock { rows: e, source: None, transform: Transform::Identity, stride: 1 };
        self.push(Part::ExpertBias, l, DType::F32, vec![e], vec![zeros]);
    }

    /// Llama's q or k projection of `heads` heads of `hd` rows, its rows in torchtitan's order:
    /// row `2i + k` of a head is HF row `k·hd/2 + i` of it.
    fn rope_permuted(&mut self, part: Part, layer: Layer, name: &str, heads: u64, hd: u64, h: u64) {
        let Some(id) = self.source(name, &[heads * hd, h]) else { return };
        let Some(dtype) = self.out_dtype(id) else { return };
        let half = hd / 2;
        let mut recipe = Vec::with_capacity((heads * hd) as usize);
        for head in 0..heads {
            for i in 0..half {
                for k in 0..2 {
                    recipe.push(self.block(id, head * hd + k * half + i, 1));
                }
            }
        }
        self.push(part, Some(layer), dtype, vec![heads * hd, h], recipe);
    }

    /// The release tensor `name` as a whole, under `part`'s name.
    fn copy(&mut self, part: Part, layer: Option<Layer>, name: &str, shape: &[u64]) {
        let Some(id) = self.source(name, shape) else { return };
        let Some(dtype) = self.out_dtype(id) else { return };
        let recipe = vec![self.block(id, 0, rows_of(shape))];
        self.push(part, layer, dtype, shape.to_vec(), recipe);
    }

    /// `part`'s native name in `layer` (an MTP layer's under `mtp_layers.`).
    fn key(&self, part: Part, layer: Option<Layer>) -> String {
        let template = self.target.version.key(part);
        match layer {
            Some(Layer::Main(l)) => template.replace("{L}", &l.to_string()),
            Some(Layer::Mtp(i)) => template.replacen("layers.{L}.", &format!("mtp_layers.{i}."), 1),
            None => template.to_string(),
        }
    }

    /// The id of release tensor `name`, marked used, when it has `shape`; else an error.
    fn source(&mut self, name: &str, shape: &[u64]) -> Option<usize> {
        let Some(&id) = self.by_name.get(name) else {
            self.errors.push(LayoutError::MissingTensor {
                missing: name.to_string(),
                present: "the model's config".into(),
                target: "--target torchtitan".into(),
            });
            return None;
        };
        self.used[id] = true;
        if self.sources[id].shape != shape {
            self.errors.push(LayoutError::Shape {
                tensor: name.to_string(),
                actual: self.sources[id].shape.clone(),
                expected: format!("{shape:?}"),
                why: "from config.json".into(),
            });
            return None;
        }
        Some(id)
    }

    /// The seed's dtype, when release tensor `id` casts to it.
    fn out_dtype(&mut self, id: usize) -> Option<DType> {
        let (from, to) = (self.sources[id].dtype, self.target.dtype);
        if from == to || can_cast(from, to) {
            return Some(to);
        }
        self.errors.push(LayoutError::DtypeMismatch {
            target: self.sources[id].name.clone(),
            detail: format!("{from} does not cast to {to}"),
        });
        None
    }

    /// `rows` rows of release tensor `id` from `first`, cast (or, a block-FP8 weight,
    /// dequantized, its scales then used too) to the seed's dtype.
    fn block(&mut self, id: usize, first: u64, rows: u64) -> RowBlock {
        let from = self.sources[id].dtype;
        let transform = match self.fp8.as_ref().and_then(|f| f.transform_of(id)) {
            Some((dequantize, scale)) => {
                self.used[scale] = true;
                dequantize
            }
            None if from == self.target.dtype => Transform::Identity,
            None => Transform::Cast(from),
        };
        RowBlock { transform, ..RowBlock::copy(id, first, rows) }
    }

    /// `part` of `layer` on the dense mesh `(dp, tp)` ([`tp::dense_mesh_tiling`]): split by TP as
    /// torchtitan's sharding configs put it, the TP-local tensor then FSDP2's `Shard(0)` over dp.
    /// A TP replica is written by the TP rank with the fewest bytes so far, as DCP's save plan
    /// spreads replicas.
    fn push(&mut self, part: Part, layer: Option<Layer>, dtype: DType, shape: Vec<u64>, recipe: Vec<RowBlock>) {
        let key = self.key(part, layer);
        self.push_on_dense_mesh(key, 0, dtype, shape, recipe);
    }

    fn push_on_dense_mesh(
        &mut self,
        key: String,
        fsdp_dim: usize,
        dtype: DType,
        shape: Vec<u64>,
        recipe: Vec<RowBlock>,
    ) {
        let split = tp::tp_split(&key);
        if let Some(why) = uneven_split(&shape, split.filter(|_| self.mesh.tp > 1), self.mesh.tp) {
            self.errors.push(LayoutError::Mesh(format!("--target torchtitan: `{key}`: {why}")));
            return;
        }
        let mesh = self.mesh;
        let bytes = |r: u64, j: u64| self.rank_bytes.get(mesh.dense_rank(r, j) as usize).copied().unwrap_or(0);
        let writer = |j: u64| {
            let r = (0..mesh.tp).min_by_key(|&r| (bytes(r, j), r)).unwrap_or(0);
            u32::try_from(r).unwrap_or(0)
        };
        let (tp_mode, tiling) = tp::dense_mesh_tiling(&shape, split, fsdp_dim, &mesh, writer);
        self.push_tiled(key, dtype, shape, recipe, tp_mode, tiling);
    }

    /// Routed experts `[E, …]`. Under EP, on torchtitan's sparse mesh over every rank, out of TP
    /// ([`tp::sparse_mesh_tiling`]); without it, on the dense mesh, TP-split as the dense layers
    /// are. FSDP2 cuts dim 1 instead of 0 once its mesh has more ranks than experts
    /// (torchtitan/distributed/fsdp.py): the sparse mesh's `dp·tp`, or the dense mesh's `dp`.
    fn push_routed_experts(
        &mut self,
        part: Part,
        layer: Option<Layer>,
        dtype: DType,
        shape: Vec<u64>,
        recipe: Vec<RowBlock>,
    ) {
        let key = self.key(part, layer);
        self.push_routed_experts_keyed(key, dtype, shape, recipe);
    }

    fn push_routed_experts_keyed(&mut self, key: String, dtype: DType, shape: Vec<u64>, recipe: Vec<RowBlock>) {
        let Mesh { tp, dp, ep, .. } = self.mesh;
        let experts = shape[0];
        if ep > 1 {
            let tiling = tp::sparse_mesh_tiling(&shape, u8::from(dp * tp > experts), &self.mesh);
            return self.push_tiled(key, dtype, shape, recipe, TpMode::Replicated, tiling);
        }
        self.push_on_dense_mesh(key, usize::from(dp > experts), dtype, shape, recipe);
    }

    fn push_tiled(
        &mut self,
        key: String,
        dtype: DType,
        shape: Vec<u64>,
        recipe: Vec<RowBlock>,
        tp_mode: TpMode,
        tiling: Tiling,
    ) {
        let tensor = OutputTensor {
            key,
            dtype,
            shape,
            recipe,
            tp_mode,
            tp: self.mesh.tp,
            group: Group::Dense,
            split: None,
            role: Role::Param,
            tiling,
        };
        for c in tensor.chunks(&self.mesh).filter(|c| c.written) {
            if let Some(b) = self.rank_bytes.get_mut(c.rank as usize) {
                *b += c.numel() * dtype.size() as u64;
            }
        }
        self.tensors.push(tensor);
    }
}

#[cfg(test)]
mod tests;
