//! Workers and leases: claim, heartbeat, complete, reap — every change after a claim is
//! guarded by the lease's fencing token.

use std::time::Duration;

use serde_json::{json, Value};
use shardline_backoff::Backoff;
use shardline_units::format_duration_human;

use crate::db::{args, sql, Conn, PoolConn};
use crate::disk::{set_scratch_needs, ScratchNeed};
use crate::error::{Result, StoreError};
use crate::records::{task_cols, TaskRecord};
use crate::runs::{fail_run, notify, run_event, task_events};
use crate::types::*;
use crate::Store;

/// No retry waits longer than this, whatever the backoff and attempt.
pub const MAX_BACKOFF: Duration = Duration::from_secs(6 * 3600);
/// `reap_expired` handles at most this many expired leases per call.
pub const REAP_BATCH: u64 = 1000;

/// Key of the transaction-scoped advisory lock that lets one reaper at a time work (PostgreSQL).
const REAPER_LOCK: i64 = 0x5348_4152_4450_0001;

impl Store {
    /// Registers a worker; its id goes with every claim.
    pub async fn register_worker(&self, w: WorkerInfo) -> Result<WorkerId, StoreError> {
        let resources = serde_json::to_value(w.resources()).unwrap_or(Value::Null);
        let gpus = json!(w.gpus);
        self.retrying_conflicts("register_worker", || async {
            let mut c = self.pool().acquire().await?;
            let (id,): (i64,) = c
                .conn()
                .one(
                    sql!("INSERT INTO workers (name, resources, gpus) VALUES ($1, $2, $3) RETURNING id"),
                    args![&w.name, &resources, &gpus],
                )
                .await?;
            Ok(WorkerId(id))
        })
        .await
    }

    /// Records that the worker is alive (and active again if it was stopped).
    pub async fn worker_heartbeat(&self, w: WorkerId) -> Result<(), StoreError> {
        self.retrying("worker_heartbeat", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(sql!("UPDATE workers SET last_heartbeat = {now}, state = 'active' WHERE id = $1"), args![w.0])
                .await?;
            if n == 0 {
                return Err(StoreError::WorkerNotFound(w));
            }
            Ok(())
        })
        .await
    }

    /// Marks a worker stopped (it claims nothing more until its next `worker_heartbeat`).
    /// Leases it still holds run out and are reaped as usual.
    pub async fn stop_worker(&self, w: WorkerId) -> Result<(), StoreError> {
        self.retrying("stop_worker", || async {
            let mut c = self.pool().acquire().await?;
            let n = c.conn().exec(sql!("UPDATE workers SET state = 'stopped' WHERE id = $1"), args![w.0]).await?;
            if n == 0 {
                return Err(StoreError::WorkerNotFound(w));
            }
            Ok(())
        })
        .await
    }

    /// Deletes a worker's row. Its attempts (with the worker's name) and its tasks' logs stay;
    /// leases it still holds run out and are reaped as usual. Returns false if it did not exist.
    pub async fn remove_worker(&self, w: WorkerId) -> Result<bool, StoreError> {
        self.retrying("remove_worker", || async {
            let mut c = self.pool().acquire().await?;
            let n = c.conn().exec(sql!("DELETE FROM workers WHERE id = $1"), args![w.0]).await?;
            Ok(n > 0)
        })
        .await
    }

    /// Leases the first ready task (by priority, then readiness time, then id) that fits into
    /// `free`, for `ttl` (or the task's timeout, if shorter). A task of a queued run is leased
    /// only if the run may start — fewer running runs of its pipeline than its concurrency
    /// limit, a free slot in its pool — and the run then holds both until it ends; on SQLite
    /// the check and the start are one serialized transaction, on PostgreSQL `claim_task`
    /// checks again under advisory locks on the pipeline and the pool. One short transaction; concurrent
    /// claimers skip each other's candidate rows instead of waiting. `None`: nothing fits now
    /// (then [`Store::wait_for_work`]).
    pub async fn claim(&self, w: WorkerId, free: &Resources, ttl: Duration) -> Result<Option<Lease>, StoreError> {
        self.mark_seen();
        let memory = i64::try_from(free.memory).unwrap_or(i64::MAX);
        let scratch = i64::try_from(free.scratch).unwrap_or(i64::MAX);
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        let a = args![w.0, i64::from(free.cpus), memory, i64::from(free.gpus), scratch, ttl_ms];
        self.retrying("claim", || async {
            let mut pc = self.pool().acquire().await?;
            let row: Option<TaskRecord> = if matches!(pc, PoolConn::Pg(_)) {
                // One statement, atomic on its own: no BEGIN/COMMIT round trips.
                let mut c = pc.conn();
                c.opt(
                    sql!(concat!(
                        "SELECT ",
                        task_cols!(),
                        " FROM claim_task($1, $2, $3, $4, $5, $6)"
                    )),
                    a.clone(),
                )
                .await
                .map_err(|e| {
                    if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("SLW01") {
                        StoreError::WorkerNotFound(w)
                    } else {
                        e.into()
                    }
                })?
            } else {
                let mut tx = pc.begin().await?;
                let mut c = tx.conn();
                {
                    let worker: Option<(String,)> =
                        c.opt(sql!("SELECT name FROM workers WHERE id = $1"), args![w.0]).await?;
                    let Some((worker_name,)) = worker else {
                        return Err(StoreError::WorkerNotFound(w));
                    };
                    let row: Option<TaskRecord> = c
                        .opt(
                            sql!(concat!(
                                "UPDATE tasks SET state = 'leased', attempt = attempt + 1, lease_owner = $1, \
                                     lease_token = lease_token + 1, leased_at = {now}, heartbeat_at = {now}, \
                                     progress = NULL, updated_at = {now}, \
                                     lease_expires_at = {now} + CASE WHEN timeout_ms > 0 AND timeout_ms < $6 \
                                         THEN timeout_ms ELSE $6 END \
                                 WHERE id = ( \
                                     SELECT t.id FROM tasks t JOIN runs r ON r.id = t.run_id \
                                     WHERE t.state = 'ready' AND t.ready_at <= {now} \
                                       AND t.cpus <= $2 AND t.memory <= $3 AND t.gpus <= $4 AND t.scratch <= $5 \
                                       AND (r.state = 'running' OR ( \
                                           (r.concurrency_limit IS NULL OR (SELECT count(*) FROM runs x \
                                               WHERE x.concurrency_key = r.concurrency_key AND x.state = 'running') \
                                               < r.concurrency_limit) \
                                           AND (r.pool IS NULL OR (SELECT count(*) FROM runs x \
                                               WHERE x.pool = r.pool AND x.state = 'running') \
                                               < COALESCE((SELECT slots FROM pools WHERE name = r.pool), 0)))) \
                                     ORDER BY t.priority DESC, t.ready_at, t.id LIMIT 1) \
                                 RETURNING ",
                                task_cols!()
                            )),
                            a.clone(),
                        )
                        .await?;
                    if let Some(t) = &row {
                        let (id, run_id, token, attempt) = t.lease_ids();
                        c.exec(
                            sql!(
                                "INSERT INTO attempts (task_id, token, attempt, run_id, worker_id, worker_name, started_at, \
                                     ready_at) \
                                 VALUES ($1, $2, $3, $4, $5, $6, {now}, (SELECT ready_at FROM tasks WHERE id = $1))"
                            ),
                            args![id, token, attempt, run_id, w.0, worker_name],
                        )
                        .await?;
                        c.exec(
                            sql!("INSERT INTO events (run_id, task_id, state, attempt) VALUES ($1, $2, 'leased', $3)"),
                            args![run_id, id, attempt],
                        )
                        .await?;
                        let started: Option<(i64,)> = c
                            .opt(
                                sql!(
                                    "UPDATE runs SET state = 'running', started_at = {now}, updated_at = {now} \
                                     WHERE id = $1 AND state = 'queued' RETURNING id"
                                ),
                                args![run_id],
                            )
                            .await?;
                        if started.is_some() {
                            run_event(&mut c, run_id, RunState::Running, None).await?;
                        }
                    }
                    tx.commit().await?;
                    row
                }
            };
            let Some(row) = row else {
                return Ok(None);
            };
            let task = row.into_row()?;
            let token = task.lease_token;
            let expires_at = task.lease_expires_at.ok_or_else(|| StoreError::Corrupt {
                table: "tasks",
                detail: format!("task {} was leased without an expiry", task.id),
            })?;
            Ok(Some(Lease {
                task,
                worker: w,
                token,
                expires_at,
            }))
        })
        .await
    }

    /// Extends the lease to `ttl` from now (never past the task's timeout) and stores
    /// `progress` if given. `false`: the lease is lost (a newer lease exists, the task was
    /// cancelled or reaped, or the timeout passed): the worker must stop the task.
    pub async fn heartbeat(&self, lease: &Lease, ttl: Duration, progress: Option<Value>) -> Result<bool, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        self.retrying("heartbeat", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(
                    sql!(
                        "UPDATE tasks SET \
                             lease_expires_at = CASE \
                                 WHEN timeout_ms > 0 AND leased_at + {ms:timeout_ms} < {now} + {ms:$3} \
                                 THEN leased_at + {ms:timeout_ms} ELSE {now} + {ms:$3} END, \
                             heartbeat_at = {now}, progress = COALESCE($4, progress), updated_at = {now} \
                         WHERE id = $1 AND lease_token = $2 AND state = 'leased' \
                           AND (timeout_ms = 0 OR leased_at + {ms:timeout_ms} > {now})"
                    ),
                    args![lease.task.id.0, lease.token, ttl_ms, progress.clone()],
                )
                .await?;
            Ok(n == 1)
        })
        .await
    }

    /// Records how the leased task ended, if `lease` is still the task's current lease.
    ///
    /// Success: the task's dependents whose needs have all succeeded become ready in the same
    /// transaction, and the run succeeds once every task has. Failure with attempts left (and
    /// `retryable`): the task is ready again after `backoff · 2^(n-1)` ± 20 %; otherwise it
    /// fails, the run fails with the reason, and the run's other unfinished tasks are cancelled.
    ///
    /// `false`: refused, the lease is stale (reaped and re-leased, cancelled, …): discard the
    /// work. Calling again with the same lease and outcome after a lost connection is safe: it
    /// returns `true` if the first call committed.
    pub async fn complete(&self, lease: &Lease, outcome: Outcome) -> Result<bool, StoreError> {
        self.complete_with(lease, outcome, &[]).await
    }

    /// [`Store::complete`]; a success also raises the scratch `needs` it learned for other tasks
    /// of its run that have not started (a shard plan sets its rank tasks' rank file sizes), in
    /// the same fenced transaction, so they are ready with their needs or not at all. A need is
    /// never lowered (the spec's `resources: scratch:` is a floor). Ignored with a failure.
    pub async fn complete_with(
        &self,
        lease: &Lease,
        outcome: Outcome,
        needs: &[ScratchNeed],
    ) -> Result<bool, StoreError> {
        let (accepted, ready) = self.retrying("complete", || self.complete_once(lease, &outcome, needs)).await?;
        if ready {
            self.wake_local();
        }
        Ok(accepted)
    }

    async fn complete_once(&self, lease: &Lease, outcome: &Outcome, needs: &[ScratchNeed]) -> Result<(bool, bool)> {
        let task = lease.task.id.0;
        let token = lease.token;
        match outcome {
            Outcome::Succeeded { output } if self.backend() == Backend::Postgres && !needs.is_empty() => {
                let done = self.pg_succeeded_with_needs(task, token, output, needs).await?;
                match done {
                    Some(promoted) => Ok((true, promoted > 0)),
                    None => Ok((self.already_completed(lease, AttemptOutcome::Succeeded).await?, false)),
                }
            }
            Outcome::Succeeded { output } if self.backend() == Backend::Postgres => {
                // One statement: migrations/postgres defines `complete_succeeded`.
                let mut pc = self.pool().acquire().await?;
                let (accepted, promoted): (bool, i64) = pc
                    .conn()
                    .one(
                        sql!("SELECT accepted, promoted FROM complete_succeeded($1, $2, $3)"),
                        args![task, token, output],
                    )
                    .await?;
                drop(pc);
                if accepted {
                    return Ok((true, promoted > 0));
                }
                Ok((self.already_completed(lease, AttemptOutcome::Succeeded).await?, false))
            }
            Outcome::Succeeded { output } => {
                // SQLite: the same steps in one (serialized) write transaction.
                let mut pc = self.pool().acquire().await?;
                let mut tx = pc.begin().await?;
                let mut c = tx.conn();
                let row: Option<(i64, i64)> = c
                    .opt(
                        sql!(
                            "UPDATE tasks SET state = 'succeeded', output = $3, error = NULL, \
                                 finished_at = {now}, lease_expires_at = NULL, updated_at = {now} \
                             WHERE id = $1 AND lease_token = $2 AND state = 'leased' \
                             RETURNING run_id, attempt"
                        ),
                        args![task, token, output],
                    )
                    .await?;
                let Some((run_id, attempt)) = row else {
                    tx.rollback().await?;
                    drop(pc);
                    return Ok((self.already_completed(lease, AttemptOutcome::Succeeded).await?, false));
                };
                set_scratch_needs(&mut c, run_id, needs).await?;
                c.exec(
                    sql!(
                        "UPDATE attempts SET ended_at = {now}, outcome = 'succeeded' WHERE task_id = $1 AND token = $2"
                    ),
                    args![task, token],
                )
                .await?;
                c.exec(
                    sql!("INSERT INTO events (run_id, task_id, state, attempt) VALUES ($1, $2, 'succeeded', $3)"),
                    args![run_id, task, attempt],
                )
                .await?;
                let promoted: Vec<(i64,)> = c
                    .all(
                        sql!(
                            "UPDATE tasks SET state = 'ready', ready_at = {now}, updated_at = {now} \
                             WHERE state = 'blocked' AND id IN (SELECT task_id FROM task_deps WHERE needs_id = $1) \
                             AND NOT EXISTS ( \
                                 SELECT 1 FROM task_deps d JOIN tasks n ON n.id = d.needs_id \
                                 WHERE d.task_id = tasks.id AND n.state <> 'succeeded') \
                             RETURNING id"
                        ),
                        args![task],
                    )
                    .await?;
                if !promoted.is_empty() {
                    let ids = json!(promoted.iter().map(|(id,)| *id).collect::<Vec<_>>());
                    task_events(&mut c, &ids, None).await?;
                }
                count_success(&mut c, run_id).await?;
                tx.commit().await?;
                Ok((true, !promoted.is_empty()))
            }
            Outcome::Failed { error, retryable } => {
                let error = clean(error);
                let mut tx = self.pool().begin().await?;
                let mut c = tx.conn();
                let Some(info) = lease_info(&mut c, task).await? else {
                    return Err(StoreError::TaskNotFound(lease.task.id));
                };
                let handled =
                    fail_attempt(&mut c, &info, token, AttemptOutcome::Failed, &error, *retryable, false).await?;
                match handled {
                    Some(ready) => {
                        tx.commit().await?;
                        Ok((true, ready))
                    }
                    None => {
                        tx.rollback().await?;
                        Ok((self.already_completed(lease, AttemptOutcome::Failed).await?, false))
                    }
                }
            }
        }
    }

    /// Whether this lease's attempt already ended with `outcome` (a retried `complete`).
    async fn already_completed(&self, lease: &Lease, outcome: AttemptOutcome) -> Result<bool> {
        let mut c = self.pool().acquire().await?;
        let row: Option<(Option<String>,)> = c
            .conn()
            .opt(
                sql!("SELECT outcome FROM attempts WHERE task_id = $1 AND token = $2"),
                args![lease.task.id.0, lease.token],
            )
            .await?;
        Ok(matches!(row, Some((Some(o),)) if o == outcome.as_str()))
    }

    /// Turns leases that ran out (or whose task ran past its timeout) into retries — ready
    /// after the backoff — or, with the budget spent, into failures that fail the run. A lease
    /// that ran out is a lost worker and draws on the task's `max_lost` ("worker lost 10 times:
    /// lease expired (last owner gpu-7)"); a timeout is the task's failure and draws on
    /// `max_attempts`. Also finishes runs whose tasks have all
    /// succeeded (a completion that crashed before doing so). Returns the number of expired
    /// leases handled (at most [`REAP_BATCH`]). Safe to run from several servers at once: on
    /// PostgreSQL one of them works at a time (advisory lock), each lease is handled once.
    pub async fn reap_expired(&self) -> Result<u64, StoreError> {
        let mut reaped = 0;
        let mut ready = false;
        while reaped < REAP_BATCH {
            match self.retrying("reap_expired", || self.reap_one()).await? {
                Reap::Done => break,
                Reap::Skipped => {}
                Reap::Reaped { ready: r } => {
                    reaped += 1;
                    ready |= r;
                }
            }
        }
        self.retrying("reap_expired", || async {
            let mut tx = self.pool().begin().await?;
            let mut c = tx.conn();
            let done: Vec<(i64,)> = c
                .all(
                    sql!(
                        "SELECT r.id FROM runs r WHERE r.state IN ('queued', 'running') AND r.open_tasks <= 0 \
                         AND EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = r.id) \
                         AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.run_id = r.id AND t.state <> 'succeeded') \
                         ORDER BY r.id LIMIT 1000"
                    ),
                    args![],
                )
                .await?;
            for (run,) in done {
                finish_run_if_done(&mut c, run).await?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await?;
        if ready {
            self.wake_local();
        }
        Ok(reaped)
    }

    async fn reap_one(&self) -> Result<Reap> {
        let mut tx = self.pool().begin().await?;
        let mut c = tx.conn();
        if let Conn::Pg(_) = c {
            let (leader,): (bool,) = c.one(sql!("SELECT pg_try_advisory_xact_lock($1)"), args![REAPER_LOCK]).await?;
            if !leader {
                return Ok(Reap::Done);
            }
        }
        let cand: Option<ExpiredRecord> = c
            .opt(
                sql!(
                    "SELECT t.id, CAST(CASE WHEN t.timeout_ms > 0 AND t.leased_at + {ms:t.timeout_ms} <= {now} \
                         THEN 1 ELSE 0 END AS BIGINT) AS timed_out, \
                         COALESCE((SELECT a.worker_name FROM attempts a \
                             WHERE a.task_id = t.id AND a.token = t.lease_token), '?') AS owner \
                     FROM tasks t WHERE t.state = 'leased' AND t.lease_expires_at < {now} \
                     ORDER BY t.lease_expires_at, t.id LIMIT 1"
                ),
                args![],
            )
            .await?;
        let Some(cand) = cand else {
            tx.commit().await?;
            return Ok(Reap::Done);
        };
        let Some(info) = lease_info(&mut c, cand.id).await? else {
            tx.commit().await?;
            return Ok(Reap::Skipped);
        };
        let (outcome, error) = if cand.timed_out != 0 {
            (
                AttemptOutcome::TimedOut,
                format!(
                    "timed out after {} (attempt {}, owner {})",
                    format_duration_human(Duration::from_millis(u64::try_from(info.timeout_ms).unwrap_or(0))),
                    info.attempt - info.attempt_base,
                    cand.owner
                ),
            )
        } else {
            let lost = info.lost + 1;
            if lost >= info.max_lost {
                let times = if lost == 1 { "once".to_string() } else { format!("{lost} times") };
                (AttemptOutcome::Expired, format!("worker lost {times}: lease expired (last owner {})", cand.owner))
            } else {
                (
                    AttemptOutcome::Expired,
                    format!(
                        "worker lost: lease expired (attempt {}, owner {}; lost {lost} of {})",
                        info.attempt - info.attempt_base,
                        cand.owner,
                        info.max_lost
                    ),
                )
            }
        };
        let handled = fail_attempt(&mut c, &info, info.lease_token, outcome, &error, true, true).await?;
        tx.commit().await?;
        Ok(match handled {
            Some(ready) => Reap::Reaped { ready },
            None => Reap::Skipped,
        })
    }
}

enum Reap {
    Done,
    Skipped,
    Reaped { ready: bool },
}

#[derive(sqlx::FromRow)]
struct ExpiredRecord {
    id: i64,
    timed_out: i64,
    owner: String,
}

#[derive(sqlx::FromRow)]
struct LeaseInfo {
    id: i64,
    run_id: i64,
    name: String,
    attempt: i64,
    attempt_base: i64,
    max_attempts: i64,
    max_lost: i64,
    lost: i64,
    backoff_ms: i64,
    timeout_ms: i64,
    lease_token: i64,
}

impl LeaseInfo {
    /// What the current attempt would use of its budget if it ended with `kind`: (the attempts
    /// or lost leases counted then, the budget's size).
    fn budget(&self, kind: AttemptKind) -> (i64, i64) {
        let made = self.attempt - self.attempt_base;
        match kind {
            AttemptKind::Error => (made - self.lost, self.max_attempts),
            AttemptKind::Lost => (self.lost + 1, self.max_lost),
        }
    }
}

async fn lease_info(c: &mut Conn<'_>, task: i64) -> Result<Option<LeaseInfo>> {
    Ok(c.opt(
        sql!(
            "SELECT id, run_id, name, attempt, attempt_base, max_attempts, max_lost, lost, backoff_ms, \
                 timeout_ms, lease_token FROM tasks WHERE id = $1"
        ),
        args![task],
    )
    .await?)
}

/// Ends the attempt `token` of a leased task with a failure: ready again after a backoff when
/// `retryable` and the budget of its kind (`outcome.kind()`: errors and timeouts against
/// `max_attempts`, lost leases against `max_lost`) has room, else failed along with its run.
/// `only_expired` guards against a heartbeat that extended the lease since the reaper looked.
/// `None`: the lease was not current (nothing changed); `Some(ready_now)` otherwise.
async fn fail_attempt(
    c: &mut Conn<'_>,
    info: &LeaseInfo,
    token: i64,
    outcome: AttemptOutcome,
    error: &str,
    retryable: bool,
    only_expired: bool,
) -> Result<Option<bool>> {
    let kind = outcome.kind().unwrap_or(AttemptKind::Error);
    let (used, budget) = info.budget(kind);
    let lost = info.lost + i64::from(kind == AttemptKind::Lost);
    let guard = i64::from(only_expired);
    let retry = retryable && used < budget;
    if retry {
        let delay = retry_delay(info.backoff_ms, used);
        let n = c
            .exec(
                sql!(
                    "UPDATE tasks SET state = 'ready', ready_at = {now} + {ms:$3}, error = $4, lost = $6, \
                         lease_expires_at = NULL, updated_at = {now} \
                     WHERE id = $1 AND lease_token = $2 AND state = 'leased' \
                       AND ($5 = 0 OR lease_expires_at < {now})"
                ),
                args![info.id, token, delay, error, guard, lost],
            )
            .await?;
        if n == 0 {
            return Ok(None);
        }
        end_attempt(c, info.id, token, outcome, error).await?;
        let message = format!(
            "retry in {} after: {error}",
            format_duration_human(Duration::from_millis(u64::try_from(delay).unwrap_or(0)))
        );
        task_events(c, &json!([info.id]), Some(&message)).await?;
        if delay == 0 {
            notify(c).await?;
        }
        Ok(Some(delay == 0))
    } else {
        let n = c
            .exec(
                sql!(
                    "UPDATE tasks SET state = 'failed', error = $3, lost = $5, finished_at = {now}, \
                         lease_expires_at = NULL, updated_at = {now} \
                     WHERE id = $1 AND lease_token = $2 AND state = 'leased' \
                       AND ($4 = 0 OR lease_expires_at < {now})"
                ),
                args![info.id, token, error, guard, lost],
            )
            .await?;
        if n == 0 {
            return Ok(None);
        }
        end_attempt(c, info.id, token, outcome, error).await?;
        task_events(c, &json!([info.id]), Some(error)).await?;
        // Which budget ran out: the attempts ("failed after 3 attempts: …") or the lost leases
        // (the error says "worker lost 10 times").
        let reason = match kind {
            AttemptKind::Error => {
                format!("task `{}` failed after {used} attempt{}: {error}", info.name, if used == 1 { "" } else { "s" })
            }
            AttemptKind::Lost => format!("task `{}` failed: {error}", info.name),
        };
        fail_run(c, info.run_id, &reason).await?;
        Ok(Some(false))
    }
}

async fn end_attempt(c: &mut Conn<'_>, task: i64, token: i64, outcome: AttemptOutcome, error: &str) -> Result<()> {
    let kind = outcome.kind().map(AttemptKind::as_str);
    c.exec(
        sql!(
            "UPDATE attempts SET ended_at = {now}, outcome = $3, kind = $4, error = $5 \
             WHERE task_id = $1 AND token = $2"
        ),
        args![task, token, outcome.as_str(), kind, error],
    )
    .await?;
    Ok(())
}

/// Counts a task's success against its run (SQLite; PostgreSQL does it in
/// `complete_succeeded`): the run ends when its last open task succeeds.
async fn count_success(c: &mut Conn<'_>, run: i64) -> Result<()> {
    let row: Option<(i64, String)> = c
        .opt(
            sql!("UPDATE runs SET open_tasks = open_tasks - 1, updated_at = {now} WHERE id = $1 RETURNING open_tasks, state"),
            args![run],
        )
        .await?;
    if let Some((open, state)) = row {
        if open <= 0 && (state == "queued" || state == "running") {
            finish_run_if_done(c, run).await?;
        }
    }
    Ok(())
}

/// Marks a live run succeeded if it has tasks and all of them succeeded.
async fn finish_run_if_done(c: &mut Conn<'_>, run: i64) -> Result<()> {
    if let Conn::Pg(_) = c {
        // One statement: on PostgreSQL this may run outside a transaction.
        c.exec(
            sql!(
                "WITH r AS ( \
                     UPDATE runs SET state = 'succeeded', finished_at = now(), updated_at = now() \
                     WHERE id = $1 AND state IN ('queued', 'running') \
                     AND NOT EXISTS (SELECT 1 FROM tasks WHERE run_id = $1 AND state <> 'succeeded') \
                     RETURNING id) \
                 INSERT INTO events (run_id, state) SELECT id, 'succeeded' FROM r"
            ),
            args![run],
        )
        .await?;
        return Ok(());
    }
    let done: Option<(i64,)> = c
        .opt(
            sql!(
                "UPDATE runs SET state = 'succeeded', finished_at = {now}, updated_at = {now} \
                 WHERE id = $1 AND state IN ('queued', 'running') \
                 AND NOT EXISTS (SELECT 1 FROM tasks WHERE run_id = $1 AND state <> 'succeeded') \
                 RETURNING id"
            ),
            args![run],
        )
        .await?;
    if done.is_some() {
        run_event(c, run, RunState::Succeeded, None).await?;
    }
    Ok(())
}

/// The delay before retry number `made` (1 after the first failed attempt):
/// `backoff · 2^(made-1)`, ± 20 % jitter, at most [`MAX_BACKOFF`]; in milliseconds.
pub(crate) fn retry_delay(backoff_ms: i64, made: i64) -> i64 {
    let Ok(base) = u64::try_from(backoff_ms) else { return 0 };
    let failures = u32::try_from(made.max(1)).unwrap_or(u32::MAX);
    let delay = Backoff { base: Duration::from_millis(base), cap: MAX_BACKOFF, spread: (0.8, 1.2) }.jittered(failures);
    i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)
}

/// Errors are stored as text: no NUL bytes (PostgreSQL refuses them), at most 64 KiB.
pub(crate) fn clean(s: &str) -> String {
    const MAX: usize = 64 * 1024;
    let mut out: String = s.replace('\0', "\u{FFFD}");
    if out.len() > MAX {
        let mut cut = MAX;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str(" … (truncated)");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        for made in 1..=4 {
            let d = retry_delay(1000, made);
            let base = 1000 * (1 << (made - 1));
            assert!(d >= base * 8 / 10 && d <= base * 12 / 10, "attempt {made}: {d}");
        }
        assert_eq!(retry_delay(0, 3), 0);
        assert!(retry_delay(i64::MAX, 60) <= MAX_BACKOFF.as_millis() as i64);
    }

    #[test]
    fn errors_are_cleaned() {
        assert_eq!(clean("a\0b"), "a\u{FFFD}b");
        assert!(clean(&"é".repeat(100_000)).ends_with("(truncated)"));
    }
}
