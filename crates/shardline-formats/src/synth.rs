//! Synthetic HuggingFace releases for scale tests and benchmarks.
//!
//! [`synth`] writes a release as `save_pretrained` would: `config.json`, the weights sharded into
//! `model-0000i-of-0000N.safetensors` files of at most [`SynthOptions::max_shard_bytes`] (a single
//! `model.safetensors` and no index when everything fits in one file, as `save_pretrained` does),
//! and `model.safetensors.index.json`. Tensor names and shapes are the architecture's real ones
//! (they match the tiny checkpoints written by `transformers` in `tests/fixtures/hf-tiny`); the
//! data is deterministic pseudo-random bf16.
//!
//! * **Size.** [`SynthModel::for_target`] fits the layer count and the vocabulary (in multiples
//!   of 64 rows) of every width of a ladder shaped like real models (head_dim 128, GQA and real
//!   vocabularies from a hidden size of 1024 up, expert counts growing with width), and keeps the
//!   least odd fit within 2 % of the target: layer count closest to 32, vocabulary closest to the
//!   width's. The tensor bytes always land within [`SIZE_TOLERANCE`] (5 %) of the target. Small
//!   targets get narrow models: 1 MB gives `hidden_size` 64 and a handful of layers.
//! * **Data.** Every tensor has its own pseudo-random stream (wyrand seeded from the seed and the
//!   tensor's name), so a tensor's bytes do not depend on the shard size, on the piece size or on
//!   the thread writing it. Each 64-bit draw gives four bf16 values through a 65 536-entry table of
//!   normal quantiles: weights are N(0, 0.02²); RMSNorm weights (and GDN `A_log`, `dt_bias`) are
//!   1 + N(0, 0.02²), except the zero-centred norms of Qwen3-Next and Qwen3.5, which are N(0, 0.02²).
//!   Values are finite by construction (|x| < 4.4σ around the mean).
//! * **Speed and memory.** Shards are written by parallel threads, each streaming its tensors
//!   through [`SafetensorsWriter::write_next`] in pieces of [`SynthOptions::piece_bytes`]; memory is
//!   one piece buffer per thread plus the tensor list.
//! * **Atomicity.** Each shard is renamed into place when complete; the index and then
//!   `config.json` are written (temporary name, then rename) only after every shard is finished,
//!   so an interrupted run never looks like a complete release. On failure, finished shards are
//!   removed again.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use shardline_layout::DType;
use thiserror::Error;

use crate::safetensors::{
    FileLayout, SafetensorsError, SafetensorsWriter, CONFIG_FILE_NAME, INDEX_FILE_NAME, SINGLE_FILE_NAME,
};

/// Default largest shard, like `save_pretrained(max_shard_size=…)`.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 2 << 30;
/// Default size of the pieces each tensor is generated and written in.
pub const DEFAULT_PIECE_BYTES: usize = 4 << 20;
/// Relative distance between the target size and the tensor bytes [`SynthModel::for_target`]
/// guarantees.
pub const SIZE_TOLERANCE: f64 = 0.05;
/// Most decoder layers a synthetic model may have.
pub const MAX_LAYERS: u64 = 4096;

/// Largest value of any dimension of [`ModelDims`] (so that products of two fit easily).
const MAX_DIM: u64 = 1 << 24;
/// Most routed experts per layer.
const MAX_EXPERTS: u64 = 4096;
/// The width whose layer count is closest to this (by ratio) is chosen for a target.
const PREFERRED_LAYERS: f64 = 32.0;
/// Fits this close to the target are preferred to the others within the tolerance.
const CLOSE_FIT: f64 = 0.02;
/// Smallest vocabulary the size fitting may shrink to.
const MIN_VOCAB: u64 = 256;
/// Standard deviation of generated weights.
const WEIGHT_STD: f64 = 0.02;
/// Number of layers of a hybrid model per full-attention layer (`layer_types` period).
const FULL_ATTENTION_INTERVAL: u64 = 4;
/// The `transformers` version whose `save_pretrained` output the release mirrors.
const TRANSFORMERS_VERSION: &str = "5.23.0";

/// Why a synthetic release cannot be made.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SynthError {
    #[error("unknown architecture `{arch}` (supported: {})", supported.join(", "))]
    UnknownArch { arch: String, supported: Vec<&'static str> },

    #[error(
        "invalid size {input:?}: {reason} (expected a number with an optional unit, e.g. `1MB`, \
         `512MiB`, `4GB`, `1.5TiB`; B, KB, MB, GB, TB, PB are powers of 1000, KiB … PiB and K, \
         M, G, T, P are powers of 1024)"
    )]
    InvalidSize { input: String, reason: String },

    #[error(
        "target of {target} bytes is too small for `{arch}`: the smallest model has {minimum} \
         bytes of tensors"
    )]
    TargetTooSmall { arch: &'static str, target: u64, minimum: u64 },

    #[error(
        "target of {target} bytes is too large for `{arch}`: it would need more than \
         {MAX_LAYERS} layers of the widest model"
    )]
    TargetTooLarge { arch: &'static str, target: u64 },

    #[error("invalid dimensions for `{arch}`: {reason}")]
    InvalidDims { arch: &'static str, reason: String },

    #[error("invalid option: {0}")]
    InvalidOption(String),

    #[error(
        "{}: already holds a release ({file}); remove it or overwrite it",
        .dir.display()
    )]
    OutputNotEmpty { dir: PathBuf, file: String },

    #[error("{}: cannot {action}: {source}", .path.display())]
    Io { path: PathBuf, action: &'static str, source: io::Error },

    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),

    #[error("a shard-writing thread panicked")]
    WorkerPanicked,
}

fn io_error(path: &Path, action: &'static str) -> impl FnOnce(io::Error) -> SynthError {
    let path = path.to_path_buf();
    move |source| SynthError::Io { path, action, source }
}

// ------------------------------------------------------------------------------------------------
// Sizes
// ------------------------------------------------------------------------------------------------

/// Parses a size such as `1MB`, `512MiB`, `4GB`, `1.5 TiB` or `1024` into bytes.
///
/// Units are case-insensitive: `B`, `KB`, `MB`, `GB`, `TB`, `PB` are powers of 1000;
/// `KiB` … `PiB` and the one-letter `K`, `M`, `G`, `T`, `P` (as in `dd`) are powers of 1024.
/// A fractional number is allowed with a unit and rounded down to whole bytes.
pub fn parse_size(input: &str) -> Result<u64, SynthError> {
    let invalid = |reason: &str| SynthError::InvalidSize { input: input.to_string(), reason: reason.to_string() };
    let text = input.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim();
    if number.is_empty() {
        return Err(invalid("no number"));
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        _ => return Err(invalid(&format!("unknown unit {unit:?}"))),
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if fraction.contains('.') {
        return Err(invalid("more than one decimal point"));
    }
    if whole.is_empty() && fraction.is_empty() {
        return Err(invalid("no digits"));
    }
    let too_large = || invalid("does not fit in 64 bits");
    let whole_value: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let mut bytes = whole_value.checked_mul(multiplier).ok_or_else(too_large)?;
    // fraction · multiplier / 10^digits, exactly; digits beyond 10^-20 are below one byte.
    let mut numerator: u128 = 0;
    let mut denominator: u128 = 1;
    for digit in fraction.bytes().take(20) {
        denominator *= 10;
        numerator = numerator * 10 + u128::from(digit - b'0');
    }
    let extra = u64::try_from(numerator * u128::from(multiplier) / denominator).map_err(|_| too_large())?;
    bytes = bytes.checked_add(extra).ok_or_else(too_large)?;
    Ok(bytes)
}

// ------------------------------------------------------------------------------------------------
// Architectures and dimensions
// ------------------------------------------------------------------------------------------------

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
}

/// Every `model_type` [`synth`] accepts.
pub const SUPPORTED_ARCHS: &[&str] =
    &["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"];

impl Arch {
    /// Every architecture, in the order of [`SUPPORTED_ARCHS`].
    pub const ALL: [Arch; 9] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Mixtral,
        Arch::Qwen3Next,
        Arch::Qwen35Text,
        Arch::Qwen35MoeText,
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
        }
    }

    /// The class `save_pretrained` records under `architectures`.
    fn class_name(self) -> &'static str {
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
        }
    }

    /// Whether layers alternate Gated DeltaNet and full attention.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText)
    }

    /// Whether the MLP of every layer is routed experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Mixtral | Arch::Qwen3Next | Arch::Qwen35MoeText)
    }

    fn has_shared_expert(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35MoeText)
    }

    fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Text | Arch::Qwen35MoeText)
    }

    /// Whether the decoder's RMSNorms compute `x · (1 + w)` (weights stored around 0).
    fn zero_centred_norms(self) -> bool {
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
}

impl ModelDims {
    /// Experts each token is routed to, as the real configs set it (2 of 8 … 10 of 512).
    fn experts_per_token(&self, arch: Arch) -> u64 {
        match arch {
            Arch::Mixtral => 2.min(self.num_experts),
            _ => (self.num_experts / 16).clamp(2, 10).min(self.num_experts),
        }
    }
}

/// One width of the size ladder; the layer count and the vocabulary are fitted afterwards.
struct Width {
    hidden: u64,
    head_dim: u64,
    kv_heads: u64,
    intermediate: u64,
    /// `None`: the architecture's real vocabulary.
    vocab: Option<u64>,
    experts: u64,
    moe_intermediate: u64,
    /// `(linear_num_key_heads, linear_num_value_heads, linear_{key,value}_head_dim)`.
    linear: (u64, u64, u64),
}

/// Widths from narrowest to widest, shaped like real models of that width (Llama-3.2-3B at
/// 3072, Llama-3-8B at 4096, Qwen3-14B at 5120, Llama-3-70B at 8192). From 1024 up: head_dim 128,
/// GQA, real vocabularies, 64–128 routed experts of 3/8 of the hidden size (Qwen3-30B-A3B has
/// 768 at 2048), GDN with 128-dim heads and twice as many value heads as key heads (16/32 at
/// 2048, as Qwen3-Next and Qwen3.5-35B-A3B). Narrower widths scale everything down, with made-up
/// vocabularies.
const WIDTHS: &[Width] = &[
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

impl Width {
    fn dims(&self, arch: Arch, num_layers: u64) -> ModelDims {
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
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Tensors of a model
// ------------------------------------------------------------------------------------------------

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
    arch: Arch,
    dims: ModelDims,
    /// In model order: embedding, layers, final norm, head.
    tensors: Vec<TensorSpec>,
    total_bytes: u64,
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

fn relative_error(total: u64, target: u64) -> f64 {
    (total as f64 - target as f64).abs() / (target as f64).max(1.0)
}

/// A candidate size fit.
#[derive(Clone, Copy, Debug)]
struct Fit {
    layers: u64,
    vocab: u64,
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

// ------------------------------------------------------------------------------------------------
// config.json
// ------------------------------------------------------------------------------------------------

/// The fields `transformers` 5 writes for the architecture's config class (keys sorted by the
/// JSON map).
fn config_value(arch: Arch, d: &ModelDims) -> Value {
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

// ------------------------------------------------------------------------------------------------
// Data
// ------------------------------------------------------------------------------------------------

const TABLE_LEN: usize = 1 << 16;

/// bf16 bit patterns of the 65 536 quantiles `mean + std · Φ⁻¹((i + ½) / 65 536)`: indexing it
/// with 16 uniform bits draws from a (finely quantised) normal distribution.
struct NormalTable(Box<[u16; TABLE_LEN]>);

impl NormalTable {
    fn new(mean: f64, std: f64) -> NormalTable {
        let mut table = Box::new([0u16; TABLE_LEN]);
        for (i, slot) in table.iter_mut().enumerate() {
            let p = (i as f64 + 0.5) / TABLE_LEN as f64;
            *slot = f32_to_bf16((mean + std * inverse_normal_cdf(p)) as f32);
        }
        NormalTable(table)
    }

    #[inline(always)]
    fn four(&self, r: u64) -> u64 {
        let t = &self.0;
        u64::from(t[r as u16 as usize])
            | u64::from(t[(r >> 16) as u16 as usize]) << 16
            | u64::from(t[(r >> 32) as u16 as usize]) << 32
            | u64::from(t[(r >> 48) as u16 as usize]) << 48
    }
}

/// The value tables, one per [`Init`].
struct Tables {
    normal: NormalTable,
    around_one: NormalTable,
}

impl Tables {
    fn new() -> Tables {
        Tables { normal: NormalTable::new(0.0, WEIGHT_STD), around_one: NormalTable::new(1.0, WEIGHT_STD) }
    }

    fn get(&self, init: Init) -> &NormalTable {
        match init {
            Init::Normal => &self.normal,
            Init::AroundOne => &self.around_one,
        }
    }
}

/// Rounds to the nearest bf16, ties to even (inputs here are finite).
fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// Φ⁻¹(p) for 0 < p < 1, by Acklam's rational approximation (relative error < 1.2e-9).
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    const P_LOW: f64 = 0.024_25;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < P_LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p <= 1.0 - P_LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    }
}

/// 64-bit FNV-1a, a hash that is the same on every platform and Rust version.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pseudo-random byte stream of one tensor (wyrand).
struct TensorStream {
    state: u64,
}

impl TensorStream {
    fn new(seed: u64, name: &str) -> TensorStream {
        TensorStream { state: splitmix64(splitmix64(seed) ^ fnv1a(name.as_bytes())) }
    }

    #[inline(always)]
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.state) * u128::from(self.state ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    }

    /// Fills `out` with the next bf16 values. Calls with lengths that are multiples of 8 bytes
    /// continue the stream exactly, so the bytes do not depend on how a tensor is cut into pieces.
    fn fill(&mut self, table: &NormalTable, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for chunk in &mut chunks {
            let r = self.next_u64();
            chunk.copy_from_slice(&table.four(r).to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let bytes = table.four(self.next_u64()).to_le_bytes();
            rest.copy_from_slice(&bytes[..rest.len()]);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Writing a release
// ------------------------------------------------------------------------------------------------

/// How [`synth`] writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthOptions {
    /// Largest shard in tensor bytes; a tensor larger than this gets a shard of its own.
    /// By default, [`DEFAULT_MAX_SHARD_BYTES`] (2 GiB).
    pub max_shard_bytes: u64,
    /// Threads writing shards; 0 means one per available core. By default, 0.
    pub threads: usize,
    /// Size of the pieces tensors are generated and written in (rounded up to a multiple of 8).
    /// By default, [`DEFAULT_PIECE_BYTES`] (4 MiB).
    pub piece_bytes: usize,
    /// Replace a complete release already in the output directory (its `config.json`, index and
    /// `model*.safetensors` files are removed first; other files stay). By default, false: such a
    /// directory is an error. The files of an interrupted run (no `config.json`) are always
    /// replaced.
    pub overwrite: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            threads: 0,
            piece_bytes: DEFAULT_PIECE_BYTES,
            overwrite: false,
        }
    }
}

/// What [`synth`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    pub arch: Arch,
    pub dims: ModelDims,
    pub dir: PathBuf,
    /// The safetensors files, in shard order.
    pub files: Vec<PathBuf>,
    /// The index, when the release is sharded.
    pub index: Option<PathBuf>,
    pub num_tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub total_bytes: u64,
    pub total_parameters: u64,
    /// Bytes of the safetensors files, headers included.
    pub file_bytes: u64,
    pub threads: usize,
    pub elapsed: Duration,
}

impl SynthReport {
    /// Tensor bytes written per second.
    pub fn bytes_per_second(&self) -> f64 {
        self.total_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Writes a synthetic `arch` release of about `target_bytes` bytes of tensors into `out_dir`
/// (created if needed), with data drawn from `seed`. See the module documentation.
pub fn synth(
    arch: &str,
    target_bytes: u64,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
) -> Result<SynthReport, SynthError> {
    synth_with_progress(arch, target_bytes, out_dir, seed, options, &|_| {})
}

/// [`synth`], calling `progress` (from the writing threads) with the number of tensor bytes
/// written since the previous call.
pub fn synth_with_progress(
    arch: &str,
    target_bytes: u64,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SynthReport, SynthError> {
    let arch: Arch = arch.parse()?;
    let model = SynthModel::for_target(arch, target_bytes)?;
    write_release(&model, out_dir, seed, options, progress)
}

/// One safetensors file to write: its name and its tensors (indices into the model's, in file
/// order, i.e. sorted by name as the safetensors serializer orders them).
struct Shard {
    file_name: String,
    tensors: Vec<usize>,
}

/// Cuts the tensors, in model order, into shards of at most `max_bytes` as `save_pretrained`
/// does: a tensor that does not fit in the current shard starts the next one.
fn assign_shards(model: &SynthModel, max_bytes: u64) -> Vec<Shard> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0u64;
    for (i, t) in model.tensors.iter().enumerate() {
        let bytes = t.byte_len();
        if !current.is_empty() && current_bytes.saturating_add(bytes) > max_bytes {
            groups.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes = current_bytes.saturating_add(bytes);
    }
    if !current.is_empty() {
        groups.push(current);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(k, mut tensors)| {
            tensors.sort_by(|&a, &b| {
                let name = |i: usize| model.tensors.get(i).map(|t| t.name.as_str());
                name(a).cmp(&name(b))
            });
            let file_name =
                if n == 1 { SINGLE_FILE_NAME.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
            Shard { file_name, tensors }
        })
        .collect()
}

/// Whether `name` is one of the files a release written here consists of.
fn is_release_file(name: &str) -> bool {
    name == CONFIG_FILE_NAME
        || name == INDEX_FILE_NAME
        || name == SINGLE_FILE_NAME
        || (name.starts_with("model-") && name.ends_with(".safetensors") && name.contains("-of-"))
}

/// Whether `name` is a temporary file an interrupted run of [`synth`] may have left behind
/// (`.<release file>.<pid>[-<n>].partial`).
fn is_leftover_temp(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.strip_suffix(".partial"))
        .and_then(|n| n.rsplit_once('.'))
        .is_some_and(|(file, _)| is_release_file(file))
}

/// Prepares `dir`: refuses a complete release (one with `config.json`) unless `overwrite`, and
/// removes the files of a previous release or of an interrupted run (`config.json` first, so a
/// half-cleared directory never looks complete). Other files are left alone.
fn prepare_output(dir: &Path, overwrite: bool) -> Result<(), SynthError> {
    fs::create_dir_all(dir).map_err(io_error(dir, "create the output directory"))?;
    let mut found: Vec<String> = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error(dir, "list the output directory"))? {
        let entry = entry.map_err(io_error(dir, "list the output directory"))?;
        if let Some(name) = entry.file_name().to_str() {
            if is_release_file(name) || is_leftover_temp(name) {
                found.push(name.to_string());
            }
        }
    }
    if !overwrite && found.iter().any(|n| n == CONFIG_FILE_NAME) {
        return Err(SynthError::OutputNotEmpty { dir: dir.to_path_buf(), file: CONFIG_FILE_NAME.to_string() });
    }
    let rank = |n: &str| match n {
        CONFIG_FILE_NAME => 0,
        INDEX_FILE_NAME => 1,
        _ => 2,
    };
    found.sort_by_key(|n| rank(n));
    for name in found {
        let path = dir.join(&name);
        fs::remove_file(&path).map_err(io_error(&path, "remove the previous release's file"))?;
    }
    Ok(())
}

/// Writes `bytes` to `dir/name` through a temporary file renamed into place.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, SynthError> {
    let path = dir.join(name);
    let temp = dir.join(format!(".{name}.{}.partial", std::process::id()));
    let result = (|| {
        let mut file = File::create(&temp).map_err(io_error(&temp, "create"))?;
        file.write_all(bytes).map_err(io_error(&temp, "write"))?;
        file.sync_all().map_err(io_error(&temp, "flush to disk"))?;
        fs::rename(&temp, &path).map_err(io_error(&path, "rename into place"))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result.map(|()| path)
}

/// What every shard-writing thread shares.
struct ShardJob<'a> {
    model: &'a SynthModel,
    dir: &'a Path,
    seed: u64,
    tables: &'a Tables,
    /// Set when any thread fails: the others stop at their next piece.
    stop: &'a AtomicBool,
    progress: &'a (dyn Fn(u64) + Sync),
}

impl ShardJob<'_> {
    /// Writes one shard, streaming each tensor in pieces through `buf`. Returns the file's path
    /// and length, or `None` when stopped because another thread failed.
    fn write(&self, shard: &Shard, buf: &mut [u8]) -> Result<Option<(PathBuf, u64)>, SynthError> {
        let specs: Vec<&TensorSpec> = shard.tensors.iter().filter_map(|&i| self.model.tensors.get(i)).collect();
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let layout =
            FileLayout::new(specs.iter().map(|t| (t.name.as_str(), DType::BF16, t.shape.as_slice())), &metadata)?;
        let file_len = layout.file_len();
        let mut writer = SafetensorsWriter::create(self.dir.join(&shard.file_name), layout)?;
        for t in specs {
            let table = self.tables.get(t.init);
            let mut stream = TensorStream::new(self.seed, &t.name);
            let mut remaining = t.byte_len();
            while remaining > 0 {
                if self.stop.load(Ordering::Relaxed) {
                    return Ok(None); // dropping the writer removes its temporary file
                }
                let n = usize::try_from(remaining).map_or(buf.len(), |r| r.min(buf.len()));
                let piece = buf.get_mut(..n).unwrap_or_default();
                stream.fill(table, piece);
                writer.write_next(piece)?;
                (self.progress)(n as u64);
                remaining -= n as u64;
            }
        }
        Ok(Some((writer.finish()?, file_len)))
    }
}

/// Writes `model` as a release into `out_dir`. See the module documentation.
pub fn write_release(
    model: &SynthModel,
    out_dir: &Path,
    seed: u64,
    options: &SynthOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<SynthReport, SynthError> {
    if options.max_shard_bytes == 0 {
        return Err(SynthError::InvalidOption("max_shard_bytes must be positive".into()));
    }
    if options.piece_bytes == 0 {
        return Err(SynthError::InvalidOption("piece_bytes must be positive".into()));
    }
    let start = Instant::now();
    prepare_output(out_dir, options.overwrite)?;
    let shards = assign_shards(model, options.max_shard_bytes);
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = match options.threads {
        0 => available,
        n => n,
    }
    .clamp(1, shards.len().max(1));
    let piece = options.piece_bytes.div_ceil(8).saturating_mul(8);

    let tables = Tables::new();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let job = ShardJob { model, dir: out_dir, seed, tables: &tables, stop: &stop, progress };
    let first_error: Mutex<Option<SynthError>> = Mutex::new(None);
    let finished: Mutex<Vec<(usize, PathBuf, u64)>> = Mutex::new(Vec::new());
    let fail = |e: SynthError| {
        stop.store(true, Ordering::Relaxed);
        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    };

    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut buf = vec![0u8; piece];
                    loop {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(shard) = shards.get(k) else {
                            return;
                        };
                        match job.write(shard, &mut buf) {
                            Ok(Some((path, len))) => {
                                finished.lock().unwrap_or_else(|p| p.into_inner()).push((k, path, len))
                            }
                            Ok(None) => return,
                            Err(e) => {
                                fail(e);
                                return;
                            }
                        }
                    }
                })
            })
            .collect();
        for handle in handles {
            if handle.join().is_err() {
                fail(SynthError::WorkerPanicked);
            }
        }
    });

    let mut finished = finished.into_inner().unwrap_or_else(|p| p.into_inner());
    let error = first_error.into_inner().unwrap_or_else(|p| p.into_inner());
    let remove_finished = |finished: &[(usize, PathBuf, u64)]| {
        for (_, path, _) in finished {
            let _ = fs::remove_file(path);
        }
    };
    if let Some(e) = error {
        remove_finished(&finished);
        return Err(e);
    }
    finished.sort_by_key(|(k, _, _)| *k);

    let result = (|| {
        let index = if shards.len() > 1 {
            let mut weight_map = Map::new();
            for shard in &shards {
                for t in shard.tensors.iter().filter_map(|&i| model.tensors.get(i)) {
                    weight_map.insert(t.name.clone(), json!(shard.file_name));
                }
            }
            let index = json!({
                "metadata": {
                    "total_parameters": model.total_parameters(),
                    "total_size": model.total_bytes(),
                },
                "weight_map": weight_map,
            });
            let mut text = serde_json::to_string_pretty(&index).map_err(|e| SynthError::Io {
                path: out_dir.join(INDEX_FILE_NAME),
                action: "serialize the index",
                source: io::Error::other(e),
            })?;
            text.push('\n');
            Some(write_atomically(out_dir, INDEX_FILE_NAME, text.as_bytes())?)
        } else {
            None
        };
        // Last: its presence is what makes the directory a release.
        write_atomically(out_dir, CONFIG_FILE_NAME, model.config_json().as_bytes())?;
        File::open(out_dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(out_dir, "flush the output directory to disk"))?;
        Ok(index)
    })();
    let index = match result {
        Ok(index) => index,
        Err(e) => {
            let _ = fs::remove_file(out_dir.join(CONFIG_FILE_NAME));
            let _ = fs::remove_file(out_dir.join(INDEX_FILE_NAME));
            remove_finished(&finished);
            return Err(e);
        }
    };

    Ok(SynthReport {
        arch: model.arch,
        dims: model.dims.clone(),
        dir: out_dir.to_path_buf(),
        file_bytes: finished.iter().map(|(_, _, len)| len).sum(),
        files: finished.into_iter().map(|(_, path, _)| path).collect(),
        index,
        num_tensors: model.tensors.len(),
        total_bytes: model.total_bytes,
        total_parameters: model.total_parameters(),
        threads,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::atomic::AtomicU64;

    use shardline_layout::{build_plan, Mesh, ModelConfig, PlanOptions, SourceTensor};
    use tempfile::TempDir;

    use super::*;
    use crate::safetensors::Release;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
    }

    fn small_shards() -> SynthOptions {
        SynthOptions { max_shard_bytes: 256 << 10, ..SynthOptions::default() }
    }

    /// Every tensor's bytes, by name.
    fn tensor_bytes(release: &Release) -> BTreeMap<String, Vec<u8>> {
        release
            .tensors()
            .map(|t| {
                let (file, info) = release.locate(&t.info.name).unwrap();
                let bytes = fs::read(file.path()).unwrap();
                let range = info.file_offset as usize..info.file_end() as usize;
                (info.name.clone(), bytes[range].to_vec())
            })
            .collect()
    }

    fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap())
            })
            .collect()
    }

    fn bf16_values(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
    }

    fn mean_std(values: &[f32]) -> (f64, f64) {
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = values.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    /// Plans the release with the layout crate's mapping tables on a 1-rank mesh.
    fn plan(release: &Release) {
        let config = ModelConfig::from_json(release.config_json()).unwrap();
        let sources = release
            .tensors()
            .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
            .collect();
        if let Err(errors) = build_plan(&config, sources, Mesh::new(1, 1, 1, 1), &PlanOptions::default()) {
            panic!("{}: {}", config.model_type, errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"));
        }
    }

    // ---- sizes ----

    #[test]
    fn parse_size_cases() {
        for (input, bytes) in [
            ("1MB", 1_000_000),
            ("1mb", 1_000_000),
            ("512MiB", 512 << 20),
            ("4GB", 4_000_000_000),
            ("4 GiB", 4 << 30),
            ("  8GB ", 8_000_000_000),
            ("1024", 1024),
            ("10B", 10),
            ("3KB", 3000),
            ("3KiB", 3072),
            ("2G", 2 << 30),
            ("1T", 1 << 40),
            ("2TB", 2_000_000_000_000),
            ("1PB", 1_000_000_000_000_000),
            ("1.5GB", 1_500_000_000),
            ("0.5KiB", 512),
            (".25MiB", 256 << 10),
            ("1.0000000000000000000000001GB", 1_000_000_000),
            ("0", 0),
        ] {
            assert_eq!(parse_size(input).unwrap(), bytes, "{input}");
        }
        for input in
            ["", "GB", "-1GB", "1.2.3GB", "1XB", "1 G B", "99999999999999999999", "20000PB", "16384PiB", ".", "1e9"]
        {
            let err = parse_size(input).unwrap_err();
            assert!(matches!(&err, SynthError::InvalidSize { input: i, .. } if i == input), "{input}: {err:?}");
            assert!(err.to_string().contains("512MiB"), "{err}");
        }
    }

    #[test]
    fn sizes_are_within_tolerance_for_every_arch_and_target() {
        let targets = [
            "1MB", "2MB", "3MB", "10MB", "33MB", "100MB", "250MB", "1GB", "1.7GB", "4GB", "8GB", "20GB", "64GB",
            "150GB", "500GB", "1TB", "3TB",
        ];
        for arch in Arch::ALL {
            for target in targets {
                let bytes = parse_size(target).unwrap();
                let model = SynthModel::for_target(arch, bytes).unwrap_or_else(|e| panic!("{arch} {target}: {e}"));
                let error = relative_error(model.total_bytes(), bytes);
                assert!(
                    error <= SIZE_TOLERANCE,
                    "{arch} {target}: {} bytes ({:.1} %), {:?}",
                    model.total_bytes(),
                    error * 100.0,
                    model.dims()
                );
                let sum: u64 = model.tensors().iter().map(TensorSpec::byte_len).sum();
                assert_eq!(sum, model.total_bytes());
                assert!(model.dims().num_layers >= 1);
                if (10_000_000..=100_000_000_000).contains(&bytes) {
                    assert!((8..=128).contains(&model.dims().num_layers), "{arch} {target}: {:?}", model.dims());
                }
                if bytes >= 4_000_000_000 {
                    assert_eq!(model.dims().head_dim, 128, "{arch} {target}");
                }
            }
        }
    }

    #[test]
    fn tiny_target_gives_a_tiny_model() {
        let model = SynthModel::for_target(Arch::Llama, 1_000_000).unwrap();
        assert_eq!(model.dims().hidden_size, 64);
        assert!(model.total_bytes() >= 950_000 && model.total_bytes() <= 1_050_000);
    }

    #[test]
    fn every_arch_has_models_well_below_one_megabyte() {
        for arch in Arch::ALL {
            let err = SynthModel::for_target(arch, 1).unwrap_err();
            let SynthError::TargetTooSmall { minimum, .. } = err else {
                panic!("{arch}: {err:?}");
            };
            assert!(minimum < 600_000, "{arch}: {minimum}");
            let model = SynthModel::for_target(arch, minimum).unwrap();
            assert_eq!(model.total_bytes(), minimum, "{arch}");
        }
    }

    #[test]
    fn impossible_targets_are_errors() {
        for arch in Arch::ALL {
            for target in [0, 1, 10_000] {
                let err = SynthModel::for_target(arch, target).unwrap_err();
                assert!(
                    matches!(err, SynthError::TargetTooSmall { minimum, .. } if minimum > target),
                    "{arch} {target}: {err:?}"
                );
                assert!(err.to_string().contains(arch.name()), "{err}");
            }
            let err = SynthModel::for_target(arch, u64::MAX).unwrap_err();
            assert!(matches!(err, SynthError::TargetTooLarge { .. }), "{arch}: {err:?}");
        }
    }

    #[test]
    fn invalid_dims_are_errors() {
        let good = WIDTHS[0].dims(Arch::Qwen3Next, 2);
        assert!(SynthModel::new(Arch::Qwen3Next, good.clone()).is_ok());
        let cases: Vec<(ModelDims, &str)> = vec![
            (ModelDims { hidden_size: 0, ..good.clone() }, "hidden_size"),
            (ModelDims { num_key_value_heads: 3, ..good.clone() }, "num_key_value_heads"),
            (ModelDims { linear: None, ..good.clone() }, "linear"),
            (ModelDims { num_experts: 0, ..good.clone() }, "num_experts"),
            (ModelDims { num_experts: 1 << 40, ..good.clone() }, "num_experts"),
            (ModelDims { num_layers: MAX_LAYERS + 1, ..good.clone() }, "layers"),
            (ModelDims { hidden_size: u64::MAX, ..good.clone() }, "hidden_size"),
            (
                ModelDims {
                    linear: Some(LinearAttentionDims { num_value_heads: 3, ..good.linear.clone().unwrap() }),
                    ..good.clone()
                },
                "linear_num_value_heads",
            ),
        ];
        for (dims, field) in cases {
            let err = SynthModel::new(Arch::Qwen3Next, dims).unwrap_err();
            assert!(matches!(err, SynthError::InvalidDims { .. }) && err.to_string().contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn unknown_arch_lists_the_supported_ones() {
        let dir = TempDir::new().unwrap();
        let err = synth("gpt_bigcode", 1_000_000, dir.path(), 0, &SynthOptions::default()).unwrap_err();
        assert!(matches!(err, SynthError::UnknownArch { .. }), "{err:?}");
        let msg = err.to_string();
        for name in SUPPORTED_ARCHS {
            assert!(msg.contains(name), "{msg}");
        }
        assert!(msg.contains("gpt_bigcode"), "{msg}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        let names: Vec<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(names, SUPPORTED_ARCHS);
    }

    // ---- against the releases transformers wrote ----

    /// The fixture's dimensions, read from its config.json.
    fn fixture_dims(config: &Value) -> ModelDims {
        let get = |k: &str| config.get(k).and_then(Value::as_u64).unwrap_or(0);
        ModelDims {
            hidden_size: get("hidden_size"),
            num_layers: get("num_hidden_layers"),
            num_attention_heads: get("num_attention_heads"),
            num_key_value_heads: get("num_key_value_heads"),
            head_dim: get("head_dim"),
            intermediate_size: get("intermediate_size"),
            vocab_size: get("vocab_size"),
            num_experts: get("num_experts").max(get("num_local_experts")),
            moe_intermediate_size: get("moe_intermediate_size"),
            shared_expert_intermediate_size: get("shared_expert_intermediate_size"),
            linear: config.get("linear_num_key_heads").map(|_| LinearAttentionDims {
                num_key_heads: get("linear_num_key_heads"),
                num_value_heads: get("linear_num_value_heads"),
                key_head_dim: get("linear_key_head_dim"),
                value_head_dim: get("linear_value_head_dim"),
                conv_kernel: get("linear_conv_kernel_dim"),
            }),
        }
    }

    #[test]
    fn names_shapes_and_config_match_the_transformers_fixtures() {
        for (name, arch) in [("llama", Arch::Llama), ("qwen3_moe", Arch::Qwen3Moe), ("qwen3_next", Arch::Qwen3Next)] {
            let release = Release::open(fixture(name)).unwrap();
            let config: Value = serde_json::from_str(release.config_json()).unwrap();
            let model = SynthModel::new(arch, fixture_dims(&config)).unwrap();

            let theirs: BTreeMap<&str, &[u64]> =
                release.tensors().map(|t| (t.info.name.as_str(), t.info.shape.as_slice())).collect();
            let ours: BTreeMap<&str, &[u64]> =
                model.tensors().iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
            assert_eq!(ours, theirs, "{name}");
            assert_eq!(model.total_bytes(), release.total_bytes(), "{name}");

            // Same fields, and the planner reads the same model from both.
            let our_config: Value = serde_json::from_str(&model.config_json()).unwrap();
            let keys = |v: &Value| -> BTreeSet<String> { v.as_object().unwrap().keys().cloned().collect() };
            assert_eq!(keys(&our_config), keys(&config), "{name}");
            for key in ["layer_types", "model_type", "architectures", "num_experts_per_tok"] {
                assert_eq!(our_config.get(key), config.get(key), "{name}: {key}");
            }
            assert_eq!(
                ModelConfig::from_json(&model.config_json()).unwrap(),
                ModelConfig::from_json(release.config_json()).unwrap(),
                "{name}"
            );
        }
    }

    // ---- writing ----

    #[test]
    fn every_arch_opens_and_plans() {
        for arch in Arch::ALL {
            for options in [SynthOptions::default(), small_shards()] {
                let dir = TempDir::new().unwrap();
                let report = synth(arch.name(), 2_000_000, dir.path(), 1, &options).unwrap();
                let release = Release::open(dir.path()).unwrap();
                assert_eq!(release.total_bytes(), report.total_bytes, "{arch}");
                assert_eq!(release.tensors().len(), report.num_tensors, "{arch}");
                assert!(relative_error(report.total_bytes, 2_000_000) <= SIZE_TOLERANCE);
                assert_eq!(report.files.len(), release.files().len());
                assert!(release.tensors().all(|t| t.info.dtype == DType::BF16));
                let sharded = report.files.len() > 1;
                assert_eq!(sharded, options.max_shard_bytes < 2_000_000, "{arch}");
                assert_eq!(report.index.is_some(), sharded);
                assert_eq!(release.index_path().is_some(), sharded);
                if let Some(index) = &report.index {
                    let index: Value = serde_json::from_slice(&fs::read(index).unwrap()).unwrap();
                    assert_eq!(index["metadata"]["total_size"], json!(report.total_bytes));
                    assert_eq!(index["metadata"]["total_parameters"], json!(report.total_bytes / 2));
                    for file in release.files() {
                        let tensors: u64 = file.tensors().iter().map(|t| t.byte_len).sum();
                        let largest = file.tensors().iter().map(|t| t.byte_len).max().unwrap();
                        assert!(
                            tensors <= options.max_shard_bytes || file.tensors().len() == 1,
                            "{arch}: {} has {tensors} bytes (largest tensor {largest})",
                            file.path().display()
                        );
                    }
                    let n = report.files.len();
                    for (k, path) in report.files.iter().enumerate() {
                        assert_eq!(
                            path.file_name().unwrap().to_str().unwrap(),
                            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
                        );
                    }
                }
                for file in release.files() {
                    assert_eq!(file.metadata().get("format").map(String::as_str), Some("pt"));
                    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
                    assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted by name");
                }
                let config = ModelConfig::from_json(release.config_json()).unwrap();
                assert_eq!(config.model_type, arch.name());
                assert_eq!(config.num_layers, report.dims.num_layers);
                assert_eq!(config.hidden_size, report.dims.hidden_size);
                plan(&release);
                // Nothing but the release.
                for name in dir_files(dir.path()).keys() {
                    assert!(is_release_file(name), "{arch}: stray file {name}");
                }
            }
        }
    }

    #[test]
    fn wider_models_plan_too() {
        // Every width of the ladder, planned without writing data, on one rank and on TP 2 × EP 4.
        for arch in Arch::ALL {
            for width in WIDTHS {
                let model = SynthModel::new(arch, width.dims(arch, 4)).unwrap();
                let config = ModelConfig::from_json(&model.config_json()).unwrap();
                let sources: Vec<SourceTensor> = model
                    .tensors()
                    .iter()
                    .map(|t| SourceTensor { name: t.name.clone(), dtype: DType::BF16, shape: t.shape.clone() })
                    .collect();
                let ep = if arch.is_moe() { 4 } else { 1 };
                for mesh in [Mesh::new(1, 1, 1, 1), Mesh::new(2, 1, 4, ep)] {
                    let result = build_plan(&config, sources.clone(), mesh, &PlanOptions::default());
                    assert!(result.is_ok(), "{arch} {}: {:?}", width.hidden, result.err());
                }
            }
        }
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let runs: Vec<(TempDir, u64)> = [7u64, 7, 8]
            .into_iter()
            .map(|seed| {
                let dir = TempDir::new().unwrap();
                synth("qwen3_next", 1_500_000, dir.path(), seed, &small_shards()).unwrap();
                (dir, seed)
            })
            .collect();
        let files: Vec<_> = runs.iter().map(|(d, _)| dir_files(d.path())).collect();
        assert!(files[0].len() > 3);
        assert_eq!(files[0], files[1], "same seed");
        // Other seed: same files and headers, every tensor's data different.
        assert_eq!(files[0].keys().collect::<Vec<_>>(), files[2].keys().collect::<Vec<_>>());
        let a = tensor_bytes(&Release::open(runs[0].0.path()).unwrap());
        let c = tensor_bytes(&Release::open(runs[2].0.path()).unwrap());
        assert_eq!(a.keys().collect::<Vec<_>>(), c.keys().collect::<Vec<_>>());
        for (name, bytes) in &a {
            assert_ne!(bytes, &c[name], "{name}");
        }
    }

    #[test]
    fn data_does_not_depend_on_sharding_pieces_or_threads() {
        let reference = TempDir::new().unwrap();
        synth("qwen3_5_moe_text", 2_000_000, reference.path(), 3, &SynthOptions::default()).unwrap();
        let expected = tensor_bytes(&Release::open(reference.path()).unwrap());
        for options in [
            SynthOptions { max_shard_bytes: 100_000, threads: 1, piece_bytes: 8, ..SynthOptions::default() },
            SynthOptions { max_shard_bytes: 300_000, threads: 3, piece_bytes: 1000, ..SynthOptions::default() },
            SynthOptions { threads: 2, piece_bytes: 13, ..SynthOptions::default() },
        ] {
            let dir = TempDir::new().unwrap();
            synth("qwen3_5_moe_text", 2_000_000, dir.path(), 3, &options).unwrap();
            assert_eq!(tensor_bytes(&Release::open(dir.path()).unwrap()), expected, "{options:?}");
        }
    }

    #[test]
    fn values_are_finite_and_distributed_as_documented() {
        for (arch, norm_mean) in [("llama", 1.0), ("qwen3_next", 0.0), ("qwen3_5_text", 0.0)] {
            let dir = TempDir::new().unwrap();
            synth(arch, 3_000_000, dir.path(), 11, &SynthOptions::default()).unwrap();
            let tensors = tensor_bytes(&Release::open(dir.path()).unwrap());
            let mut all_norms = Vec::new();
            for (name, bytes) in &tensors {
                let values = bf16_values(bytes);
                assert!(values.iter().all(|v| v.is_finite()), "{arch} {name}");
                let around_one =
                    name.ends_with("linear_attn.norm.weight") || name.ends_with("A_log") || name.ends_with("dt_bias");
                if around_one {
                    assert!(values.iter().all(|v| (v - 1.0).abs() < 0.1), "{arch} {name}");
                } else if name.ends_with("norm.weight") {
                    all_norms.extend(values);
                } else {
                    assert!(values.iter().all(|v| v.abs() < 0.1), "{arch} {name}");
                }
            }
            let (mean, std) = mean_std(&all_norms);
            assert!((mean - norm_mean).abs() < 0.005, "{arch}: norms mean {mean}");
            assert!((std - WEIGHT_STD).abs() < 0.003, "{arch}: norms std {std}");
            let embed = bf16_values(&tensors["model.embed_tokens.weight"]);
            let (mean, std) = mean_std(&embed);
            assert!(mean.abs() < 0.001, "{arch}: embedding mean {mean}");
            assert!((std - WEIGHT_STD).abs() < 0.0005, "{arch}: embedding std {std}");
        }
    }

    #[test]
    fn progress_counts_every_tensor_byte() {
        let dir = TempDir::new().unwrap();
        let seen = AtomicU64::new(0);
        let report = synth_with_progress("mixtral", 1_000_000, dir.path(), 0, &small_shards(), &|n| {
            seen.fetch_add(n, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), report.total_bytes);
        let on_disk: u64 = report.files.iter().map(|p| fs::metadata(p).unwrap().len()).sum();
        assert_eq!(on_disk, report.file_bytes);
        assert!(report.bytes_per_second() > 0.0);
    }

    #[test]
    fn an_existing_release_is_kept_unless_overwrite() {
        let dir = TempDir::new().unwrap();
        fs::write(dir.path().join("README.md"), "notes").unwrap();
        synth("qwen2", 1_000_000, dir.path(), 0, &small_shards()).unwrap();
        let before = dir_files(dir.path());

        let err = synth("qwen2", 1_000_000, dir.path(), 1, &small_shards()).unwrap_err();
        assert!(matches!(&err, SynthError::OutputNotEmpty { file, .. } if file == CONFIG_FILE_NAME), "{err:?}");
        assert!(err.to_string().contains("overwrite"), "{err}");
        assert_eq!(dir_files(dir.path()), before);

        // What an interrupted run leaves (no config.json) is replaced without asking.
        fs::remove_file(dir.path().join(CONFIG_FILE_NAME)).unwrap();
        fs::write(dir.path().join(".model-00009-of-00009.safetensors.77-0.partial"), "x").unwrap();
        fs::write(dir.path().join(".config.json.77.partial"), "x").unwrap();
        fs::write(dir.path().join(".keep.77.partial"), "x").unwrap();
        synth("qwen2", 1_000_000, dir.path(), 0, &small_shards()).unwrap();
        let mut expected = before.clone();
        expected.insert(".keep.77.partial".into(), b"x".to_vec());
        assert_eq!(dir_files(dir.path()), expected);

        // Overwrite with a single-file release: no stale shard or index stays behind.
        let options = SynthOptions { overwrite: true, ..SynthOptions::default() };
        synth("llama", 1_000_000, dir.path(), 1, &options).unwrap();
        let names: BTreeSet<String> = dir_files(dir.path()).into_keys().collect();
        let expected: BTreeSet<String> = [CONFIG_FILE_NAME, SINGLE_FILE_NAME, "README.md", ".keep.77.partial"]
            .into_iter()
            .map(String::from)
            .collect();
        assert_eq!(names, expected);
        let release = Release::open(dir.path()).unwrap();
        assert_eq!(ModelConfig::from_json(release.config_json()).unwrap().model_type, "llama");
    }

    #[test]
    fn a_failed_run_leaves_no_release() {
        let dir = TempDir::new().unwrap();
        // Block the temporary name of config.json: every shard gets written, then the run fails.
        let blocker = dir.path().join(format!(".{CONFIG_FILE_NAME}.{}.partial", std::process::id()));
        fs::create_dir(&blocker).unwrap();
        let err = synth("qwen3", 1_000_000, dir.path(), 0, &small_shards()).unwrap_err();
        assert!(matches!(err, SynthError::Io { .. }), "{err:?}");
        let names: Vec<String> = dir_files_or_dirs(dir.path());
        assert_eq!(names, vec![blocker.file_name().unwrap().to_string_lossy().into_owned()]);
        assert!(Release::open(dir.path()).is_err());
    }

    fn dir_files_or_dirs(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn bad_options_and_output_paths_are_errors() {
        let dir = TempDir::new().unwrap();
        for options in [
            SynthOptions { max_shard_bytes: 0, ..SynthOptions::default() },
            SynthOptions { piece_bytes: 0, ..SynthOptions::default() },
        ] {
            let err = synth("llama", 1_000_000, dir.path(), 0, &options).unwrap_err();
            assert!(matches!(err, SynthError::InvalidOption(_)), "{err:?}");
        }
        let file = dir.path().join("a-file");
        fs::write(&file, "x").unwrap();
        let err = synth("llama", 1_000_000, &file, 0, &SynthOptions::default()).unwrap_err();
        assert!(matches!(err, SynthError::Io { .. }), "{err:?}");
    }

    // ---- data generation ----

    #[test]
    fn streams_continue_across_pieces() {
        let tables = Tables::new();
        let mut whole = vec![0u8; 1003];
        TensorStream::new(5, "t").fill(&tables.normal, &mut whole);
        let mut pieces = vec![0u8; 1003];
        let mut stream = TensorStream::new(5, "t");
        for chunk in pieces.chunks_mut(64) {
            stream.fill(&tables.normal, chunk);
        }
        assert_eq!(whole, pieces);
        let mut other = vec![0u8; 1003];
        TensorStream::new(5, "u").fill(&tables.normal, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn normal_quantiles_and_bf16_rounding() {
        assert!(inverse_normal_cdf(0.5).abs() < 1e-12);
        assert!((inverse_normal_cdf(0.975) - 1.959_963_985).abs() < 1e-6);
        assert!((inverse_normal_cdf(0.025) + 1.959_963_985).abs() < 1e-6);
        assert!((inverse_normal_cdf(1e-5) + 4.264_890_794).abs() < 1e-6);
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        assert_eq!(f32_to_bf16(-2.0), 0xC000);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        let tables = Tables::new();
        for table in [&tables.normal, &tables.around_one] {
            assert!(table.0.iter().all(|&b| b & 0x7F80 != 0x7F80), "finite");
            assert!(table.0.windows(2).all(|w| {
                let v = |b: u16| f32::from_bits(u32::from(b) << 16);
                v(w[0]) <= v(w[1])
            }));
        }
    }
}
