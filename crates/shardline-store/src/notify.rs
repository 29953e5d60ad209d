//! Notifications: the webhook targets of runs, pipelines and servers, and the outbox the servers
//! deliver from.
//!
//! Rows of `notifications` are never inserted from Rust for a run: a database trigger on `runs`
//! enqueues them in the statement that moves a run to `succeeded`, `failed` or `cancelled`
//! (whichever of the store's paths does it), one per URL that asked for that event, keyed so a
//! repeated finish adds nothing. A trigger on `triggers` does the same for the first error of a
//! trigger's error streak. Delivery is leased like a task: [`Store::claim_notifications`] hands
//! out due rows with a fencing token, [`Store::record_delivery`] records an attempt only while the
//! token is current.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::db::{args, sql, Conn, DbTime};
use crate::error::{Result, StoreError};
use crate::records::parse;
use crate::types::*;
use crate::Store;

/// A webhook and what it wants to hear about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyTarget {
    /// As written; may hold `${ENV_VAR}` references the delivering server expands.
    pub url: String,
    pub events: Vec<NotifyEvent>,
    pub format: NotifyFormat,
}

/// One notification and its delivery so far.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notification {
    pub id: i64,
    /// The run it is about (`None` for a trigger error).
    pub run: Option<RunId>,
    /// The trigger it is about (trigger errors).
    pub trigger_id: Option<i64>,
    pub event: NotifyEvent,
    /// The target as written (secrets and all): redact before showing it.
    pub url: String,
    pub format: NotifyFormat,
    /// Trigger errors: the trigger's pipeline.
    pub detail: Option<String>,
    pub state: DeliveryState,
    /// Attempts made so far.
    pub attempts: u32,
    pub next_at: DateTime<Utc>,
    /// The HTTP status of the last attempt, if it got one.
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

/// A notification leased for delivery: [`Store::record_delivery`] needs its token.
#[derive(Debug, Clone, PartialEq)]
pub struct NotificationLease {
    pub notification: Notification,
    pub token: i64,
}

/// What one delivery attempt did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// The receiver answered 2xx.
    Delivered { status: u16 },
    /// No 2xx: tried again after `retry_in`, or never again when it is `None`.
    Failed { status: Option<u16>, error: String, retry_in: Option<Duration> },
}

const NOTIFICATION_COLS: &str = "id, run_id, trigger_id, event, url, format, detail, state, attempts, next_at, \
     last_status, last_error, last_attempt_at, delivered_at, created_at, lease_token";

#[derive(sqlx::FromRow)]
struct NotificationRecord {
    id: i64,
    run_id: Option<i64>,
    trigger_id: Option<i64>,
    event: String,
    url: String,
    format: String,
    detail: Option<String>,
    state: String,
    attempts: i64,
    next_at: DbTime,
    last_status: Option<i64>,
    last_error: Option<String>,
    last_attempt_at: Option<DbTime>,
    delivered_at: Option<DbTime>,
    created_at: DbTime,
    lease_token: i64,
}

impl NotificationRecord {
    fn into_lease(self) -> Result<NotificationLease> {
        let corrupt = |column: &str, v: i64| StoreError::Corrupt {
            table: "notifications",
            detail: format!("`{column}` = {v} is out of range"),
        };
        let notification = Notification {
            id: self.id,
            run: self.run_id.map(RunId),
            trigger_id: self.trigger_id,
            event: parse("notifications", &self.event)?,
            url: self.url,
            format: parse("notifications", &self.format)?,
            detail: self.detail,
            state: parse("notifications", &self.state)?,
            attempts: u32::try_from(self.attempts).map_err(|_| corrupt("attempts", self.attempts))?,
            next_at: self.next_at.0,
            last_status: self
                .last_status
                .map(|s| u16::try_from(s).map_err(|_| corrupt("last_status", s)))
                .transpose()?,
            last_error: self.last_error,
            last_attempt_at: self.last_attempt_at.map(|t| t.0),
            delivered_at: self.delivered_at.map(|t| t.0),
            created_at: self.created_at.0,
        };
        Ok(NotificationLease { notification, token: self.lease_token })
    }
}

/// `,failed,succeeded,`: what the triggers' `LIKE '%,event,%'` matches.
fn events_column(events: &[NotifyEvent]) -> String {
    let mut s = String::from(",");
    for e in events {
        s.push_str(e.as_str());
        s.push(',');
    }
    s
}

/// The longest error text kept per attempt.
const MAX_ERROR: usize = 2000;

fn check_targets(targets: &[NotifyTarget]) -> Result<()> {
    for t in targets {
        if t.url.is_empty() || t.url.len() > 4096 {
            return Err(StoreError::InvalidArgument(format!("a notification URL of {} bytes", t.url.len())));
        }
    }
    Ok(())
}

/// Stores a new run's targets, in the transaction that creates it.
pub(crate) async fn insert_run_targets(c: &mut Conn<'_>, run: i64, targets: &[NotifyTarget]) -> Result<()> {
    for (i, t) in targets.iter().enumerate() {
        c.exec(
            sql!("INSERT INTO run_notify_targets (run_id, position, url, events, format) VALUES ($1, $2, $3, $4, $5)"),
            args![run, i64::try_from(i).unwrap_or(i64::MAX), &t.url, events_column(&t.events), t.format.as_str()],
        )
        .await?;
    }
    Ok(())
}

pub(crate) fn check_run_targets(targets: &[NotifyTarget]) -> Result<()> {
    check_targets(targets)
}

impl Store {
    /// Replaces the server-wide targets (`shardline server --notify`): every run that finishes
    /// from now on, and every trigger error, is also sent to them. Servers sharing a store
    /// share them; the last one started sets them.
    pub async fn set_default_notify_targets(&self, targets: &[NotifyTarget]) -> Result<(), StoreError> {
        check_targets(targets)?;
        self.retrying("set_default_notify_targets", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                // Servers starting together each replace the defaults: one after the other, else
                // the second's inserts meet the first's rows its delete did not see.
                c.exec(sql!("{lock:notify_defaults}"), args![]).await?;
                c.exec(sql!("DELETE FROM notify_defaults"), args![]).await?;
                for (i, t) in targets.iter().enumerate() {
                    c.exec(
                        sql!("INSERT INTO notify_defaults (position, url, events, format) VALUES ($1, $2, $3, $4)"),
                        args![
                            i64::try_from(i).unwrap_or(i64::MAX),
                            &t.url,
                            events_column(&t.events),
                            t.format.as_str()
                        ],
                    )
                    .await?;
                }
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// Replaces the targets a pipeline's trigger errors go to (its spec's `notify:`), as the
    /// server that registers its triggers read it.
    pub async fn set_pipeline_notify_targets(
        &self,
        pipeline: &str,
        targets: &[NotifyTarget],
    ) -> Result<(), StoreError> {
        check_targets(targets)?;
        self.retrying("set_pipeline_notify_targets", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                c.exec(sql!("{lock:pipeline_notify_targets}"), args![]).await?;
                c.exec(sql!("DELETE FROM pipeline_notify_targets WHERE pipeline = $1"), args![pipeline]).await?;
                for (i, t) in targets.iter().enumerate() {
                    c.exec(
                        sql!(
                            "INSERT INTO pipeline_notify_targets (pipeline, position, url, events, format) \
                             VALUES ($1, $2, $3, $4, $5)"
                        ),
                        args![
                            pipeline,
                            i64::try_from(i).unwrap_or(i64::MAX),
                            &t.url,
                            events_column(&t.events),
                            t.format.as_str()
                        ],
                    )
                    .await?;
                }
                Ok(())
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// The notifications of a run, oldest first.
    pub async fn run_notifications(&self, run: RunId) -> Result<Vec<Notification>, StoreError> {
        self.retrying("run_notifications", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<NotificationRecord> = c
                .conn()
                .all(
                    sql!(&format!("SELECT {NOTIFICATION_COLS} FROM notifications WHERE run_id = $1 ORDER BY id")),
                    args![run.0],
                )
                .await?;
            rows.into_iter().map(|r| r.into_lease().map(|l| l.notification)).collect()
        })
        .await
    }

    /// The notifications about a trigger's errors, oldest first.
    pub async fn trigger_notifications(&self, trigger_id: i64) -> Result<Vec<Notification>, StoreError> {
        self.retrying("trigger_notifications", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<NotificationRecord> = c
                .conn()
                .all(
                    sql!(&format!("SELECT {NOTIFICATION_COLS} FROM notifications WHERE trigger_id = $1 ORDER BY id")),
                    args![trigger_id],
                )
                .await?;
            rows.into_iter().map(|r| r.into_lease().map(|l| l.notification)).collect()
        })
        .await
    }

    /// Leases up to `limit` pending notifications that are due and not leased (or whose lease
    /// expired), for `ttl`. Concurrent callers never get the same row while its lease runs.
    pub async fn claim_notifications(&self, limit: u32, ttl: Duration) -> Result<Vec<NotificationLease>, StoreError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        // Not repeated once it may have committed: a repeat would lease rows a second time.
        self.retrying_conflicts("claim_notifications", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                let ids: Vec<(i64,)> = c
                    .all(
                        sql!(
                            "SELECT id FROM notifications WHERE state = 'pending' AND next_at <= {now} \
                             AND (lease_until IS NULL OR lease_until < {now}) ORDER BY next_at, id LIMIT $1 {skip_locked}"
                        ),
                        args![i64::from(limit)],
                    )
                    .await?;
                let mut out = Vec::with_capacity(ids.len());
                for (id,) in ids {
                    let row: NotificationRecord = c
                        .one(
                            sql!(&format!(
                                "UPDATE notifications SET lease_until = {{now}} + {{ms:$2}}, lease_token = lease_token + 1 \
                                 WHERE id = $1 RETURNING {NOTIFICATION_COLS}"
                            )),
                            args![id, ttl_ms],
                        )
                        .await?;
                    out.push(row.into_lease()?);
                }
                Ok(out)
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// Records one delivery attempt of a leased notification and ends its lease. Returns
    /// `false` (and records nothing) when the lease is no longer the current one.
    pub async fn record_delivery(
        &self,
        lease: &NotificationLease,
        outcome: &DeliveryOutcome,
    ) -> Result<bool, StoreError> {
        let id = lease.notification.id;
        let (state, status, error, retry_ms) = match outcome {
            DeliveryOutcome::Delivered { status } => (DeliveryState::Delivered, Some(i64::from(*status)), None, 0),
            DeliveryOutcome::Failed { status, error, retry_in } => {
                let error: String = crate::lease::clean(error).chars().take(MAX_ERROR).collect();
                match retry_in {
                    Some(d) => (
                        DeliveryState::Pending,
                        status.map(i64::from),
                        Some(error),
                        i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
                    ),
                    None => (DeliveryState::Failed, status.map(i64::from), Some(error), 0),
                }
            }
        };
        self.retrying("record_delivery", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(
                    sql!(
                        "UPDATE notifications SET state = $3, attempts = attempts + 1, last_status = $4, \
                           last_error = $5, last_attempt_at = {now}, next_at = {now} + {ms:$6}, lease_until = NULL, \
                           delivered_at = CASE WHEN $3 = 'delivered' THEN {now} ELSE delivered_at END \
                         WHERE id = $1 AND lease_token = $2 AND state = 'pending' AND lease_until IS NOT NULL"
                    ),
                    args![id, lease.token, state.as_str(), status, error.clone(), retry_ms],
                )
                .await?;
            Ok(n > 0)
        })
        .await
    }
}
