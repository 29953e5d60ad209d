//! The API's own wire types, converted from the store's rows (with secrets redacted).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use shardline_store::{
    AttemptRow, Change, DeliveryState, EventRow, LogRow, Notification, Resources, RunRow, TaskCounts, TaskRow,
    WorkerRow,
};
use utoipa::{IntoParams, ToSchema};

use crate::redact::{redact, redact_line, redact_opt};

pub use crate::dto_page::{ParamDto, ResultDto, TimelineDto, TimelineStepDto, TimelineTaskDto};
pub use crate::dto_storage::{CacheUsageDto, DiskReporterDto, RetentionDto, StorageDto};

/// A pipeline name with its stored spec versions.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PipelineDto {
    pub name: String,
    /// Stored versions (distinct spec hashes) of this pipeline.
    pub versions: i64,
    /// Id of the newest version.
    pub latest_id: i64,
    pub latest_spec_hash: String,
}

/// A pipeline's newest spec, as submitted (secrets redacted), with its triggers.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PipelineDetailDto {
    pub name: String,
    pub versions: i64,
    pub latest_id: i64,
    pub latest_spec_hash: String,
    /// The YAML text of the newest version.
    pub spec_text: String,
    /// The params it declares, in spec order (empty when the stored text no longer lints).
    pub params: Vec<ParamDto>,
}

/// A pipeline's trigger with its last and next firing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TriggerDto {
    pub id: i64,
    pub pipeline: String,
    /// Index in the spec's `triggers:` list.
    pub position: u32,
    /// `schedule` or `watch`.
    pub kind: String,
    /// One line: `cron "0 2 * * *" Europe/Paris, missed: run-once`, `org/model@main every 10m`.
    pub summary: String,
    /// The trigger as written, secrets redacted.
    #[schema(value_type = Object)]
    pub spec: Value,
    pub last_check_at: Option<DateTime<Utc>>,
    /// When it is due next: the next cron instant or the next poll.
    pub next_at: Option<DateTime<Utc>>,
    pub last_sha: Option<String>,
    pub last_fired_at: Option<DateTime<Utc>>,
    /// The run it started last.
    pub last_run: Option<i64>,
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    /// Failed checks in a row.
    pub errors: u32,
}

impl From<&shardline_store::TriggerRecord> for TriggerDto {
    fn from(t: &shardline_store::TriggerRecord) -> TriggerDto {
        TriggerDto {
            id: t.id,
            pipeline: t.pipeline.clone(),
            position: t.position,
            kind: t.kind.clone(),
            summary: redact_line(&t.summary),
            spec: redact(&t.spec),
            last_check_at: t.last_check_at,
            next_at: t.next_at,
            last_sha: t.last_sha.clone(),
            last_fired_at: t.last_fired_at,
            last_run: t.last_run.map(|r| r.0),
            last_error: t.last_error.as_deref().map(redact_line),
            last_error_at: t.last_error_at,
            errors: t.errors,
        }
    }
}

/// Task counts of a run by state.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TaskCountsDto {
    pub blocked: i64,
    pub ready: i64,
    pub leased: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub cancelled: i64,
    pub total: i64,
}

impl From<&TaskCounts> for TaskCountsDto {
    fn from(c: &TaskCounts) -> TaskCountsDto {
        TaskCountsDto {
            blocked: c.blocked,
            ready: c.ready,
            leased: c.leased,
            succeeded: c.succeeded,
            failed: c.failed,
            cancelled: c.cancelled,
            total: c.total(),
        }
    }
}

/// A run as listed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunDto {
    pub id: i64,
    pub pipeline_id: i64,
    pub pipeline: String,
    /// `queued`, `running`, `succeeded`, `failed` or `cancelled`.
    pub state: String,
    /// Parameters, secrets redacted.
    #[schema(value_type = Object)]
    pub params: Value,
    /// The run's name (its work directory and `${{ run.id }}`); absent for runs made without one.
    pub name: Option<String>,
    /// Whether the run skips the step cache.
    pub no_cache: bool,
    pub dedupe_key: Option<String>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub tasks: TaskCountsDto,
    /// The Hub repository (or local path) the run's `hf.download` step reads.
    pub model: Option<String>,
    /// The Hub revision, for a Hub source.
    pub revision: Option<String>,
    /// From start to finish (to now while running), in milliseconds; absent before the start.
    pub duration_ms: Option<i64>,
    /// Who submitted it: `token:<name>` (the API), `user:<login>@<host>` (the CLI),
    /// `trigger:<pipeline>#<n>`; absent for runs from before this was recorded.
    pub submitted_by: Option<String>,
    /// Who cancelled or retried it and when, oldest first.
    pub actions: Vec<RunActionDto>,
}

/// A cancel or retry of a run.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunActionDto {
    /// `cancel` or `retry`.
    pub action: String,
    /// Who did it, spelled as `submitted_by` is.
    pub actor: String,
    pub at: DateTime<Utc>,
}

impl From<&RunRow> for RunDto {
    fn from(r: &RunRow) -> RunDto {
        let (model, revision) = crate::view::model_of(&r.spec);
        let (model, revision) = (model.map(|m| redact_line(&m)), revision.map(|v| redact_line(&v)));
        RunDto {
            id: r.id.0,
            pipeline_id: r.pipeline_id,
            pipeline: r.pipeline_name.clone(),
            state: r.state.as_str().into(),
            params: redact(&r.params),
            name: r.options.name.as_deref().map(redact_line),
            no_cache: r.options.no_cache,
            dedupe_key: r.dedupe_key.clone(),
            error: r.error.as_deref().map(redact_line),
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            tasks: (&r.tasks).into(),
            model,
            revision,
            duration_ms: crate::view::duration_ms(r, Utc::now()),
            submitted_by: r.submitted_by.as_deref().map(redact_line),
            actions: r
                .actions
                .iter()
                .map(|a| RunActionDto { action: a.action.as_str().into(), actor: redact_line(&a.actor), at: a.at })
                .collect(),
        }
    }
}

/// A run with its resolved spec and plan.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunDetailDto {
    pub run: RunDto,
    /// The resolved spec the run executes, secrets redacted.
    #[schema(value_type = Object)]
    pub spec: Value,
    #[schema(value_type = Option<Object>)]
    pub plan: Option<Value>,
    /// The webhooks told about the run's end, and how delivery went.
    pub notifications: Vec<NotificationDto>,
    /// Bytes of its work directory, summed over the state directories whose gc last measured
    /// it (the step cache entries inside it included); null when none did (not measured yet,
    /// or freed).
    pub disk_bytes: Option<u64>,
}

impl RunDetailDto {
    pub fn new(r: &RunRow, notifications: &[Notification]) -> RunDetailDto {
        RunDetailDto {
            run: r.into(),
            spec: redact(&r.spec),
            plan: redact_opt(&r.plan),
            notifications: notifications.iter().map(NotificationDto::from).collect(),
            disk_bytes: None,
        }
    }
}

/// A notification of a run's end: its target (redacted: no user info, query values or secret
/// path segments) and its delivery so far.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NotificationDto {
    pub id: i64,
    /// `succeeded`, `failed`, `cancelled` or `trigger-error`.
    pub event: String,
    /// The webhook URL, redacted.
    pub target: String,
    /// `json` or `slack`.
    pub format: String,
    /// `pending`, `delivered` or `failed` (given up).
    pub state: String,
    pub attempts: u32,
    /// The HTTP status of the last attempt, when it got an answer.
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// When the next attempt is due (pending notifications).
    pub next_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

impl From<&Notification> for NotificationDto {
    fn from(n: &Notification) -> NotificationDto {
        let target = shardline_spec::notify::redact_url(&n.url);
        NotificationDto {
            id: n.id,
            event: n.event.as_str().into(),
            format: n.format.as_str().into(),
            state: n.state.as_str().into(),
            attempts: n.attempts,
            last_status: n.last_status,
            // The notifier keeps URLs out of its errors; this is in case one slipped through.
            last_error: n.last_error.as_deref().map(|e| redact_line(&e.replace(&n.url, &target))),
            last_attempt_at: n.last_attempt_at,
            next_at: (n.state == DeliveryState::Pending).then_some(n.next_at),
            delivered_at: n.delivered_at,
            created_at: n.created_at,
            target,
        }
    }
}

/// One page of runs, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunPageDto {
    pub runs: Vec<RunDto>,
    /// Pass as `before` for the next page; absent on the last page.
    pub next: Option<i64>,
}

/// Query of `GET /runs`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RunsQuery {
    /// Only runs in this state.
    pub state: Option<String>,
    /// Only runs of this pipeline (by name).
    pub pipeline: Option<String>,
    /// Runs with ids below this (the `next` of the previous page).
    pub before: Option<i64>,
    /// Page size, 1 to 1000 (default 50).
    pub limit: Option<i64>,
}

/// Resources in bytes, cores and devices.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResourcesDto {
    pub cpus: u32,
    pub memory: u64,
    pub gpus: u32,
    pub scratch: u64,
}

impl From<&Resources> for ResourcesDto {
    fn from(r: &Resources) -> ResourcesDto {
        ResourcesDto { cpus: r.cpus, memory: r.memory, gpus: r.gpus, scratch: r.scratch }
    }
}

/// A task of a run.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TaskDto {
    pub id: i64,
    pub run: i64,
    pub name: String,
    pub step_id: String,
    pub kind: String,
    /// `blocked`, `ready`, `leased`, `succeeded`, `failed` or `cancelled`.
    pub state: String,
    pub priority: i64,
    pub resources: ResourcesDto,
    #[schema(value_type = Object)]
    pub payload: Value,
    #[schema(value_type = Option<Object>)]
    pub output: Option<Value>,
    #[schema(value_type = Option<Object>)]
    pub progress: Option<Value>,
    /// Attempts started so far (every lease, lost ones included).
    pub attempt: i32,
    /// Attempts counted against `max_attempts` since the last retry of the run: those that
    /// failed (an error or a timeout) and the running one.
    pub attempts_used: i32,
    pub max_attempts: i32,
    /// Lost leases (the worker died or lost the store; the lease expired) since the last retry
    /// of the run, counted against `max_lost`.
    pub lost: i32,
    pub max_lost: i32,
    pub backoff_ms: u64,
    /// Zero for no limit.
    pub timeout_ms: u64,
    pub ready_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<i64>,
    pub leased_at: Option<DateTime<Utc>>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub cache_key: Option<String>,
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Bytes moved, expected total, rate and time left (when the task reports bytes).
    pub progress_info: Option<ProgressDto>,
    /// Why the task is where it is: what a blocked or ready task waits for, or that it was
    /// served from the step cache.
    pub reason: Option<String>,
}

impl From<&TaskRow> for TaskDto {
    fn from(t: &TaskRow) -> TaskDto {
        TaskDto::build(t, true)
    }
}

impl TaskDto {
    /// Without payload and output (`null`): what a listing of many tasks needs.
    pub fn summary(t: &TaskRow) -> TaskDto {
        TaskDto::build(t, false)
    }

    fn build(t: &TaskRow, full: bool) -> TaskDto {
        TaskDto {
            id: t.id.0,
            run: t.run.0,
            name: t.name.clone(),
            step_id: t.step_id.clone(),
            kind: t.kind.clone(),
            state: t.state.as_str().into(),
            priority: t.priority,
            resources: (&t.resources).into(),
            payload: if full { redact(&t.payload) } else { Value::Null },
            output: if full { redact_opt(&t.output) } else { None },
            progress: redact_opt(&t.progress),
            attempt: t.attempt,
            attempts_used: t.attempts_used(),
            max_attempts: t.max_attempts,
            lost: t.lost,
            max_lost: t.max_lost,
            backoff_ms: u64::try_from(t.backoff.as_millis()).unwrap_or(u64::MAX),
            timeout_ms: u64::try_from(t.timeout.as_millis()).unwrap_or(u64::MAX),
            ready_at: t.ready_at,
            lease_owner: t.lease_owner.map(|w| w.0),
            leased_at: t.leased_at,
            lease_expires_at: t.lease_expires_at,
            heartbeat_at: t.heartbeat_at,
            cache_key: t.cache_key.clone(),
            error: t.error.as_deref().map(redact_line),
            created_at: t.created_at,
            finished_at: t.finished_at,
            progress_info: None,
            reason: None,
        }
    }
}

/// A task's progress as the dashboard shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProgressDto {
    /// Bytes written (or checked) so far, as of the last heartbeat.
    pub bytes: u64,
    /// Bytes the task is expected to move, when known (rank files: from the plan).
    pub total_bytes: Option<u64>,
    /// `bytes / total_bytes`, 0 to 1.
    pub fraction: Option<f64>,
    /// Mean rate of the current attempt (leased tasks).
    pub bytes_per_sec: Option<f64>,
    /// Seconds left at that rate.
    pub eta_seconds: Option<f64>,
}

/// A step of a run's graph: its tasks (fan-out) by state.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StepDto {
    pub id: String,
    /// The step kind, e.g. `megatron.shard`.
    pub kind: String,
    /// Steps this one needs.
    pub needs: Vec<String>,
    /// `pending`, `blocked`, `ready`, `running`, `succeeded`, `failed` or `cancelled`.
    pub state: String,
    /// The step's tasks by state; `total` is its fan-out.
    pub tasks: TaskCountsDto,
    /// Tasks served from the step cache.
    pub cached: i64,
    pub bytes: u64,
    pub total_bytes: Option<u64>,
}

/// What a run's page shows.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunViewDto {
    pub run: RunDto,
    pub steps: Vec<StepDto>,
    /// In summary form: payloads and outputs are `null`.
    pub tasks: Vec<TaskDto>,
    /// The webhooks told about the run's end (as in `GET /runs/{id}`).
    pub notifications: Vec<NotificationDto>,
    /// Where the result went; absent until something is published or written.
    pub result: Option<ResultDto>,
    /// Each step's and task's span, from their attempts.
    pub timeline: TimelineDto,
    /// Every attempt of every task, by task and then oldest first.
    pub attempts: Vec<AttemptDto>,
    /// Bytes of its work directory on disk (as in `GET /runs/{id}`).
    pub disk_bytes: Option<u64>,
}

/// A run's step graph.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct GraphDto {
    pub run: i64,
    pub steps: Vec<StepDto>,
}

/// One lease of a task.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AttemptDto {
    pub task: i64,
    pub run: i64,
    pub attempt: i32,
    pub worker: Option<i64>,
    pub worker_name: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// Absent while the lease is held; else `succeeded`, `failed`, `expired`, `timed_out`, `cancelled`.
    pub outcome: Option<String>,
    /// The retry budget it drew on: `error` (it failed or timed out: `max_attempts`) or `lost`
    /// (its lease expired: the worker died or lost the store; `max_lost`). Absent while it runs
    /// and when it succeeded or was cancelled.
    pub kind: Option<String>,
    pub error: Option<String>,
}

impl From<&AttemptRow> for AttemptDto {
    fn from(a: &AttemptRow) -> AttemptDto {
        AttemptDto {
            task: a.task.0,
            run: a.run.0,
            attempt: a.attempt,
            worker: a.worker.map(|w| w.0),
            worker_name: a.worker_name.clone(),
            started_at: a.started_at,
            ended_at: a.ended_at,
            outcome: a.outcome.map(|o| o.as_str().into()),
            kind: a.kind.map(|k| k.as_str().into()),
            error: a.error.as_deref().map(redact_line),
        }
    }
}

/// A registered worker.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WorkerDto {
    pub id: i64,
    pub name: String,
    pub resources: ResourcesDto,
    pub gpus: Vec<u32>,
    /// `active` or `stopped`.
    pub state: String,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    /// Seconds since the last heartbeat.
    pub heartbeat_age_s: f64,
    /// Tasks it holds a lease on now.
    pub leases: Vec<LeaseDto>,
    /// What those leases hold of its resources.
    pub used: ResourcesDto,
    /// What it last measured of its disk; absent until it reports one.
    pub disk: Option<WorkerDiskDto>,
}

/// A worker's disk (the file system of its work directory), in bytes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WorkerDiskDto {
    /// Available to the worker.
    pub free: u64,
    pub total: u64,
    /// What it offers to claims: `free` less its reserve and its leases' scratch.
    pub scratch_free: u64,
}

/// A task a worker holds.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LeaseDto {
    pub task: i64,
    pub run: i64,
    pub name: String,
    pub step_id: String,
}

impl From<&WorkerRow> for WorkerDto {
    fn from(w: &WorkerRow) -> WorkerDto {
        WorkerDto {
            id: w.id.0,
            name: w.name.clone(),
            resources: (&w.resources).into(),
            gpus: w.gpus.clone(),
            state: w.state.as_str().into(),
            registered_at: w.registered_at,
            last_heartbeat: w.last_heartbeat,
            heartbeat_age_s: (Utc::now() - w.last_heartbeat).num_milliseconds().max(0) as f64 / 1000.0,
            leases: Vec::new(),
            used: ResourcesDto { cpus: 0, memory: 0, gpus: 0, scratch: 0 },
            disk: w.disk.map(|d| WorkerDiskDto { free: d.free, total: d.total, scratch_free: d.scratch_free }),
        }
    }
}

/// A line of task output (token-like words redacted).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LogLineDto {
    pub id: i64,
    pub task: i64,
    pub run: i64,
    pub attempt: i32,
    pub ts: DateTime<Utc>,
    /// `stdout`, `stderr` or `system`.
    pub stream: String,
    pub line: String,
}

impl From<&LogRow> for LogLineDto {
    fn from(l: &LogRow) -> LogLineDto {
        LogLineDto {
            id: l.id,
            task: l.task.0,
            run: l.run.0,
            attempt: l.attempt,
            ts: l.ts,
            stream: l.stream.as_str().into(),
            line: redact_line(&l.line),
        }
    }
}

/// Query of `GET /runs/{id}/tasks`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TasksQuery {
    /// `true`: leave out each task's payload and output (`null`), for listings of many tasks.
    pub summary: Option<bool>,
}

/// Query of `GET /runs/{id}/logs`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// Lines with ids above this (the `next_after` of the previous page); default 0.
    pub after: Option<i64>,
    /// Lines read per page, 1 to 10000 (default 1000).
    pub limit: Option<i64>,
    /// Only this task's lines (a task of this run).
    pub task: Option<i64>,
    /// Only lines containing this text (case-insensitive), among the page read.
    pub q: Option<String>,
}

/// A page of log lines.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LogPageDto {
    pub lines: Vec<LogLineDto>,
    /// Pass as `after` to read on (the last id read, matching `q` or not).
    pub next_after: i64,
    /// Whether the page was full, so more lines may follow right away.
    pub more: bool,
}

/// A state change of a run or a task, as sent on the event stream.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventDto {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub run: i64,
    /// `run` or `task`.
    pub kind: String,
    /// For task events.
    pub task: Option<i64>,
    pub attempt: Option<i32>,
    /// The state entered.
    pub state: String,
    pub message: Option<String>,
}

impl From<&EventRow> for EventDto {
    fn from(e: &EventRow) -> EventDto {
        let (kind, task, attempt, state) = match e.change {
            Change::Run { state } => ("run", None, None, state.as_str()),
            Change::Task { task, state, attempt } => ("task", Some(task.0), Some(attempt), state.as_str()),
        };
        EventDto {
            id: e.id,
            at: e.at,
            run: e.run.0,
            kind: kind.into(),
            task,
            attempt,
            state: state.into(),
            message: e.message.as_deref().map(redact_line),
        }
    }
}

/// Query of `GET /events`.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Start after this event id (the `Last-Event-ID` header takes precedence). Without either,
    /// the stream starts with the next change.
    pub after: Option<i64>,
    /// Only events of this run.
    pub run: Option<i64>,
}

/// A spec to submit.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct SubmitRequest {
    /// The pipeline spec, YAML text; empty (or absent) with `pipeline`.
    #[serde(default)]
    pub spec: String,
    /// Instead of `spec`: the newest stored spec of this pipeline, as submitted before (the
    /// dashboard's params form; the text it shows has its secrets redacted, this one has not).
    pub pipeline: Option<String>,
    /// File name shown in diagnostics (default `pipeline.yaml`).
    pub file: Option<String>,
    /// Parameter overrides, `name: value` (like `--set name=value`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub set: Option<serde_json::Map<String, Value>>,
    /// A second submission with the same key returns the existing run (unless it failed or was cancelled).
    pub dedupe_key: Option<String>,
    /// Ignore the step cache.
    #[serde(default)]
    pub no_cache: bool,
    /// The run's priority: its tasks are claimed before those of lower-priority runs
    /// (default: the spec's `priority:`, else 0).
    #[serde(default)]
    pub priority: Option<i64>,
}

/// A submitted (or deduplicated) run.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SubmittedDto {
    pub run: i64,
    /// The run's name (its work directory).
    pub name: String,
    /// False when the dedupe key matched an existing run.
    pub created: bool,
    /// Runs of the pipeline cancelled for this one (`concurrency.overflow: cancel-previous`).
    #[serde(default)]
    pub cancelled: Vec<i64>,
}

/// A spec to lint.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct LintRequest {
    pub spec: String,
    pub file: Option<String>,
}

/// A lint diagnostic: where and what.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DiagnosticDto {
    /// `error` or `warning`.
    pub severity: String,
    /// Stable, kebab-case kind, e.g. `unknown-step-kind`.
    pub code: String,
    pub file: String,
    /// 1-based.
    pub line: usize,
    /// 1-based.
    pub column: usize,
    pub length: usize,
    /// Key path of the offending node, e.g. `steps[1].with.tp`.
    pub path: String,
    pub message: String,
    pub hint: Option<String>,
    pub notes: Vec<String>,
}

impl From<&shardline_spec::Diagnostic> for DiagnosticDto {
    fn from(d: &shardline_spec::Diagnostic) -> DiagnosticDto {
        DiagnosticDto {
            severity: match d.severity {
                shardline_spec::Severity::Error => "error".into(),
                _ => "warning".into(),
            },
            code: d.code.clone(),
            file: d.file.clone(),
            line: d.line,
            column: d.column,
            length: d.length,
            path: d.path.clone(),
            message: d.message.clone(),
            hint: d.hint.clone(),
            notes: d.notes.clone(),
        }
    }
}

/// Result of a lint.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LintResponse {
    /// No errors (warnings allowed).
    pub valid: bool,
    pub diagnostics: Vec<DiagnosticDto>,
}

/// Options of a retry.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct RetryRequest {
    /// Also rerun this step's tasks and everything downstream of them.
    pub from_step: Option<String>,
}

/// The run after an action.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ActionDto {
    pub run: i64,
    pub state: String,
}
