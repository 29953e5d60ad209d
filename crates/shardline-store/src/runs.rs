//! Pipelines, runs and their task graphs: creation, dynamic fan-out, cancel, retry.
//!
//! Lock order on PostgreSQL: a run's row before its tasks' rows (every run-wide operation takes
//! the run row first). The one exception, a success completion locking its dependents, never
//! locks the run row inside its transaction. Deadlocks that remain possible (a claim moving a
//! queued run to running while it is being cancelled) are resolved by the database and the
//! operation is retried (`Store::retrying`).

use std::collections::{BTreeSet, HashMap, HashSet};

use serde_json::{json, Value};

use crate::batch::{prepare, Prepared};
use crate::db::{args, sql, Conn};
use crate::error::{Result, StoreError};
use crate::records::parse;
use crate::types::*;
use crate::Store;

impl Store {
    /// Stores a version of a pipeline spec; returns the id of the `(name, spec_hash)` row,
    /// existing or new. Runs point at the exact version they were built from.
    pub async fn upsert_pipeline(&self, name: &str, spec_text: &str, spec_hash: &str) -> Result<i64, StoreError> {
        self.retrying("upsert_pipeline", || async {
            let mut c = self.pool().acquire().await?;
            let (id,): (i64,) = c
                .conn()
                .one(
                    sql!(
                        "INSERT INTO pipelines (name, spec_text, spec_hash) VALUES ($1, $2, $3) \
                         ON CONFLICT (name, spec_hash) DO UPDATE SET name = excluded.name RETURNING id"
                    ),
                    args![name, spec_text, spec_hash],
                )
                .await?;
            Ok(id)
        })
        .await
    }

    /// Stores the run's plan (replacing an earlier one).
    pub async fn set_run_plan(&self, run: RunId, plan: Value) -> Result<(), StoreError> {
        self.retrying("set_run_plan", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(sql!("UPDATE runs SET plan = $2, updated_at = {now} WHERE id = $1"), args![run.0, &plan])
                .await?;
            if n == 0 {
                return Err(StoreError::RunNotFound(run));
            }
            Ok(())
        })
        .await
    }

    /// Adds tasks to a queued or running run, in one transaction; returns their ids in input
    /// order. `needs` may name tasks of this batch or tasks added earlier; a task whose needs
    /// have all succeeded starts `ready`, any other `blocked`. Every problem of the batch
    /// (duplicate or unknown names, cycles, out-of-range values) is reported at once.
    pub async fn add_tasks(&self, run: RunId, tasks: Vec<NewTask>) -> Result<Vec<TaskId>, StoreError> {
        let prepared = prepare(run, &tasks)?;
        let ids = self
            .retrying_conflicts("add_tasks", || async {
                let mut tx = self.pool().begin().await?;
                let added = add_tasks_tx(&mut tx.conn(), run, &prepared).await;
                tx.finish(added).await
            })
            .await?;
        if ids.1 {
            self.wake_local();
        }
        Ok(ids.0)
    }

    /// Dynamic fan-out: adds `tasks` and makes every task that waits for `from_task` also wait
    /// for each of them, in one transaction. A `plan` task adds its N rank tasks and a commit
    /// task this way while it runs, and the steps after `plan` then wait for all of them.
    /// Tasks of the batch that themselves need `from_task` are not redirected.
    pub async fn add_tasks_and_redirect(
        &self,
        run: RunId,
        tasks: Vec<NewTask>,
        from_task: TaskId,
    ) -> Result<Vec<TaskId>, StoreError> {
        let prepared = prepare(run, &tasks)?;
        let (ids, ready) = self
            .retrying_conflicts("add_tasks_and_redirect", || async {
                let mut tx = self.pool().begin().await?;
                let redirected = async {
                    let mut c = tx.conn();
                    let owner: Option<(i64,)> =
                        c.opt(sql!("SELECT run_id FROM tasks WHERE id = $1"), args![from_task.0]).await?;
                    match owner {
                        Some((r,)) if r == run.0 => {}
                        _ => return Err(StoreError::TaskNotFound(from_task)),
                    }
                    // The successors' rows first (task rows before the run's row, as everywhere).
                    let dependents: Vec<(i64, String, String)> = c
                        .all(
                            sql!(
                                "SELECT t.id, t.name, t.state FROM tasks t JOIN task_deps d ON d.task_id = t.id \
                             WHERE d.needs_id = $1 ORDER BY t.id {for_update}"
                            ),
                            args![from_task.0],
                        )
                        .await?;
                    let (ids, ready) = add_tasks_tx(&mut c, run, &prepared).await?;
                    let new: HashSet<i64> = ids.iter().map(|t| t.0).collect();
                    let new_ids: Vec<i64> = ids.iter().map(|t| t.0).collect();
                    for (id, name, state) in dependents.into_iter().filter(|(id, _, _)| !new.contains(id)) {
                        add_edges(&mut c, run, (id, &name, &state), &new_ids).await?;
                    }
                    Ok((ids, ready))
                }
                .await;
                tx.finish(redirected).await
            })
            .await?;
        if ready {
            self.wake_local();
        }
        Ok(ids)
    }

    /// Makes the task `task_name` of `run` also wait for the tasks named in `needs`, in one
    /// transaction. The task must not have been leased yet (blocked or ready); a ready task that
    /// gains an unfinished need goes back to blocked. Refuses edges that would close a cycle.
    pub async fn add_deps(&self, run: RunId, task_name: &str, needs: Vec<String>) -> Result<(), StoreError> {
        self.retrying("add_deps", || async {
            let mut tx = self.pool().begin().await?;
            let added = async {
                let mut c = tx.conn();
                let task: Option<(i64, String)> = c
                    .opt(
                        sql!("SELECT id, state FROM tasks WHERE run_id = $1 AND name = $2 {for_update}"),
                        args![run.0, task_name],
                    )
                    .await?;
                let Some((task_id, state)) = task else {
                    return Err(StoreError::InvalidTasks {
                        run,
                        problems: vec![format!("no task `{task_name}` in run {run}")],
                    });
                };
                let found: Vec<(i64, String, String)> = c
                    .all(
                        sql!(
                            "SELECT id, name, state FROM tasks WHERE run_id = $1 AND name IN {strs:$2} \
                         ORDER BY id {for_share}"
                        ),
                        args![run.0, json!(needs)],
                    )
                    .await?;
                let known: HashSet<&str> = found.iter().map(|(_, n, _)| n.as_str()).collect();
                let problems: Vec<String> = needs
                    .iter()
                    .filter(|n| !known.contains(n.as_str()))
                    .map(|n| format!("task `{task_name}` cannot need `{n}`: no such task in run {run}"))
                    .collect();
                if !problems.is_empty() {
                    return Err(StoreError::InvalidTasks { run, problems });
                }
                lock_live_run(&mut c, run, "tasks can only gain needs while it is queued or running").await?;
                let need_ids: Vec<i64> = found.iter().map(|(id, _, _)| *id).collect();
                add_edges(&mut c, run, (task_id, task_name, &state), &need_ids).await?;
                Ok(())
            }
            .await;
            tx.finish(added).await
        })
        .await
    }

    /// Cancels a queued or running run: every unfinished task becomes `cancelled` (a leased
    /// task's later heartbeat returns false and its completion is refused), and `actor` is
    /// recorded as who cancelled it. Returns false when the run had already finished.
    pub async fn cancel_run(&self, run: RunId, actor: &str) -> Result<bool, StoreError> {
        self.retrying("cancel_run", || async {
            let mut tx = self.pool().begin().await?;
            let mut c = tx.conn();
            let row: Option<(String,)> = c.opt(sql!("SELECT state FROM runs WHERE id = $1"), args![run.0]).await?;
            let Some((state,)) = row else {
                return Err(StoreError::RunNotFound(run));
            };
            if parse::<RunState>("runs", &state)?.is_terminal() {
                return Ok(false);
            }
            if !cancel_live_run(&mut c, run.0, "cancelled").await? {
                // It finished meanwhile.
                tx.rollback().await?;
                return Ok(false);
            }
            crate::audit::record_action(&mut c, run.0, RunActionKind::Cancel, actor).await?;
            tx.commit().await?;
            // Its pipeline's place and its pool slot are free: a queued run may start.
            self.wake_local();
            Ok(true)
        })
        .await
    }

    /// Puts a finished run back to work: its failed and cancelled tasks — and, with
    /// `from_step`, that step's tasks and everything downstream of them — go back to `ready`
    /// (needs all succeeded) or `blocked`, with outputs cleared and fresh budgets of attempts and
    /// lost leases;
    /// the run becomes `running` (`queued` if it has no tasks yet, or has a concurrency limit or
    /// a pool: it starts again when there is room). Attempt numbers keep counting, so logs of earlier attempts
    /// stay apart. `actor` is recorded as who retried it. Fails for a queued or running run,
    /// for an unknown step, and when a live run has taken the run's dedupe key meanwhile.
    pub async fn retry_run(&self, run: RunId, from_step: Option<&str>, actor: &str) -> Result<(), StoreError> {
        let ready = self
            .retrying_conflicts("retry_run", || async {
                let mut tx = self.pool().begin().await?;
                let mut c = tx.conn();
                let row: Option<(String, Option<String>, bool)> = c
                    .opt(
                        sql!(
                            "SELECT state, dedupe_key, \
                                 (concurrency_limit IS NOT NULL OR pool IS NOT NULL) AS limited \
                             FROM runs WHERE id = $1 {for_update}"
                        ),
                        args![run.0],
                    )
                    .await?;
                let Some((state, dedupe_key, limited)) = row else {
                    return Err(StoreError::RunNotFound(run));
                };
                let state: RunState = parse("runs", &state)?;
                if !state.is_terminal() {
                    return Err(StoreError::RunState {
                        run,
                        state,
                        action: "only a finished run can be retried (hint: cancel it first)",
                    });
                }
                if let Some(step) = from_step {
                    let steps: Vec<(String,)> = c
                        .all(
                            sql!("SELECT DISTINCT step_id FROM tasks WHERE run_id = $1 ORDER BY step_id"),
                            args![run.0],
                        )
                        .await?;
                    if !steps.iter().any(|(s,)| s == step) {
                        return Err(StoreError::UnknownStep {
                            run,
                            step: step.to_string(),
                            known: steps.into_iter().map(|(s,)| s).collect(),
                        });
                    }
                }
                let reset: Vec<(i64,)> = c
                    .all(
                        sql!(
                            "WITH RECURSIVE seed(id) AS ( \
                                 SELECT id FROM tasks WHERE run_id = $1 \
                                 AND (state IN ('failed', 'cancelled') OR step_id = $2)), \
                             down(id) AS ( \
                                 SELECT id FROM seed \
                                 UNION SELECT d.task_id FROM task_deps d JOIN down ON d.needs_id = down.id) \
                             SELECT id FROM down ORDER BY id"
                        ),
                        args![run.0, from_step],
                    )
                    .await?;
                let (tasks,): (i64,) =
                    c.one(sql!("SELECT count(*) FROM tasks WHERE run_id = $1"), args![run.0]).await?;
                if reset.is_empty() && tasks > 0 {
                    return Err(StoreError::RunState {
                        run,
                        state,
                        action: "it has no failed or cancelled task to retry (hint: name a step to run again)",
                    });
                }
                let ids = json!(reset.iter().map(|(id,)| *id).collect::<Vec<_>>());
                c.exec(
                    sql!(
                        "UPDATE tasks SET state = 'blocked', attempt_base = attempt, lost = 0, output = NULL, \
                         progress = NULL, error = NULL, ready_at = NULL, lease_owner = NULL, \
                         leased_at = NULL, lease_expires_at = NULL, heartbeat_at = NULL, \
                         finished_at = NULL, updated_at = {now} WHERE id IN {ids:$1}"
                    ),
                    args![ids.clone()],
                )
                .await?;
                let promoted = promote(&mut c, &ids).await?;
                task_events(&mut c, &ids, Some("retried")).await?;
                // A run that never got tasks goes back to the queue, to be planned again; so does
                // a run under a concurrency limit or in a pool, which starts again only when its
                // claim finds room.
                let back_to = if tasks > 0 && !limited { RunState::Running } else { RunState::Queued };
                let back = c
                    .exec(
                        sql!(
                            "UPDATE runs SET state = $2, error = NULL, finished_at = NULL, updated_at = {now}, \
                             open_tasks = (SELECT count(*) FROM tasks WHERE run_id = $1 AND state <> 'succeeded') \
                             WHERE id = $1"
                        ),
                        args![run.0, back_to.as_str()],
                    )
                    .await;
                match back {
                    Ok(_) => {}
                    Err(e) if is_unique_violation(&e) => {
                        tx.rollback().await?;
                        let key = dedupe_key.unwrap_or_default();
                        let mut c = self.pool().acquire().await?;
                        let holder: Option<(i64,)> = c
                            .conn()
                            .opt(
                                sql!(
                                    "SELECT id FROM runs WHERE dedupe_key = $1 \
                                     AND state IN ('queued', 'running', 'succeeded')"
                                ),
                                args![key.clone()],
                            )
                            .await?;
                        return Err(StoreError::DedupeConflict {
                            run,
                            holder: RunId(holder.map_or(0, |(id,)| id)),
                            key,
                        });
                    }
                    Err(e) => return Err(e.into()),
                }
                run_event(&mut c, run.0, back_to, Some("retried")).await?;
                crate::audit::record_action(&mut c, run.0, RunActionKind::Retry, actor).await?;
                if promoted > 0 {
                    notify(&mut c).await?;
                }
                tx.commit().await?;
                Ok(promoted > 0)
            })
            .await?;
        if ready {
            self.wake_local();
        }
        Ok(())
    }
}

/// Locks a run's row (shared) and checks that it is queued or running.
async fn lock_live_run(c: &mut Conn<'_>, run: RunId, action: &'static str) -> Result<()> {
    let row: Option<(String,)> = c.opt(sql!("SELECT state FROM runs WHERE id = $1 {for_share}"), args![run.0]).await?;
    let Some((state,)) = row else {
        return Err(StoreError::RunNotFound(run));
    };
    let state: RunState = parse("runs", &state)?;
    if state.is_terminal() {
        return Err(StoreError::RunState { run, state, action });
    }
    Ok(())
}

/// Inserts a validated batch; returns the ids in batch order and whether any task is ready.
async fn add_tasks_tx(c: &mut Conn<'_>, run: RunId, tasks: &[Prepared]) -> Result<(Vec<TaskId>, bool)> {
    if tasks.is_empty() {
        lock_live_run(c, run, "tasks can only be added while it is queued or running").await?;
        return Ok((Vec::new(), false));
    }
    let batch: HashSet<&str> = tasks.iter().map(|t| t.name.as_str()).collect();
    let mut referenced: BTreeSet<&str> = batch.iter().copied().collect();
    for t in tasks {
        referenced.extend(t.needs.iter().map(String::as_str));
    }
    // Lock (shared) the existing tasks the batch needs, so a completion of one of them either
    // commits before our readiness check or sees our edges: a new task never misses its promotion.
    let existing: Vec<(i64, String, String)> = c
        .all(
            sql!("SELECT id, name, state FROM tasks WHERE run_id = $1 AND name IN {strs:$2} ORDER BY id {for_share}"),
            args![run.0, json!(referenced)],
        )
        .await?;
    let existing: HashMap<&str, i64> = existing.iter().map(|(id, name, _)| (name.as_str(), *id)).collect();
    // The run's row after the task rows (the lock order of every operation): count the new
    // tasks as open, if the run is still live.
    let counted: Option<(String,)> = c
        .opt(
            sql!("UPDATE runs SET open_tasks = open_tasks + $2, updated_at = {now} WHERE id = $1 RETURNING state"),
            args![run.0, tasks.len() as i64],
        )
        .await?;
    let Some((state,)) = counted else {
        return Err(StoreError::RunNotFound(run));
    };
    let state: RunState = parse("runs", &state)?;
    if state.is_terminal() {
        return Err(StoreError::RunState {
            run,
            state,
            action: "tasks can only be added while it is queued or running",
        });
    }
    let mut problems = Vec::new();
    for t in tasks {
        if existing.contains_key(t.name.as_str()) {
            problems.push(format!("task `{}` already exists in run {run}", t.name));
        }
        for n in &t.needs {
            if !batch.contains(n.as_str()) && !existing.contains_key(n.as_str()) {
                problems
                    .push(format!("task `{}` needs `{n}`, which is neither in run {run} nor in this batch", t.name));
            }
        }
    }
    if !problems.is_empty() {
        return Err(StoreError::InvalidTasks { run, problems });
    }
    let rows = Value::Array(tasks.iter().map(|t| t.row.clone()).collect());
    let inserted: Vec<(i64, String)> = c
        .all(
            sql!(
                pg: "INSERT INTO tasks (run_id, name, step_id, kind, state, cpus, memory, gpus, scratch, \
                         payload, max_attempts, max_lost, backoff_ms, timeout_ms, cache_key, priority) \
                     SELECT $1, v ->> 'name', v ->> 'step_id', v ->> 'kind', 'blocked', \
                         (v ->> 'cpus')::bigint, (v ->> 'memory')::bigint, (v ->> 'gpus')::bigint, \
                         (v ->> 'scratch')::bigint, COALESCE(v -> 'payload', 'null'::jsonb), \
                         (v ->> 'max_attempts')::bigint, (v ->> 'max_lost')::bigint, (v ->> 'backoff_ms')::bigint, \
                         (v ->> 'timeout_ms')::bigint, v ->> 'cache_key', \
                         (SELECT priority FROM runs WHERE id = $1) \
                     FROM jsonb_array_elements($2) WITH ORDINALITY AS x(v, ord) \
                     ORDER BY x.ord RETURNING id, name",
                lite: "INSERT INTO tasks (run_id, name, step_id, kind, state, cpus, memory, gpus, scratch, \
                           payload, max_attempts, max_lost, backoff_ms, timeout_ms, cache_key, priority) \
                       SELECT $1, value ->> '$.name', value ->> '$.step_id', value ->> '$.kind', 'blocked', \
                           value ->> '$.cpus', value ->> '$.memory', value ->> '$.gpus', value ->> '$.scratch', \
                           value -> '$.payload', value ->> '$.max_attempts', value ->> '$.max_lost', \
                           value ->> '$.backoff_ms', value ->> '$.timeout_ms', value ->> '$.cache_key', \
                           (SELECT priority FROM runs WHERE id = $1) \
                       FROM json_each($2) WHERE true ORDER BY key RETURNING id, name"
            ),
            args![run.0, rows],
        )
        .await
        .map_err(|e| {
            unique_or(e, || StoreError::InvalidTasks {
                run,
                problems: vec!["a task of the batch was added concurrently by another call".to_string()],
            })
        })?;
    let mut ids: HashMap<&str, i64> = existing.clone();
    let by_name: HashMap<String, i64> = inserted.into_iter().map(|(id, name)| (name, id)).collect();
    for t in tasks {
        let Some(&id) = by_name.get(&t.name) else {
            return Err(StoreError::Corrupt {
                table: "tasks",
                detail: format!("insert of task `{}` returned no id", t.name),
            });
        };
        ids.insert(t.name.as_str(), id);
    }
    let mut edges = Vec::new();
    for t in tasks {
        let id = ids[t.name.as_str()];
        for n in &t.needs {
            edges.push(json!([id, ids[n.as_str()]]));
        }
    }
    if !edges.is_empty() {
        insert_edges(c, Value::Array(edges)).await?;
    }
    let new_ids: Vec<i64> = tasks.iter().map(|t| ids[t.name.as_str()]).collect();
    let new_json = json!(new_ids);
    let promoted = promote(c, &new_json).await?;
    task_events(c, &new_json, None).await?;
    if promoted > 0 {
        notify(c).await?;
    }
    Ok((new_ids.into_iter().map(TaskId).collect(), promoted > 0))
}

async fn insert_edges(c: &mut Conn<'_>, pairs: Value) -> Result<()> {
    c.exec(
        sql!(
            pg: "INSERT INTO task_deps (task_id, needs_id) \
                 SELECT (e ->> 0)::bigint, (e ->> 1)::bigint FROM jsonb_array_elements($1) AS e \
                 ON CONFLICT DO NOTHING",
            lite: "INSERT INTO task_deps (task_id, needs_id) \
                   SELECT value ->> 0, value ->> 1 FROM json_each($1) WHERE true ON CONFLICT DO NOTHING"
        ),
        args![pairs],
    )
    .await?;
    Ok(())
}

/// Makes `task` (locked by the caller) also wait for `needs` (existing tasks of the run),
/// refusing cycles; a ready task that now waits for something unfinished becomes blocked.
async fn add_edges(c: &mut Conn<'_>, run: RunId, task: (i64, &str, &str), needs: &[i64]) -> Result<()> {
    let (task_id, name, state) = task;
    let state: TaskState = parse("tasks", state)?;
    if !matches!(state, TaskState::Blocked | TaskState::Ready) {
        return Err(StoreError::TaskState {
            run,
            name: name.to_string(),
            state,
            action: "only a task that was not leased yet can gain needs",
        });
    }
    if needs.is_empty() {
        return Ok(());
    }
    if needs.contains(&task_id) {
        return Err(StoreError::InvalidTasks { run, problems: vec![format!("task `{name}` cannot need itself")] });
    }
    let downstream: Vec<(String,)> = c
        .all(
            sql!(
                "WITH RECURSIVE down(id) AS ( \
                     SELECT task_id FROM task_deps WHERE needs_id = $1 \
                     UNION SELECT d.task_id FROM task_deps d JOIN down ON d.needs_id = down.id) \
                 SELECT t.name FROM tasks t WHERE t.id IN (SELECT id FROM down) AND t.id IN {ids:$2} ORDER BY t.name"
            ),
            args![task_id, json!(needs)],
        )
        .await?;
    if !downstream.is_empty() {
        let names: Vec<String> = downstream.into_iter().map(|(n,)| format!("`{n}`")).collect();
        return Err(StoreError::InvalidTasks {
            run,
            problems: vec![format!(
                "dependency cycle: task `{name}` cannot need {}, which already wait(s) for it",
                names.join(", ")
            )],
        });
    }
    let pairs: Vec<Value> = needs.iter().map(|n| json!([task_id, n])).collect();
    insert_edges(c, Value::Array(pairs)).await?;
    let blocked: Vec<(i64,)> = c
        .all(
            sql!(
                "UPDATE tasks SET state = 'blocked', ready_at = NULL, updated_at = {now} \
                 WHERE id = $1 AND state = 'ready' AND EXISTS ( \
                     SELECT 1 FROM task_deps d JOIN tasks n ON n.id = d.needs_id \
                     WHERE d.task_id = tasks.id AND n.state <> 'succeeded') RETURNING id"
            ),
            args![task_id],
        )
        .await?;
    if !blocked.is_empty() {
        task_events(c, &json!([task_id]), Some("waits for new needs")).await?;
    }
    Ok(())
}

/// Makes the blocked tasks among `ids` whose needs have all succeeded ready; returns how many.
pub(crate) async fn promote(c: &mut Conn<'_>, ids: &Value) -> Result<u64> {
    let n = c
        .exec(
            sql!(
                "UPDATE tasks SET state = 'ready', ready_at = {now}, updated_at = {now} \
                 WHERE id IN {ids:$1} AND state = 'blocked' AND NOT EXISTS ( \
                     SELECT 1 FROM task_deps d JOIN tasks n ON n.id = d.needs_id \
                     WHERE d.task_id = tasks.id AND n.state <> 'succeeded')"
            ),
            args![ids.clone()],
        )
        .await?;
    Ok(n)
}

/// Records the current state of each task in `ids` as an event.
pub(crate) async fn task_events(c: &mut Conn<'_>, ids: &Value, message: Option<&str>) -> Result<()> {
    c.exec(
        sql!(
            "INSERT INTO events (run_id, task_id, state, attempt, message) \
             SELECT run_id, id, state, attempt, $2 FROM tasks WHERE id IN {ids:$1} ORDER BY id"
        ),
        args![ids.clone(), message],
    )
    .await?;
    Ok(())
}

pub(crate) async fn run_event(c: &mut Conn<'_>, run: i64, state: RunState, message: Option<&str>) -> Result<()> {
    c.exec(
        sql!("INSERT INTO events (run_id, state, message) VALUES ($1, $2, $3)"),
        args![run, state.as_str(), message],
    )
    .await?;
    Ok(())
}

/// Announces ready tasks to listening workers (PostgreSQL; delivered at commit, coalesced).
pub(crate) async fn notify(c: &mut Conn<'_>) -> Result<()> {
    if let Conn::Pg(_) = c {
        c.exec(sql!("SELECT pg_notify('shardline_work', '')"), args![]).await?;
    }
    Ok(())
}

/// Fails a run (if still live) with `message` and cancels its unfinished tasks (task rows
/// first, the run's row last: the lock order of every operation).
pub(crate) async fn fail_run(c: &mut Conn<'_>, run: i64, message: &str) -> Result<()> {
    let (live,): (i64,) =
        c.one(sql!("SELECT count(*) FROM runs WHERE id = $1 AND state IN ('queued', 'running')"), args![run]).await?;
    if live == 0 {
        return Ok(());
    }
    cancel_unfinished(c, run, "run failed").await?;
    let failed: Option<(i64,)> = c
        .opt(
            sql!(
                "UPDATE runs SET state = 'failed', error = $2, finished_at = {now}, updated_at = {now} \
                 WHERE id = $1 AND state IN ('queued', 'running') RETURNING id"
            ),
            args![run, message],
        )
        .await?;
    if failed.is_some() {
        run_event(c, run, RunState::Failed, Some(message)).await?;
    }
    Ok(())
}

/// Cancels a live run with `message` as its error: its unfinished tasks first, then its row
/// (the lock order of every operation). `false` when it was no longer queued or running.
pub(crate) async fn cancel_live_run(c: &mut Conn<'_>, run: i64, message: &str) -> Result<bool> {
    cancel_unfinished(c, run, "run cancelled").await?;
    let done: Option<(i64,)> = c
        .opt(
            sql!(
                "UPDATE runs SET state = 'cancelled', error = $2, finished_at = {now}, \
                 updated_at = {now} WHERE id = $1 AND state IN ('queued', 'running') RETURNING id"
            ),
            args![run, message],
        )
        .await?;
    if done.is_none() {
        return Ok(false);
    }
    run_event(c, run, RunState::Cancelled, Some(message)).await?;
    Ok(true)
}

/// Cancels every unfinished task of a run and closes their open attempts.
pub(crate) async fn cancel_unfinished(c: &mut Conn<'_>, run: i64, reason: &str) -> Result<()> {
    let cancelled: Vec<(i64,)> = c
        .all(
            sql!(
                "UPDATE tasks SET state = 'cancelled', lease_expires_at = NULL, finished_at = {now}, \
                 updated_at = {now} WHERE run_id = $1 AND state IN ('blocked', 'ready', 'leased') RETURNING id"
            ),
            args![run],
        )
        .await?;
    c.exec(
        sql!(
            "UPDATE attempts SET ended_at = {now}, outcome = 'cancelled', error = $2 \
             WHERE run_id = $1 AND outcome IS NULL"
        ),
        args![run, reason],
    )
    .await?;
    if !cancelled.is_empty() {
        let ids = json!(cancelled.iter().map(|(id,)| *id).collect::<Vec<_>>());
        task_events(c, &ids, Some(reason)).await?;
    }
    Ok(())
}

pub(crate) fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| matches!(d.kind(), sqlx::error::ErrorKind::UniqueViolation))
}

fn unique_or(e: sqlx::Error, f: impl FnOnce() -> StoreError) -> StoreError {
    if is_unique_violation(&e) {
        f()
    } else {
        e.into()
    }
}

pub(crate) fn fk_or(e: sqlx::Error, err: StoreError) -> StoreError {
    let fk = e.as_database_error().is_some_and(|d| matches!(d.kind(), sqlx::error::ErrorKind::ForeignKeyViolation));
    if fk {
        err
    } else {
        e.into()
    }
}
