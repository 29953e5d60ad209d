//! What the metrics endpoint reads: how many runs, tasks and workers are in each state now, and
//! the attempts that ended in a window of time (for counters and histograms that every server
//! derives from the same rows, so they agree across servers and survive restarts).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::types::Json;

use crate::db::{args, sql, DbTime};
use crate::error::StoreError;
use crate::records::parse;
use crate::types::{AttemptOutcome, RunState, TaskId, TaskState};
use crate::Store;

/// Counts of the job state at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateCounts {
    /// Runs by state (states with no run are absent).
    pub runs: Vec<(RunState, i64)>,
    /// Tasks by step kind and state (pairs with no task are absent).
    pub tasks: Vec<(String, TaskState, i64)>,
    /// Ready tasks whose backoff has passed: what workers could claim now.
    pub claimable: i64,
    /// When the oldest claimable task became ready.
    pub oldest_claimable: Option<DateTime<Utc>>,
    /// The database's clock when counted (ages are measured against it).
    pub now: DateTime<Utc>,
}

/// One ended attempt, as the metrics see it.
#[derive(Debug, Clone, PartialEq)]
pub struct EndedAttempt {
    pub task: TaskId,
    pub token: i64,
    /// The step kind of its task (`megatron.shard`, …).
    pub step_kind: String,
    pub outcome: AttemptOutcome,
    /// When the task became claimable for this attempt (`None` for attempts recorded before
    /// that was kept).
    pub ready_at: Option<DateTime<Utc>>,
    pub started_at: DateTime<Utc>,
    pub ended_at: DateTime<Utc>,
    /// Whether another attempt followed (or is waiting for its backoff): a retry.
    pub retried: bool,
    /// The task's output, for attempts that succeeded.
    pub output: Option<Value>,
}

/// Ended attempts of a window, one page at a time (see [`Store::ended_attempts`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndedPage {
    pub attempts: Vec<EndedAttempt>,
    /// Where the next page starts: pass it back as `after`; `None` when the window is done.
    pub next: Option<EndedCursor>,
}

/// A position in the order of ended attempts: (end time, task, token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedCursor {
    pub ended_at: DateTime<Utc>,
    pub task: TaskId,
    pub token: i64,
}

type EndedRecord = (i64, i64, String, String, Option<DbTime>, DbTime, DbTime, bool, Option<Json<Value>>);

impl Store {
    /// Counts runs and tasks by state, and the claimable queue, in one snapshot per table.
    pub async fn state_counts(&self) -> Result<StateCounts, StoreError> {
        self.retrying("state_counts", || async {
            let mut pc = self.pool().acquire().await?;
            let mut c = pc.conn();
            let (now,): (DbTime,) = c.one(sql!("SELECT {now}"), args![]).await?;
            let runs: Vec<(String, i64)> =
                c.all(sql!("SELECT state, COUNT(*) FROM runs GROUP BY state ORDER BY state"), args![]).await?;
            let tasks: Vec<(String, String, i64)> = c
                .all(sql!("SELECT kind, state, COUNT(*) FROM tasks GROUP BY kind, state ORDER BY kind, state"), args![])
                .await?;
            let (claimable, oldest): (i64, Option<DbTime>) = c
                .one(
                    sql!("SELECT COUNT(*), MIN(ready_at) FROM tasks WHERE state = 'ready' AND ready_at <= $1"),
                    args![now.0],
                )
                .await?;
            Ok(StateCounts {
                runs: runs.into_iter().map(|(s, n)| Ok((parse("runs", &s)?, n))).collect::<Result<_, StoreError>>()?,
                tasks: tasks
                    .into_iter()
                    .map(|(k, s, n)| Ok((k, parse("tasks", &s)?, n)))
                    .collect::<Result<_, StoreError>>()?,
                claimable,
                oldest_claimable: oldest.map(|t| t.0),
                now: now.0,
            })
        })
        .await
    }

    /// The end of the window [`Store::ended_attempts`] may read now: the database's clock minus
    /// `lag`, so that an attempt whose transaction commits late (its `ended_at` is its
    /// transaction's time) is still counted in a later window.
    pub async fn metrics_horizon(&self, lag: std::time::Duration) -> Result<DateTime<Utc>, StoreError> {
        let lag_ms = i64::try_from(lag.as_millis()).unwrap_or(i64::MAX);
        self.retrying("metrics_horizon", || async {
            let mut pc = self.pool().acquire().await?;
            let (t,): (DbTime,) = pc.conn().one(sql!("SELECT {now} - {ms:$1}"), args![lag_ms]).await?;
            Ok(t.0)
        })
        .await
    }

    /// Attempts that ended after `from` and at or before `to`, in (end time, task, token)
    /// order, at most `limit` per page, starting after `after`.
    pub async fn ended_attempts(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        after: Option<EndedCursor>,
        limit: i64,
    ) -> Result<EndedPage, StoreError> {
        let limit = limit.clamp(1, 10_000);
        // Keyset paging: rows past the cursor's (ended_at, task, token).
        let (at, task, token) = match after {
            Some(c) => (c.ended_at, c.task.0, c.token),
            None => (from, i64::MAX, i64::MAX),
        };
        self.retrying("ended_attempts", || async {
            let mut pc = self.pool().acquire().await?;
            let rows: Vec<EndedRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT a.task_id, a.token, t.kind, a.outcome, a.ready_at, a.started_at, a.ended_at, \
                             (a.outcome <> 'succeeded' AND (t.attempt > a.attempt \
                                 OR t.state IN ('ready', 'leased', 'succeeded'))), \
                             CASE WHEN a.outcome = 'succeeded' THEN t.output END \
                         FROM attempts a JOIN tasks t ON t.id = a.task_id \
                         WHERE a.ended_at > $1 AND a.ended_at <= $2 \
                           AND (a.ended_at > $3 OR (a.ended_at = $3 AND (a.task_id > $4 \
                                OR (a.task_id = $4 AND a.token > $5)))) \
                         ORDER BY a.ended_at, a.task_id, a.token LIMIT $6"
                    ),
                    args![from, to, at, task, token, limit],
                )
                .await?;
            let full = rows.len() as i64 == limit;
            let attempts = rows
                .into_iter()
                .map(|(task, token, step_kind, outcome, ready_at, started_at, ended_at, retried, output)| {
                    Ok(EndedAttempt {
                        task: TaskId(task),
                        token,
                        step_kind,
                        outcome: parse("attempts", &outcome)?,
                        ready_at: ready_at.map(|t| t.0),
                        started_at: started_at.0,
                        ended_at: ended_at.0,
                        retried,
                        output: output.map(|j| j.0),
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            let next = if full {
                attempts.last().map(|a| EndedCursor { ended_at: a.ended_at, task: a.task, token: a.token })
            } else {
                None
            };
            Ok(EndedPage { attempts, next })
        })
        .await
    }
}
