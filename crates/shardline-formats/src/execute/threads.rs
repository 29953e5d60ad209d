//! The threads of a write: the sync thread that makes rank files durable, and the pool of
//! writers that takes rank files (or groups of them) one by one.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use super::*;

/// A request to the sync thread.
pub(crate) struct SyncJob {
    pub(crate) file: Arc<File>,
    pub(crate) path: PathBuf,
    /// The file is complete: `fsync` it (else `fdatasync`, to start writeback early).
    pub(crate) last: bool,
}

/// The sync thread: makes rank files durable while the writer threads go on copying, so no
/// writer waits on the device. Jobs queued while one runs are merged (a file's latest request
/// wins). Returns how many files were completely synced, or the first error.
pub(crate) fn run_syncer(jobs: mpsc::Receiver<SyncJob>) -> Result<usize, ExecuteError> {
    let mut synced = 0;
    let mut first_error = None;
    while let Ok(job) = jobs.recv() {
        let mut batch = vec![job];
        while let Ok(more) = jobs.try_recv() {
            match batch.iter_mut().find(|j| Arc::ptr_eq(&j.file, &more.file)) {
                Some(j) => j.last |= more.last,
                None => batch.push(more),
            }
        }
        if first_error.is_some() {
            continue;
        }
        for job in batch {
            let result = if job.last { job.file.sync_all() } else { job.file.sync_data() };
            match result {
                Ok(()) => synced += usize::from(job.last),
                Err(e) => {
                    first_error.get_or_insert(ExecuteError::Io { path: job.path, action: "sync rank file", error: e });
                    break;
                }
            }
        }
    }
    first_error.map_or(Ok(synced), Err)
}

/// Runs `work(unit)` for every unit `0..units` (a rank file, or a group of them) on `threads`
/// threads; the first error wins and stops the rest.
pub(crate) fn for_each_unit<T: Send>(
    units: usize,
    threads: usize,
    progress: &Progress,
    work: impl Fn(usize) -> Result<T, ExecuteError> + Sync,
) -> Result<Vec<T>, ExecuteError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..units).map(|_| None).collect());
    let first_error: Mutex<Option<ExecuteError>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, units.max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) || progress.cancel.load(Ordering::Relaxed) {
                    return;
                }
                let unit = next.fetch_add(1, Ordering::Relaxed);
                if unit >= units {
                    return;
                }
                match work(unit) {
                    Ok(r) => {
                        if let Ok(mut g) = results.lock() {
                            g[unit] = Some(r);
                        }
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        if let Ok(mut g) = first_error.lock() {
                            g.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    if progress.cancel.load(Ordering::Relaxed) {
        return Err(ExecuteError::Cancelled);
    }
    Ok(results.into_inner().unwrap_or_default().into_iter().flatten().collect())
}
