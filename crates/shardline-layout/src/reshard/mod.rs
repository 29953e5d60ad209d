//! Resharding a Megatron-FSDP training checkpoint to another mesh, offline: what each item is
//! (`keys`), how each parameter is laid out (`params`, from the mapping tables), whether the
//! source's chunks tile their tensors and which runs of them fill a target chunk (`boxes`), and
//! the target checkpoint — parameters and optimizer moments re-tiled exactly as Megatron-FSDP
//! saves them on the target mesh, RNG states re-keyed for its TP grid, everything else carried
//! (`plan`). Pure: the I/O shell (`shardline-formats`) reads and writes what this decides.

mod boxes;
mod cost;
mod fsdp2;
mod infer;
mod keys;
mod params;
mod plan;
mod target;

use thiserror::Error;

pub use boxes::{check_tiling, merged_runs, runs, ChunkBox, MergedRuns, Run, Runs, TilingProblem};
pub use cost::{reshard_cost, RankCost, ReshardCost};
pub use fsdp2::{
    classify_fsdp2, mismatched_states, per_rank_sources, plan_fsdp2_reshard, source_placement, Fsdp2Item, Fsdp2Options,
    Placement,
};
pub use infer::infer_mesh;
pub use keys::{
    classify, classify_torch_dist, flat_key, parse_rng_rank, rng_rank_part, strip_modules, ItemKind, PathElem,
};
pub use params::{is_buffer, param_layout, vision_table, ParamLayout};
pub use plan::{
    plan_reshard, ReshardOptions, ReshardPlan, RngPolicy, SourceItem, SourceTensorMeta, TargetObject, TargetTensor,
};
pub use target::RngObject;

/// Why a checkpoint cannot be resharded as asked. Every problem is found before a byte is written.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ReshardError {
    #[error("`{key}`: {problem}")]
    Tiling { key: String, problem: String },
    #[error("`{key}` cannot be resharded like its parameter `{param}`: {problem}")]
    StateMismatch { key: String, param: String, problem: String },
    #[error("the target mesh does not fit the model: {0}")]
    Mesh(String),
    #[error("parameters no mapping table knows (their layout on another mesh is unknown): {}", .0.join(", "))]
    UnknownParams(Vec<String>),
    #[error("`{fused}` is split into {want} but the checkpoint has only {have}")]
    Sections { fused: String, have: String, want: String },
    #[error("two items would be named `{0}`")]
    Duplicate(String),
    #[error("`{key}` cannot be written as torch_dist: {problem}")]
    Dialect { key: String, problem: String },
    #[error("the target layout breaks invariants: {}", .0.join("; "))]
    Invalid(Vec<String>),
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ReshardError>),
}

#[cfg(test)]
mod tests;
