//! Disk as a resource: what workers measure of the disk they write to (reported with their
//! heartbeats, shown by "why waiting" and the metrics), and the scratch needs a task learns for
//! other tasks of its run (a shard plan knows each rank file's size), set in its completion.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::db::{args, sql, Conn};
use crate::error::{Result, StoreError};
use crate::types::WorkerId;
use crate::Store;

/// What a worker measured of the file system its work directory is on, and the scratch it
/// offered to claims at that moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDisk {
    /// Bytes available to the worker (statvfs `f_bavail` blocks).
    pub free: u64,
    /// Bytes of the file system.
    pub total: u64,
    /// Scratch it offers: `free` less its reserve and its leases' scratch, at most its configured
    /// scratch less its leases'.
    pub scratch_free: u64,
}

impl WorkerDisk {
    /// From the three stored columns; `None` unless all are there (a worker that never reported).
    pub(crate) fn from_columns(free: Option<i64>, total: Option<i64>, scratch_free: Option<i64>) -> Option<WorkerDisk> {
        let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
        Some(WorkerDisk { free: unsigned(free?), total: unsigned(total?), scratch_free: unsigned(scratch_free?) })
    }
}

/// A task's scratch need, learned by another task of its run: a shard plan knows how large each
/// rank file will be. Set in the succeeding task's completion ([`Store::complete_with`]); it
/// never lowers a need, so a spec's `resources: scratch:` stays a floor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScratchNeed {
    /// The task's name (unique within the run).
    pub task: String,
    /// Bytes of scratch it needs.
    pub bytes: u64,
}

impl Store {
    /// Records that the worker is alive (and active again if it was stopped), with what it
    /// measured of its disk.
    pub async fn worker_heartbeat_with_disk(&self, w: WorkerId, disk: &WorkerDisk) -> Result<(), StoreError> {
        let signed = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let a = args![w.0, signed(disk.free), signed(disk.total), signed(disk.scratch_free)];
        self.retrying("worker_heartbeat_with_disk", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(
                    sql!(
                        "UPDATE workers SET last_heartbeat = {now}, state = 'active', disk_free = $2, \
                             disk_total = $3, scratch_free = $4 \
                         WHERE id = $1"
                    ),
                    a.clone(),
                )
                .await?;
            if n == 0 {
                return Err(StoreError::WorkerNotFound(w));
            }
            Ok(())
        })
        .await
    }

    /// A success with scratch needs on PostgreSQL: the lease's row locked and checked first
    /// (tasks before dependents before the run, as everywhere), the needs raised, then
    /// `complete_succeeded`, in one transaction. `None`: the lease is not current.
    pub(crate) async fn pg_succeeded_with_needs(
        &self,
        task: i64,
        token: i64,
        output: &Value,
        needs: &[ScratchNeed],
    ) -> Result<Option<i64>> {
        let mut tx = self.pool().begin().await?;
        let result = async {
            let mut c = tx.conn();
            let row: Option<(i64,)> = c
                .opt(
                    sql!(
                        "SELECT run_id FROM tasks WHERE id = $1 AND lease_token = $2 AND state = 'leased' {for_update}"
                    ),
                    args![task, token],
                )
                .await?;
            let Some((run_id,)) = row else { return Ok(None) };
            set_scratch_needs(&mut c, run_id, needs).await?;
            let (accepted, promoted): (bool, i64) = c
                .one(sql!("SELECT accepted, promoted FROM complete_succeeded($1, $2, $3)"), args![task, token, output])
                .await?;
            Ok(accepted.then_some(promoted))
        }
        .await;
        tx.finish(result).await
    }
}

/// Raises the scratch needs of tasks of `run` that have not started (blocked or ready) to
/// `needs`, never lowering one. One statement, inside the completion's transaction.
pub(crate) async fn set_scratch_needs(c: &mut Conn<'_>, run: i64, needs: &[ScratchNeed]) -> Result<()> {
    if needs.is_empty() {
        return Ok(());
    }
    // One entry per task (the largest need), as `[name, bytes]` pairs.
    let mut by_task: BTreeMap<&str, u64> = BTreeMap::new();
    for n in needs {
        let e = by_task.entry(n.task.as_str()).or_default();
        *e = (*e).max(n.bytes);
    }
    let pairs: Vec<_> = by_task.into_iter().map(|(t, b)| json!([t, i64::try_from(b).unwrap_or(i64::MAX)])).collect();
    c.exec(
        sql!(
            pg: "UPDATE tasks t SET scratch = GREATEST(t.scratch, n.bytes), updated_at = {now} \
                 FROM (SELECT e->>0 AS name, (e->>1)::bigint AS bytes FROM jsonb_array_elements($2) e) n \
                 WHERE t.run_id = $1 AND t.name = n.name AND t.state IN ('blocked', 'ready')",
            lite: "UPDATE tasks SET scratch = MAX(scratch, (SELECT CAST(json_extract(n.value, '$[1]') AS INTEGER) \
                       FROM json_each($2) n WHERE json_extract(n.value, '$[0]') = tasks.name)), \
                       updated_at = {now} \
                   WHERE run_id = $1 AND state IN ('blocked', 'ready') \
                     AND name IN (SELECT json_extract(value, '$[0]') FROM json_each($2))"
        ),
        args![run, serde_json::Value::Array(pairs)],
    )
    .await?;
    Ok(())
}
