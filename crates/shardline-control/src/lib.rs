//! The control plane's contracts and entry points, shared by the engine (which runs tasks),
//! the HTTP API and the trigger poller (which submit runs):
//!
//! - [`graph`]: a resolved pipeline → a run's task graph, and the typed task payloads
//!   ([`graph::Payload`], [`graph::ShardJob`]) that the graph writes and workers read;
//! - [`output`]: what tasks report — [`TaskOutput`] when they succeed, [`TaskProgress`] with
//!   each heartbeat — written by the engine, read by the engine, the dashboard and the CLI;
//! - [`submit`]: lint, instantiate and store a run with its whole task graph and its
//!   [`RunOptions`] (name, no-cache, priority, the pipeline's concurrency limit and pool); a
//!   pipeline at its limit with `overflow: skip` gets no run ([`SubmitError::Skipped`]);
//! - [`actor`]: how the submitter of a run and whoever cancels or retries it are named;
//! - [`notify_targets`]: a spec's `notify:` as the store keeps it;
//! - [`lint_context`] and [`parse_pipeline`]: spec loading as `submit` does it, for linting
//!   from anywhere.
//!
//! **Owns:** the shape of task payloads, outputs and progress, and how runs are submitted.
//! **Must not depend on:** the engine, the data plane's I/O (`shardline-formats`), the Hub
//! client, publishing or object stores — submitting a run never moves a byte of a model.

pub mod actor;
pub mod graph;
pub mod output;
pub mod policy;

pub use output::{BoxFingerprint, ListedFile, PartUpload, TaskOutput, TaskProgress};

use std::path::{Path, PathBuf};

use serde_json::json;
use shardline_spec::{lint, render_all, LintContext, OverflowPolicy, Pipeline, ResolvedPipeline, PRIORITY_RANGE};
use shardline_store::{Admission, Concurrency, NewRun, Overflow, RunId, RunOptions, Skipped, Store, StoreError};
use thiserror::Error;

/// Why a submission was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SubmitError {
    #[error("{0}")]
    Invalid(String),
    /// The pipeline is at its concurrency limit and its overflow is `skip`: no run was created
    /// ("skipped: pipeline nightly at its limit 1 (live: run 12)").
    #[error(transparent)]
    Skipped(Skipped),
    #[error(transparent)]
    Store(StoreError),
}

impl From<StoreError> for SubmitError {
    fn from(e: StoreError) -> SubmitError {
        match e {
            StoreError::Skipped(s) => SubmitError::Skipped(s),
            other => SubmitError::Store(other),
        }
    }
}

/// A lint context that reads model configs from disk, so mesh errors show at lint time.
pub fn lint_context(base_dir: &Path) -> LintContext {
    LintContext::new().with_base_dir(base_dir.to_path_buf()).with_model_config(|path: &Path| {
        let text = std::fs::read_to_string(path.join("config.json")).ok()?;
        shardline_layout::ModelConfig::from_json(&text).ok()
    })
}

/// Lints a spec; all diagnostics rendered in one message on failure.
pub fn parse_pipeline(file: &str, text: &str, base_dir: &Path) -> Result<Pipeline, SubmitError> {
    let (pipeline, diagnostics) = lint(file, text, &lint_context(base_dir));
    match pipeline {
        Some(p) if diagnostics.iter().all(|d| d.severity != shardline_spec::Severity::Error) => Ok(p),
        _ => Err(SubmitError::Invalid(render_all(&diagnostics, text))),
    }
}

/// What to submit.
pub struct Submission<'a> {
    pub file: &'a str,
    pub text: &'a str,
    pub overrides: &'a [(String, String)],
    /// Directory relative spec paths are resolved against.
    pub base_dir: &'a Path,
    /// Root of run work directories (`<work>/runs/<run name>/<step>/…`).
    pub work_dir: &'a Path,
    /// Idempotency key: a second submission with it returns the existing run (unless that failed).
    pub dedupe_key: Option<String>,
    pub no_cache: bool,
    /// Where the spec may read and write (a shared server's API and triggers); `None`: anywhere
    /// the worker can (the local CLI).
    pub policy: Option<&'a shardline_spec::policy::PathPolicy>,
    /// The run's priority (higher first); `None` takes the spec's `priority:` (default 0).
    pub priority: Option<i64>,
    /// Who submits it, as [`actor`] spells it; recorded with the run.
    pub submitted_by: Option<String>,
    /// An object-store artifact store (`s3://bucket/prefix`): the run's step outputs live there,
    /// so its tasks can run on workers that share no disk. `None`: under `work_dir`.
    pub artifacts: Option<&'a str>,
}

/// A submitted run.
#[derive(Clone, Debug)]
pub struct Submitted {
    pub run: RunId,
    pub name: String,
    pub created: bool,
    /// Runs of the pipeline that its `overflow: cancel-previous` cancelled for this one.
    pub cancelled: Vec<RunId>,
    pub resolved: ResolvedPipeline,
}

/// Lints, instantiates and stores a run with its whole task graph.
pub async fn submit(store: &Store, s: Submission<'_>) -> Result<Submitted, SubmitError> {
    let pipeline = parse_pipeline(s.file, s.text, s.base_dir)?;
    // The run's name is its work directory and its `${{ run.id }}`.
    let name = format!("{}-{}", pipeline.name, chrono::Utc::now().format("%Y%m%d-%H%M%S-%6f"));
    let resolved =
        pipeline.instantiate(s.overrides, &name).map_err(|d| SubmitError::Invalid(render_all(&d, s.text)))?;
    if let Some(policy) = s.policy {
        let base = absolute(s.base_dir);
        let resolve = |p: &Path| policy::resolve_local(&base, p);
        let refused = shardline_spec::policy::check_policy(&pipeline, &resolved, policy, &resolve);
        if !refused.is_empty() {
            return Err(SubmitError::Invalid(render_all(&refused, s.text)));
        }
    }
    let run_dir = absolute(s.work_dir).join("runs").join(&name);
    let tasks =
        graph::tasks_for(&resolved, &run_dir, &absolute(s.base_dir), s.artifacts).map_err(SubmitError::Invalid)?;
    let pipeline_id = store.upsert_pipeline(&pipeline.name, s.text, &resolved.spec_hash).await?;
    let params = serde_json::to_value(&resolved.params).unwrap_or(json!({}));
    let spec = serde_json::to_value(&resolved).unwrap_or(json!({}));
    let priority = s.priority.unwrap_or(resolved.limits.priority);
    if !(-PRIORITY_RANGE..=PRIORITY_RANGE).contains(&priority) {
        return Err(SubmitError::Invalid(format!(
            "priority {priority} is out of range ({} to {PRIORITY_RANGE})",
            -PRIORITY_RANGE
        )));
    }
    let options = run_options(&resolved, name.clone(), s.no_cache, priority);
    let notify = notify_targets(&pipeline.notify);
    let new =
        NewRun { pipeline_id, dedupe_key: s.dedupe_key, params, spec, options, notify, submitted_by: s.submitted_by };
    let (run, created, cancelled) = match store.admit_run(new).await? {
        Admission::Created { run, cancelled } => (run, true, cancelled),
        Admission::Existing(run) => (run, false, Vec::new()),
        Admission::Skipped(skipped) => return Err(SubmitError::Skipped(skipped)),
    };
    if created {
        store.add_tasks(run, tasks).await?;
    }
    Ok(Submitted { run, name, created, cancelled, resolved })
}

/// The store's options of a run of `resolved`: its name, the cache switch, its priority, its
/// pipeline's concurrency limit (keyed by the pipeline's name) and pool, and its retention.
fn run_options(resolved: &ResolvedPipeline, name: String, no_cache: bool, priority: i64) -> RunOptions {
    let concurrency = resolved.limits.concurrency.map(|c| Concurrency {
        key: resolved.name.clone(),
        limit: c.limit,
        overflow: match c.overflow {
            OverflowPolicy::Queue => Overflow::Queue,
            OverflowPolicy::Skip => Overflow::Skip,
            OverflowPolicy::CancelPrevious => Overflow::CancelPrevious,
        },
    });
    RunOptions {
        name: Some(name),
        no_cache,
        priority,
        concurrency,
        pool: resolved.limits.pool.clone(),
        retention: resolved.retention.runs,
    }
}

/// A spec's `notify:` entries as the store keeps them.
pub fn notify_targets(targets: &[shardline_spec::notify::NotifyTarget]) -> Vec<shardline_store::NotifyTarget> {
    use shardline_spec::notify::{NotifyEvent as E, NotifyFormat as F};
    use shardline_store::{NotifyEvent, NotifyFormat};
    targets
        .iter()
        .map(|t| shardline_store::NotifyTarget {
            url: t.url.clone(),
            events: t
                .on
                .iter()
                .map(|e| match e {
                    E::Succeeded => NotifyEvent::Succeeded,
                    E::Failed => NotifyEvent::Failed,
                    E::Cancelled => NotifyEvent::Cancelled,
                    E::TriggerError => NotifyEvent::TriggerError,
                })
                .collect(),
            format: match t.format {
                F::Json => NotifyFormat::Json,
                F::Slack => NotifyFormat::Slack,
            },
        })
        .collect()
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(p)).unwrap_or_else(|_| p.to_path_buf())
    }
}
