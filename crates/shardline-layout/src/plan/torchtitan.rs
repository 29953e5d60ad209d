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
use crate::recipe::{can_cast, RowBlock, Transform};

/// Which torchtitan's names a seed is written for: its native key names changed three times in
/// 2026 (fsdp2-frameworks.md §2.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TorchtitanVersion {
    /// torchtitan since 3101b42f9 (2026-07-16, `routed_experts.inner_experts`), torchtitan 0.3.0:
    /// `qkv_linear.{wq,wk,wv}`, `lm_head`, `w1_EFD`/`w3_EFD`/`w2_EDF`, `expert_bias_E`.
    #[default]
    Main,
    /// torchtitan before its 2026 renames (36a4b6942, 2025-12-17): `attention.{wq,wk,wv}`,
    /// `output`, `moe.experts.{w1,w2,w3}`, `moe.expert_bias`.
    V2025_12,
}

impl TorchtitanVersion {
    /// The spellings `--torchtitan-version` accepts, with what each means.
    pub const NAMES: &'static [(&'static str, TorchtitanVersion)] = &[
        ("main", TorchtitanVersion::Main),
        ("0.3.0", TorchtitanVersion::Main),
        ("2025-12", TorchtitanVersion::V2025_12),
    ];

    pub fn parse(name: &str) -> Option<TorchtitanVersion> {
        Self::NAMES.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    pub fn name(self) -> &'static str {
        match self {
            TorchtitanVersion::Main => "main",
            TorchtitanVersion::V2025_12 => "2025-12",
        }
    }

    /// The native name of `part` of layer `{L}`, or of the model.
    fn key(self, part: Part) -> &'static str {
        let main = self == TorchtitanVersion::Main;
        match part {
            Part::Embed => "tok_embeddings.weight",
            Part::Output if main => "lm_head.weight",
            Part::Output => "output.weight",
            Part::Norm => "norm.weight",
            Part::Q if main => "layers.{L}.attention.qkv_linear.wq.weight",
            Part::K if main => "layers.{L}.attention.qkv_linear.wk.weight",
            Part::V if main => "layers.{L}.attention.qkv_linear.wv.weight",
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
            Part::ExpertsW1 => "layers.{L}.moe.experts.w1",
            Part::ExpertsW2 => "layers.{L}.moe.experts.w2",
            Part::ExpertsW3 => "layers.{L}.moe.experts.w3",
            Part::ExpertBias if main => "layers.{L}.moe.expert_bias_E",
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
    let mut errors = mesh.check();
    if mesh.tp > 1 || mesh.cp > 1 || mesh.etp > 1 {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan shards over data and expert parallelism only (FSDP2 over dp, routed experts over \
             ep); got {mesh}: torchtitan's TP placements are not written yet, and DCP reshards the seed on load"
        )));
    }
    if mesh.ep > 1 && !config.num_experts.is_multiple_of(mesh.ep) {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: ep = {} does not divide the model's {} routed experts",
            mesh.ep, config.num_experts
        )));
    }
    let Some(_) = torchtitan_model(config) else {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: no torchtitan seed for `{}` (Shardline writes llama, qwen3, qwen3_moe and deepseek_v3)",
            config.model_type
        )));
        return Err(errors);
    };
    if config.family == Family::DeepseekV3 && target.version != TorchtitanVersion::Main {
        errors.push(LayoutError::Mesh(format!(
            "--target torchtitan: deepseek_v3 is written for torchtitan main only, not {}",
            target.version.name()
        )));
    }
    // Block-FP8 weights are dequantized (as torchtitan's quantized HF reader does); another
    // scheme is an error naming it.
    let fp8 = Fp8Scales::find(config, &Inventory::new(&sources, config.language_model_prefix), &mut errors);
    if matches!(config.quantization, Some(Quantization::Mxfp4)) {
        errors.push(LayoutError::Mesh(
            "--target torchtitan: MXFP4 releases are not dequantized for torchtitan yet".into(),
        ));
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
        dp: mesh.dp,
        ep: mesh.ep,
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
    dp: u64,
    ep: u64,
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
            if matches!(c.family, Family::Qwen3 | Family::Qwen3Moe) {
                self.copy(Part::QNorm, l, &self.hf(layer, "self_attn.q_norm.weight"), &[hd]);
                self.copy(Part::KNorm, l, &self.hf(layer, "self_attn.k_norm.weight"), &[hd]);
            }
        }
        self.copy(Part::AttentionNorm, l, &self.hf(layer, "input_layernorm.weight"), &[h]);
        self.copy(Part::FfnNorm, l, &self.hf(layer, "post_attention_layernorm.weight"), &[h]);
        // A layer is sparse when the release holds its router (Qwen3-MoE's `mlp_only_layers`,
        // DeepSeek-V3's first dense layers).
        if c.num_experts > 0 && self.by_name.contains_key(self.hf(layer, "mlp.gate.weight").as_str()) {
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
            self.push(self.key(part, l), dtype, vec![e, shape[0], shape[1]], recipe);
            self.place_routed_experts();
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
            self.push(self.key(Part::ExpertBias, l), DType::F32, vec![e], vec![block]);
        } else {
            let zeros = RowBlock { rows: e, source: None, transform: Transform::Identity, stride: 1 };
            self.push(self.key(Part::ExpertBias, l), DType::F32, vec![e], vec![zeros]);
        }
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
        self.push(self.key(part, Some(layer)), dtype, vec![heads * hd, h], recipe);
    }

    /// The release tensor `name` as a whole, under `part`'s name.
    fn copy(&mut self, part: Part, layer: Option<Layer>, name: &str, shape: &[u64]) {
        let Some(id) = self.source(name, shape) else { return };
        let Some(dtype) = self.out_dtype(id) else { return };
        let recipe = vec![self.block(id, 0, rows_of(shape))];
        self.push(self.key(part, layer), dtype, shape.to_vec(), recipe);
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

    /// The routed experts just pushed, on torchtitan's sparse mesh `(efsdp, ep)`: one slab of
    /// `E / ep` experts per EP rank, cut over its expert-FSDP ranks along dim 0
    /// (`[_StridedShard(0), Shard(0)]`), or along dim 1 once the mesh has more ranks than experts
    /// (torchtitan/distributed/fsdp.py).
    fn place_routed_experts(&mut self) {
        let Some(t) = self.tensors.last_mut() else { return };
        let Tiling::Fsdp(f) = &mut t.tiling else { return };
        let dim = u8::from(self.dp > t.shape[0]);
        let n = t.shape[usize::from(dim)];
        f.numbers = FsdpNumbers { dim, slabs: self.ep, local_rows: n, section_rows: n, ..f.numbers };
    }

    fn push(&mut self, key: String, dtype: DType, shape: Vec<u64>, recipe: Vec<RowBlock>) {
        let rows = rows_of(&shape);
        let numbers = FsdpNumbers {
            fsdp_size: self.dp,
            local_rows: rows,
            section_start: 0,
            section_rows: rows,
            dp_writer: 0,
            dim: 0,
            slabs: 1,
        };
        self.tensors.push(OutputTensor {
            key,
            dtype,
            shape,
            recipe,
            tp_mode: TpMode::Replicated,
            tp: 1,
            group: Group::Dense,
            split: None,
            role: Role::Param,
            tiling: Tiling::Fsdp(FsdpTiling { numbers, writers: Box::new([]) }),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(tied: bool) -> (ModelConfig, Vec<SourceTensor>) {
        let config = ModelConfig::from_json(&format!(
            r#"{{"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 12, "vocab_size": 10,
                "tie_word_embeddings": {tied}}}"#
        ))
        .expect("config");
        let t =
            |name: &str, shape: &[u64]| SourceTensor { name: name.into(), dtype: DType::BF16, shape: shape.to_vec() };
        let mut sources = vec![
            t("model.embed_tokens.weight", &[10, 8]),
            t("model.norm.weight", &[8]),
            t("model.layers.0.self_attn.q_proj.weight", &[8, 8]),
            t("model.layers.0.self_attn.k_proj.weight", &[4, 8]),
            t("model.layers.0.self_attn.v_proj.weight", &[4, 8]),
            t("model.layers.0.self_attn.o_proj.weight", &[8, 8]),
            t("model.layers.0.mlp.gate_proj.weight", &[12, 8]),
            t("model.layers.0.mlp.up_proj.weight", &[12, 8]),
            t("model.layers.0.mlp.down_proj.weight", &[8, 12]),
            t("model.layers.0.input_layernorm.weight", &[8]),
            t("model.layers.0.post_attention_layernorm.weight", &[8]),
        ];
        if !tied {
            sources.push(t("lm_head.weight", &[10, 8]));
        }
        (config, sources)
    }

    fn plan(config: &ModelConfig, sources: Vec<SourceTensor>, dp: u64, version: TorchtitanVersion) -> Plan {
        let target = TorchtitanTarget { version, dtype: DType::F32 };
        let options = PlanOptions { prefix: String::new(), dialect: Dialect::Torchtitan(target), ..Default::default() };
        build_plan(config, sources, Mesh { tp: 1, cp: 1, dp, ep: 1, etp: 1 }, &options).expect("plan")
    }

    #[test]
    fn llama_keys_are_torchtitan_s_and_q_k_rows_are_rope_permuted() {
        let (config, sources) = llama(false);
        let p = plan(&config, sources, 3, TorchtitanVersion::Main);
        let keys: Vec<&str> = p.tensors.iter().map(|t| t.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "layers.0.attention.qkv_linear.wk.weight",
                "layers.0.attention.qkv_linear.wq.weight",
                "layers.0.attention.qkv_linear.wv.weight",
                "layers.0.attention.wo.weight",
                "layers.0.attention_norm.weight",
                "layers.0.feed_forward.w1.weight",
                "layers.0.feed_forward.w2.weight",
                "layers.0.feed_forward.w3.weight",
                "layers.0.ffn_norm.weight",
                "lm_head.weight",
                "norm.weight",
                "tok_embeddings.weight",
            ]
        );
        assert!(p.tensors.iter().all(|t| t.dtype == DType::F32));
        // q: 2 heads of 4 rows, half 2: torchtitan rows (0,1,2,3) are HF rows (0,2,1,3) per head.
        let q = p.tensors.iter().find(|t| t.key.ends_with("wq.weight")).expect("wq");
        let rows: Vec<u64> = q.recipe.iter().map(|b| b.source.expect("source").1).collect();
        assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(q.recipe.iter().all(|b| b.transform == Transform::Cast(DType::BF16) && b.rows == 1));
        // FSDP2 Shard(0) over 3 ranks: torch.chunk's ceil-sized pieces, the last short.
        let w1 = p.tensors.iter().find(|t| t.key.ends_with("w1.weight")).expect("w1");
        let pieces: Vec<(u64, u64, Vec<u64>)> =
            w1.chunks(&p.mesh).map(|c| (c.rank, c.offsets[0], c.sizes.clone())).collect();
        assert_eq!(pieces, [(0, 0, vec![4, 8]), (1, 4, vec![4, 8]), (2, 8, vec![4, 8])]);
        let norm = p.tensors.iter().find(|t| t.key == "norm.weight").expect("norm");
        let sizes: Vec<u64> = norm.chunks(&p.mesh).map(|c| c.sizes[0]).collect();
        assert_eq!(sizes, [3, 3, 2]);
    }

    #[test]
    fn tied_embeddings_give_the_output_projection_the_embedding_and_old_names_are_kept() {
        let (config, sources) = llama(true);
        let p = plan(&config, sources, 1, TorchtitanVersion::V2025_12);
        let output = p.tensors.iter().find(|t| t.key == "output.weight").expect("output");
        let embed = p.tensors.iter().find(|t| t.key == "tok_embeddings.weight").expect("embed");
        assert_eq!(output.recipe, embed.recipe);
        assert!(p.tensors.iter().any(|t| t.key == "layers.0.attention.wq.weight"));
    }

    #[test]
    fn what_torchtitan_cannot_take_is_refused_with_the_reason() {
        let (config, mut sources) = llama(false);
        sources.push(SourceTensor {
            name: "model.layers.0.self_attn.q_proj.bias".into(),
            dtype: DType::BF16,
            shape: vec![8],
        });
        let target = Dialect::Torchtitan(TorchtitanTarget::default());
        let options = PlanOptions { dialect: target, ..Default::default() };
        let errors = build_plan(&config, sources.clone(), Mesh { tp: 1, cp: 1, dp: 2, ep: 1, etp: 1 }, &options)
            .expect_err("a bias torchtitan's llama3 has no place for");
        assert!(errors.iter().any(|e| e.to_string().contains("q_proj.bias")), "{errors:?}");
        let errors =
            build_plan(&config, sources, Mesh { tp: 2, cp: 1, dp: 1, ep: 1, etp: 2 }, &options).expect_err("tp");
        assert!(errors.iter().any(|e| e.to_string().contains("data and expert parallelism only")), "{errors:?}");
    }
}
