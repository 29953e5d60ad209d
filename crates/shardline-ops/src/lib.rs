//! The operations a person runs — `convert` (and the plan it would write), `validate`,
//! `reshard`, `export` — as typed
//! requests in and typed reports out, shared by every front end: the `shardline` CLI prints
//! their reports, the Python module (`shardline-py`) returns them. Nothing here parses
//! arguments, prints, or knows of a terminal; what a combination of options means, and which
//! combinations are refused and why, is decided here once.
//!
//! **Owns:** the sequence of each operation (open, plan, check, write, finish) and its refusals.
//! **Must not depend on:** any workspace crate but `shardline-layout` and `shardline-formats`.

// The formats crate's errors carry paths and keys for their messages (see the same allowance
// there); they are built only on the way out.
#![allow(clippy::result_large_err)]

mod convert;
mod error;
mod export;
mod fsdp2;
mod reshard;
mod simulate;
mod validate;

pub use convert::{convert, plan_release, ConvertReport, ConvertRequest};
pub use error::OpsError;
pub use export::{
    automodel_release, export, export_tensors, open_model, plan_export_of, saved_etp, AutomodelRelease, ExportDone,
    ExportRequest, PlannedExport,
};
pub use fsdp2::OpenedCheckpoint;
pub use reshard::{
    inferred_mesh, plan_reshard_of, reshard_options, AutomodelReshard, PlannedReshard, ReshardHints, ReshardRequest,
};
pub use simulate::{simulate_reshard, SimulatedReshard};
pub use validate::{detect_dialect, validate, ValidateRequest};
