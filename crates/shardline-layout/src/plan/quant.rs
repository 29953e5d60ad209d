//! Quantized releases: which FP8 weights carry block scales (and that the scales fit them), the
//! dequantizing transform of their recipes, and the error for a scheme Shardline does not know.

use std::collections::HashMap;

use super::build::Inventory;
use super::*;
use crate::config::{ModelConfig, Quantization};
use crate::error::{by_pattern, LayoutError};
use crate::recipe::Transform;

/// FP8 weights and their `_scale_inv` tensors, by source id.
pub(super) struct Fp8Scales {
    block: [u64; 2],
    /// weight id → scale id.
    pub(super) scale_of: HashMap<usize, usize>,
}

impl Fp8Scales {
    /// Pairs every `<w>_scale_inv` with its weight `<w>` and checks both, for a release whose
    /// config declares block FP8; `None` for other releases. Problems go to `errors`.
    pub(super) fn find(config: &ModelConfig, inv: &Inventory<'_>, errors: &mut Vec<LayoutError>) -> Option<Self> {
        let block = match &config.quantization {
            Some(Quantization::Fp8Block { block }) => *block,
            Some(Quantization::Other(scheme)) => {
                errors.push(unknown_scheme(scheme, inv.sources));
                return None;
            }
            // Dequantized by the gpt-oss expert kinds.
            Some(Quantization::Mxfp4) | None => return None,
        };
        let mut scale_of = HashMap::new();
        for (id, s) in inv.sources.iter().enumerate() {
            let Some(weight) = s.name.strip_suffix("_scale_inv") else { continue };
            let Some(w) = inv.get(&super::build::normalise(weight, config.language_model_prefix)) else {
                errors.push(scale_error(s, format!("no tensor `{weight}` for it to scale")));
                continue;
            };
            let ws = &inv.sources[w];
            if ws.dtype != DType::F8E4M3 || ws.shape.len() != 2 {
                errors.push(scale_error(
                    s,
                    format!("`{weight}` is {} {:?}, not a 2-D F8_E4M3 weight", ws.dtype, ws.shape),
                ));
                continue;
            }
            let want = vec![ws.shape[0].div_ceil(block[0]), ws.shape[1].div_ceil(block[1])];
            if s.dtype != DType::F32 || s.shape != want {
                errors.push(LayoutError::Shape {
                    tensor: s.name.clone(),
                    actual: s.shape.clone(),
                    expected: format!("F32 {want:?}"),
                    why: format!(
                        "block scales of `{weight}` {:?} in blocks of {block:?} (found {})",
                        ws.shape, s.dtype
                    ),
                });
                continue;
            }
            if u32::try_from(id).is_err() || block.iter().any(|b| u32::try_from(*b).is_err()) {
                errors.push(scale_error(s, "too many tensors or too large a block".into()));
                continue;
            }
            scale_of.insert(w, id);
        }
        // A weight the release stores in FP8 without its scales would load as unscaled codes.
        for (id, s) in inv.sources.iter().enumerate() {
            if s.dtype == DType::F8E4M3 && !scale_of.contains_key(&id) && !s.name.ends_with("_scale_inv") {
                errors.push(scale_error(s, format!("F8_E4M3 weight without its `{}_scale_inv`", s.name)));
            }
        }
        Some(Fp8Scales { block, scale_of })
    }

    /// The dequantizing transform of FP8 weight `id` and the id of its scales, when it is one.
    pub(super) fn transform_of(&self, id: usize) -> Option<(Transform, usize)> {
        let &scale = self.scale_of.get(&id)?;
        // `find` checked that these fit.
        let t = Transform::DequantFp8 { scale: scale as u32, rows: self.block[0] as u32, cols: self.block[1] as u32 };
        Some((t, scale))
    }

    /// Whether any of `ids` is a scaled FP8 weight.
    pub(super) fn any(&self, ids: &[usize]) -> bool {
        ids.iter().any(|id| self.scale_of.contains_key(id))
    }

    /// Turns the casts of scaled FP8 weights in `draft` into block dequantizations.
    pub(super) fn dequantize(&self, draft: &mut Draft) {
        for b in draft.sections.iter_mut().flat_map(|s| s.recipe.iter_mut()) {
            if let (Some((id, _)), Transform::Cast(DType::F8E4M3)) = (b.source, b.transform) {
                if let Some(&scale) = self.scale_of.get(&id) {
                    // `find` checked that these fit.
                    b.transform = Transform::DequantFp8 {
                        scale: scale as u32,
                        rows: self.block[0] as u32,
                        cols: self.block[1] as u32,
                    };
                }
            }
        }
    }
}

fn scale_error(s: &SourceTensor, why: String) -> LayoutError {
    LayoutError::Shape { tensor: s.name.clone(), actual: s.shape.clone(), expected: "FP8 block scales".into(), why }
}

/// A quantization scheme without a dequantization here: named, with the tensors it concerns
/// (those not stored as 16/32-bit floats, or named as scales), by pattern.
fn unknown_scheme(scheme: &str, sources: &[SourceTensor]) -> LayoutError {
    let quantized: Vec<String> = sources
        .iter()
        .filter(|s| {
            !matches!(s.dtype, DType::BF16 | DType::F16 | DType::F32)
                || ["_scale", "_scale_inv", "_scales", "_blocks", ".qweight", ".qzeros", ".scales", ".g_idx"]
                    .iter()
                    .any(|suffix| s.name.ends_with(suffix))
        })
        .map(|s| s.name.clone())
        .collect();
    LayoutError::Quantization {
        scheme: scheme.to_string(),
        tensors: if quantized.is_empty() { "none recognisable".into() } else { by_pattern(&quantized) },
    }
}
