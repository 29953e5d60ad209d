//! Pipeline specs for the Shardline orchestrator: `apiVersion: shardline/v1`, `kind: Pipeline`
//! YAML files, read with a position for every key path, linted with every problem reported at
//! once in compiler style, and instantiated into typed, hashable step configs.
//!
//! ```
//! use shardline_spec::{lint, LintContext};
//!
//! let text = "apiVersion: shardline/v1
//! kind: Pipeline
//! name: demo
//! params:
//!   tp: {type: int, default: 2}
//! steps:
//!   - {id: download, uses: hf.download, with: {path: /data/models/llama}}
//!   - {id: shard, uses: megatron.shard, needs: [download], with: {tp: \"${{ params.tp }}\", dp: 4}}
//! ";
//! let (pipeline, diagnostics) = lint("demo.yaml", text, &LintContext::new());
//! assert!(diagnostics.is_empty());
//! let run = pipeline.unwrap().instantiate(&[("tp".into(), "1".into())], "run-1").unwrap();
//! assert_eq!(run.topo_order()[1].id, "shard");
//! ```
//!
//! **Architecture invariant:** this crate does no I/O: it is given text (and, through
//! [`LintContext`], a way to look up model configs) and returns data. Diagnostics are values,
//! never panics, on any input.

mod diagnostic;
mod lint;
mod model;
mod resolve;
mod schema;
mod suggest;
mod template;
mod units;
mod yaml;

pub use diagnostic::{render_all, Diagnostic, Severity};
pub use lint::{lint, LintContext};
pub use model::{
    Location, OutputFormatName, ParamSpec, ParamType, ParamValue, Pipeline, ResolvedPipeline, ResolvedStep, Resources,
    Retry, SpecValue, StepConfig, StepKind, StepSpec, UnknownOutputFormat, UnknownParamType, UnknownStepKind,
    API_VERSION, KIND,
};
pub use resolve::{parse_override, OverrideSyntaxError};
pub use suggest::did_you_mean;
pub use template::{Part, Template};
pub use units::{format_duration, format_size, parse_duration, parse_size, UnitError};

/// Limits on untrusted input.
pub mod limits {
    pub use crate::yaml::{MAX_ALIASES, MAX_ALIAS_NODES, MAX_ANCHORS, MAX_DEPTH, MAX_FILE_BYTES};
}
