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
    /// N(2·10⁻⁴, (2.5·10⁻⁵)²), always positive: the block scales (`weight_scale_inv`) of FP8
    /// weights, whose codes are N(0, 100²) rounded to e4m3, so that the weights they make are
    /// about N(0, 0.02²) and a block's largest code is near the e4m3 maximum (448), as a block
    /// quantizer leaves them.
    Scale,
}

/// How the projection weights of a model's layers are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// Every tensor bf16 (but DeepSeek-V3's float32 score-correction biases).
    #[default]
    Bf16,
    /// As DeepSeek-V3 is published: the linear projections of the decoder layers (attention,
    /// dense MLP, routed and shared experts) are FP8 e4m3, each with a float32
    /// `<weight>_scale_inv` of one scale per `[rows, cols]` block; embeddings, output head,
    /// norms, routers and MTP `eh_proj` stay bf16; `config.json` carries the
    /// `quantization_config`. Only for architectures that [`Arch::supports_fp8`].
    Fp8Block { block: [u64; 2] },
}

impl WeightFormat {
    /// DeepSeek-V3's format: FP8 in blocks of 128 × 128.
    pub const FP8: WeightFormat = WeightFormat::Fp8Block { block: [128, 128] };
}

/// One tensor of a synthetic release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub init: Init,
}

impl TensorSpec {
    /// Elements of the tensor.
    pub fn numel(&self) -> u64 {
        self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).unwrap_or(u64::MAX)
    }

    /// Bytes of data.
    pub fn byte_len(&self) -> u64 {
        checked_bytes(&self.shape, self.dtype).unwrap_or(u64::MAX)
    }
}

/// A synthetic model: its architecture, dimensions, weight format and tensors. No I/O.
#[derive(Clone, Debug)]
pub struct SynthModel {
    pub(crate) arch: Arch,
    pub(crate) dims: ModelDims,
    pub(crate) format: WeightFormat,
    /// In model order: embedding, layers, final norm, head, MTP layers.
    pub(crate) tensors: Vec<TensorSpec>,
    pub(crate) total_bytes: u64,
    pub(crate) total_parameters: u64,
}

/// Bytes of tensor data (in bf16) of the non-layer tensors and of one layer of each kind.
struct SizeModel {
    /// Everything but the decoder layers (embedding, head, final norm, MTP layers).
    fixed: u64,
    /// Bytes of the tensors with a vocabulary dimension per vocabulary row.
    per_vocab_row: u64,
    /// Leading layers of the dense kind (DeepSeek-V3's `first_k_dense_replace`).
    dense_prefix: u64,
    dense_layer: u64,
    /// Layers after the dense prefix: full-attention ones (all of them but in hybrid models)…
    full_layer: u64,
    /// … and Gated DeltaNet ones.
    linear_layer: u64,
}

impl SizeModel {
    fn of(arch: Arch, dims: &ModelDims) -> Result<SizeModel, SynthError> {
        let sum = |specs: &[TensorSpec]| -> Result<u64, SynthError> {
            specs.iter().try_fold(0u64, |acc, t| {
                checked_bytes(&t.shape, t.dtype).and_then(|b| acc.checked_add(b)).ok_or_else(|| overflow(arch))
            })
        };
        let outer = |dims: &ModelDims| {
            let mut specs = Vec::new();
            let mut tail = Vec::new();
            outer_tensors(arch, dims, WeightFormat::Bf16, &mut specs, &mut tail);
            specs.append(&mut tail);
            sum(&specs)
        };
        let fixed = outer(dims)?;
        let one_more_row = ModelDims { vocab_size: dims.vocab_size.saturating_add(1), ..dims.clone() };
        let per_vocab_row = outer(&one_more_row)?.saturating_sub(fixed);
        let layer = |layer: u64| {
            let mut specs = Vec::new();
            layer_tensors(arch, dims, WeightFormat::Bf16, layer, &mut specs);
            sum(&specs)
        };
        let (dense_prefix, dense_layer, full_layer, linear_layer) = if arch == Arch::DeepseekV3 {
            let k = dims.first_dense_layers;
            (k, if k > 0 { layer(0)? } else { 0 }, layer(k)?, 0)
        } else if arch.is_hybrid() {
            (0, 0, layer(FULL_ATTENTION_INTERVAL - 1)?, layer(0)?)
        } else {
            (0, 0, layer(0)?, 0)
        };
        Ok(SizeModel { fixed, per_vocab_row, dense_prefix, dense_layer, full_layer, linear_layer })
    }

    /// The fewest decoder layers a fitted model has: one after the dense prefix, so that a
    /// model with experts has some.
    fn min_layers(&self) -> u64 {
        self.dense_prefix + 1
    }

    /// Tensor bytes with `layers` layers and `vocab_delta` more vocabulary rows than measured;
    /// `None` on overflow.
    fn total(&self, arch: Arch, layers: u64, vocab_delta: i64) -> Option<u64> {
        let dense = layers.min(self.dense_prefix);
        let rest = layers - dense;
        let full = if arch.is_hybrid() { rest / FULL_ATTENTION_INTERVAL } else { rest };
        let linear = rest - full;
        let layers_bytes = dense
            .checked_mul(self.dense_layer)?
            .checked_add(full.checked_mul(self.full_layer)?)?
            .checked_add(linear.checked_mul(self.linear_layer)?)?;
        let vocab_bytes = self.per_vocab_row.checked_mul(vocab_delta.unsigned_abs())?;
        let fixed = if vocab_delta >= 0 {
            self.fixed.checked_add(vocab_bytes)?
        } else {
            self.fixed.checked_sub(vocab_bytes)?
        };
        fixed.checked_add(layers_bytes)
    }

    /// About how many layers `bytes` of layers make.
    fn layers_in(&self, arch: Arch, bytes: u64) -> u64 {
        let prefix = self.dense_prefix.saturating_mul(self.dense_layer);
        if bytes <= prefix {
            return bytes / self.dense_layer.max(1);
        }
        let mean = if arch.is_hybrid() {
            ((FULL_ATTENTION_INTERVAL - 1) * self.linear_layer + self.full_layer) / FULL_ATTENTION_INTERVAL
        } else {
            self.full_layer
        };
        self.dense_prefix + (bytes - prefix) / mean.max(1)
    }
}

fn overflow(arch: Arch) -> SynthError {
    SynthError::InvalidDims { arch: arch.name(), reason: "tensor sizes overflow a 64-bit byte count".to_string() }
}

fn checked_bytes(shape: &[u64], dtype: DType) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?.checked_mul(dtype.size() as u64)
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
        if layers < size.min_layers() || layers > MAX_LAYERS {
            return None;
        }
        let total = size.total(arch, layers, delta(new_vocab))?;
        let oddity = (layers as f64 / PREFERRED_LAYERS).ln().abs() + (new_vocab as f64 / vocab as f64).ln().abs();
        Some(Fit { layers, vocab: new_vocab, total, error: relative_error(total, target), oddity })
    };
    // The layer counts that can come close with some vocabulary in range.
    let layers_with = |v: u64| {
        let fixed = size.total(arch, 0, delta(v)).unwrap_or(u64::MAX);
        size.layers_in(arch, target.saturating_sub(fixed))
    };
    let first = layers_with(highest).saturating_sub(2).max(size.min_layers());
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
    /// A bf16 model of architecture `arch` with exactly these dimensions.
    pub fn new(arch: Arch, dims: ModelDims) -> Result<SynthModel, SynthError> {
        SynthModel::with_format(arch, dims, WeightFormat::Bf16)
    }

    /// A model of architecture `arch` with exactly these dimensions, its weights in `format`.
    pub fn with_format(arch: Arch, dims: ModelDims, format: WeightFormat) -> Result<SynthModel, SynthError> {
        check_format(arch, format)?;
        check_dims(arch, &dims)?;
        let mut tensors = Vec::new();
        let mut tail = Vec::new();
        outer_tensors(arch, &dims, format, &mut tensors, &mut tail);
        for layer in 0..dims.num_layers {
            layer_tensors(arch, &dims, format, layer, &mut tensors);
        }
        tensors.append(&mut tail);
        let total_bytes = tensors.iter().try_fold(0u64, |acc, t| {
            checked_bytes(&t.shape, t.dtype).and_then(|b| acc.checked_add(b)).ok_or_else(|| overflow(arch))
        })?;
        let total_parameters = tensors.iter().map(TensorSpec::numel).sum();
        Ok(SynthModel { arch, dims, format, tensors, total_bytes, total_parameters })
    }

    /// The model a `config.json` describes (its `model_type`, dimensions and, for an FP8
    /// release, `quantization_config`), with exactly its dimensions: a synthetic release shaped
    /// like a real model, or like a framework's model flavor. The written `config.json` is
    /// [`SynthModel::config_json`]'s, which keeps the dimensions and sets the rest as
    /// `transformers` does (an output head of its own: `tie_word_embeddings` false).
    pub fn from_config_json(text: &str) -> Result<SynthModel, SynthError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| SynthError::InvalidConfig(e.to_string()))?;
        let Some(config) = value.as_object() else {
            return Err(SynthError::InvalidConfig("not a JSON object".to_string()));
        };
        let Some(model_type) = config.get("model_type").and_then(serde_json::Value::as_str) else {
            return Err(SynthError::InvalidConfig("no `model_type`".to_string()));
        };
        let arch: Arch = model_type.parse()?;
        SynthModel::with_format(arch, dims_from_config(config), format_from_config(config)?)
    }

    /// A bf16 model of `arch` whose tensor bytes are within [`SIZE_TOLERANCE`] of
    /// `target_bytes`.
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

    /// The model [`SynthModel::for_target`] fits to `target_bytes` in bf16, its weights in
    /// `format`: the same model whatever the format, so that releases in different formats
    /// convert to the same checkpoint. An FP8 release has about half the target's bytes.
    pub fn for_target_as(arch: Arch, format: WeightFormat, target_bytes: u64) -> Result<SynthModel, SynthError> {
        check_format(arch, format)?;
        let model = SynthModel::for_target(arch, target_bytes)?;
        match format {
            WeightFormat::Bf16 => Ok(model),
            _ => SynthModel::with_format(arch, model.dims, format),
        }
    }

    fn no_fit(arch: Arch, target: u64) -> SynthError {
        let smallest = WIDTHS.first().map(|w| {
            let mut dims = w.dims(arch, 1);
            dims.vocab_size = MIN_VOCAB;
            SizeModel::of(arch, &dims).ok().and_then(|s| s.total(arch, s.min_layers(), 0)).unwrap_or(u64::MAX)
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

    /// Number of elements of all tensors, FP8 scales included (the index's
    /// `total_parameters`).
    pub fn total_parameters(&self) -> u64 {
        self.total_parameters
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The `config.json` of the release, as `save_pretrained` writes it (sorted keys, two-space
    /// indent, final newline).
    pub fn config_json(&self) -> String {
        let mut text = serde_json::to_string_pretty(&config_value(self.arch, &self.dims, self.format))
            .unwrap_or_else(|_| "{}".to_string());
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
    let dense_mlp = !arch.is_moe() || arch == Arch::Mixtral || (arch == Arch::DeepseekV3 && d.first_dense_layers > 0);
    if dense_mlp {
        need.push(("intermediate_size", d.intermediate_size));
    }
    if arch.is_moe() {
        need.push(("num_experts", d.num_experts));
        if arch != Arch::Mixtral {
            need.push(("moe_intermediate_size", d.moe_intermediate_size));
        }
    }
    if arch.has_shared_expert() || arch == Arch::DeepseekV3 {
        need.push(("shared_expert_intermediate_size", d.shared_expert_intermediate_size));
    }
    if arch == Arch::DeepseekV3 {
        let Some(m) = &d.mla else {
            return Err(invalid("a deepseek_v3 model needs latent-attention dimensions".to_string()));
        };
        need.extend([
            ("q_lora_rank", m.q_lora_rank),
            ("kv_lora_rank", m.kv_lora_rank),
            ("qk_nope_head_dim", m.qk_nope_head_dim),
            ("qk_rope_head_dim", m.qk_rope_head_dim),
            ("v_head_dim", m.v_head_dim),
        ]);
        // `config.json` sizes the shared experts as `n_shared_experts` routed ones.
        if d.moe_intermediate_size > 0 && !d.shared_expert_intermediate_size.is_multiple_of(d.moe_intermediate_size) {
            return Err(invalid(format!(
                "shared_expert_intermediate_size ({}) is not a multiple of moe_intermediate_size ({})",
                d.shared_expert_intermediate_size, d.moe_intermediate_size
            )));
        }
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
    let mtp_layers = if arch == Arch::DeepseekV3 { d.mtp_layers } else { 0 };
    if d.num_layers.saturating_add(mtp_layers) > MAX_LAYERS {
        return Err(invalid(format!(
            "{} layers exceed the limit of {MAX_LAYERS}",
            d.num_layers.saturating_add(mtp_layers)
        )));
    }
    // Every dimension product must fit: checked once on the largest shapes via SizeModel.
    SizeModel::of(arch, d)?;
    Ok(())
}

fn check_format(arch: Arch, format: WeightFormat) -> Result<(), SynthError> {
    match format {
        WeightFormat::Bf16 => Ok(()),
        WeightFormat::Fp8Block { .. } if !arch.supports_fp8() => Err(SynthError::Fp8NotSupported { arch: arch.name() }),
        WeightFormat::Fp8Block { block } if block.contains(&0) => {
            Err(SynthError::InvalidOption(format!("the FP8 block {block:?} must be positive")))
        }
        WeightFormat::Fp8Block { .. } => Ok(()),
    }
}

/// Pushes the tensors of one layer, named `model.layers.{layer}.…`.
struct Layer<'a> {
    prefix: String,
    format: WeightFormat,
    out: &'a mut Vec<TensorSpec>,
}

impl Layer<'_> {
    fn push(&mut self, name: &str, shape: Vec<u64>, init: Init) {
        self.push_as(name, shape, DType::BF16, init);
    }

    fn push_as(&mut self, name: &str, shape: Vec<u64>, dtype: DType, init: Init) {
        self.out.push(TensorSpec { name: format!("{}{name}", self.prefix), shape, dtype, init });
    }

    /// A linear projection `[rows, cols]`: bf16, or in an FP8 release FP8 followed by its
    /// float32 block scales `<name>_scale_inv [⌈rows / block rows⌉, ⌈cols / block cols⌉]`.
    fn proj(&mut self, name: &str, [rows, cols]: [u64; 2]) {
        match self.format {
            WeightFormat::Bf16 => self.push(name, vec![rows, cols], Init::Normal),
            WeightFormat::Fp8Block { block } => {
                self.push_as(name, vec![rows, cols], DType::F8E4M3, Init::Normal);
                let scales = vec![rows.div_ceil(block[0].max(1)), cols.div_ceil(block[1].max(1))];
                self.push_as(&format!("{name}_scale_inv"), scales, DType::F32, Init::Scale);
            }
        }
    }
}

/// The embedding (into `head`), and the final norm, the output head and the MTP layers (into
/// `tail`).
fn outer_tensors(
    arch: Arch,
    d: &ModelDims,
    format: WeightFormat,
    head: &mut Vec<TensorSpec>,
    tail: &mut Vec<TensorSpec>,
) {
    let (h, v) = (d.hidden_size, d.vocab_size);
    let norm = if arch.zero_centred_norms() { Init::Normal } else { Init::AroundOne };
    let bf16 =
        |name: &str, shape: Vec<u64>, init: Init| TensorSpec { name: name.into(), shape, dtype: DType::BF16, init };
    head.push(bf16("model.embed_tokens.weight", vec![v, h], Init::Normal));
    tail.push(bf16("model.norm.weight", vec![h], norm));
    tail.push(bf16("lm_head.weight", vec![v, h], Init::Normal));
    if arch != Arch::DeepseekV3 {
        return;
    }
    // DeepSeek-V3's MTP layers: decoder layers with experts, after the decoder's.
    for layer in (0..d.mtp_layers).map(|k| d.num_layers + k) {
        decoder_layer(arch, d, format, layer, false, tail);
        let mut l = Layer { prefix: format!("model.layers.{layer}."), format, out: tail };
        l.push("enorm.weight", vec![h], Init::AroundOne);
        l.push("hnorm.weight", vec![h], Init::AroundOne);
        l.push("eh_proj.weight", vec![h, 2 * h], Init::Normal);
        l.push("shared_head.norm.weight", vec![h], Init::AroundOne);
        l.push("shared_head.head.weight", vec![v, h], Init::Normal);
        l.push("embed_tokens.weight", vec![v, h], Init::Normal);
    }
}

/// The tensors of decoder layer `layer`.
fn layer_tensors(arch: Arch, d: &ModelDims, format: WeightFormat, layer: u64, out: &mut Vec<TensorSpec>) {
    let dense = arch == Arch::DeepseekV3 && layer < d.first_dense_layers;
    decoder_layer(arch, d, format, layer, dense, out);
}

/// The tensors of a decoder layer (for DeepSeek-V3, with a dense MLP or experts).
fn decoder_layer(arch: Arch, d: &ModelDims, format: WeightFormat, layer: u64, dense: bool, out: &mut Vec<TensorSpec>) {
    let mut l = Layer { prefix: format!("model.layers.{layer}."), format, out };
    let h = d.hidden_size;
    let norm = if arch.zero_centred_norms() { Init::Normal } else { Init::AroundOne };
    l.push("input_layernorm.weight", vec![h], norm);
    l.push("post_attention_layernorm.weight", vec![h], norm);

    match (&d.linear, &d.mla, arch.is_full_attention(layer)) {
        (_, Some(m), _) if arch == Arch::DeepseekV3 => {
            let (nh, ql, kvl) = (d.num_attention_heads, m.q_lora_rank, m.kv_lora_rank);
            let (dn, dr, dv) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
            l.proj("self_attn.q_a_proj.weight", [ql, h]);
            l.push("self_attn.q_a_layernorm.weight", vec![ql], norm);
            l.proj("self_attn.q_b_proj.weight", [nh * (dn + dr), ql]);
            l.proj("self_attn.kv_a_proj_with_mqa.weight", [kvl + dr, h]);
            l.push("self_attn.kv_a_layernorm.weight", vec![kvl], norm);
            l.proj("self_attn.kv_b_proj.weight", [nh * (dn + dv), kvl]);
            l.proj("self_attn.o_proj.weight", [h, nh * dv]);
        }
        (Some(linear), _, false) => {
            let (qk, v) = (linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim);
            let nv = linear.num_value_heads;
            if arch == Arch::Qwen3Next {
                l.push("linear_attn.in_proj_qkvz.weight", vec![2 * qk + 2 * v, h], Init::Normal);
                l.push("linear_attn.in_proj_ba.weight", vec![2 * nv, h], Init::Normal);
            } else {
                l.push("linear_attn.in_proj_qkv.weight", vec![2 * qk + v, h], Init::Normal);
                l.push("linear_attn.in_proj_z.weight", vec![v, h], Init::Normal);
                l.push("linear_attn.in_proj_b.weight", vec![nv, h], Init::Normal);
                l.push("linear_attn.in_proj_a.weight", vec![nv, h], Init::Normal);
            }
            l.push("linear_attn.conv1d.weight", vec![2 * qk + v, 1, linear.conv_kernel], Init::Normal);
            l.push("linear_attn.A_log", vec![nv], Init::AroundOne);
            l.push("linear_attn.dt_bias", vec![nv], Init::AroundOne);
            // RMSNormGated: a plain (ones-initialised) weight in every architecture.
            l.push("linear_attn.norm.weight", vec![linear.value_head_dim], Init::AroundOne);
            l.push("linear_attn.out_proj.weight", vec![h, v], Init::Normal);
        }
        _ => {
            let (nh, ng, hd) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim);
            // Gated attention: each query head is followed by its output-gate head.
            let q_rows = if arch.is_hybrid() { 2 * nh * hd } else { nh * hd };
            l.push("self_attn.q_proj.weight", vec![q_rows, h], Init::Normal);
            l.push("self_attn.k_proj.weight", vec![ng * hd, h], Init::Normal);
            l.push("self_attn.v_proj.weight", vec![ng * hd, h], Init::Normal);
            l.push("self_attn.o_proj.weight", vec![h, nh * hd], Init::Normal);
            if arch == Arch::Qwen2 {
                l.push("self_attn.q_proj.bias", vec![nh * hd], Init::Normal);
                l.push("self_attn.k_proj.bias", vec![ng * hd], Init::Normal);
                l.push("self_attn.v_proj.bias", vec![ng * hd], Init::Normal);
            }
            if arch.has_qk_norm() {
                l.push("self_attn.q_norm.weight", vec![hd], norm);
                l.push("self_attn.k_norm.weight", vec![hd], norm);
            }
        }
    }

    let e = d.num_experts;
    match arch {
        Arch::DeepseekV3 if dense => {
            let f = d.intermediate_size;
            l.proj("mlp.gate_proj.weight", [f, h]);
            l.proj("mlp.up_proj.weight", [f, h]);
            l.proj("mlp.down_proj.weight", [h, f]);
        }
        Arch::DeepseekV3 => {
            let (f, s) = (d.moe_intermediate_size, d.shared_expert_intermediate_size);
            l.push("mlp.gate.weight", vec![e, h], Init::Normal);
            l.push_as("mlp.gate.e_score_correction_bias", vec![e], DType::F32, Init::Normal);
            for x in 0..e {
                let q = format!("mlp.experts.{x}.");
                l.proj(&format!("{q}gate_proj.weight"), [f, h]);
                l.proj(&format!("{q}up_proj.weight"), [f, h]);
                l.proj(&format!("{q}down_proj.weight"), [h, f]);
            }
            l.proj("mlp.shared_experts.gate_proj.weight", [s, h]);
            l.proj("mlp.shared_experts.up_proj.weight", [s, h]);
            l.proj("mlp.shared_experts.down_proj.weight", [h, s]);
        }
        Arch::Mixtral => {
            let f = d.intermediate_size;
            l.push("block_sparse_moe.gate.weight", vec![e, h], Init::Normal);
            for x in 0..e {
                let q = format!("block_sparse_moe.experts.{x}.");
                l.push(&format!("{q}w1.weight"), vec![f, h], Init::Normal);
                l.push(&format!("{q}w2.weight"), vec![h, f], Init::Normal);
                l.push(&format!("{q}w3.weight"), vec![f, h], Init::Normal);
            }
        }
        Arch::Qwen3Moe | Arch::Qwen3Next => {
            let f = d.moe_intermediate_size;
            l.push("mlp.gate.weight", vec![e, h], Init::Normal);
            for x in 0..e {
                let q = format!("mlp.experts.{x}.");
                l.push(&format!("{q}gate_proj.weight"), vec![f, h], Init::Normal);
                l.push(&format!("{q}up_proj.weight"), vec![f, h], Init::Normal);
                l.push(&format!("{q}down_proj.weight"), vec![h, f], Init::Normal);
            }
        }
        Arch::Qwen35MoeText => {
            let f = d.moe_intermediate_size;
            l.push("mlp.gate.weight", vec![e, h], Init::Normal);
            l.push("mlp.experts.gate_up_proj", vec![e, 2 * f, h], Init::Normal);
            l.push("mlp.experts.down_proj", vec![e, h, f], Init::Normal);
        }
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35Text => {
            let f = d.intermediate_size;
            l.push("mlp.gate_proj.weight", vec![f, h], Init::Normal);
            l.push("mlp.up_proj.weight", vec![f, h], Init::Normal);
            l.push("mlp.down_proj.weight", vec![h, f], Init::Normal);
        }
    }
    if arch.has_shared_expert() {
        let f = d.shared_expert_intermediate_size;
        l.push("mlp.shared_expert.gate_proj.weight", vec![f, h], Init::Normal);
        l.push("mlp.shared_expert.up_proj.weight", vec![f, h], Init::Normal);
        l.push("mlp.shared_expert.down_proj.weight", vec![h, f], Init::Normal);
        l.push("mlp.shared_expert_gate.weight", vec![1, h], Init::Normal);
    }
}
