//! Synthetic HuggingFace releases for scale tests and benchmarks.
//!
//! [`synth`] writes a release as `save_pretrained` would: `config.json`, the weights sharded into
//! `model-0000i-of-0000N.safetensors` files of at most [`SynthOptions::max_shard_bytes`] (a single
//! `model.safetensors` and no index when everything fits in one file, as `save_pretrained` does),
//! and `model.safetensors.index.json`. Tensor names and shapes are the architecture's real ones
//! (they match the tiny checkpoints written by `transformers` in `tests/fixtures/hf-tiny`); the
//! data is deterministic pseudo-random bf16 (DeepSeek-V3's score-correction biases float32, as
//! released).
//!
//! [`synth_as`] writes DeepSeek-V3 as it is published, in block FP8 ([`WeightFormat::FP8`]): its
//! layers' linear projections e4m3, each with float32 `weight_scale_inv` block scales, and a
//! `quantization_config`. It is the model fitted in bf16, so an FP8 release has about half the
//! bytes of the bf16 one and converts to the same checkpoint.
//!
//! * **Size.** [`SynthModel::for_target`] fits the layer count and the vocabulary (in multiples
//!   of 64 rows) of every width of a ladder shaped like real models (head_dim 128, GQA and real
//!   vocabularies from a hidden size of 1024 up, expert counts growing with width), and keeps the
//!   least odd fit within 2 % of the target: layer count closest to 32, vocabulary closest to the
//!   width's. The tensor bytes always land within [`SIZE_TOLERANCE`] (5 %) of the target, counted
//!   in each tensor's own dtype. Small targets get narrow models: 1 MB gives `hidden_size` 64 and
//!   a handful of layers. DeepSeek-V3 scales the real model's shape to the width (see
//!   `Width::dims`); its fits keep at least one layer with experts after the dense ones.
//!   [`SynthModel::from_config_json`] instead takes the dimensions of a `config.json` as they are
//!   (a real release's, or a training framework's model flavor: `shardline bench --model-flavor`).
//! * **Data.** Every tensor has its own pseudo-random stream (wyrand seeded from the seed and the
//!   tensor's name), so a tensor's bytes do not depend on the shard size, on the piece size or on
//!   the thread writing it. Each 64-bit draw gives four bf16 values through a 65 536-entry table of
//!   normal quantiles: weights are N(0, 0.02²); RMSNorm weights (and GDN `A_log`, `dt_bias`) are
//!   1 + N(0, 0.02²), except the zero-centred norms of Qwen3-Next and Qwen3.5, which are N(0, 0.02²).
//!   Values are finite by construction (|x| < 4.4σ around the mean). A float32 tensor takes two
//!   such values (widened exactly) per draw. FP8 weights take four e4m3 codes per draw, N(0, 100²)
//!   rounded (never a NaN code, within ±448), and their block scales are N(2·10⁻⁴, (2.5·10⁻⁵)²),
//!   so the weights they make are about N(0, 0.02²).
//! * **Speed and memory.** Shards are written by parallel threads, each streaming its tensors
//!   through [`SafetensorsWriter::write_next`] in pieces of [`SynthOptions::piece_bytes`]; memory
//!   is one piece buffer per thread plus the tensor list.
//! * **Atomicity.** Each shard is renamed into place when complete; the index and then
//!   `config.json` are written (temporary name, then rename) only after every shard is finished,
//!   so an interrupted run never looks like a complete release. On failure, finished shards are
//!   removed again.
//!
//! [`SafetensorsWriter::write_next`]: shardline_formats::safetensors::SafetensorsWriter::write_next
//!
//! Modules: `arch` (architectures, dimensions, the ladder of widths), `model` (a model's tensors
//! and the fit to a target size), `config` (`config.json`, written and read), `data` (the
//! pseudo-random streams), `write` (the release on disk).
//!
//! **Owns:** the synthetic releases of `shardline synth` and `shardline bench` and of the scale
//! tests. **Must not depend on:** any workspace crate but `shardline-layout` and
//! `shardline-formats` (it writes through the formats' safetensors writer); nothing in production
//! conversion depends on it but the binary's `synth` and `bench` commands.

mod arch;
mod config;
mod data;
mod model;
mod write;

#[cfg(test)]
mod tests;

pub use arch::{Arch, LatentAttentionDims, LinearAttentionDims, ModelDims, SUPPORTED_ARCHS};
pub use model::{Init, SynthModel, TensorSpec, WeightFormat};
pub use shardline_layout::DType;
pub use write::{synth, synth_as, synth_with_progress, write_release, SynthOptions, SynthReport};

use std::io;
use std::path::PathBuf;

use shardline_formats::safetensors::SafetensorsError;
use thiserror::Error;

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
/// Standard deviation of the values whose e4m3 codes FP8 weights hold (a block quantizer maps a
/// block's largest magnitude near 448; 4.4 σ is 440).
const FP8_CODE_STD: f64 = 100.0;
/// Mean and standard deviation of FP8 block scales: `WEIGHT_STD / FP8_CODE_STD`, σ an eighth of
/// it (so always positive: the tables reach 4.5 σ).
const SCALE_MEAN: f64 = WEIGHT_STD / FP8_CODE_STD;
const SCALE_STD: f64 = SCALE_MEAN / 8.0;
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

    #[error("`{arch}` releases are not published with FP8 weights; only deepseek_v3 is synthesized in FP8")]
    Fp8NotSupported { arch: &'static str },

    #[error("invalid option: {0}")]
    InvalidOption(String),

    #[error("invalid config.json: {0}")]
    InvalidConfig(String),

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
