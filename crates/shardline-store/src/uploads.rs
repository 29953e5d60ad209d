//! Multipart uploads tasks opened in an object store. A task registers an upload under its live
//! lease as soon as the store has given it an id; the commit task marks the uploads it completed;
//! an upload whose attempt ended without success, or whose run has ended, is *abandoned*: the
//! worker that opened it or the server's reaper aborts it and marks it so. No upload is
//! completed later by anyone else, so nothing partial ever becomes an object.

use crate::db::{args, sql};
use crate::error::Result;
use crate::types::{Lease, RunId};
use crate::Store;

/// An upload that is open in its store.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct OpenUpload {
    /// The store's row id.
    pub id: i64,
    pub run_id: i64,
    pub task_id: i64,
    /// The store's URL (`s3://bucket/prefix`) the key is relative to.
    pub store_url: String,
    pub object_key: String,
    pub upload_id: String,
}

/// How an upload ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadEnd {
    Completed,
    Aborted,
}

impl Store {
    /// Records an upload `lease`'s task opened. `false`: the lease is no longer the task's
    /// (reaped, cancelled): the caller must abort the upload itself.
    pub async fn register_upload(
        &self,
        lease: &Lease,
        store_url: &str,
        object_key: &str,
        upload_id: &str,
    ) -> Result<bool> {
        self.retrying("register_upload", || async {
            let mut c = self.pool().acquire().await?;
            let n = c
                .conn()
                .exec(
                    sql!(
                        "INSERT INTO uploads (run_id, task_id, token, store_url, object_key, upload_id) \
                         SELECT run_id, id, lease_token, $3, $4, $5 FROM tasks \
                         WHERE id = $1 AND lease_token = $2 AND state = 'leased'"
                    ),
                    args![lease.task.id.0, lease.token, store_url, object_key, upload_id],
                )
                .await?;
            Ok(n == 1)
        })
        .await
    }

    /// Marks the upload `upload_id` of `object_key` in `store_url` as ended (idempotent).
    pub async fn end_upload(&self, store_url: &str, object_key: &str, upload_id: &str, end: UploadEnd) -> Result<()> {
        let state = match end {
            UploadEnd::Completed => "completed",
            UploadEnd::Aborted => "aborted",
        };
        self.retrying("end_upload", || async {
            let mut c = self.pool().acquire().await?;
            c.conn()
                .exec(
                    sql!(
                        "UPDATE uploads SET state = $4, ended_at = {now} \
                         WHERE store_url = $1 AND object_key = $2 AND upload_id = $3 AND state = 'open'"
                    ),
                    args![store_url, object_key, upload_id, state],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// Open uploads nobody will complete: their attempt ended without success, a later attempt
    /// of their task exists, or their run has ended. At most `limit`, oldest first.
    pub async fn abandoned_uploads(&self, limit: i64) -> Result<Vec<OpenUpload>> {
        self.retrying("abandoned_uploads", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<OpenUpload> = c
                .conn()
                .all(
                    sql!(
                        "SELECT u.id, u.run_id, u.task_id, u.store_url, u.object_key, u.upload_id FROM uploads u \
                         JOIN runs r ON r.id = u.run_id \
                         JOIN tasks t ON t.id = u.task_id \
                         LEFT JOIN attempts a ON a.task_id = u.task_id AND a.token = u.token \
                         WHERE u.state = 'open' AND ( \
                             r.state IN ('succeeded', 'failed', 'cancelled') \
                             OR (a.outcome IS NOT NULL AND a.outcome <> 'succeeded') \
                             OR t.lease_token > u.token) \
                         ORDER BY u.id LIMIT $1"
                    ),
                    args![limit],
                )
                .await?;
            Ok(rows)
        })
        .await
    }

    /// Every upload of `run` still open (what the run's commit has yet to complete, or a test's
    /// check that none is left).
    pub async fn open_uploads(&self, run: RunId) -> Result<Vec<OpenUpload>> {
        self.retrying("open_uploads", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<OpenUpload> = c
                .conn()
                .all(
                    sql!(
                        "SELECT id, run_id, task_id, store_url, object_key, upload_id FROM uploads \
                         WHERE run_id = $1 AND state = 'open' ORDER BY id"
                    ),
                    args![run.0],
                )
                .await?;
            Ok(rows)
        })
        .await
    }

    /// Whether any task recorded the upload `upload_id` (open or ended), in whatever store.
    pub async fn upload_recorded(&self, upload_id: &str) -> Result<bool> {
        self.retrying("upload_recorded", || async {
            let mut c = self.pool().acquire().await?;
            let row: Option<(i64,)> =
                c.conn().opt(sql!("SELECT id FROM uploads WHERE upload_id = $1 LIMIT 1"), args![upload_id]).await?;
            Ok(row.is_some())
        })
        .await
    }
}
