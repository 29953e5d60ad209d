//! The store's one error type.

use crate::types::{Backend, RunId, RunState, TaskId, TaskState, WorkerId};

/// Everything a [`Store`](crate::Store) call can fail with.
///
/// Database errors carry the operation that failed (`claim`, `add_tasks`, …). Domain errors name
/// the run, task or worker, and say what state it was in.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The URL names no backend we know.
    #[error("unsupported job store URL `{0}` (expected `postgres://…`, `sqlite://PATH` or `sqlite::memory:`)")]
    UnsupportedUrl(String),
    /// The database could not be reached or opened.
    #[error("cannot connect to the {backend} job store at `{url}`: {source}")]
    Connect {
        backend: Backend,
        /// The URL with any password replaced by `***`.
        url: String,
        #[source]
        source: sqlx::Error,
    },
    /// Applying the embedded migrations failed.
    #[error("cannot migrate the {backend} job store: {source}")]
    Migrate {
        backend: Backend,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    /// Another process held the store's migration lock (it was creating or migrating the store,
    /// or hangs doing so) for longer than [`StoreOptions::migrate_wait`](crate::StoreOptions).
    #[error(
        "gave up after {} waiting for another process to create or migrate the {backend} job store at `{url}` \
         (it holds the {holder}); if no other shardline process is starting, find the one that holds it",
        shardline_units::format_duration_human(*waited)
    )]
    MigrationLocked {
        backend: Backend,
        /// The URL with any password replaced by `***`.
        url: String,
        /// What is held: the lock file or the advisory lock.
        holder: String,
        waited: std::time::Duration,
    },
    /// A query failed; `op` is the store operation that issued it.
    #[error("job store `{op}` failed: {source}")]
    Database {
        op: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("pipeline {0} not found")]
    PipelineNotFound(i64),
    #[error("run {0} not found")]
    RunNotFound(RunId),
    #[error("task {0} not found")]
    TaskNotFound(TaskId),
    #[error("worker {0} not found (register it first)")]
    WorkerNotFound(WorkerId),
    /// The run is finished (or not) where the operation needs the opposite.
    #[error("run {run} is {state}; {action}")]
    RunState { run: RunId, state: RunState, action: &'static str },
    /// A task is in a state that does not allow the operation.
    #[error("task `{name}` of run {run} is {state}; {action}")]
    TaskState { run: RunId, name: String, state: TaskState, action: &'static str },
    /// A batch of new tasks (or new edges) is invalid; every problem found is listed.
    #[error("invalid tasks for run {run}: {}", problems.join("; "))]
    InvalidTasks { run: RunId, problems: Vec<String> },
    /// `retry_run` named a step the run has no task of.
    #[error("run {run} has no step `{step}` (known steps: {})", known.join(", "))]
    UnknownStep { run: RunId, step: String, known: Vec<String> },
    /// Putting a run back to running would give it a dedupe key that a live run already holds.
    #[error("run {run} cannot be retried: run {holder} already holds its dedupe key `{key}` (hint: retry or cancel run {holder} instead)")]
    DedupeConflict { run: RunId, holder: RunId, key: String },
    /// `create_run` of a run whose pipeline is at its concurrency limit with `overflow: skip`:
    /// no run was created ([`Store::admit_run`](crate::Store::admit_run) says so without an error).
    #[error(transparent)]
    Skipped(#[from] crate::types::Skipped),
    /// An argument is out of the range the store can represent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A row holds a value the store does not understand (a state string, a negative size, …).
    #[error("corrupt row in `{table}`: {detail}")]
    Corrupt { table: &'static str, detail: String },
}

impl StoreError {
    /// Whether retrying the same call later may succeed: lost connections, a database restarting
    /// or shutting down, pool exhaustion, deadlocks, serialization failures, a busy SQLite file.
    ///
    /// `complete` and `heartbeat` are safe to retry (a retried `complete` whose first attempt did
    /// commit returns `true`); a `claim` whose commit was lost leaves a lease that expires and is
    /// retried by the reaper.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Connect { source, .. } | StoreError::Database { source, .. } => is_transient_sqlx(source),
            _ => false,
        }
    }

    pub(crate) fn op(self, op: &'static str) -> StoreError {
        match self {
            StoreError::Database { op: "", source } => StoreError::Database { op, source },
            other => other,
        }
    }

    /// The connection died under the call (server restart, network): the statement may or may
    /// not have run.
    pub(crate) fn is_connection_lost(&self) -> bool {
        match self {
            StoreError::Database { source, .. } => match source {
                sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Database(db) => {
                    db.code().is_some_and(|c| c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02" | "57P03"))
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// A conflict the database resolved by rolling our transaction back: safe to run it again.
    pub(crate) fn is_rollback_conflict(&self) -> bool {
        match self {
            StoreError::Database { source, .. } => match source.as_database_error() {
                Some(db) => matches!(
                    db.code().as_deref(),
                    // serialization_failure, deadlock_detected; SQLITE_BUSY, SQLITE_LOCKED (+ extended codes)
                    Some("40001" | "40P01" | "5" | "6" | "261" | "262" | "517")
                ),
                None => false,
            },
            _ => false,
        }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(source: sqlx::Error) -> StoreError {
        StoreError::Database { op: "", source }
    }
}

fn is_transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some(code) => {
                code.starts_with("08") // connection exception
                    || code.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
                    || code == "53300" // too many connections
                    || code == "40001"
                    || code == "40P01"
                    || matches!(code, "5" | "6" | "261" | "262" | "517")
            }
            None => false,
        },
        _ => false,
    }
}

pub(crate) type Result<T, E = StoreError> = std::result::Result<T, E>;
