//! Snapshot downloads into the HF cache: bounded parallel streams, `Range` resume, large files
//! split into parallel ranges, and a digest check of every file before it is linked.
//!
//! Modules: what callers pass and get (`options`), one file from the cache or the network
//! (`file`), one fetch of its missing bytes (`fetch`), the HTTP streams (`stream`), positional
//! writes (`writer`), hashing beside the transfer (`hashing`), and `HF_HUB_OFFLINE` (`offline`).

mod fetch;
mod file;
mod hashing;
mod offline;
mod options;
mod stream;
mod writer;

use std::fs;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cache::RepoCache;
use crate::client::Ctx;
use crate::repo::{check_revision, PathFilter};
use crate::{HubClient, HubError, RepoFile, RepoId, Result};

use offline::offline_snapshot;
pub use options::{DownloadOptions, DownloadProgress, ProgressFn, Snapshot};

/// One snapshot download: its settings, the stream limit shared by its files and ranges, and
/// its counters.
struct Job {
    client: HubClient,
    repo: String,
    sha: String,
    cache: RepoCache,
    streams: Semaphore,
    concurrency: usize,
    split_threshold: u64,
    part_size: u64,
    verify_cached: bool,
    progress: Option<ProgressFn>,
    files_total: usize,
    bytes_total: u64,
    files_done: AtomicUsize,
    bytes_downloaded: AtomicU64,
    bytes_reused: AtomicU64,
    cancel: AtomicBool,
}

/// Progress is reported every this many bytes of a stream...
const REPORT_EVERY: u64 = 16 << 20;
/// ... and at least this often while bytes arrive, so that a slow link still shows a live rate.
const REPORT_INTERVAL: Duration = Duration::from_millis(250);

impl HubClient {
    /// Downloads the files of `repo` at `revision` selected by `opts` into the HF cache and returns
    /// the snapshot. Every file is verified (LFS: sha256; others: size and git blob sha1) before it
    /// is linked into `snapshots/{sha}/`; blobs already in the cache are reused.
    pub async fn download(&self, repo: &str, revision: &str, opts: &DownloadOptions) -> Result<Snapshot> {
        let id = RepoId::parse(repo)?;
        check_revision(revision)?;
        let root = opts.cache_dir.clone().or_else(|| self.inner.cache_dir.clone()).ok_or_else(|| {
            HubError::Config("no cache directory: set DownloadOptions::cache_dir, HF_HUB_CACHE or HF_HOME".into())
        })?;
        let cache = RepoCache::new(root, &id);
        let filter = PathFilter::new(&opts.allow, &opts.ignore)?;
        if self.inner.offline {
            return offline_snapshot(repo, revision, &cache, &filter, opts.verify_cached).await;
        }

        let rev = self.resolve(repo, revision).await?;
        let files: Vec<RepoFile> = rev.files.into_iter().filter(|f| filter.matches(&f.path)).collect();
        for d in [cache.repo_dir().join("blobs"), cache.snapshot_dir(&rev.sha)] {
            fs::create_dir_all(&d).map_err(|e| HubError::io(&d, e))?;
        }
        let concurrency = opts.concurrency.max(1);
        let job = Arc::new(Job {
            client: self.clone(),
            repo: repo.to_owned(),
            sha: rev.sha.clone(),
            cache: cache.clone(),
            streams: Semaphore::new(concurrency),
            concurrency,
            split_threshold: opts.split_threshold.max(1),
            part_size: opts.part_size.max(64 << 10),
            verify_cached: opts.verify_cached,
            progress: opts.progress.clone(),
            files_total: files.len(),
            bytes_total: files.iter().map(|f| f.size).sum(),
            files_done: AtomicUsize::new(0),
            bytes_downloaded: AtomicU64::new(0),
            bytes_reused: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
        });
        tracing::info!(repo, revision, sha = %rev.sha, files = files.len(), bytes = job.bytes_total, "downloading snapshot");

        let file_slots = Arc::new(Semaphore::new(concurrency));
        let mut set = JoinSet::new();
        for f in files.clone() {
            let job = job.clone();
            let slots = file_slots.clone();
            set.spawn(async move {
                let _slot = slots.acquire_owned().await.expect("semaphore open");
                job.ensure_file(&f).await
            });
        }
        let mut first_err = None;
        while let Some(r) = set.join_next().await {
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    job.cancel.store(true, Ordering::SeqCst);
                    first_err.get_or_insert(e);
                }
                Err(j) if j.is_panic() => std::panic::resume_unwind(j.into_panic()),
                Err(_) => {}
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if revision != rev.sha {
            cache.write_ref(revision, &rev.sha)?;
        }
        let snap = Snapshot {
            repo: repo.to_owned(),
            revision: revision.to_owned(),
            sha: rev.sha.clone(),
            dir: cache.snapshot_dir(&rev.sha),
            files,
            bytes_downloaded: job.bytes_downloaded.load(Ordering::SeqCst),
            bytes_reused: job.bytes_reused.load(Ordering::SeqCst),
        };
        tracing::info!(repo, sha = %snap.sha, downloaded = snap.bytes_downloaded, reused = snap.bytes_reused, "snapshot ready");
        Ok(snap)
    }
}

impl Job {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    fn report(&self, path: &str) {
        if let Some(p) = &self.progress {
            p(&DownloadProgress {
                path: path.to_owned(),
                files_done: self.files_done.load(Ordering::Relaxed),
                files_total: self.files_total,
                bytes_downloaded: self.bytes_downloaded.load(Ordering::Relaxed),
                bytes_reused: self.bytes_reused.load(Ordering::Relaxed),
                bytes_total: self.bytes_total,
            });
        }
    }

    fn ctx<'a>(&'a self, f: &'a RepoFile) -> Ctx<'a> {
        Ctx { repo: &self.repo, revision: Some(&self.sha), path: Some(&f.path), has_token: self.client.has_token() }
    }
}
