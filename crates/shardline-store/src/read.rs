//! Reads for the dashboard and the CLI, logs, events and the step cache.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::db::{args, sql, Conn};
use crate::error::{Result, StoreError};
use crate::records::*;
use crate::types::*;
use crate::Store;

/// `logs` and `events_after` return at most this many rows per call.
pub const MAX_PAGE: i64 = 10_000;
/// Longer log lines are cut (and marked) when stored.
pub const MAX_LOG_LINE: usize = 64 * 1024;

/// Key of the transaction-scoped advisory lock serializing event publication (PostgreSQL).
const EVENTS_LOCK: i64 = 0x5348_4152_4450_0002;

impl Store {
    /// A run with its task counts.
    pub async fn get_run(&self, run: RunId) -> Result<Option<RunRow>, StoreError> {
        self.retrying("get_run", || async {
            let mut pc = self.pool().acquire().await?;
            let mut c = pc.conn();
            let rec: Option<RunRecord> = c
                .opt(
                    sql!(concat!(
                        "SELECT ",
                        run_cols!(),
                        " FROM runs r JOIN pipelines p ON p.id = r.pipeline_id WHERE r.id = $1"
                    )),
                    args![run.0],
                )
                .await?;
            match rec {
                Some(rec) => {
                    let mut counts = counts(&mut c, &[run.0]).await?;
                    let tasks = counts.remove(&run.0).unwrap_or_default();
                    let actions = crate::audit::actions(&mut c, &[run.0]).await?.remove(&run.0).unwrap_or_default();
                    Ok(Some(rec.into_row(tasks, actions)?))
                }
                None => Ok(None),
            }
        })
        .await
    }

    /// Runs, newest first, filtered by state and pipeline name; one page at a time.
    pub async fn list_runs(&self, filter: &RunFilter, page: Page) -> Result<RunPage, StoreError> {
        let limit = page.limit.clamp(1, 1000);
        self.retrying("list_runs", || async {
            let mut pc = self.pool().acquire().await?;
            let mut c = pc.conn();
            let recs: Vec<RunRecord> = c
                .all(
                    sql!(concat!(
                        "SELECT ",
                        run_cols!(),
                        " FROM runs r JOIN pipelines p ON p.id = r.pipeline_id \
                         WHERE ($1 IS NULL OR r.state = $1) AND ($2 IS NULL OR p.name = $2) \
                           AND ($3 IS NULL OR r.id < $3) \
                         ORDER BY r.id DESC LIMIT $4"
                    )),
                    args![
                        filter.state.map(|s| s.as_str().to_string()),
                        filter.pipeline.clone(),
                        page.before.map(|r| r.0),
                        limit + 1
                    ],
                )
                .await?;
            let more = recs.len() as i64 > limit;
            let ids: Vec<i64> = recs.iter().take(limit as usize).map(|r| r.id).collect();
            let mut counts = counts(&mut c, &ids).await?;
            let mut actions = crate::audit::actions(&mut c, &ids).await?;
            let mut runs = Vec::with_capacity(ids.len());
            for rec in recs.into_iter().take(limit as usize) {
                let tasks = counts.remove(&rec.id).unwrap_or_default();
                let acts = actions.remove(&rec.id).unwrap_or_default();
                runs.push(rec.into_row(tasks, acts)?);
            }
            let next = if more { runs.last().map(|r| r.id) } else { None };
            Ok(RunPage { runs, next })
        })
        .await
    }

    /// A run's tasks, by id.
    pub async fn run_tasks(&self, run: RunId) -> Result<Vec<TaskRow>, StoreError> {
        self.retrying("run_tasks", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<TaskRecord> = pc
                .conn()
                .all(sql!(concat!("SELECT ", task_cols!(), " FROM tasks WHERE run_id = $1 ORDER BY id")), args![run.0])
                .await?;
            recs.into_iter().map(TaskRecord::into_row).collect()
        })
        .await
    }

    /// One task.
    pub async fn task(&self, id: TaskId) -> Result<Option<TaskRow>, StoreError> {
        self.retrying("task", || async {
            let mut pc = self.pool().acquire().await?;
            let rec: Option<TaskRecord> =
                pc.conn().opt(sql!(concat!("SELECT ", task_cols!(), " FROM tasks WHERE id = $1")), args![id.0]).await?;
            rec.map(TaskRecord::into_row).transpose()
        })
        .await
    }

    /// The edges of a run's task graph.
    pub async fn run_deps(&self, run: RunId) -> Result<Vec<TaskDep>, StoreError> {
        self.retrying("run_deps", || async {
            let mut pc = self.pool().acquire().await?;
            let rows: Vec<(i64, i64)> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT d.task_id, d.needs_id FROM task_deps d JOIN tasks t ON t.id = d.task_id \
                         WHERE t.run_id = $1 ORDER BY d.task_id, d.needs_id"
                    ),
                    args![run.0],
                )
                .await?;
            Ok(rows.into_iter().map(|(t, n)| TaskDep { task: TaskId(t), needs: TaskId(n) }).collect())
        })
        .await
    }

    /// Every lease of a task, oldest first.
    pub async fn task_attempts(&self, task: TaskId) -> Result<Vec<AttemptRow>, StoreError> {
        self.retrying("task_attempts", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<AttemptRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT task_id, run_id, attempt, token, worker_id, worker_name, started_at, \
                         ended_at, outcome, kind, error FROM attempts WHERE task_id = $1 ORDER BY token"
                    ),
                    args![task.0],
                )
                .await?;
            recs.into_iter().map(AttemptRecord::into_row).collect()
        })
        .await
    }

    /// Every lease of every task of a run, by task and then oldest first.
    pub async fn run_attempts(&self, run: RunId) -> Result<Vec<AttemptRow>, StoreError> {
        self.retrying("run_attempts", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<AttemptRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT task_id, run_id, attempt, token, worker_id, worker_name, started_at, \
                         ended_at, outcome, kind, error FROM attempts WHERE run_id = $1 ORDER BY task_id, token"
                    ),
                    args![run.0],
                )
                .await?;
            recs.into_iter().map(AttemptRecord::into_row).collect()
        })
        .await
    }

    /// Registered workers, by id.
    pub async fn list_workers(&self) -> Result<Vec<WorkerRow>, StoreError> {
        self.retrying("list_workers", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<WorkerRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT id, name, resources, gpus, state, registered_at, last_heartbeat, disk_free, \
                             disk_total, scratch_free \
                         FROM workers ORDER BY id"
                    ),
                    args![],
                )
                .await?;
            recs.into_iter().map(WorkerRecord::into_row).collect()
        })
        .await
    }

    /// Stores lines of an attempt's output. Logs belong to the task, not to the worker: they
    /// stay when the worker is gone. NUL bytes become U+FFFD; lines longer than
    /// [`MAX_LOG_LINE`] bytes are cut.
    pub async fn append_logs(&self, task: TaskId, attempt: i32, lines: &[LogLine]) -> Result<(), StoreError> {
        if lines.is_empty() {
            return Ok(());
        }
        let chunks: Vec<Value> = lines
            .chunks(1000)
            .map(|chunk| {
                Value::Array(
                    chunk
                        .iter()
                        .map(|l| {
                            json!({
                                "ts": l.ts.timestamp_millis(),
                                "stream": l.stream.as_str(),
                                "line": clean_line(&l.line),
                            })
                        })
                        .collect(),
                )
            })
            .collect();
        self.retrying_conflicts("append_logs", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                for chunk in &chunks {
                    let n = c
                        .exec(
                            sql!(
                                pg: "INSERT INTO logs (task_id, run_id, attempt, ts, stream, line) \
                                     SELECT $1, t.run_id, $2, to_timestamp((x.v ->> 'ts')::bigint / 1000.0), \
                                         x.v ->> 'stream', x.v ->> 'line' \
                                     FROM tasks t, jsonb_array_elements($3) WITH ORDINALITY AS x(v, ord) \
                                     WHERE t.id = $1 ORDER BY x.ord",
                                lite: "INSERT INTO logs (task_id, run_id, attempt, ts, stream, line) \
                                       SELECT $1, t.run_id, $2, value ->> '$.ts', value ->> '$.stream', value ->> '$.line' \
                                       FROM tasks t, json_each($3) WHERE t.id = $1 ORDER BY key"
                            ),
                            args![task.0, i64::from(attempt), chunk.clone()],
                        )
                        .await?;
                    if n == 0 {
                        return Err(StoreError::TaskNotFound(task));
                    }
                }
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// Log lines after `after_id` (0 for the first), oldest first, at most `limit`
    /// (capped at [`MAX_PAGE`]). Tail a task by passing the last id seen.
    pub async fn logs(&self, filter: LogFilter, after_id: i64, limit: i64) -> Result<Vec<LogRow>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        self.retrying("logs", || async {
            let mut pc = self.pool().acquire().await?;
            let mut c = pc.conn();
            let recs: Vec<LogRecord> = match filter {
                LogFilter::Task(t) => {
                    c.all(
                        sql!(
                            "SELECT id, task_id, run_id, attempt, ts, stream, line FROM logs \
                             WHERE task_id = $1 AND id > $2 ORDER BY id LIMIT $3"
                        ),
                        args![t.0, after_id, limit],
                    )
                    .await?
                }
                LogFilter::Attempt(t, attempt) => {
                    c.all(
                        sql!(
                            "SELECT id, task_id, run_id, attempt, ts, stream, line FROM logs \
                             WHERE task_id = $1 AND attempt = $2 AND id > $3 ORDER BY id LIMIT $4"
                        ),
                        args![t.0, i64::from(attempt), after_id, limit],
                    )
                    .await?
                }
                LogFilter::Run(r) => {
                    c.all(
                        sql!(
                            "SELECT id, task_id, run_id, attempt, ts, stream, line FROM logs \
                             WHERE run_id = $1 AND id > $2 ORDER BY id LIMIT $3"
                        ),
                        args![r.0, after_id, limit],
                    )
                    .await?
                }
            };
            recs.into_iter().map(LogRecord::into_row).collect()
        })
        .await
    }

    /// State changes with ids above `after_id`, in id order, at most `limit` (capped at
    /// [`MAX_PAGE`]). A follower passing the last id it saw misses nothing, even of
    /// transactions that commit out of order, and sees the events of one task or run in the
    /// order they happened.
    ///
    /// On PostgreSQL an event gets its id here, when it is first read after its transaction
    /// committed (before, it is invisible to every reader); on SQLite, at insert (writers are
    /// serialized, so insertion order is commit order).
    pub async fn events_after(&self, after_id: i64, limit: i64) -> Result<Vec<EventRow>, StoreError> {
        let limit = limit.clamp(1, MAX_PAGE);
        self.retrying("events_after", || async {
            if self.backend() == Backend::Postgres {
                publish_events(self).await?;
            }
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<EventRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT id, run_id, task_id, state, attempt, message, created_at FROM events \
                         WHERE id > $1 ORDER BY id LIMIT $2"
                    ),
                    args![after_id, limit],
                )
                .await?;
            recs.into_iter().map(EventRecord::into_row).collect()
        })
        .await
    }
}

/// Gives ids to committed events that have none, in insertion order, after the highest id
/// given so far; one publisher at a time, so ids grow in publication order.
pub(crate) async fn publish_events(store: &Store) -> Result<()> {
    let mut pc = store.pool().acquire().await?;
    let pending: Option<(i64,)> =
        pc.conn().opt(sql!("SELECT seq FROM events WHERE id IS NULL LIMIT 1"), args![]).await?;
    if pending.is_none() {
        return Ok(());
    }
    let mut tx = pc.begin().await?;
    let result = async {
        let mut c = tx.conn();
        c.exec(sql!("SELECT pg_advisory_xact_lock($1)"), args![EVENTS_LOCK]).await?;
        // A fresh statement, so its snapshot sees the previous publisher's commit.
        c.exec(
            sql!(
                "WITH pending AS ( \
                     SELECT seq FROM events WHERE id IS NULL ORDER BY seq LIMIT 10000), \
                 numbered AS ( \
                     SELECT seq, (SELECT COALESCE(max(id), 0) FROM events) \
                         + row_number() OVER (ORDER BY seq) AS new_id FROM pending) \
                 UPDATE events e SET id = n.new_id FROM numbered n WHERE e.seq = n.seq"
            ),
            args![],
        )
        .await?;
        Ok(())
    }
    .await;
    tx.finish(result).await
}

async fn counts(c: &mut Conn<'_>, runs: &[i64]) -> Result<HashMap<i64, TaskCounts>> {
    let mut out: HashMap<i64, TaskCounts> = HashMap::new();
    if runs.is_empty() {
        return Ok(out);
    }
    let rows: Vec<(i64, String, i64)> = c
        .all(
            sql!(
                "SELECT run_id, state, count(*) FROM tasks WHERE run_id IN {ids:$1} \
                 GROUP BY run_id, state"
            ),
            args![json!(runs)],
        )
        .await?;
    for (run, state, n) in rows {
        let state: TaskState = parse("tasks", &state)?;
        out.entry(run).or_default().add(state, n);
    }
    Ok(out)
}

fn clean_line(line: &str) -> String {
    if line.len() <= MAX_LOG_LINE && !line.contains('\0') {
        return line.to_string();
    }
    let mut s = line.replace('\0', "\u{FFFD}");
    if s.len() > MAX_LOG_LINE {
        let mut cut = MAX_LOG_LINE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str(" … (line truncated)");
    }
    s
}
