//! Triggers and their firings (tables `triggers` and `trigger_firings`).
//!
//! A trigger row is named by its pipeline and its position in the spec's `triggers:` list; it
//! holds what the poller needs to carry between checks (next firing, last sha, ETags, the last
//! error and how many checks failed in a row) and what a listing shows. Times are the ones the
//! caller passes (the trigger poller's clock), not the database's, so a test clock drives them.
//!
//! **One run per dedupe key.** A firing is claimed by inserting its dedupe key
//! (`pipeline + repo + sha`, `pipeline + instant`) into `trigger_firings`; the key is the primary
//! key, so of any number of servers, restarts and repeated checks exactly one claim succeeds,
//! and only the claimant submits the run (with the same dedupe key, which the runs table
//! enforces too). A claim whose server died before recording its run becomes stale after a
//! while and may be taken over; a submission repeated that way finds the live run by its key.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::types::Json;

use crate::db::{args, sql, DbTime};
use crate::error::{Result, StoreError};
use crate::types::RunId;
use crate::Store;

/// A trigger as a pipeline spec declares it, for [`Store::register_triggers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTrigger {
    /// Index in the spec's `triggers:` list.
    pub position: u32,
    /// `schedule` or `watch`.
    pub kind: String,
    /// The trigger as written (settings and params), as JSON.
    pub spec: Value,
    /// One line for listings: `cron "0 2 * * *" Europe/Paris, missed: run-once`.
    pub summary: String,
}

/// What the poller carries from one check of a trigger to the next. Stored as JSON; a field
/// that is absent is `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TriggerState {
    /// The ETag of the Hub's last answer (a revision, or an author's model listing), sent back
    /// as `If-None-Match`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// An author watch: the commit of each matching repository at the last listing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seen: Option<BTreeMap<String, String>>,
    /// A schedule whose firing failed: not checked again before this time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<DateTime<Utc>>,
}

/// A registered trigger and its state, as [`Store::list_triggers`] returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerRecord {
    pub id: i64,
    /// The pipeline's name.
    pub pipeline: String,
    /// Index in the spec's `triggers:` list.
    pub position: u32,
    /// `schedule` or `watch`.
    pub kind: String,
    /// The trigger as written (settings and params).
    pub spec: Value,
    /// One line: `cron "0 2 * * *" Europe/Paris, missed: run-once`, `Qwen/Qwen3-0.6B@main every 10m`.
    pub summary: String,
    /// What the poller carries between checks (ETags, an author listing's shas).
    pub state: TriggerState,
    /// When the trigger was last checked (a watch polled, a schedule evaluated).
    pub last_check_at: Option<DateTime<Utc>>,
    /// When it is due next: the next cron instant, or the next poll.
    pub next_at: Option<DateTime<Utc>>,
    /// The commit a watch saw last (for an author watch, the last one that fired).
    pub last_sha: Option<String>,
    /// When it last started a run, and which.
    pub last_fired_at: Option<DateTime<Utc>>,
    pub last_run: Option<RunId>,
    /// The last failed check's error and time (kept after a good check; see `errors`).
    pub last_error: Option<String>,
    pub last_error_at: Option<DateTime<Utc>>,
    /// Failed checks in a row (0 after a good one).
    pub errors: u32,
}

/// The outcome of one check, for [`Store::record_trigger_check`].
#[derive(Debug, Clone, PartialEq)]
pub struct TriggerCheck {
    pub checked_at: DateTime<Utc>,
    pub next_at: Option<DateTime<Utc>>,
    /// A new `last_sha`; `None` keeps the old one.
    pub last_sha: Option<String>,
    /// A new `state`; `None` keeps the old one.
    pub state: Option<TriggerState>,
    /// `Some`: the check failed (`errors` + 1); `None`: it succeeded (`errors` = 0).
    pub error: Option<String>,
}

/// A claimed or made firing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FiringRecord {
    pub dedupe_key: String,
    pub trigger_id: i64,
    /// What fired: `{repo, sha}` or `{instant}`.
    pub detail: Value,
    pub claimed_at: DateTime<Utc>,
    /// The run it started, once recorded.
    pub run: Option<RunId>,
    pub fired_at: Option<DateTime<Utc>>,
    /// Why it started no run: its pipeline was at its concurrency limit with `overflow: skip`
    /// ("skipped: pipeline nightly at its limit 1 (live: run 12)"). Such a firing is done.
    #[serde(default)]
    pub skipped: Option<String>,
}

/// The answer to [`Store::claim_firing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FiringClaim {
    /// This caller owns the firing: submit the run, then [`Store::complete_firing`].
    Claimed,
    /// Someone claimed it already; `run` once it is recorded.
    Taken { run: Option<RunId> },
    /// It fired already and started no run: its pipeline was at its limit (`overflow: skip`).
    Skipped,
}

#[derive(sqlx::FromRow)]
struct TriggerRow {
    id: i64,
    pipeline: String,
    position: i64,
    kind: String,
    spec: Json<Value>,
    summary: String,
    state: Json<Value>,
    last_check_at: Option<DbTime>,
    next_at: Option<DbTime>,
    last_sha: Option<String>,
    last_fired_at: Option<DbTime>,
    last_run_id: Option<i64>,
    last_error: Option<String>,
    last_error_at: Option<DbTime>,
    errors: i64,
}

const TRIGGER_COLS: &str = "id, pipeline, position, kind, spec, summary, state, last_check_at, next_at, last_sha, \
                            last_fired_at, last_run_id, last_error, last_error_at, errors";

impl TriggerRow {
    fn into_record(self) -> Result<TriggerRecord> {
        let corrupt = |detail: String| StoreError::Corrupt { table: "triggers", detail };
        Ok(TriggerRecord {
            id: self.id,
            position: u32::try_from(self.position).map_err(|_| corrupt(format!("position {}", self.position)))?,
            pipeline: self.pipeline,
            kind: self.kind,
            spec: self.spec.0,
            summary: self.summary,
            state: serde_json::from_value(self.state.0)
                .map_err(|e| corrupt(format!("`state` of trigger {}: {e}", self.id)))?,
            last_check_at: self.last_check_at.map(|t| t.0),
            next_at: self.next_at.map(|t| t.0),
            last_sha: self.last_sha,
            last_fired_at: self.last_fired_at.map(|t| t.0),
            last_run: self.last_run_id.map(RunId),
            last_error: self.last_error,
            last_error_at: self.last_error_at.map(|t| t.0),
            errors: u32::try_from(self.errors.max(0)).unwrap_or(u32::MAX),
        })
    }
}

#[derive(sqlx::FromRow)]
struct FiringRow {
    dedupe_key: String,
    trigger_id: i64,
    detail: Json<Value>,
    claimed_at: DbTime,
    run_id: Option<i64>,
    fired_at: Option<DbTime>,
    skipped: Option<String>,
}

impl FiringRow {
    fn into_record(self) -> FiringRecord {
        FiringRecord {
            dedupe_key: self.dedupe_key,
            trigger_id: self.trigger_id,
            detail: self.detail.0,
            claimed_at: self.claimed_at.0,
            run: self.run_id.map(RunId),
            fired_at: self.fired_at.map(|t| t.0),
            skipped: self.skipped,
        }
    }
}

impl Store {
    /// Registers the triggers of `pipeline` (all of them: other positions are removed)
    /// and returns their rows. A trigger whose spec is unchanged keeps its state; a changed one
    /// starts afresh (its firings stay, so a watch does not fire twice for a sha).
    pub async fn register_triggers(
        &self,
        pipeline: &str,
        triggers: &[NewTrigger],
    ) -> Result<Vec<TriggerRecord>, StoreError> {
        if pipeline.is_empty() || pipeline.len() > 512 {
            return Err(StoreError::InvalidArgument(format!("pipeline name of {} bytes", pipeline.len())));
        }
        for t in triggers {
            if t.kind != "schedule" && t.kind != "watch" {
                return Err(StoreError::InvalidArgument(format!("unknown trigger kind `{}`", t.kind)));
            }
        }
        let fresh = json!(TriggerState::default());
        self.retrying("register_triggers", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                for t in triggers {
                    c.exec(
                        sql!(
                            "INSERT INTO triggers (pipeline, position, kind, spec, summary) VALUES ($1, $2, $3, $4, $5) \
                             ON CONFLICT (pipeline, position) DO UPDATE SET \
                               state = CASE WHEN triggers.spec = excluded.spec THEN triggers.state ELSE $6 END, \
                               next_at = CASE WHEN triggers.spec = excluded.spec THEN triggers.next_at ELSE NULL END, \
                               last_sha = CASE WHEN triggers.spec = excluded.spec THEN triggers.last_sha ELSE NULL END, \
                               errors = CASE WHEN triggers.spec = excluded.spec THEN triggers.errors ELSE 0 END, \
                               kind = excluded.kind, spec = excluded.spec, summary = excluded.summary, \
                               updated_at = {now}"
                        ),
                        args![pipeline, i64::from(t.position), &t.kind, &t.spec, &t.summary, fresh.clone()],
                    )
                    .await?;
                }
                let positions: Vec<u32> = triggers.iter().map(|t| t.position).collect();
                c.exec(
                    sql!("DELETE FROM triggers WHERE pipeline = $1 AND position NOT IN {ids:$2}"),
                    args![pipeline, json!(positions)],
                )
                .await?;
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await?;
        Ok(self.list_triggers().await?.into_iter().filter(|t| t.pipeline == pipeline).collect())
    }

    /// Every registered trigger with its last and next firing, by pipeline and position. The
    /// records serialize to JSON for the CLI and the HTTP API.
    pub async fn list_triggers(&self) -> Result<Vec<TriggerRecord>, StoreError> {
        self.retrying("list_triggers", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<TriggerRow> = c
                .conn()
                .all(sql!(&format!("SELECT {TRIGGER_COLS} FROM triggers ORDER BY pipeline, position")), args![])
                .await?;
            rows.into_iter().map(TriggerRow::into_record).collect()
        })
        .await
    }

    /// One trigger by id.
    pub async fn trigger(&self, id: i64) -> Result<Option<TriggerRecord>, StoreError> {
        self.retrying("trigger", || async {
            let mut c = self.pool().acquire().await?;
            let row: Option<TriggerRow> =
                c.conn().opt(sql!(&format!("SELECT {TRIGGER_COLS} FROM triggers WHERE id = $1")), args![id]).await?;
            row.map(TriggerRow::into_record).transpose()
        })
        .await
    }

    /// Records a check's outcome (see [`TriggerCheck`]). Returns `false` when the trigger is gone.
    pub async fn record_trigger_check(&self, id: i64, check: &TriggerCheck) -> Result<bool, StoreError> {
        self.retrying("record_trigger_check", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(
                    sql!(
                        "UPDATE triggers SET last_check_at = $2, next_at = $3, \
                           last_sha = COALESCE($4, last_sha), state = COALESCE($5, state), \
                           errors = CASE WHEN $6 IS NULL THEN 0 ELSE errors + 1 END, \
                           last_error = COALESCE($6, last_error), \
                           last_error_at = CASE WHEN $6 IS NULL THEN last_error_at ELSE $2 END, \
                           updated_at = {now} \
                         WHERE id = $1"
                    ),
                    args![
                        id,
                        check.checked_at,
                        check.next_at,
                        check.last_sha.clone(),
                        check.state.as_ref().map(|st| json!(st)),
                        check.error.clone()
                    ],
                )
                .await?;
            Ok(n > 0)
        })
        .await
    }

    /// Claims the firing named `dedupe_key` for trigger `trigger_id` at `now`. Exactly one caller
    /// gets [`FiringClaim::Claimed`] for a key, unless that claim recorded no run within
    /// `stale_after` (its server died): then the next caller takes it over.
    pub async fn claim_firing(
        &self,
        trigger_id: i64,
        dedupe_key: &str,
        detail: &Value,
        now: DateTime<Utc>,
        stale_after: Duration,
    ) -> Result<FiringClaim, StoreError> {
        if dedupe_key.is_empty() || dedupe_key.len() > 2048 {
            return Err(StoreError::InvalidArgument(format!("dedupe key of {} bytes", dedupe_key.len())));
        }
        let stale_before = now
            - chrono::Duration::from_std(stale_after)
                .map_err(|_| StoreError::InvalidArgument(format!("stale_after {stale_after:?}")))?;
        // Not repeated once it may have committed: a lost reply leaves a claim without a run,
        // which goes stale and is taken over.
        self.retrying_conflicts("claim_firing", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                let inserted: Option<(String,)> = c
                    .opt(
                        sql!(
                            "INSERT INTO trigger_firings (dedupe_key, trigger_id, detail, claimed_at) \
                             VALUES ($1, $2, $3, $4) ON CONFLICT (dedupe_key) DO NOTHING RETURNING dedupe_key"
                        ),
                        args![dedupe_key, trigger_id, detail, now],
                    )
                    .await?;
                if inserted.is_some() {
                    return Ok(FiringClaim::Claimed);
                }
                let taken_over: Option<(String,)> = c
                    .opt(
                        sql!(
                            "UPDATE trigger_firings SET claimed_at = $2, trigger_id = $3 \
                             WHERE dedupe_key = $1 AND run_id IS NULL AND fired_at IS NULL AND claimed_at < $4 \
                             RETURNING dedupe_key"
                        ),
                        args![dedupe_key, now, trigger_id, stale_before],
                    )
                    .await?;
                if taken_over.is_some() {
                    return Ok(FiringClaim::Claimed);
                }
                let row: Option<(Option<i64>, Option<String>)> = c
                    .opt(sql!("SELECT run_id, skipped FROM trigger_firings WHERE dedupe_key = $1"), args![dedupe_key])
                    .await?;
                Ok(match row {
                    Some((None, Some(_))) => FiringClaim::Skipped,
                    other => FiringClaim::Taken { run: other.and_then(|(r, _)| r).map(RunId) },
                })
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// Gives up a claim that started no run (its submission failed), so that the next check
    /// claims it afresh instead of waiting for it to go stale. A firing with a run stays.
    pub async fn release_firing(&self, dedupe_key: &str) -> Result<(), StoreError> {
        self.retrying("release_firing", || async {
            let mut c = self.pool().acquire().await?;
            c.conn()
                .exec(sql!("DELETE FROM trigger_firings WHERE dedupe_key = $1 AND run_id IS NULL"), args![dedupe_key])
                .await?;
            Ok(())
        })
        .await
    }

    /// Records the run a claimed firing started, on the firing and as the trigger's last run.
    pub async fn complete_firing(
        &self,
        trigger_id: i64,
        dedupe_key: &str,
        run: RunId,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        self.retrying("complete_firing", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                c.exec(
                    sql!("UPDATE trigger_firings SET run_id = $2, fired_at = $3 WHERE dedupe_key = $1"),
                    args![dedupe_key, run.0, now],
                )
                .await?;
                c.exec(
                    sql!("UPDATE triggers SET last_fired_at = $2, last_run_id = $3, updated_at = {now} WHERE id = $1"),
                    args![trigger_id, now, run.0],
                )
                .await?;
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// Records that a claimed firing started no run, and why (its pipeline was at its
    /// concurrency limit with `overflow: skip`): the firing is done, never taken over.
    pub async fn skip_firing(&self, dedupe_key: &str, reason: &str, now: DateTime<Utc>) -> Result<(), StoreError> {
        self.retrying("skip_firing", || async {
            let mut c = self.pool().acquire().await?;
            c.conn()
                .exec(
                    sql!(
                        "UPDATE trigger_firings SET skipped = $2, fired_at = $3 \
                         WHERE dedupe_key = $1 AND run_id IS NULL"
                    ),
                    args![dedupe_key, reason, now],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// One firing by dedupe key.
    pub async fn firing(&self, dedupe_key: &str) -> Result<Option<FiringRecord>, StoreError> {
        self.retrying("firing", || async {
            let mut c = self.pool().acquire().await?;
            let row: Option<FiringRow> = c
                .conn()
                .opt(
                    sql!(
                        "SELECT dedupe_key, trigger_id, detail, claimed_at, run_id, fired_at, skipped \
                         FROM trigger_firings WHERE dedupe_key = $1"
                    ),
                    args![dedupe_key],
                )
                .await?;
            Ok(row.map(FiringRow::into_record))
        })
        .await
    }

    /// The firings of a trigger, oldest claim first.
    pub async fn trigger_firings(&self, trigger_id: i64) -> Result<Vec<FiringRecord>, StoreError> {
        self.retrying("trigger_firings", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<FiringRow> = c
                .conn()
                .all(
                    sql!(
                        "SELECT dedupe_key, trigger_id, detail, claimed_at, run_id, fired_at, skipped \
                         FROM trigger_firings WHERE trigger_id = $1 ORDER BY claimed_at, dedupe_key"
                    ),
                    args![trigger_id],
                )
                .await?;
            Ok(rows.into_iter().map(FiringRow::into_record).collect())
        })
        .await
    }
}
