//! Runs pipelines: workers lease the tasks of a run's graph (built and submitted by
//! `shardline-control`) and execute them ([`worker`], [`steps`], [`hub`], [`objects`],
//! [`checkpoints`], [`command`]), offering the scratch their disk has free ([`disk`]); the
//! reaper returns expired leases to the queue; [`gc`] frees what finished runs and old caches
//! left in a work directory.
//!
//! **Owns:** what each task does and the worker loop (leases, heartbeats, logs, the step cache),
//! and the retention of a work directory (what the gc frees and keeps).
//! **Must not depend on:** the HTTP API, the trigger poller or the CLI; it reads payloads as
//! `shardline-control` defines them and never writes SQL (the store does).
//!
//! **Architecture invariant:** only the store changes task state, and every change after a claim
//! carries the lease's fencing token. No task needs another task's in-memory state: each reads
//! the outputs its needs recorded, and sharding tasks rebuild the recorded plan from the run's
//! inputs (checking its digest).

pub mod checkpoints;
pub mod command;
pub mod disk;
pub mod gc;
pub mod hub;
pub mod objects;
mod rank_task;
pub mod reader_needs;
pub mod remote;
mod remote_reshard;
mod sparse_checkpoint;
pub mod steps;
pub mod validate;
pub mod worker;

use std::time::Duration;

use shardline_store::Store;
use tokio::sync::watch;

pub use disk::{DiskSettings, DEFAULT_SCRATCH_RESERVE};
pub use hub::HubSettings;
pub use objects::ObjectSourceSettings;
pub use worker::{run_worker, WorkerConfig};

/// Returns expired leases to the queue every `every`, until `shutdown`, and aborts the
/// multipart uploads nobody will complete (their attempt ended without success, or their run
/// ended). Safe to run in several servers at once (the store's reaper is idempotent, and aborting
/// an upload twice is harmless).
pub async fn reaper(store: Store, every: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = store.reap_expired().await {
                    tracing::warn!("reaping expired leases failed (will retry): {e}");
                }
                abort_abandoned_uploads(&store).await;
            }
            _ = shutdown.changed() => {
                if *shutdown.borrow() { return; }
            }
        }
    }
}

/// Aborts a batch of abandoned multipart uploads (see [`reaper`]).
async fn abort_abandoned_uploads(store: &Store) {
    let abandoned = match store.abandoned_uploads(shardline_store::REAP_BATCH as i64).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!("listing abandoned uploads failed (will retry): {e}");
            return;
        }
    };
    for u in abandoned {
        match remote::abort(store, &u.store_url, &u.object_key, &u.upload_id).await {
            Ok(()) => tracing::info!("aborted the abandoned upload of `{}` in {}", u.object_key, u.store_url),
            Err(e) => {
                tracing::warn!("aborting the upload of `{}` in {} failed (will retry): {e}", u.object_key, u.store_url)
            }
        }
    }
}

/// How old an upload the object store lists as open, and no task recorded, must be before it is
/// taken for abandoned: a task records its upload right after the store creates it, so only one
/// whose creator died in between stays unrecorded this long.
pub const UNRECORDED_UPLOAD_AGE: Duration = Duration::from_secs(600);

/// Aborts the multipart uploads open under `artifacts` that no task recorded and that were
/// created more than `min_age` ago (an upload the store gives no creation time for counts as
/// old); returns how many. Where the store cannot list its uploads, does nothing.
pub async fn abort_unrecorded_uploads(
    store: &Store,
    artifacts: &shardline_artifacts::Artifacts,
    min_age: Duration,
) -> Result<u64, String> {
    let Some(open) = artifacts.open_uploads().await.map_err(|e| e.to_string())? else { return Ok(0) };
    let cutoff = chrono::Utc::now() - chrono::Duration::from_std(min_age).unwrap_or(chrono::Duration::MAX);
    let mut aborted = 0;
    for u in open.into_iter().filter(|u| u.initiated.is_none_or(|t| t <= cutoff)) {
        if store.upload_recorded(&u.upload_id).await.map_err(|e| e.to_string())? {
            continue; // the ledger's own: the reaper settles it when its attempt ends
        }
        artifacts.abort(&u.key, &u.upload_id).await.map_err(|e| e.to_string())?;
        tracing::info!("aborted the unrecorded upload of `{}` in {}", u.key, artifacts.url());
        aborted += 1;
    }
    Ok(aborted)
}
