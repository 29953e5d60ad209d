//! Snapshot downloads into the HF cache: bounded parallel streams, `Range` resume, large files
//! split into parallel ranges, and a digest check of every file before it is linked.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_RANGE, RANGE};
use reqwest::{Method, StatusCode, Url};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cache::{digest_file, BlobLock, Digester, Expected, RepoCache};
use crate::client::{check_status, encode_path, invalid, network, Ctx, Failure};
use crate::repo::{check_revision, is_commit_sha, PathFilter};
use crate::{HubClient, HubError, RepoFile, RepoId, Result};

/// Called as a download progresses (after each few MiB and each finished file).
pub type ProgressFn = Arc<dyn Fn(&DownloadProgress) + Send + Sync>;

/// What to download and how.
#[derive(Clone)]
pub struct DownloadOptions {
    /// Keep only files matching one of these (`fnmatch` globs; `*` crosses `/`). Empty keeps all.
    pub allow: Vec<String>,
    /// Then drop files matching one of these.
    pub ignore: Vec<String>,
    /// The cache (`…/huggingface/hub`); `None` uses the client's (from the environment).
    pub cache_dir: Option<PathBuf>,
    /// HTTP streams open at once, across files and ranges. Default 8.
    pub concurrency: usize,
    /// Files with at least this many bytes left are fetched as parallel ranges. Default 64 MiB.
    pub split_threshold: u64,
    /// Size of one range. Default 32 MiB.
    pub part_size: u64,
    /// Re-hash blobs already in the cache before reusing them (a corrupt one is downloaded again).
    /// Default true.
    pub verify_cached: bool,
    /// Progress callback.
    pub progress: Option<ProgressFn>,
}

impl Default for DownloadOptions {
    fn default() -> Self {
        DownloadOptions {
            allow: Vec::new(),
            ignore: Vec::new(),
            cache_dir: None,
            concurrency: 8,
            split_threshold: 64 << 20,
            part_size: 32 << 20,
            verify_cached: true,
            progress: None,
        }
    }
}

impl std::fmt::Debug for DownloadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadOptions")
            .field("allow", &self.allow)
            .field("ignore", &self.ignore)
            .field("cache_dir", &self.cache_dir)
            .field("concurrency", &self.concurrency)
            .field("split_threshold", &self.split_threshold)
            .field("part_size", &self.part_size)
            .field("verify_cached", &self.verify_cached)
            .field("progress", &self.progress.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

/// A progress report.
#[derive(Clone, Debug)]
pub struct DownloadProgress {
    /// The file the report is about.
    pub path: String,
    /// Files verified and linked so far.
    pub files_done: usize,
    /// Files selected.
    pub files_total: usize,
    /// Bytes received over the network so far (a retried range counts again).
    pub bytes_downloaded: u64,
    /// Bytes of files found verified in the cache.
    pub bytes_reused: u64,
    /// Bytes of all selected files.
    pub bytes_total: u64,
}

/// A downloaded, verified snapshot.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The repository id.
    pub repo: String,
    /// The revision asked for.
    pub revision: String,
    /// The commit it resolved to.
    pub sha: String,
    /// `{cache}/models--org--name/snapshots/{sha}`: the files, as symlinks into `blobs/`.
    pub dir: PathBuf,
    /// The files selected by the patterns, sorted by path; every one is in `dir`, verified.
    pub files: Vec<RepoFile>,
    /// Bytes received over the network.
    pub bytes_downloaded: u64,
    /// Bytes of files that were already in the cache.
    pub bytes_reused: u64,
}

impl Snapshot {
    /// The local path of a repository file.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

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

const WRITE_BUF: usize = 4 << 20;
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

    async fn ensure_file(self: &Arc<Self>, f: &RepoFile) -> Result<()> {
        if self.cancelled() {
            return Ok(());
        }
        let expected = match &f.lfs_sha256 {
            Some(h) => Expected::Sha256(h.clone()),
            None => Expected::GitSha1(f.blob_id.clone()),
        };
        let name = f.cache_blob_name().to_owned();
        if !self.cached_ok(f, &name, &expected, false).await? {
            let _lock = BlobLock::acquire(&self.cache.lock_path(&name)).await?;
            if !self.cached_ok(f, &name, &expected, true).await? && !self.fetch_blob(f, &name, &expected).await? {
                return Ok(()); // cancelled: another file failed
            }
        }
        self.cache.link(&self.sha, &f.path, &name)?;
        self.files_done.fetch_add(1, Ordering::Relaxed);
        self.report(&f.path);
        Ok(())
    }

    /// True if `blobs/{name}` exists with the right content (counted as reused). Under the lock,
    /// a corrupt blob is deleted.
    async fn cached_ok(&self, f: &RepoFile, name: &str, expected: &Expected, locked: bool) -> Result<bool> {
        let blob = self.cache.blob(name);
        let len = match fs::metadata(&blob) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(HubError::io(&blob, e)),
        };
        let good = if len != f.size {
            false
        } else if !self.verify_cached {
            true
        } else {
            let (b, e, size) = (blob.clone(), expected.clone(), f.size);
            let d = tokio::task::spawn_blocking(move || digest_file(&b, &e, size))
                .await
                .expect("hash task")
                .map_err(|e| HubError::io(&blob, e))?;
            d.as_deref() == Some(expected.hex())
        };
        if good {
            self.bytes_reused.fetch_add(f.size, Ordering::Relaxed);
            tracing::debug!(path = %f.path, blob = name, "reusing verified cached blob");
        } else if locked {
            tracing::warn!(path = %f.path, blob = %blob.display(), "cached blob does not match its {} digest; downloading it again", expected.algorithm());
            fs::remove_file(&blob).map_err(|e| HubError::io(&blob, e))?;
        }
        Ok(good)
    }

    /// Downloads into `.incomplete`, verifies, renames to the blob. A mismatch deletes the bytes and
    /// downloads once more; a second mismatch is an error. Returns false if cancelled.
    async fn fetch_blob(self: &Arc<Self>, f: &RepoFile, name: &str, expected: &Expected) -> Result<bool> {
        let incomplete = self.cache.incomplete(name);
        let split = self.cache.split_incomplete(name);
        match fs::remove_file(&split) {
            Ok(()) => tracing::warn!(file = %split.display(), "removed parts of an interrupted split download"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(HubError::io(&split, e)),
        }
        let url = self.client.url(&format!("/{}/resolve/{}/{}", self.repo, self.sha, encode_path(&f.path)))?;
        for round in 1..=2 {
            let have = match fs::metadata(&incomplete) {
                Ok(m) if m.len() <= f.size => m.len(),
                Ok(_) => {
                    fs::remove_file(&incomplete).map_err(|e| HubError::io(&incomplete, e))?;
                    0
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
                Err(e) => return Err(HubError::io(&incomplete, e)),
            };
            let Some((done, actual)) = self.fetch_once(f, &url, &incomplete, &split, have, expected).await? else {
                return Ok(false);
            };
            if actual == expected.hex() {
                let blob = self.cache.blob(name);
                fs::rename(&done, &blob).map_err(|e| HubError::io(&blob, e))?;
                return Ok(true);
            }
            fs::remove_file(&done).map_err(|e| HubError::io(&done, e))?;
            tracing::warn!(path = %f.path, expected = expected.hex(), actual = %actual, round, "downloaded bytes do not match the published {} digest; deleted", expected.algorithm());
            if round == 2 {
                return Err(HubError::ChecksumMismatch {
                    repo: self.repo.clone(),
                    path: f.path.clone(),
                    algorithm: expected.algorithm(),
                    expected: expected.hex().to_owned(),
                    actual,
                });
            }
        }
        unreachable!("two rounds return")
    }

    /// Fetches `[have, size)` and hashes the whole file while it arrives.
    ///
    /// One stream writes `.incomplete` in order, so it is a valid prefix at any moment. Large
    /// files are fetched as parallel ranges into `.split.incomplete` (never a valid prefix); if
    /// that stops early, the contiguous part goes back to `.incomplete` so the next attempt, of
    /// this client or `huggingface_hub`, resumes from it. A hasher thread reads back the
    /// contiguous prefix as it grows, so verification overlaps the transfer.
    /// Returns the file holding the bytes and their digest, or `None` if cancelled.
    async fn fetch_once(
        self: &Arc<Self>,
        f: &RepoFile,
        url: &Url,
        incomplete: &Path,
        split: &Path,
        have: u64,
        expected: &Expected,
    ) -> Result<Option<(PathBuf, String)>> {
        let left = f.size - have;
        let parallel = self.concurrency > 1 && left >= self.split_threshold && left > self.part_size;
        let data = if parallel { split } else { incomplete };
        let io_err = |e| HubError::io(data, e);
        if parallel && have > 0 {
            fs::rename(incomplete, split).map_err(io_err)?;
        }
        let file = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(data).map_err(io_err)?;
        file.set_len(have).map_err(io_err)?;
        let file = Arc::new(file);
        if have > 0 {
            tracing::info!(path = %f.path, have, size = f.size, "resuming a partial download");
        }

        let mut parts = Vec::new();
        let mut a = have;
        while a < f.size {
            let b = if parallel { (a + self.part_size).min(f.size) } else { f.size };
            parts.push(Arc::new(Part { start: a, end: b, written: AtomicU64::new(0) }));
            a = b;
        }
        let parts = Arc::new(parts);
        // Ranges go straight to where the Hub redirects (one redirect for all of them, as on a
        // CDN each costs a round trip); a range that fails goes back through the Hub.
        let direct = if parallel && !parts.is_empty() { self.locate(f, url).await? } else { None };
        let stop = Arc::new(AtomicBool::new(false));
        let hashing = Arc::new(Hashing::default());
        let hasher = {
            let (file, parts, stop, expected, size) =
                (file.clone(), parts.clone(), stop.clone(), expected.clone(), f.size);
            let hashing = hashing.clone();
            tokio::task::spawn_blocking(move || ordered_digest(&file, &expected, size, have, &parts, &hashing, &stop))
        };

        let mut set = JoinSet::new();
        for part in parts.iter().cloned() {
            let (job, f, url, file, hashing) = (self.clone(), f.clone(), url.clone(), file.clone(), hashing.clone());
            let direct = direct.clone();
            let single = !parallel;
            set.spawn(async move {
                let mut w = PartWriter::new(file, part.start, part.clone(), hashing);
                let r = job.stream(&f, &url, direct.as_ref(), part.start, part.end, &mut w, single).await;
                let fl = w.flush().await;
                (r, fl)
            });
        }
        let mut complete = true;
        let mut err = None;
        while let Some(j) = set.join_next().await {
            let (r, fl) = match j {
                Ok(v) => v,
                Err(j) if j.is_panic() => std::panic::resume_unwind(j.into_panic()),
                Err(_) => continue,
            };
            match (r, fl) {
                (Ok(true), Ok(())) => {}
                (Ok(false), Ok(())) => complete = false,
                (Err(e), _) => {
                    complete = false;
                    self.cancel.store(true, Ordering::SeqCst);
                    err.get_or_insert(e);
                }
                (Ok(_), Err(e)) => {
                    complete = false;
                    self.cancel.store(true, Ordering::SeqCst);
                    err.get_or_insert(HubError::io(data, e));
                }
            }
        }
        if !complete {
            stop.store(true, Ordering::SeqCst);
        }
        let digest = match hasher.await {
            Ok(r) => r.map_err(io_err)?,
            Err(j) => std::panic::resume_unwind(j.into_panic()),
        };
        if complete {
            let d = digest.expect("every part written, so the hasher finished");
            return Ok(Some((data.to_owned(), d)));
        }
        if parallel {
            let prefix = contiguous(have, &parts);
            file.set_len(prefix).map_err(io_err)?;
            drop(file);
            fs::rename(split, incomplete).map_err(|e| HubError::io(incomplete, e))?;
            tracing::info!(path = %f.path, kept = prefix, "parallel download stopped; the contiguous prefix is kept for resuming");
        }
        match err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// Where the bytes of `f` are: the first redirect target on another origin (the CDN), found
    /// with `HEAD` like `huggingface_hub` does, without requesting it (signed URLs may be bound to
    /// `GET`). `None` if the Hub serves the file itself.
    async fn locate(&self, f: &RepoFile, resolve_url: &Url) -> Result<Option<Url>> {
        let ctx = self.ctx(f);
        self.client
            .retrying(resolve_url, |attempt| async move {
                let mut url = resolve_url.clone();
                for _hop in 0..10 {
                    let sent = self.client.send_once(Method::HEAD, &url, &HeaderMap::new(), attempt).await?;
                    if let Some(c) = crate::client::header_str(sent.headers(), "x-repo-commit") {
                        if c != self.sha {
                            return Err(Failure::Fatal(invalid(
                                &url,
                                format!("X-Repo-Commit {c} differs from the requested commit {}", self.sha),
                            )));
                        }
                    }
                    let status = sent.status();
                    if status.is_redirection() {
                        let next = sent
                            .headers()
                            .get(reqwest::header::LOCATION)
                            .and_then(|l| l.to_str().ok())
                            .and_then(|l| url.join(l).ok())
                            .ok_or_else(|| {
                                Failure::Fatal(invalid(&url, "redirect without a usable Location".into()))
                            })?;
                        if !self.client.is_endpoint_origin(&next) {
                            return Ok(Some(next));
                        }
                        url = next;
                        continue;
                    }
                    check_status(sent, ctx, attempt).await?;
                    return Ok(None);
                }
                Err(Failure::Fatal(invalid(&url, "more than 10 redirects".into())))
            })
            .await
    }

    /// Streams `[start, end)` of `f` into `w`, retrying with `Range: bytes=pos-` from where the
    /// last attempt stopped. Returns false if cancelled. `single`: this is the file's only stream,
    /// so a 200 answer to a range request can be used by skipping what the file already has.
    #[allow(clippy::too_many_arguments)]
    async fn stream(
        &self,
        f: &RepoFile,
        resolve_url: &Url,
        direct: Option<&Url>,
        start: u64,
        end: u64,
        w: &mut PartWriter,
        single: bool,
    ) -> Result<bool> {
        let mut pos = start;
        let mut attempt = 1u32;
        let policy = &self.client.inner.retry;
        let mut url = direct.unwrap_or(resolve_url);
        loop {
            if pos >= end {
                return Ok(true);
            }
            if self.cancelled() {
                return Ok(false);
            }
            let before = pos;
            let r = {
                let _permit = self.streams.acquire().await.expect("semaphore open");
                self.attempt(f, url, &mut pos, end, w, single, attempt).await
            };
            match r {
                Ok(()) => {}
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Retry { err, after }) => {
                    url = resolve_url;
                    if pos > before {
                        attempt = 1;
                    } else if attempt >= policy.max_attempts {
                        return Err(err);
                    } else {
                        attempt += 1;
                    }
                    // Everything received so far is on disk before the next range starts.
                    w.flush().await.map_err(|e| HubError::io(PathBuf::from(&f.path), e))?;
                    let delay = self.client.delay(attempt, after);
                    tracing::warn!(path = %f.path, pos, end, attempt, delay_ms = delay.as_millis() as u64, error = %err, "retrying download");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        f: &RepoFile,
        url: &Url,
        pos: &mut u64,
        end: u64,
        w: &mut PartWriter,
        single: bool,
        attempt: u32,
    ) -> std::result::Result<(), Failure> {
        let ctx = self.ctx(f);
        let whole = *pos == 0 && end == f.size;
        let mut headers = HeaderMap::new();
        if !whole {
            headers.insert(RANGE, HeaderValue::from_str(&format!("bytes={}-{}", *pos, end - 1)).expect("ascii"));
        }
        let sent = self.client.send(Method::GET, url, &headers, ctx, attempt).await?;
        if let Some(c) = &sent.repo_commit {
            if c != &self.sha {
                return Err(Failure::Fatal(invalid(
                    url,
                    format!("X-Repo-Commit {c} differs from the requested commit {}", self.sha),
                )));
            }
        }
        let final_url = sent.url.clone();
        if let (Some(linked), Some(want)) = (&sent.linked_etag, &f.lfs_sha256) {
            if linked != want {
                tracing::warn!(path = %f.path, linked = %linked, expected = %want, "X-Linked-Etag differs from the listed sha256; the sha256 check decides");
            }
        }
        // A CDN's 4xx (an expired signed URL) is retried through a fresh redirect; the Hub's own
        // 4xx answers are final.
        let from_cdn = !self.client.is_endpoint_origin(&final_url);
        let mut resp = match check_status(sent.response, ctx, attempt).await {
            Err(Failure::Fatal(e)) if from_cdn && !matches!(e, HubError::InvalidResponse { .. }) => {
                return Err(Failure::Retry { err: e, after: None });
            }
            r => r?,
        };
        // Bytes of the body to drop before `pos` (a server that answers a range with the whole file).
        let mut skip = 0u64;
        match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let cr = resp.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("");
                let first =
                    cr.strip_prefix("bytes ").and_then(|r| r.split('-').next()).and_then(|s| s.parse::<u64>().ok());
                if first != Some(*pos) {
                    return Err(Failure::Fatal(invalid(
                        &final_url,
                        format!("asked for bytes from {}, got Content-Range `{cr}`", *pos),
                    )));
                }
            }
            StatusCode::OK if !whole => {
                if !single {
                    return Err(Failure::Fatal(invalid(
                        &final_url,
                        "the server ignored a Range request; download with concurrency 1".into(),
                    )));
                }
                tracing::warn!(path = %f.path, pos = *pos, "the server ignored the Range header; skipping what is already here");
                skip = *pos;
            }
            StatusCode::OK => {}
            s => return Err(Failure::Fatal(invalid(&final_url, format!("unexpected HTTP {}", s.as_u16())))),
        }
        let mut since_report = 0u64;
        let mut reported = Instant::now();
        loop {
            match resp.chunk().await {
                Ok(Some(mut b)) => {
                    self.bytes_downloaded.fetch_add(b.len() as u64, Ordering::Relaxed);
                    if skip > 0 {
                        let n = skip.min(b.len() as u64);
                        skip -= n;
                        b = b.slice(n as usize..);
                    }
                    let room = end - *pos;
                    if b.len() as u64 > room {
                        return Err(Failure::Fatal(HubError::SizeMismatch {
                            repo: self.repo.clone(),
                            path: f.path.clone(),
                            expected: f.size,
                            actual: *pos + b.len() as u64,
                        }));
                    }
                    let n = b.len() as u64;
                    w.write(b).await.map_err(|e| Failure::Fatal(HubError::io(PathBuf::from(&f.path), e)))?;
                    *pos += n;
                    since_report += n;
                    if since_report >= REPORT_EVERY || reported.elapsed() >= REPORT_INTERVAL {
                        since_report = 0;
                        reported = Instant::now();
                        self.report(&f.path);
                    }
                    if self.cancelled() {
                        return Ok(());
                    }
                }
                Ok(None) if *pos < end => {
                    return Err(Failure::Retry {
                        err: HubError::Network {
                            url: crate::client::redact(&final_url),
                            attempts: attempt,
                            message: format!("connection closed after byte {} of {}", *pos, f.size),
                        },
                        after: None,
                    })
                }
                Ok(None) => return Ok(()),
                Err(e) => return Err(Failure::Retry { err: network(&final_url, attempt, &e), after: None }),
            }
        }
    }
}

/// One range of a download and how much of it is on disk.
struct Part {
    start: u64,
    end: u64,
    /// Bytes written from `start` on, contiguous (updated after each write completes).
    written: AtomicU64,
}

/// How far the file is written without a gap: `have` plus the parts done in order, plus what the
/// first unfinished part has.
fn contiguous(have: u64, parts: &[Arc<Part>]) -> u64 {
    let mut end = have;
    for p in parts {
        let w = p.written.load(Ordering::Acquire);
        end = p.start + w;
        if p.start + w < p.end {
            break;
        }
    }
    end
}

/// Batches written to disk recently, kept in memory when they are near the hash frontier so the
/// hasher need not read them back.
#[derive(Default)]
struct Hashing {
    /// Bytes hashed from offset 0.
    hashed: AtomicU64,
    /// Written batches by offset, at most [`KEEP_AHEAD`] beyond `hashed`.
    recent: std::sync::Mutex<std::collections::BTreeMap<u64, Arc<Batch>>>,
}

const KEEP_AHEAD: u64 = 64 << 20;

struct Batch {
    chunks: Vec<Bytes>,
    len: u64,
}

impl Hashing {
    fn recent(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Arc<Batch>>> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Hashes `file` from 0 as its contiguous prefix grows (from the batches in memory, else reading
/// it back); the digest once all `size` bytes are in, `None` if `stop` is set first (blocking;
/// runs beside the transfer).
fn ordered_digest(
    file: &File,
    expected: &Expected,
    size: u64,
    have: u64,
    parts: &[Arc<Part>],
    hashing: &Hashing,
    stop: &AtomicBool,
) -> io::Result<Option<String>> {
    let mut d = Digester::new(expected, size);
    let mut hashed = 0u64;
    let mut buf = vec![0u8; WRITE_BUF];
    loop {
        let avail = contiguous(have, parts);
        if hashed < avail {
            let (batch, next_key) = {
                let m = hashing.recent();
                (m.get(&hashed).cloned(), m.range(hashed + 1..).next().map(|(k, _)| *k))
            };
            match batch {
                Some(b) if hashed + b.len <= avail => {
                    for c in &b.chunks {
                        d.update(c);
                    }
                    hashed += b.len;
                }
                Some(_) => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
                None => {
                    let mut n = (avail - hashed).min(WRITE_BUF as u64);
                    if let Some(k) = next_key {
                        n = n.min(k - hashed);
                    }
                    let buf = &mut buf[..n as usize];
                    file.read_exact_at(buf, hashed)?;
                    d.update(buf);
                    hashed += n;
                }
            }
            hashing.hashed.store(hashed, Ordering::Release);
            let mut m = hashing.recent();
            let keep = m.split_off(&hashed);
            *m = keep;
            continue;
        }
        if hashed >= size {
            return Ok(Some(d.finish()));
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// `pwritev` until every byte of `chunks` is at `offset`.
fn write_all_vectored_at(file: &File, chunks: &[Bytes], mut offset: u64) -> io::Result<()> {
    let (mut i, mut skip) = (0usize, 0usize);
    while i < chunks.len() {
        let slices: Vec<io::IoSlice<'_>> = std::iter::once(&chunks[i][skip..])
            .chain(chunks[i + 1..].iter().map(|c| &c[..]))
            .take(512)
            .map(io::IoSlice::new)
            .collect();
        let mut n = match rustix::io::pwritev(file, &slices, offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing")),
            Ok(n) => n,
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) => return Err(e.into()),
        };
        offset += n as u64;
        while n > 0 {
            let left = chunks[i].len() - skip;
            if n >= left {
                n -= left;
                i += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
        while i < chunks.len() && chunks[i].len() == skip {
            i += 1;
            skip = 0;
        }
    }
    Ok(())
}

/// Sequential positional writes off the async threads, one in flight while the next batch of
/// received chunks gathers (no copy: the chunks go to `pwritev` as they are); each completed
/// write advances the part's `written` and may leave the batch for the hasher.
struct PartWriter {
    file: Arc<File>,
    offset: u64,
    chunks: Vec<Bytes>,
    len: usize,
    part: Arc<Part>,
    hashing: Arc<Hashing>,
    pending: Option<tokio::task::JoinHandle<io::Result<()>>>,
}

impl PartWriter {
    fn new(file: Arc<File>, offset: u64, part: Arc<Part>, hashing: Arc<Hashing>) -> Self {
        PartWriter { file, offset, chunks: Vec::new(), len: 0, part, hashing, pending: None }
    }

    async fn write(&mut self, data: Bytes) -> io::Result<()> {
        self.len += data.len();
        self.chunks.push(data);
        if self.len >= WRITE_BUF {
            self.submit().await?;
        }
        Ok(())
    }

    async fn submit(&mut self) -> io::Result<()> {
        self.wait().await?;
        if self.chunks.is_empty() {
            return Ok(());
        }
        let batch = Batch { chunks: std::mem::take(&mut self.chunks), len: std::mem::take(&mut self.len) as u64 };
        let (file, off, part, hashing) = (self.file.clone(), self.offset, self.part.clone(), self.hashing.clone());
        self.offset += batch.len;
        self.pending = Some(tokio::task::spawn_blocking(move || {
            write_all_vectored_at(&file, &batch.chunks, off)?;
            let len = batch.len;
            let hashed = hashing.hashed.load(Ordering::Acquire);
            if off >= hashed && off < hashed + KEEP_AHEAD {
                hashing.recent().insert(off, Arc::new(batch));
            }
            part.written.fetch_add(len, Ordering::Release);
            Ok(())
        }));
        Ok(())
    }

    async fn wait(&mut self) -> io::Result<()> {
        if let Some(h) = self.pending.take() {
            match h.await {
                Ok(r) => r?,
                Err(j) => std::panic::resume_unwind(j.into_panic()),
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> io::Result<()> {
        self.submit().await?;
        self.wait().await
    }
}

/// `HF_HUB_OFFLINE`: the snapshot from the cache alone (refs for branch names), verified.
async fn offline_snapshot(
    repo: &str,
    revision: &str,
    cache: &RepoCache,
    filter: &PathFilter,
    verify: bool,
) -> Result<Snapshot> {
    let sha = if is_commit_sha(revision) { Some(revision.to_owned()) } else { cache.read_ref(revision) };
    let missing = || {
        HubError::Config(format!(
            "offline mode: `{repo}` at `{revision}` is not in the cache {}",
            cache.repo_dir().display()
        ))
    };
    let sha = sha.ok_or_else(missing)?;
    let dir = cache.snapshot_dir(&sha);
    if !dir.is_dir() {
        return Err(missing());
    }
    let mut files = Vec::new();
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).map_err(|e| HubError::io(&d, e))? {
            let entry = entry.map_err(|e| HubError::io(&d, e))?;
            let p = entry.path();
            let meta = fs::metadata(&p).map_err(|e| HubError::io(&p, e))?;
            if meta.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p.strip_prefix(&dir).expect("under dir").to_string_lossy().into_owned();
            if !filter.matches(&rel) {
                continue;
            }
            let blob = fs::read_link(&p)
                .ok()
                .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_default();
            let lfs = (blob.len() == 64).then(|| blob.clone());
            files.push(RepoFile { path: rel, size: meta.len(), lfs_sha256: lfs, blob_id: blob });
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    if verify {
        for f in &files {
            let expected = match &f.lfs_sha256 {
                Some(h) => Expected::Sha256(h.clone()),
                None if f.blob_id.len() == 40 => Expected::GitSha1(f.blob_id.clone()),
                None => continue,
            };
            let (p, e, size) = (dir.join(&f.path), expected.clone(), f.size);
            let d = tokio::task::spawn_blocking(move || digest_file(&p, &e, size))
                .await
                .expect("hash task")
                .map_err(|e| HubError::io(dir.join(&f.path), e))?;
            if d.as_deref() != Some(expected.hex()) {
                return Err(HubError::ChecksumMismatch {
                    repo: repo.to_owned(),
                    path: f.path.clone(),
                    algorithm: expected.algorithm(),
                    expected: expected.hex().to_owned(),
                    actual: d.unwrap_or_else(|| "<wrong length>".into()),
                });
            }
        }
    }
    let reused = files.iter().map(|f| f.size).sum();
    Ok(Snapshot {
        repo: repo.to_owned(),
        revision: revision.to_owned(),
        sha,
        dir,
        files,
        bytes_downloaded: 0,
        bytes_reused: reused,
    })
}
