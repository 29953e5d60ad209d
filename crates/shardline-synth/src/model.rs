//! The tensors of a model, and the fitting of a model to a target size.

use crate::*;
use crate::{arch::*, config::*};

/// How a tensor's values are distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Init {
    /// N(0, 0.02²): weights, biases, zero-centred norms.
    Normal,
    /// 1 + N(0, 0.02²): RMSNorm weights, GDN `A_log` and `dt_bias`.
    AroundOne,
}

/// One bf16 tensor of a synthetic release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub init: Init,
}

impl TensorSpec {
    /// Bytes of bf16 data.
    pub fn byte_len(&self) -> u64 {
        checked_bytes(&self.shape).unwrap_or(u64::MAX)
    }
}

/// A synthetic model: its architecture, dimensions and tensors. No I/O.
#[derive(Clone, Debug)]
pub struct SynthModel {
    pub(crate) arch: Arch,
    pub(crate) dims: ModelDims,
    /// In model order: embedding, layers, final norm, head.
    pub(crate) tensors: Vec<TensorSpec>,
    pub(crate) total_bytes: u64,
}

/// Bytes of tensor data of the non-layer tensors and of one layer of each kind.
struct SizeModel {
    fixed: u64,
    /// Bytes of the embedding plus the head per vocabulary row.
    per_vocab_row: u64,
    full_layer: u64,
    linear_layer: u64,
}

impl SizeModel {
    fn of(arch: Arch, dims: &ModelDims) -> Result<SizeModel, SynthError> {
        let sum = |specs: &[TensorSpec]| -> Result<u64, SynthError> {
            specs.iter().try_fold(0u64, |acc, t| {
                checked_bytes(&t.shape).and_then(|b| acc.checked_add(b)).ok_or_else(|| overflow(arch))
            })
        };
        let mut specs = Vec::new();
        let mut tail = Vec::new();
        outer_tensors(arch, dims, &mut specs, &mut tail);
        specs.append(&mut tail);
        let fixed = sum(&specs)?;
        specs.clear();
        layer_tensors(arch, dims, FULL_ATTENTION_INTERVAL - 1, &mut specs);
        let full_layer = sum(&specs)?;
        specs.clear();
        layer_tensors(arch, dims, 0, &mut specs);
        let linear_layer = sum(&specs)?;
        Ok(SizeModel { fixed, per_vocab_row: 4 * dims.hidden_size, full_layer, linear_layer })
    }

    /// Tensor bytes with `layers` layers and `vocab_delta` more vocabulary rows than measured;
    /// `None` on overflow.
    fn total(&self, arch: Arch, layers: u64, vocab_delta: i64) -> Option<u64> {
        let full = if arch.is_hybrid() { layers / FULL_ATTENTION_INTERVAL } else { layers };
        let linear = layers - full;
        let layers_bytes = full.checked_mul(self.full_layer)?.checked_add(linear.checked_mul(self.linear_layer)?)?;
        let vocab_bytes = self.per_vocab_row.checked_mul(vocab_delta.unsigned_abs())?;
        let fixed = if vocab_delta >= 0 {
            self.fixed.checked_add(vocab_bytes)?
        } else {
            self.fixed.checked_sub(vocab_bytes)?
        };
        fixed.checked_add(layers_bytes)
    }

    /// Average bytes of a layer.
    fn mean_layer(&self, arch: Arch) -> u64 {
        if arch.is_hybrid() {
            ((FULL_ATTENTION_INTERVAL - 1) * self.linear_layer + self.full_layer) / FULL_ATTENTION_INTERVAL
        } else {
            self.full_layer
        }
    }
}

fn overflow(arch: Arch) -> SynthError {
    SynthError::InvalidDims { arch: arch.name(), reason: "tensor sizes overflow a 64-bit byte count".to_string() }
}

fn checked_bytes(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?.checked_mul(2)
}

pub(crate) fn relative_error(total: u64, target: u64) -> f64 {
    (total as f64 - target as f64).abs() / (target as f64).max(1.0)
}

/// A candidate size fit.
#[derive(Clone, Copy, Debug)]
struct Fit {
    layers: u64,
    pub(crate) vocab: u64,
    total: u64,
    /// Relative distance of `total` from the target.
    error: f64,
    /// How unusual the shape is: `|ln(layers / 32)| + |ln(vocab / width's vocab)|`.
    oddity: f64,
}

/// The fits of one width within [`SIZE_TOLERANCE`] of `target`: for every layer count that can
/// come close, the width's vocabulary as it is and the vocabulary (in multiples of 64 rows) that
/// best fills the gap. A real vocabulary may move by half of it either way, the made-up ones of
/// narrow widths down to [`MIN_VOCAB`] and up to four times.
fn fit_width(arch: Arch, width: &Width, target: u64) -> Result<Vec<Fit>, SynthError> {
    let dims = width.dims(arch, 1);
    let size = SizeModel::of(arch, &dims)?;
    let vocab = dims.vocab_size;
    let (lowest, highest) = match width.vocab {
        Some(_) => (MIN_VOCAB, 4 * vocab),
        None => (vocab / 2, vocab + vocab / 2),
    };
    let delta = |v: u64| v as i64 - vocab as i64;
    let evaluate = |layers: u64, new_vocab: u64| -> Option<Fit> {
        if layers == 0 || layers > MAX_LAYERS {
            return None;
        }
        let total = size.total(arch, layers, delta(new_vocab))?;
        let oddity = (layers as f64 / PREFERRED_LAYERS).ln().abs() + (new_vocab as f64 / vocab as f64).ln().abs();
        Some(Fit { layers, vocab: new_vocab, total, error: relative_error(total, target), oddity })
    };
    // The layer counts that can come close with some vocabulary in range.
    let mean = size.mean_layer(arch).max(1);
    let layers_with = |v: u64| {
        let fixed = size.total(arch, 0, delta(v)).unwrap_or(u64::MAX);
        target.saturating_sub(fixed) / mean
    };
    let first = layers_with(highest).saturating_sub(2).max(1);
    let last = layers_with(lowest).saturating_add(2).min(MAX_LAYERS);

    let mut fits = Vec::new();
    for layers in first..=last {
        let Some(plain) = evaluate(layers, vocab) else {
            continue;
        };
        let rows = (target as f64 - plain.total as f64) / size.per_vocab_row as f64;
        let tuned = ((vocab as f64 + rows) / 64.0).round() * 64.0;
        let tuned = (tuned.max(0.0) as u64).clamp(lowest, highest);
        fits.extend([Some(plain), evaluate(layers, tuned)].into_iter().flatten().filter(|f| f.error <= SIZE_TOLERANCE));
    }
    Ok(fits)
}

impl SynthModel {
    /// A model of architecture `arch` with exactly these dimensions.
    pub fn new(arch: Arch, dims: ModelDims) -> Result<SynthModel, SynthError> {
        check_dims(arch, &dims)?;
        let mut tensors = Vec::new();
        let mut tail = Vec::new();
        outer_tensors(arch, &dims, &mut tensors, &mut tail);
        for layer in 0..dims.num_layers {
            layer_tensors(arch, &dims, layer, &mut tensors);
        }
        tensors.append(&mut tail);
        let total_bytes = tensors.iter().try_fold(0u64, |acc, t| {
            checked_bytes(&t.shape).and_then(|b| acc.checked_add(b)).ok_or_else(|| overflow(arch))
        })?;
        Ok(SynthModel { arch, dims, tensors, total_bytes })
    }

    /// A model of `arch` whose tensor bytes are within [`SIZE_TOLERANCE`] of `target_bytes`.
    ///
    /// Every width of the ladder is fitted (layer count and vocabulary, see [`fit_width`]).
    /// Among the fits within 2 % of the target (or, failing any, within the tolerance), the least
    /// odd one wins: layer count closest to 32 and vocabulary closest to the width's, by ratio.
    pub fn for_target(arch: Arch, target_bytes: u64) -> Result<SynthModel, SynthError> {
        let mut fits: Vec<(&Width, Fit)> = Vec::new();
        for width in WIDTHS {
            fits.extend(fit_width(arch, width, target_bytes)?.into_iter().map(|f| (width, f)));
        }
        let close = fits.iter().any(|(_, f)| f.error <= CLOSE_FIT);
        let chosen = fits.into_iter().filter(|(_, f)| !close || f.error <= CLOSE_FIT).min_by(|(_, a), (_, b)| {
            (a.oddity, a.error).partial_cmp(&(b.oddity, b.error)).unwrap_or(std::cmp::Ordering::Equal)
        });
        let Some((width, fit)) = chosen else {
            return Err(Self::no_fit(arch, target_bytes));
        };
        let mut dims = width.dims(arch, fit.layers);
        dims.vocab_size = fit.vocab;
        let model = SynthModel::new(arch, dims)?;
        debug_assert_eq!(model.total_bytes, fit.total);
        Ok(model)
    }

    fn no_fit(arch: Arch, target: u64) -> SynthError {
        let smallest = WIDTHS.first().map(|w| {
            let mut dims = w.dims(arch, 1);
            dims.vocab_size = MIN_VOCAB;
            SizeModel::of(arch, &dims).ok().and_then(|s| s.total(arch, 1, 0)).unwrap_or(u64::MAX)
        });
        match smallest {
            Some(minimum) if target < minimum => SynthError::TargetTooSmall { arch: arch.name(), target, minimum },
            _ => SynthError::TargetTooLarge { arch: arch.name(), target },
        }
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn dims(&self) -> &ModelDims {
        &self.dims
    }

    /// The tensors in model order (embedding, layers, final norm, head).
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Bytes of tensor data (the index's `total_size`).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Number of parameters (the index's `total_parameters`).
    pub fn total_parameters(&self) -> u64 {
        self.total_bytes / 2
    }

    /// The `config.json` of the release, as `save_pretrained` writes it (sorted keys, two-space
    /// indent, final newline).
    pub fn config_json(&self) -> String {
        let mut text =
            serde_json::to_string_pretty(&config_value(self.arch, &self.dims)).unwrap_or_else(|_| "{}".to_string());
        text.push('\n');
        text
    }
}

fn check_dims(arch: Arch, d: &ModelDims) -> Result<(), SynthError> {
    let invalid = |reason: String| SynthError::InvalidDims { arch: arch.name(), reason };
    let mut need = vec![
        ("hidden_size", d.hidden_size),
        ("num_hidden_layers", d.num_layers),
        ("num_attention_heads", d.num_attention_heads),
        ("num_key_value_heads", d.num_key_value_heads),
        ("head_dim", d.head_dim),
        ("vocab_size", d.vocab_size),
    ];
    if !arch.is_moe() || arch == Arch::Mixtral {
        need.push(("intermediate_size", d.intermediate_size));
    }
    if arch.is_moe() {
        need.push(("num_experts", d.num_experts));
        if arch != Arch::Mixtral {
            need.push(("moe_intermediate_size", d.moe_intermediate_size));
        }
    }
    if arch.has_shared_expert() {
        need.push(("shared_expert_intermediate_size", d.shared_expert_intermediate_size));
    }
    if arch.is_hybrid() {
        let Some(l) = &d.linear else {
            return Err(invalid("a hybrid model needs linear-attention dimensions".to_string()));
        };
        need.extend([
            ("linear_num_key_heads", l.num_key_heads),
            ("linear_num_value_heads", l.num_value_heads),
            ("linear_key_head_dim", l.key_head_dim),
            ("linear_value_head_dim", l.value_head_dim),
            ("linear_conv_kernel_dim", l.conv_kernel),
        ]);
        if l.num_key_heads > 0 && l.num_value_heads % l.num_key_heads != 0 {
            return Err(invalid(format!(
                "linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                l.num_value_heads, l.num_key_heads
            )));
        }
    }
    if let Some((field, _)) = need.iter().find(|(_, v)| *v == 0) {
        return Err(invalid(format!("`{field}` must be positive")));
    }
    if d.num_attention_heads.checked_rem(d.num_key_value_heads) != Some(0) {
        return Err(invalid(format!(
            "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
            d.num_attention_heads, d.num_key_value_heads
        )));
    }
    let mut all = need.clone();
    all.extend([
        ("intermediate_size", d.intermediate_size),
        ("num_experts", d.num_experts),
        ("moe_intermediate_size", d.moe_intermediate_size),
        ("shared_expert_intermediate_size", d.shared_expert_intermediate_size),
    ]);
    if let Some((field, value)) = all.iter().find(|(_, v)| *v > MAX_DIM) {
        return Err(invalid(format!("`{field}` = {value} exceeds the limit of {MAX_DIM}")));
    }
    if d.num_experts > MAX_EXPERTS {
        return Err(invalid(format!("{} experts exceed the limit of {MAX_EXPERTS}", d.num_experts)));
    }
    if d.num_layers > MAX_LAYERS {
        return Err(invalid(format!("{} layers exceed the limit of {MAX_LAYERS}", d.num_layers)));
    }
    // Every dimension product must fit: checked once on the largest shapes via SizeModel.
    SizeModel::of(arch, d)?;
    Ok(())
}

fn spec(name: String, shape: Vec<u64>, init: Init) -> TensorSpec {
    TensorSpec { name, shape, init }
}

/// The embedding (into `head`) and the final norm and output head (into `tail`).
fn outer_tensors(arch: Arch, d: &ModelDims, head: &mut Vec<TensorSpec>, tail: &mut Vec<TensorSpec>) {
    let (h, v) = (d.hidden_size, d.vocab_size);
    let norm = if arch.zero_centred_norms() { Init::Normal } else { Init::AroundOne };
    head.push(spec("model.embed_tokens.weight".into(), vec![v, h], Init::Normal));
    tail.push(spec("model.norm.weight".into(), vec![h], norm));
    tail.push(spec("lm_head.weight".into(), vec![v, h], Init::Normal));
}

/// The tensors of decoder layer `layer`.
fn layer_tensors(arch: Arch, d: &ModelDims, layer: u64, out: &mut Vec<TensorSpec>) {
    let p = format!("model.layers.{layer}.");
    let h = d.hidden_size;
    let norm = if arch.zero_centred_norms() { Init::Normal } else { Init::AroundOne };
    let mut push = |name: &str, shape: Vec<u64>, init: Init| {
        out.push(spec(format!("{p}{name}"), shape, init));
    };
    push("input_layernorm.weight", vec![h], norm);
    push("post_attention_layernorm.weight", vec![h], norm);

    match (&d.linear, arch.is_full_attention(layer)) {
        (Some(l), false) => {
            let (qk, v) = (l.num_key_heads * l.key_head_dim, l.num_value_heads * l.value_head_dim);
            let nv = l.num_value_heads;
            if arch == Arch::Qwen3Next {
                push("linear_attn.in_proj_qkvz.weight", vec![2 * qk + 2 * v, h], Init::Normal);
                push("linear_attn.in_proj_ba.weight", vec![2 * nv, h], Init::Normal);
            } else {
                push("linear_attn.in_proj_qkv.weight", vec![2 * qk + v, h], Init::Normal);
                push("linear_attn.in_proj_z.weight", vec![v, h], Init::Normal);
                push("linear_attn.in_proj_b.weight", vec![nv, h], Init::Normal);
                push("linear_attn.in_proj_a.weight", vec![nv, h], Init::Normal);
            }
            push("linear_attn.conv1d.weight", vec![2 * qk + v, 1, l.conv_kernel], Init::Normal);
            push("linear_attn.A_log", vec![nv], Init::AroundOne);
            push("linear_attn.dt_bias", vec![nv], Init::AroundOne);
            // RMSNormGated: a plain (ones-initialised) weight in every architecture.
            push("linear_attn.norm.weight", vec![l.value_head_dim], Init::AroundOne);
            push("linear_attn.out_proj.weight", vec![h, v], Init::Normal);
        }
        _ => {
            let (nh, ng, hd) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim);
            // Gated attention: each query head is followed by its output-gate head.
            let q_rows = if arch.is_hybrid() { 2 * nh * hd } else { nh * hd };
            push("self_attn.q_proj.weight", vec![q_rows, h], Init::Normal);
            push("self_attn.k_proj.weight", vec![ng * hd, h], Init::Normal);
            push("self_attn.v_proj.weight", vec![ng * hd, h], Init::Normal);
            push("self_attn.o_proj.weight", vec![h, nh * hd], Init::Normal);
            if arch == Arch::Qwen2 {
                push("self_attn.q_proj.bias", vec![nh * hd], Init::Normal);
                push("self_attn.k_proj.bias", vec![ng * hd], Init::Normal);
                push("self_attn.v_proj.bias", vec![ng * hd], Init::Normal);
            }
            if arch.has_qk_norm() {
                push("self_attn.q_norm.weight", vec![hd], norm);
                push("self_attn.k_norm.weight", vec![hd], norm);
            }
        }
    }

    let e = d.num_experts;
    match arch {
        Arch::Mixtral => {
            let f = d.intermediate_size;
            push("block_sparse_moe.gate.weight", vec![e, h], Init::Normal);
            for x in 0..e {
                let q = format!("block_sparse_moe.experts.{x}.");
                push(&format!("{q}w1.weight"), vec![f, h], Init::Normal);
                push(&format!("{q}w2.weight"), vec![h, f], Init::Normal);
                push(&format!("{q}w3.weight"), vec![f, h], Init::Normal);
            }
        }
        Arch::Qwen3Moe | Arch::Qwen3Next => {
            let f = d.moe_intermediate_size;
            push("mlp.gate.weight", vec![e, h], Init::Normal);
            for x in 0..e {
                let q = format!("mlp.experts.{x}.");
                push(&format!("{q}gate_proj.weight"), vec![f, h], Init::Normal);
                push(&format!("{q}up_proj.weight"), vec![f, h], Init::Normal);
                push(&format!("{q}down_proj.weight"), vec![h, f], Init::Normal);
            }
        }
        Arch::Qwen35MoeText => {
            let f = d.moe_intermediate_size;
            push("mlp.gate.weight", vec![e, h], Init::Normal);
            push("mlp.experts.gate_up_proj", vec![e, 2 * f, h], Init::Normal);
            push("mlp.experts.down_proj", vec![e, h, f], Init::Normal);
        }
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35Text => {
            let f = d.intermediate_size;
            push("mlp.gate_proj.weight", vec![f, h], Init::Normal);
            push("mlp.up_proj.weight", vec![f, h], Init::Normal);
            push("mlp.down_proj.weight", vec![h, f], Init::Normal);
        }
    }
    if arch.has_shared_expert() {
        let f = d.shared_expert_intermediate_size;
        push("mlp.shared_expert.gate_proj.weight", vec![f, h], Init::Normal);
        push("mlp.shared_expert.up_proj.weight", vec![f, h], Init::Normal);
        push("mlp.shared_expert.down_proj.weight", vec![h, f], Init::Normal);
        push("mlp.shared_expert_gate.weight", vec![1, h], Init::Normal);
    }
}
