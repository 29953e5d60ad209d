//! Pipeline specs for the Shardline orchestrator: `apiVersion: shardline/v1`, `kind: Pipeline`
//! YAML files, read with a position for every key path, linted with every problem reported at
//! once in compiler style, and instantiated into typed, hashable step configs.
//!
//! **Owns:** the spec language (syntax, lint, `--set`, interpolation, triggers' settings); its
//! sizes and durations are `shardline-units`'.
//! **Must not depend on:** any workspace crate but `shardline-layout` (model configs for mesh
//! checks) and `shardline-units`, nor on I/O of any kind: files come in as text, model configs
//! through `LintContext`.
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
//! # The spec
//!
//! Top level: `apiVersion` (`shardline/v1`), `kind` (`Pipeline`), `name` (`[a-z0-9-]+`),
//! `description`, `params`, `steps`. A param is `{type, default?, enum?, description?}` with type
//! `string`, `int`, `bool`, `path`, `size` (`4GiB`, `10GB`, bytes) or `duration` (`90s`, `2h`,
//! `1h30m`); one without a default must be set with `--set NAME=VALUE`. A step is
//! `{id, uses, needs?, with?, resources?, retry?, timeout?, cache?}`; `needs` is a list of ids
//! (or one id). The `with` fields of each kind, with defaults:
//!
//! | kind | fields |
//! |---|---|
//! | `hf.download` | exactly one of `repo` (a Hub repository, `org/name`) and `path` (a local HF-layout directory, or an object-store prefix: `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///abs/dir`); with `repo`: `revision` = `main` (branch, tag or commit sha), `allow` / `ignore` = [] (`fnmatch` globs), `endpoint` = `HF_ENDPOINT`, else `https://huggingface.co` |
//! | `megatron.shard` | `tp`, `dp` (required), `cp` = 1, `ep` = 1, `etp` = `tp`, `format` = `dcp` \| `dcp-safetensors`, `target` = `fsdp_dtensor` \| `torch_dist` (a Megatron save directory: tracker and `release/`), `prefix` = `model.module.` (none for `torch_dist`), `optimizer_state` = false, `vocab_divisible_by` = 128, `keep` = false |
//! | `megatron.split_fused` | `keep` = false; its only need is a `megatron.shard` step |
//! | `checkpoint.reshard` | `tp`, `dp` (required), `cp` = 1, `ep` = 1, `etp` = `tp`, `rng` = `from-rank0` \| `drop`, `vocab_size` (the tokenizer's; default: the checkpoint's `args`, else the upstream release's `config.json`), `from_mesh` (`tp=2,dp=4,…`; default: `args`, else the mesh the upstream step wrote, else the chunk geometry's), `target` (`fsdp_dtensor` \| `torch_dist`: either translates a checkpoint of the other dialect, `torch_dist` writing a Megatron save directory with `fully_reshardable` optimizer state; default: the source's dialect), `path` (a local checkpoint directory or an object-store prefix, fetched as `hf.download` fetches one; without it, the checkpoint of the upstream `megatron.shard`, `megatron.split_fused` or `checkpoint.reshard` step) |
//! | `checkpoint.validate` | none; validates against the upstream download's source |
//! | `checkpoint.export` | `like` (a local HF release; default: the upstream download's), `etp` (default: the checkpoint's `args`, else its mesh), `max_file_size` = `5GB`, `parts` = 1 (tasks writing the weight files, then one committing); exports the upstream checkpoint as an HF directory |
//! | `store.upload` | `to` (required): a `file://`, `s3://`, `gs://` or `az://` URL, or an absolute path; uploads the nearest upstream checkpoint or export |
//!
//! `resources` = `{cpus: 1, memory: 1GiB, gpus: 0, scratch: 0}`, `retry` =
//! `{attempts: 3, lost: 10, backoff: 5s}`, `timeout` = `6h`, `cache` = `true`. The retry
//! settings are two budgets and a delay:
//!
//! | `retry` field | default | what it bounds |
//! |---|---|---|
//! | `attempts` | 3 | tries that fail — the task's own error or its `timeout` — the first try included; the one that reaches it fails the task ("failed after 3 attempts") |
//! | `lost` | 10 | lost leases — the worker died, was preempted or lost the store, and its lease expired; the one that reaches it fails the task ("worker lost 10 times"); lost leases never spend `attempts` |
//! | `backoff` | `5s` | base of the exponential backoff with jitter before a retry; it doubles with each failure of the same budget |
//!
//! All three are part of the step's hash; `lost` at its default leaves the hash as it was before
//! the field existed. Values of `with`, `resources`, `retry`, `timeout` and `cache` may
//! interpolate `${{ params.NAME }}` and `${{ run.id }}`: as the whole value (the param's type
//! must fit the field), or inside string, path and URL values.
//!
//! `concurrency` (optional: `N`, or `{limit: N, overflow: queue | skip | cancel-previous}`,
//! overflow `queue` by default) bounds the runs of the pipeline that run at once and says what a
//! submission beyond it does; `pool` (optional) names a pool of run slots shared across pipelines
//! (the server defines its size); `priority` (optional, default 0, `-1000000..=1000000`) orders
//! the claims of its runs' tasks, higher first. None of them is interpolated; each is in the spec
//! hash only when set.
//!
//! `retention` (optional: `{runs: 7d}`) keeps the work directories of the pipeline's finished
//! runs for that long (the shorter of it and the server's `--retain-runs`); not interpolated, in
//! the spec hash only when set, never in a step's.
//!
//! `triggers` (optional) lists what starts runs without a submission: a cron `schedule` in a
//! named time zone with a missed-run policy, or a `watch` on Hub repositories; see [`triggers`].
//! `notify` (optional) lists webhooks told when a run finishes or a trigger fails; see [`notify`].
//!
//! # Why not a serde YAML deserializer
//!
//! A serde deserializer stops at the first error and loses positions, and this crate's job is to
//! report every problem at its line and column. So the YAML is read once, with `saphyr-parser`
//! (YAML 1.2, a span on every event), into a tree of positioned nodes; the typed structs are
//! built from it by the field tables in `schema.rs`. One parser means no disagreement between
//! two YAML implementations on what a file says. Serde is used where data leaves the crate:
//! [`ResolvedPipeline`] and [`Diagnostic`] (de)serialize as JSON, and [`PipelineOutline`] reads a
//! stored resolved pipeline leniently, whatever version of the types wrote it.
//!
//! **Architecture invariant:** this crate does no I/O: it is given text (and, through
//! [`LintContext`], a way to look up model configs) and returns data. Diagnostics are values,
//! never panics, on any input.

mod checks;
mod diagnostic;
mod graph;
mod lint;
mod model;
pub mod notify;
mod outline;
pub mod policy;
mod resolve;
mod retention;
mod run_limits;
mod schema;
pub use checks::is_object_store_source;
mod suggest;
mod targets;
mod template;
pub mod triggers;
mod yaml;

pub use diagnostic::{render_all, Diagnostic, Severity, MAX_DIAGNOSTICS};
pub use lint::{lint, LintContext};
pub use model::{
    CheckpointSource, DownloadSource, Location, OutputFormatName, ParamSpec, ParamType, ParamValue, Pipeline,
    ResolvedPipeline, ResolvedStep, Resources, Retry, RngPolicyName, SpecValue, StepConfig, StepKind, StepSpec,
    UnknownOutputFormat, UnknownParamType, UnknownStepKind, API_VERSION, DEFAULT_LOST, KIND,
};
pub use outline::{PipelineOutline, SourceOutline, StepOutline};
pub use resolve::{parse_override, OverrideSyntaxError};
pub use retention::Retention;
pub use run_limits::{is_pool_name, ConcurrencyLimit, OverflowPolicy, RunLimits, MAX_CONCURRENCY, PRIORITY_RANGE};
pub use shardline_units::{format_duration, format_size, parse_duration, parse_size, UnitError};
pub use suggest::did_you_mean;
pub use template::{Part, Template};
pub use triggers::{
    parse_cron, parse_timezone, MissedPolicy, Schedule, Trigger, TriggerContext, TriggerKind, Watch, WatchTarget,
    DEFAULT_WATCH_INTERVAL, MIN_WATCH_INTERVAL, ON_TIME_GRACE, TRIGGER_VARS,
};

/// Limits on untrusted input.
pub mod limits {
    pub use crate::yaml::{MAX_ALIASES, MAX_ALIAS_NODES, MAX_ANCHORS, MAX_DEPTH, MAX_FILE_BYTES};
}
