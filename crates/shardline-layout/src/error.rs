//! Errors of the layout core. Every message names the numbers and the tensor it is about.

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

    /// Tensors that no mapping rule consumes (a silent drop would lose weights).
    #[error("{} release tensor(s) have no mapping for `{model_type}`: {}{}", names.len(), names.iter().take(8).cloned().collect::<Vec<_>>().join(", "), if names.len() > 8 { ", …" } else { "" })]
    Unmapped { model_type: String, names: Vec<String> },

    /// Source tensors of one mapping disagree in dtype.
    #[error("`{target}`: source dtypes differ ({detail})")]
    DtypeMismatch { target: String, detail: String },
}
