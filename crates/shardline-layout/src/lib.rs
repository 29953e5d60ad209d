//! The pure layout core of Shardline: dtypes, model architectures as mapping tables, the parallel
//! mesh, the conversion plan (every chunk of every output tensor, derived arithmetically), and the
//! invariants a plan must satisfy before a byte is written.
//!
//! **Owns:** where every byte goes. **Must not depend on:** any workspace crate.
//!
//! **Architecture invariant:** this crate does no I/O, spawns nothing, and knows nothing of YAML,
//! HTTP, SQL or async runtimes; a test reads its manifest to keep it so.

pub mod arch;
pub mod config;
pub mod dialect;
pub mod dtype;
pub mod error;
pub mod export;
pub mod invariants;
pub mod mesh;
pub mod plan;
pub mod recipe;
pub mod reshard;
pub mod table;

pub use config::{Family, ModelConfig};
pub use dialect::{Dialect, DiskLayout, Placement};
pub use dtype::DType;
pub use error::LayoutError;
pub use invariants::{lower, validate, validate_plan, Invariant, RankPlan, Violation, WriteItem};
pub use mesh::Mesh;
pub use plan::{
    build_plan, check_mesh_for_model, Chunk, FsdpNumbers, FsdpTiling, Group, OutputTensor, Plan, PlanOptions, Role,
    SourceTensor, TensorView, Tiling, TilingView, TorchtitanTarget, TorchtitanVersion,
};
pub use recipe::{RowBlock, Segment, Transform};
pub use table::PlanTable;
