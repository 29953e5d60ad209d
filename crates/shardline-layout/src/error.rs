//! Errors of the layout core. Every message names the numbers and the tensor it is about.

use std::collections::BTreeMap;

use thiserror::Error;

/// Why a model, a mesh or a release cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A `config.json` field is missing or has the wrong type.
    #[error("config.json: `{field}`: {message}")]
    Config { field: String, message: String },

    /// `model_type` names an architecture without a mapping table.
    #[error("unknown architecture `{model_type}` (supported: {})", supported.join(", "))]
    UnknownArchitecture { model_type: String, supported: Vec<&'static str> },

    /// The mesh is inconsistent in itself or with the model (Megatron would refuse it).
    #[error("mesh: {0}")]
    Mesh(String),

    /// A tensor the mapping needs is absent from the release.
    #[error("release is missing `{missing}`, needed with `{present}` for `{target}`")]
    MissingTensor { missing: String, present: String, target: String },

    /// A tensor's shape contradicts the config.
    #[error("`{tensor}` has shape {actual:?}, expected {expected} ({why})")]
    Shape { tensor: String, actual: Vec<u64>, expected: String, why: String },

    /// Tensors that no mapping rule consumes (a silent drop would lose weights), listed by
    /// pattern (layer and expert numbers as `*`).
    #[error("{} release tensor(s) have no mapping for `{model_type}`: {}", names.len(), by_pattern(names))]
    Unmapped { model_type: String, names: Vec<String> },

    /// `quantization_config` names a scheme Shardline does not dequantize.
    #[error("quantization `{scheme}` is not supported (Shardline dequantizes block-wise FP8 e4m3); quantized tensors: {tensors}")]
    Quantization { scheme: String, tensors: String },

    /// Source tensors of one mapping disagree in dtype.
    #[error("`{target}`: source dtypes differ ({detail})")]
    DtypeMismatch { target: String, detail: String },
}

/// `a.0.b, a.1.b, c` → `a.*.b × 2, c`: numbered path components become `*`, at most 12 patterns.
pub fn by_pattern(names: &[String]) -> String {
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    for n in names {
        let pattern: Vec<&str> = n
            .split('.')
            .map(|c| if !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()) { "*" } else { c })
            .collect();
        *groups.entry(pattern.join(".")).or_default() += 1;
    }
    let mut parts: Vec<String> =
        groups.iter().take(12).map(|(p, n)| if *n > 1 { format!("{p} × {n}") } else { p.clone() }).collect();
    if groups.len() > 12 {
        parts.push(format!("… ({} more patterns)", groups.len() - 12));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmapped_names_group_by_pattern() {
        let names: Vec<String> = (0..4)
            .flat_map(|l| (0..256).map(move |e| format!("model.layers.{l}.mlp.experts.{e}.gate_proj.weight_scale_inv")))
            .chain(["model.visual.x.weight".to_string()])
            .collect();
        assert_eq!(
            by_pattern(&names),
            "model.layers.*.mlp.experts.*.gate_proj.weight_scale_inv × 1024, model.visual.x.weight"
        );
    }
}
