//! Runs entering the store and what holds them back: admission (dedupe key, a pipeline's
//! concurrency limit and its overflow policy), the pools of run slots the server defines, and
//! why a queued run does not start.
//!
//! A run holds its pipeline's place and its pool's slot while it is `running`, from its first
//! claim until it ends; the claim (`lease.rs`, `claim_task` on PostgreSQL) starts a queued run
//! only while both have room. Admission decides only what a submission beyond the limit does.

use crate::db::{args, sql, Conn};
use crate::error::{Result, StoreError};
use crate::runs::{cancel_live_run, fk_or, run_event};
use crate::types::*;
use crate::Store;

impl Store {
    /// Creates a run in state `queued`, or returns the live run with the same dedupe key:
    /// `(id, true)` when created, `(existing, false)` when a run with `new.dedupe_key` is queued,
    /// running or succeeded. A key whose runs all failed or were cancelled is free again.
    /// A run skipped by its pipeline's `overflow: skip` is [`StoreError::Skipped`]; see
    /// [`Store::admit_run`].
    pub async fn create_run(&self, new: NewRun) -> Result<(RunId, bool), StoreError> {
        match self.admit_run(new).await? {
            Admission::Created { run, .. } => Ok((run, true)),
            Admission::Existing(run) => Ok((run, false)),
            Admission::Skipped(s) => Err(StoreError::Skipped(s)),
        }
    }

    /// Admits a run: the live run with the same dedupe key if there is one; else, when the
    /// run's pipeline already has `limit` live (queued or running) runs, what its overflow says —
    /// `queue`: create it queued (it starts when a running one ends); `skip`: create nothing
    /// ([`Admission::Skipped`]); `cancel-previous`: cancel the oldest live runs (as
    /// [`Store::cancel_run`] does) so that with the new one `limit` are live, then create it.
    pub async fn admit_run(&self, new: NewRun) -> Result<Admission, StoreError> {
        crate::notify::check_run_targets(&new.notify)?;
        if let Some(c) = &new.options.concurrency {
            if c.limit == 0 || c.key.is_empty() {
                return Err(StoreError::InvalidArgument(format!(
                    "concurrency limit {} for key {:?}: the limit must be at least 1 and the key not empty",
                    c.limit, c.key
                )));
            }
        }
        // With a dedupe key a repeat finds the run the first try created; without, it would
        // create a second one.
        let admission = if new.dedupe_key.is_some() {
            self.retrying("create_run", || self.admit_once(&new)).await?
        } else {
            self.retrying_conflicts("create_run", || self.admit_once(&new)).await?
        };
        if let Admission::Created { cancelled, .. } = &admission {
            if !cancelled.is_empty() {
                // Their places are free: a queued run may start.
                self.wake_local();
            }
        }
        Ok(admission)
    }

    async fn admit_once(&self, new: &NewRun) -> Result<Admission> {
        for _ in 0..5 {
            let mut tx = self.pool().begin().await?;
            let mut c = tx.conn();
            if let Some(id) = live_with_key(&mut c, new.dedupe_key.as_deref()).await? {
                tx.commit().await?;
                return Ok(Admission::Existing(RunId(id)));
            }
            let mut cancelled = Vec::new();
            if let Some(limit) = &new.options.concurrency {
                if limit.overflow != Overflow::Queue {
                    if let Conn::Pg(_) = c {
                        // Two submissions of one pipeline decide one after the other (claims
                        // take other locks: this one is held only for this short transaction).
                        c.exec(
                            sql!("SELECT pg_advisory_xact_lock(hashtext('shardline.submit:' || $1))"),
                            args![limit.key.as_str()],
                        )
                        .await?;
                    }
                    let live: Vec<(i64,)> = c
                        .all(
                            sql!(
                                "SELECT id FROM runs WHERE concurrency_key = $1 AND state IN ('queued', 'running') \
                                 ORDER BY id"
                            ),
                            args![limit.key.as_str()],
                        )
                        .await?;
                    let over = (live.len() + 1).saturating_sub(limit.limit as usize);
                    if over > 0 && limit.overflow == Overflow::Skip {
                        tx.commit().await?;
                        return Ok(Admission::Skipped(Skipped {
                            key: limit.key.clone(),
                            limit: limit.limit,
                            live: live.into_iter().map(|(id,)| RunId(id)).collect(),
                        }));
                    }
                    for (id,) in live.into_iter().take(over) {
                        let why =
                            format!("cancelled: a newer run of pipeline {} replaces it (cancel-previous)", limit.key);
                        if cancel_live_run(&mut c, id, &why).await? {
                            // The submitter of the replacing run is who cancelled it.
                            let actor = new.submitted_by.as_deref().unwrap_or("cancel-previous");
                            crate::audit::record_action(&mut c, id, RunActionKind::Cancel, actor).await?;
                            cancelled.push(RunId(id));
                        }
                    }
                }
            }
            let (key, limit, overflow) = match &new.options.concurrency {
                Some(l) => (Some(l.key.clone()), Some(i64::from(l.limit)), Some(l.overflow.as_str())),
                None => (None, None, None),
            };
            let inserted: Option<(i64,)> = c
                .opt(
                    sql!(
                        "INSERT INTO runs (pipeline_id, params, spec, dedupe_key, name, no_cache, priority, \
                             concurrency_key, concurrency_limit, concurrency_overflow, pool, submitted_by, retain_ms) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
                         ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL \
                         AND state IN ('queued', 'running', 'succeeded') DO NOTHING RETURNING id"
                    ),
                    args![
                        new.pipeline_id,
                        &new.params,
                        &new.spec,
                        new.dedupe_key.clone(),
                        new.options.name.clone(),
                        new.options.no_cache,
                        new.options.priority,
                        key,
                        limit,
                        overflow,
                        new.options.pool.clone(),
                        new.submitted_by.clone(),
                        new.options.retention.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                    ],
                )
                .await
                .map_err(|e| fk_or(e, StoreError::PipelineNotFound(new.pipeline_id)))?;
            if let Some((id,)) = inserted {
                run_event(&mut c, id, RunState::Queued, None).await?;
                crate::notify::insert_run_targets(&mut c, id, &new.notify).await?;
                tx.commit().await?;
                return Ok(Admission::Created { run: RunId(id), cancelled });
            }
            // A run with the key was created since we looked: roll back (cancels included) and
            // look again; the holder may also have failed meanwhile, then insert again.
            tx.rollback().await?;
        }
        Err(StoreError::InvalidArgument(format!(
            "dedupe key {:?} is contended: no run could be created or found",
            new.dedupe_key
        )))
    }

    /// Defines (or resizes) pools of run slots: a run of a pipeline with `pool: NAME` takes
    /// one slot while it runs. Pools not named keep their slots.
    pub async fn set_pools(&self, pools: &[(String, u32)]) -> Result<(), StoreError> {
        self.retrying("set_pools", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                for (name, slots) in pools {
                    c.exec(
                        sql!(
                            "INSERT INTO pools (name, slots) VALUES ($1, $2) \
                             ON CONFLICT (name) DO UPDATE SET slots = excluded.slots, updated_at = {now}"
                        ),
                        args![name.as_str(), i64::from(*slots)],
                    )
                    .await?;
                }
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await?;
        // More slots may let queued runs start.
        self.wake_local();
        Ok(())
    }

    /// The defined pools by name, with the slots their running runs hold.
    pub async fn list_pools(&self) -> Result<Vec<PoolRow>, StoreError> {
        self.retrying("list_pools", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<(String, i64, i64)> = c
                .conn()
                .all(
                    sql!(
                        "SELECT p.name, p.slots, \
                             (SELECT count(*) FROM runs r WHERE r.pool = p.name AND r.state = 'running') \
                         FROM pools p ORDER BY p.name"
                    ),
                    args![],
                )
                .await?;
            Ok(rows
                .into_iter()
                .map(|(name, slots, in_use)| PoolRow { name, slots: count(slots), in_use: count(in_use) })
                .collect())
        })
        .await
    }

    /// Why a queued run does not start: its pipeline at its limit, else its pool full or
    /// undefined. `None` for a run that is not queued or has room (it waits for a worker).
    pub async fn held_back(&self, run: RunId) -> Result<Option<HeldBack>, StoreError> {
        self.retrying("held_back", || async {
            let mut c = self.pool().acquire().await?;
            let mut c = c.conn();
            let row: Option<HoldRecord> = c
                .opt(
                    sql!(
                        "SELECT r.state, r.concurrency_key, r.concurrency_limit, r.pool, \
                             (SELECT count(*) FROM runs x WHERE x.concurrency_key = r.concurrency_key \
                                 AND x.state = 'running') AS running, \
                             (SELECT count(*) FROM runs x WHERE x.pool = r.pool AND x.state = 'running') AS in_use, \
                             (SELECT slots FROM pools WHERE name = r.pool) AS slots \
                         FROM runs r WHERE r.id = $1"
                    ),
                    args![run.0],
                )
                .await?;
            let Some(h) = row else {
                return Err(StoreError::RunNotFound(run));
            };
            if h.state != RunState::Queued.as_str() {
                return Ok(None);
            }
            if let (Some(key), Some(limit)) = (h.concurrency_key, h.concurrency_limit) {
                if h.running >= limit {
                    return Ok(Some(HeldBack::Concurrency { key, running: count(h.running), limit: count(limit) }));
                }
            }
            if let Some(name) = h.pool {
                if h.in_use >= h.slots.unwrap_or(0) {
                    return Ok(Some(HeldBack::Pool { name, in_use: count(h.in_use), slots: h.slots.map(count) }));
                }
            }
            Ok(None)
        })
        .await
    }
}

#[derive(sqlx::FromRow)]
struct HoldRecord {
    state: String,
    concurrency_key: Option<String>,
    concurrency_limit: Option<i64>,
    pool: Option<String>,
    running: i64,
    in_use: i64,
    slots: Option<i64>,
}

fn count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// The queued, running or succeeded run holding `key`, if any.
async fn live_with_key(c: &mut Conn<'_>, key: Option<&str>) -> Result<Option<i64>> {
    let Some(key) = key else { return Ok(None) };
    let row: Option<(i64,)> = c
        .opt(
            sql!("SELECT id FROM runs WHERE dedupe_key = $1 AND state IN ('queued', 'running', 'succeeded')"),
            args![key],
        )
        .await?;
    Ok(row.map(|(id,)| id))
}
