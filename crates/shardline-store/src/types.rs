//! The store's vocabulary: ids, states, what goes in and what comes out.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Which database a [`Store`](crate::Store) talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backend {
    /// PostgreSQL (15 or later): shared deployments, several servers and workers.
    Postgres,
    /// SQLite: the embedded default, one process.
    Sqlite,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "PostgreSQL",
            Backend::Sqlite => "SQLite",
        })
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub i64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_type!(
    /// A run's id.
    RunId
);
id_type!(
    /// A task's id (unique across runs).
    TaskId
);
id_type!(
    /// A registered worker's id.
    WorkerId
);

macro_rules! state_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every state, in lifecycle order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The name stored in the database.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<$name, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(format!(
                        "unknown {} `{}` (known: {})",
                        stringify!($name),
                        other,
                        [$($text),+].join(", ")
                    )),
                }
            }
        }
    };
}

state_enum!(
    /// A run's state.
    RunState {
        /// Submitted; no task has been leased yet.
        Queued = "queued",
        /// At least one task was leased; not finished.
        Running = "running",
        /// Every task succeeded.
        Succeeded = "succeeded",
        /// A task failed for good; the run's other unfinished tasks were cancelled.
        Failed = "failed",
        /// Cancelled by a user.
        Cancelled = "cancelled",
    }
);

state_enum!(
    /// What a notification tells.
    NotifyEvent {
        /// A run succeeded.
        Succeeded = "succeeded",
        /// A run failed.
        Failed = "failed",
        /// A run was cancelled.
        Cancelled = "cancelled",
        /// A trigger's check failed (once per error streak).
        TriggerError = "trigger-error",
    }
);

state_enum!(
    /// How a notification's body is written.
    NotifyFormat {
        /// A JSON object with the run's fields.
        Json = "json",
        /// `{"text": …}`, as Slack incoming webhooks read it.
        Slack = "slack",
    }
);

state_enum!(
    /// Where a notification is in its delivery.
    DeliveryState {
        /// Waiting for its (next) attempt.
        Pending = "pending",
        /// A receiver accepted it (2xx).
        Delivered = "delivered",
        /// Every attempt failed; no more are made.
        Failed = "failed",
    }
);

impl RunState {
    /// Succeeded, failed or cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, RunState::Succeeded | RunState::Failed | RunState::Cancelled)
    }
}

state_enum!(
    /// A task's state.
    TaskState {
        /// Waits for tasks it needs.
        Blocked = "blocked",
        /// Claimable (from `ready_at` on, which a retry backoff puts in the future).
        Ready = "ready",
        /// Held by a worker under a lease (owner, fencing token, expiry).
        Leased = "leased",
        Succeeded = "succeeded",
        Failed = "failed",
        Cancelled = "cancelled",
    }
);

impl TaskState {
    /// Succeeded, failed or cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled)
    }
}

state_enum!(
    /// How an attempt (one lease) ended.
    AttemptOutcome {
        Succeeded = "succeeded",
        /// The worker reported a failure.
        Failed = "failed",
        /// The lease expired without a completion (the worker died, hung or lost the database).
        Expired = "expired",
        /// The task ran past its timeout.
        TimedOut = "timed_out",
        /// The run was cancelled or failed while this attempt held the lease.
        Cancelled = "cancelled",
    }
);

state_enum!(
    /// Which retry budget an ended attempt drew on.
    AttemptKind {
        /// The task failed: it reported an error or ran past its timeout. Counted against the
        /// task's `max_attempts`.
        Error = "error",
        /// The lease was lost: it expired without a completion because the worker died, hung or
        /// lost the database. Counted against the task's `max_lost`.
        Lost = "lost",
    }
);

impl AttemptOutcome {
    /// The budget an attempt that ended this way draws on; `None` for one that succeeded or was
    /// cancelled.
    pub fn kind(self) -> Option<AttemptKind> {
        match self {
            AttemptOutcome::Failed | AttemptOutcome::TimedOut => Some(AttemptKind::Error),
            AttemptOutcome::Expired => Some(AttemptKind::Lost),
            AttemptOutcome::Succeeded | AttemptOutcome::Cancelled => None,
        }
    }
}

/// How many lost leases a task may have by default: workers killed, preempted or cut off from
/// the database are the infrastructure's failures, not the task's.
pub const DEFAULT_MAX_LOST: u32 = 10;

state_enum!(
    /// A registered worker's state.
    WorkerState {
        Active = "active",
        Stopped = "stopped",
    }
);

state_enum!(
    /// Which stream a log line came from.
    LogStream {
        Stdout = "stdout",
        Stderr = "stderr",
        /// Written by the worker itself (start, retries, resource use).
        System = "system",
    }
);

/// What a task needs, or what a worker has free. Sizes are bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Resources {
    pub cpus: u32,
    pub memory: u64,
    pub gpus: u32,
    pub scratch: u64,
}

impl Resources {
    /// Whether `need` fits into `self`.
    pub fn fits(&self, need: &Resources) -> bool {
        need.cpus <= self.cpus && need.memory <= self.memory && need.gpus <= self.gpus && need.scratch <= self.scratch
    }
}

/// How a run is executed, beside its pipeline's parameters (stored in columns of their own, never
/// in `params`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOptions {
    /// The run's name: its work directory and its `${{ run.id }}`. Runs created without one
    /// (directly through the store) have none.
    pub name: Option<String>,
    /// Skip the step cache: recompute every step even when an identical output exists.
    pub no_cache: bool,
    /// Claim order of the run's tasks: higher first (then readiness, then id). 0 by default.
    pub priority: i64,
    /// At most this many runs with the same key may run at once (see [`Concurrency`]).
    pub concurrency: Option<Concurrency>,
    /// A pool of slots shared across pipelines: the run takes one while it runs. A pool the
    /// server has not defined has no slots, so the run waits (and says why).
    pub pool: Option<String>,
    /// How long the run's work directory is kept once it ended (its spec's `retention.runs`);
    /// the gc keeps it for the shorter of this and the server's `--retain-runs`.
    pub retention: Option<Duration>,
}

/// A concurrency limit: runs with the same `key` (a pipeline's name) that may be `running` at
/// once, and what a submission beyond it does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Concurrency {
    pub key: String,
    /// At least 1.
    pub limit: u32,
    pub overflow: Overflow,
}

state_enum!(
    /// What a submission does when its pipeline already has `limit` live (queued or running)
    /// runs.
    Overflow {
        /// Create the run queued: it starts when a running one ends.
        Queue = "queue",
        /// Create no run; the caller is told ([`Admission::Skipped`]).
        Skip = "skip",
        /// Cancel the live runs of the pipeline, then create the run.
        CancelPrevious = "cancel-previous",
    }
);

/// What [`Store::admit_run`](crate::Store::admit_run) did with a new run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Admission {
    /// A new queued run; `cancelled` lists the runs `cancel-previous` cancelled for it.
    Created { run: RunId, cancelled: Vec<RunId> },
    /// A live run with the same dedupe key.
    Existing(RunId),
    /// `overflow: skip` and the pipeline at its limit: no run was created.
    Skipped(Skipped),
}

/// Why a submission created no run: its pipeline had `limit` live runs (`live`, oldest first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("skipped: pipeline {key} at its limit {limit} (live: {})", live.iter().map(|r| format!("run {r}")).collect::<Vec<_>>().join(", "))]
pub struct Skipped {
    pub key: String,
    pub limit: u32,
    pub live: Vec<RunId>,
}

/// Why a queued run's ready tasks are not claimed: what it would need to start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HeldBack {
    /// Its pipeline has `running` runs of `limit`.
    Concurrency { key: String, running: u32, limit: u32 },
    /// Its pool has `in_use` of `slots` slots taken; `slots` is `None` when the server defines
    /// no such pool.
    Pool { name: String, in_use: u32, slots: Option<u32> },
}

impl fmt::Display for HeldBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeldBack::Concurrency { key, running, limit } => write!(f, "pipeline {key}: {running} of {limit} running"),
            HeldBack::Pool { name, in_use, slots: Some(slots) } => {
                write!(f, "pool {name}: {in_use} of {slots} slots in use")
            }
            HeldBack::Pool { name, slots: None, .. } => write!(
                f,
                "pool {name} is not defined on the server (start it with `shardline server --pool {name}=SLOTS`)"
            ),
        }
    }
}

/// A pool of run slots as stored, with the slots running runs hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolRow {
    pub name: String,
    pub slots: u32,
    pub in_use: u32,
}

/// A run to create.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRun {
    pub pipeline_id: i64,
    /// Submissions with the same key while a run with it is queued, running or succeeded return
    /// that run; after it failed or was cancelled, a new run is created (e.g. repo@sha + spec hash).
    pub dedupe_key: Option<String>,
    pub params: Value,
    /// The resolved spec this run executes, kept with the run.
    pub spec: Value,
    pub options: RunOptions,
    /// Webhooks told when the run finishes (the spec's `notify:`), in the run's creating
    /// transaction; the server-wide ones are added by the store when it finishes.
    pub notify: Vec<crate::NotifyTarget>,
    /// Who submits it (see [`RunRow::submitted_by`]).
    pub submitted_by: Option<String>,
}

/// A task to add to a run.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTask {
    /// Unique within the run.
    pub name: String,
    pub step_id: String,
    pub kind: String,
    /// Names of tasks of the same run this one waits for: earlier tasks or tasks of the same batch.
    pub needs: Vec<String>,
    pub resources: Resources,
    pub payload: Value,
    /// Attempts that may fail (an error or a timeout), the first included; at least 1.
    pub max_attempts: u32,
    /// Lost leases (the lease expired: the worker died, hung or lost the database) the task may
    /// have; the one that reaches it fails the task. At least 1; by default [`DEFAULT_MAX_LOST`].
    pub max_lost: u32,
    /// Base retry delay; retry n of a budget waits `backoff · 2^(n-1)` ± 20 %, capped at six
    /// hours (failures and lost leases are counted apart).
    pub backoff: Duration,
    /// How long one attempt may hold its lease in all, heartbeats included; zero for no limit.
    pub timeout: Duration,
    pub cache_key: Option<String>,
}

impl Default for NewTask {
    fn default() -> NewTask {
        NewTask {
            name: String::new(),
            step_id: String::new(),
            kind: String::new(),
            needs: Vec::new(),
            resources: Resources::default(),
            payload: Value::Null,
            max_attempts: 1,
            max_lost: DEFAULT_MAX_LOST,
            backoff: Duration::from_secs(10),
            timeout: Duration::ZERO,
            cache_key: None,
        }
    }
}

/// A worker to register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub name: String,
    pub cpus: u32,
    /// Bytes.
    pub memory: u64,
    /// GPU device indices.
    pub gpus: Vec<u32>,
    /// Bytes of local scratch disk.
    pub scratch: u64,
}

impl WorkerInfo {
    /// The worker's total resources (`gpus` counts the devices).
    pub fn resources(&self) -> Resources {
        Resources {
            cpus: self.cpus,
            memory: self.memory,
            gpus: u32::try_from(self.gpus.len()).unwrap_or(u32::MAX),
            scratch: self.scratch,
        }
    }
}

/// How a leased task ended, as its worker reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Succeeded {
        output: Value,
    },
    /// `retryable: false` fails the task at once, whatever attempts are left.
    Failed {
        error: String,
        retryable: bool,
    },
}

/// A task as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TaskRow {
    pub id: TaskId,
    pub run: RunId,
    pub name: String,
    pub step_id: String,
    pub kind: String,
    pub state: TaskState,
    pub priority: i64,
    pub resources: Resources,
    pub payload: Value,
    pub output: Option<Value>,
    pub progress: Option<Value>,
    /// Attempts started so far (1 during the first lease); never reset, so `(task, attempt)`
    /// names one attempt, its logs included.
    pub attempt: i32,
    /// Attempts started before the last `retry_run`; of the attempts since, the lost ones
    /// (`lost`) count against `max_lost` and the others against `max_attempts`.
    pub attempt_base: i32,
    pub max_attempts: i32,
    pub max_lost: i32,
    /// Lost leases since the last `retry_run`.
    pub lost: i32,
    pub backoff: Duration,
    pub timeout: Duration,
    pub ready_at: Option<DateTime<Utc>>,
    pub lease_owner: Option<WorkerId>,
    /// The fencing token of the latest lease (0 before the first).
    pub lease_token: i64,
    pub leased_at: Option<DateTime<Utc>>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub heartbeat_at: Option<DateTime<Utc>>,
    pub cache_key: Option<String>,
    /// The latest error: of the last failed attempt while retrying, the final one when failed.
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl TaskRow {
    /// Attempts counted against `max_attempts` since the last `retry_run`: those that failed,
    /// and the running one.
    pub fn attempts_used(&self) -> i32 {
        self.attempt - self.attempt_base - self.lost
    }
}

/// A granted lease: the task, and the fencing token every later call must carry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lease {
    pub task: TaskRow,
    pub worker: WorkerId,
    /// Strictly increasing across all leases of this task.
    pub token: i64,
    /// By the database clock, at grant time; `heartbeat` extends it.
    pub expires_at: DateTime<Utc>,
}

/// Task counts of a run by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TaskCounts {
    pub blocked: i64,
    pub ready: i64,
    pub leased: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub cancelled: i64,
}

impl TaskCounts {
    pub fn total(&self) -> i64 {
        self.blocked + self.ready + self.leased + self.succeeded + self.failed + self.cancelled
    }

    pub(crate) fn add(&mut self, state: TaskState, n: i64) {
        match state {
            TaskState::Blocked => self.blocked += n,
            TaskState::Ready => self.ready += n,
            TaskState::Leased => self.leased += n,
            TaskState::Succeeded => self.succeeded += n,
            TaskState::Failed => self.failed += n,
            TaskState::Cancelled => self.cancelled += n,
        }
    }
}

/// A run as stored, with its task counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunRow {
    pub id: RunId,
    pub pipeline_id: i64,
    pub pipeline_name: String,
    pub state: RunState,
    pub params: Value,
    pub spec: Value,
    pub options: RunOptions,
    pub plan: Option<Value>,
    pub dedupe_key: Option<String>,
    /// Why it failed ("task `x` failed after 3 attempts: …") or "cancelled".
    pub error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub tasks: TaskCounts,
    /// Who submitted it (`token:<name>`, `user:<login>@<host>`, `trigger:<pipeline>#<n>`);
    /// absent for runs made before submitters were recorded, or directly through the store.
    pub submitted_by: Option<String>,
    /// Who cancelled or retried it and when, oldest first.
    pub actions: Vec<RunAction>,
}

state_enum!(
    /// What was done to a run by someone other than its workers.
    RunActionKind {
        Cancel = "cancel",
        Retry = "retry",
    }
);

/// A cancel or retry of a run: what, by whom, when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAction {
    pub action: RunActionKind,
    pub actor: String,
    pub at: DateTime<Utc>,
}

/// Which runs `list_runs` returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunFilter {
    pub state: Option<RunState>,
    /// Pipeline name (all versions of it).
    pub pipeline: Option<String>,
}

/// A page of a newest-first listing: at most `limit` rows with ids below `before`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    pub limit: i64,
    pub before: Option<RunId>,
}

impl Default for Page {
    fn default() -> Page {
        Page { limit: 50, before: None }
    }
}

/// One page of runs, newest first; `next` is the `before` cursor of the following page.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunPage {
    pub runs: Vec<RunRow>,
    pub next: Option<RunId>,
}

/// An edge of a run's task graph: `task` waits for `needs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct TaskDep {
    pub task: TaskId,
    pub needs: TaskId,
}

/// One lease of a task, from grant to end.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRow {
    pub task: TaskId,
    pub run: RunId,
    pub attempt: i32,
    pub token: i64,
    /// None when the worker row has since been removed.
    pub worker: Option<WorkerId>,
    pub worker_name: String,
    pub started_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    /// None while the lease is held.
    pub outcome: Option<AttemptOutcome>,
    /// The budget it drew on: `error` (failed, timed out) or `lost` (lease expired); None while
    /// it runs and when it succeeded or was cancelled.
    pub kind: Option<AttemptKind>,
    pub error: Option<String>,
}

/// A registered worker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerRow {
    pub id: WorkerId,
    pub name: String,
    pub resources: Resources,
    pub gpus: Vec<u32>,
    pub state: WorkerState,
    pub registered_at: DateTime<Utc>,
    pub last_heartbeat: DateTime<Utc>,
    /// What it last measured of its disk; `None` until it reports (or for an older worker).
    pub disk: Option<crate::WorkerDisk>,
}

/// A line of task output to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub ts: DateTime<Utc>,
    pub stream: LogStream,
    pub line: String,
}

/// A stored log line; `id` increases in insertion order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogRow {
    pub id: i64,
    pub task: TaskId,
    pub run: RunId,
    pub attempt: i32,
    pub ts: DateTime<Utc>,
    pub stream: LogStream,
    pub line: String,
}

/// Whose log lines `logs` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFilter {
    /// Every attempt of a task.
    Task(TaskId),
    /// One attempt of a task.
    Attempt(TaskId, i32),
    /// Every task of a run.
    Run(RunId),
}

/// What an event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Change {
    /// The run entered `state`.
    Run { state: RunState },
    /// A task entered `state` (`attempt` is the task's attempt count then).
    Task { task: TaskId, state: TaskState, attempt: i32 },
}

/// A state change. `id`s increase strictly in the order readers see events, and a reader that
/// passes the last id it saw to `events_after` never misses one.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub run: RunId,
    pub change: Change,
    /// The error of a failure, the reason of a cancel, the retry delay.
    pub message: Option<String>,
}
