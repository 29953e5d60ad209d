//! Rows as both backends return them, and their checked conversion to the public types.
//! A value the store cannot understand becomes `StoreError::Corrupt`, never a panic.

use std::str::FromStr;
use std::time::Duration;

use serde_json::Value;
use sqlx::types::Json;

use crate::db::DbTime;
use crate::error::{Result, StoreError};
use crate::types::*;

/// The columns of `tasks` that [`TaskRecord`] reads.
macro_rules! task_cols {
    () => {
        "id, run_id, name, step_id, kind, state, priority, cpus, memory, gpus, scratch, payload, \
         output, progress, attempt, attempt_base, max_attempts, max_lost, lost, backoff_ms, timeout_ms, \
         ready_at, lease_owner, lease_token, leased_at, lease_expires_at, heartbeat_at, cache_key, error, \
         created_at, finished_at"
    };
}
pub(crate) use task_cols;

#[derive(sqlx::FromRow)]
pub(crate) struct TaskRecord {
    id: i64,
    run_id: i64,
    name: String,
    step_id: String,
    kind: String,
    state: String,
    priority: i64,
    cpus: i64,
    memory: i64,
    gpus: i64,
    scratch: i64,
    payload: Json<Value>,
    output: Option<Json<Value>>,
    progress: Option<Json<Value>>,
    attempt: i64,
    attempt_base: i64,
    max_attempts: i64,
    max_lost: i64,
    lost: i64,
    backoff_ms: i64,
    timeout_ms: i64,
    ready_at: Option<DbTime>,
    lease_owner: Option<i64>,
    lease_token: i64,
    leased_at: Option<DbTime>,
    lease_expires_at: Option<DbTime>,
    heartbeat_at: Option<DbTime>,
    cache_key: Option<String>,
    error: Option<String>,
    created_at: DbTime,
    finished_at: Option<DbTime>,
}

pub(crate) fn parse<T: FromStr<Err = String>>(table: &'static str, s: &str) -> Result<T> {
    s.parse().map_err(|detail| StoreError::Corrupt { table, detail })
}

fn int<T: TryFrom<i64>>(table: &'static str, column: &str, v: i64) -> Result<T> {
    T::try_from(v).map_err(|_| StoreError::Corrupt { table, detail: format!("`{column}` = {v} is out of range") })
}

fn millis(table: &'static str, column: &str, v: i64) -> Result<Duration> {
    Ok(Duration::from_millis(int::<u64>(table, column, v)?))
}

impl TaskRecord {
    /// (id, run, token, attempt) of a freshly leased row.
    pub(crate) fn lease_ids(&self) -> (i64, i64, i64, i64) {
        (self.id, self.run_id, self.lease_token, self.attempt)
    }

    pub(crate) fn into_row(self) -> Result<TaskRow> {
        const T: &str = "tasks";
        Ok(TaskRow {
            id: TaskId(self.id),
            run: RunId(self.run_id),
            name: self.name,
            step_id: self.step_id,
            kind: self.kind,
            state: parse(T, &self.state)?,
            priority: self.priority,
            resources: Resources {
                cpus: int(T, "cpus", self.cpus)?,
                memory: int(T, "memory", self.memory)?,
                gpus: int(T, "gpus", self.gpus)?,
                scratch: int(T, "scratch", self.scratch)?,
            },
            payload: self.payload.0,
            output: self.output.map(|j| j.0),
            progress: self.progress.map(|j| j.0),
            attempt: int(T, "attempt", self.attempt)?,
            attempt_base: int(T, "attempt_base", self.attempt_base)?,
            max_attempts: int(T, "max_attempts", self.max_attempts)?,
            max_lost: int(T, "max_lost", self.max_lost)?,
            lost: int(T, "lost", self.lost)?,
            backoff: millis(T, "backoff_ms", self.backoff_ms)?,
            timeout: millis(T, "timeout_ms", self.timeout_ms)?,
            ready_at: self.ready_at.map(|t| t.0),
            lease_owner: self.lease_owner.map(WorkerId),
            lease_token: self.lease_token,
            leased_at: self.leased_at.map(|t| t.0),
            lease_expires_at: self.lease_expires_at.map(|t| t.0),
            heartbeat_at: self.heartbeat_at.map(|t| t.0),
            cache_key: self.cache_key,
            error: self.error,
            created_at: self.created_at.0,
            finished_at: self.finished_at.map(|t| t.0),
        })
    }
}

macro_rules! run_cols {
    () => {
        "r.id, r.pipeline_id, p.name AS pipeline_name, r.state, r.params, r.spec, r.name, r.no_cache, \
         r.plan, r.dedupe_key, r.error, r.created_at, r.started_at, r.finished_at, r.priority, \
         r.concurrency_key, r.concurrency_limit, r.concurrency_overflow, r.pool, r.submitted_by, r.retain_ms"
    };
}
pub(crate) use run_cols;

#[derive(sqlx::FromRow)]
pub(crate) struct RunRecord {
    pub(crate) id: i64,
    pipeline_id: i64,
    pipeline_name: String,
    state: String,
    params: Json<Value>,
    spec: Json<Value>,
    name: Option<String>,
    no_cache: bool,
    plan: Option<Json<Value>>,
    dedupe_key: Option<String>,
    error: Option<String>,
    created_at: DbTime,
    started_at: Option<DbTime>,
    finished_at: Option<DbTime>,
    priority: i64,
    concurrency_key: Option<String>,
    concurrency_limit: Option<i64>,
    concurrency_overflow: Option<String>,
    pool: Option<String>,
    submitted_by: Option<String>,
    retain_ms: Option<i64>,
}

impl RunRecord {
    pub(crate) fn into_row(self, tasks: TaskCounts, actions: Vec<RunAction>) -> Result<RunRow> {
        Ok(RunRow {
            id: RunId(self.id),
            pipeline_id: self.pipeline_id,
            pipeline_name: self.pipeline_name,
            state: parse("runs", &self.state)?,
            params: self.params.0,
            spec: self.spec.0,
            options: RunOptions {
                name: self.name,
                no_cache: self.no_cache,
                priority: self.priority,
                concurrency: match (self.concurrency_key, self.concurrency_limit) {
                    (Some(key), Some(limit)) => Some(Concurrency {
                        key,
                        limit: u32::try_from(limit).map_err(|_| StoreError::Corrupt {
                            table: "runs",
                            detail: format!("concurrency_limit {limit}"),
                        })?,
                        overflow: self
                            .concurrency_overflow
                            .as_deref()
                            .map(|o| parse("runs", o))
                            .transpose()?
                            .unwrap_or(Overflow::Queue),
                    }),
                    _ => None,
                },
                pool: self.pool,
                retention: self.retain_ms.map(|ms| millis("runs", "retain_ms", ms)).transpose()?,
            },
            plan: self.plan.map(|j| j.0),
            dedupe_key: self.dedupe_key,
            error: self.error,
            created_at: self.created_at.0,
            started_at: self.started_at.map(|t| t.0),
            finished_at: self.finished_at.map(|t| t.0),
            tasks,
            submitted_by: self.submitted_by,
            actions,
        })
    }
}

/// A row of `run_actions`.
#[derive(sqlx::FromRow)]
pub(crate) struct RunActionRecord {
    pub(crate) run_id: i64,
    action: String,
    actor: String,
    at: DbTime,
}

impl RunActionRecord {
    pub(crate) fn into_action(self) -> Result<RunAction> {
        Ok(RunAction { action: parse("run_actions", &self.action)?, actor: self.actor, at: self.at.0 })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct AttemptRecord {
    task_id: i64,
    run_id: i64,
    attempt: i64,
    token: i64,
    worker_id: Option<i64>,
    worker_name: String,
    started_at: DbTime,
    ended_at: Option<DbTime>,
    outcome: Option<String>,
    kind: Option<String>,
    error: Option<String>,
}

impl AttemptRecord {
    pub(crate) fn into_row(self) -> Result<AttemptRow> {
        Ok(AttemptRow {
            task: TaskId(self.task_id),
            run: RunId(self.run_id),
            attempt: int("attempts", "attempt", self.attempt)?,
            token: self.token,
            worker: self.worker_id.map(WorkerId),
            worker_name: self.worker_name,
            started_at: self.started_at.0,
            ended_at: self.ended_at.map(|t| t.0),
            outcome: self.outcome.as_deref().map(|s| parse("attempts", s)).transpose()?,
            kind: self.kind.as_deref().map(|s| parse("attempts", s)).transpose()?,
            error: self.error,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct WorkerRecord {
    id: i64,
    name: String,
    resources: Json<Value>,
    gpus: Json<Value>,
    state: String,
    registered_at: DbTime,
    last_heartbeat: DbTime,
    disk_free: Option<i64>,
    disk_total: Option<i64>,
    scratch_free: Option<i64>,
}

impl WorkerRecord {
    pub(crate) fn into_row(self) -> Result<WorkerRow> {
        let corrupt = |detail: String| StoreError::Corrupt { table: "workers", detail };
        let resources: Resources = serde_json::from_value(self.resources.0)
            .map_err(|e| corrupt(format!("`resources` of worker {}: {e}", self.id)))?;
        let gpus: Vec<u32> =
            serde_json::from_value(self.gpus.0).map_err(|e| corrupt(format!("`gpus` of worker {}: {e}", self.id)))?;
        Ok(WorkerRow {
            id: WorkerId(self.id),
            name: self.name,
            resources,
            gpus,
            state: parse("workers", &self.state)?,
            registered_at: self.registered_at.0,
            last_heartbeat: self.last_heartbeat.0,
            disk: crate::WorkerDisk::from_columns(self.disk_free, self.disk_total, self.scratch_free),
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct LogRecord {
    id: i64,
    task_id: i64,
    run_id: i64,
    attempt: i64,
    ts: DbTime,
    stream: String,
    line: String,
}

impl LogRecord {
    pub(crate) fn into_row(self) -> Result<LogRow> {
        Ok(LogRow {
            id: self.id,
            task: TaskId(self.task_id),
            run: RunId(self.run_id),
            attempt: int("logs", "attempt", self.attempt)?,
            ts: self.ts.0,
            stream: parse("logs", &self.stream)?,
            line: self.line,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct EventRecord {
    id: i64,
    run_id: i64,
    task_id: Option<i64>,
    state: String,
    attempt: Option<i64>,
    message: Option<String>,
    created_at: DbTime,
}

impl EventRecord {
    pub(crate) fn into_row(self) -> Result<EventRow> {
        const T: &str = "events";
        let change = match self.task_id {
            None => Change::Run { state: parse(T, &self.state)? },
            Some(task) => Change::Task {
                task: TaskId(task),
                state: parse(T, &self.state)?,
                attempt: int(T, "attempt", self.attempt.unwrap_or(0))?,
            },
        };
        Ok(EventRow { id: self.id, at: self.created_at.0, run: RunId(self.run_id), change, message: self.message })
    }
}
