//! `hf.download` of a Hub repository: resolve the revision to a commit, download the selected
//! files through `shardline-hub` into the HF cache (every file checked against its published
//! digest before it is linked), and hand later steps the snapshot directory.
//!
//! The step cache key is the repository, the resolved commit sha and the allow/ignore patterns:
//! a second run of the same commit is served without a byte downloaded; a new commit runs again.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shardline_control::TaskOutput;
use shardline_formats::execute::Progress;
use shardline_hub::{DownloadOptions, DownloadProgress, HubClient, HubEnv, HubError, RetryPolicy, Snapshot};

use crate::steps::{StepContext, StepError};

/// How a worker reaches the Hub. By default everything comes from the worker's environment, as
/// `huggingface_hub` reads it: `HF_ENDPOINT`, `HF_TOKEN` (or the token file), `HF_HUB_CACHE` /
/// `HF_HOME`, `HF_HUB_OFFLINE`.
#[derive(Clone, Debug, Default)]
pub struct HubSettings {
    /// The cache (`…/huggingface/hub`) instead of the environment's.
    pub cache_dir: Option<PathBuf>,
    /// The client's retry policy instead of the default (tests shorten the backoff).
    pub retry: Option<RetryPolicy>,
}

/// What an `hf.download` task of a Hub repository needs.
#[derive(Clone, Copy, Debug)]
pub struct HubRequest<'a> {
    pub repo: &'a str,
    pub revision: &'a str,
    pub allow: &'a [String],
    pub ignore: &'a [String],
    pub endpoint: Option<&'a str>,
}

fn hub_error(req: &HubRequest, e: HubError) -> StepError {
    let message = format!("downloading `{}` at `{}`: {e}", req.repo, req.revision);
    if e.is_transient() {
        StepError::transient(message)
    } else {
        StepError::fatal(message)
    }
}

/// A client for the request's endpoint. The token of the environment goes only to the
/// environment's endpoint: a spec that names another endpoint gets anonymous requests, so a spec
/// cannot send the worker's token to a server of its choosing.
pub fn client(req: &HubRequest, settings: &HubSettings) -> Result<(HubClient, PathBuf), StepError> {
    let env = HubEnv::from_env().map_err(|e| StepError::fatal(e.to_string()))?;
    let endpoint = req.endpoint.map(|e| e.trim_end_matches('/').to_owned()).unwrap_or_else(|| env.endpoint.clone());
    let token = if endpoint == env.endpoint { env.token } else { None };
    let cache = settings.cache_dir.clone().unwrap_or(env.cache_dir);
    let mut client = HubClient::new(&endpoint, token)
        .map_err(|e| hub_error(req, e))?
        .with_cache_dir(&cache)
        .with_offline(env.offline);
    if let Some(r) = &settings.retry {
        client = client.with_retry_policy(r.clone());
    }
    Ok((client, cache))
}

/// The step cache key: what determines the snapshot's content.
pub fn cache_key(repo: &str, sha: &str, allow: &[String], ignore: &[String]) -> String {
    let mut h = Sha256::new();
    h.update(b"shardline hf.download\0");
    for part in [repo, sha] {
        h.update(part.as_bytes());
        h.update(b"\0");
    }
    for (name, list) in [("allow", allow), ("ignore", ignore)] {
        h.update(name.as_bytes());
        for p in list {
            h.update(b"\0");
            h.update(p.as_bytes());
        }
        h.update(b"\x01");
    }
    hex::encode(h.finalize())
}

/// The commit a revision points to now (one API request; no file is listed or downloaded).
pub async fn resolve_sha(req: &HubRequest<'_>, settings: &HubSettings) -> Result<String, StepError> {
    let (client, _) = client(req, settings)?;
    if shardline_hub::is_commit_sha(req.revision) {
        return Ok(req.revision.to_owned());
    }
    client.resolve_revision(req.repo, req.revision).await.map_err(|e| hub_error(req, e))
}

/// Whether a remembered download output still describes a complete snapshot: the directory and
/// every file with its size.
pub fn cached_snapshot_usable(output: &TaskOutput) -> bool {
    let (Some(dir), Some(files)) = (&output.path, &output.file_list) else { return false };
    !files.is_empty()
        && files.iter().all(|f| std::fs::metadata(dir.join(&f.path)).is_ok_and(|m| m.is_file() && m.len() == f.size))
}

/// A digest of the snapshot's content for the shard step's cache key: the repository, the commit
/// and every file's path, size and blob id (sha256 for LFS files). Unlike a local release's
/// digest it does not depend on file times, so a snapshot downloaded again keeps its digest.
fn snapshot_digest(snap: &Snapshot) -> String {
    let mut h = Sha256::new();
    h.update(b"shardline hub snapshot\0");
    h.update(snap.repo.as_bytes());
    h.update(b"\0");
    h.update(snap.sha.as_bytes());
    for f in &snap.files {
        h.update(format!("\0{}\0{}\0{}", f.path, f.size, f.cache_blob_name()).as_bytes());
    }
    hex::encode(h.finalize())
}

/// Downloads the snapshot (blocking: runs the download on a runtime of its own). Progress goes to
/// `ctx.progress` (bytes done, files done) and `ctx.bytes_total`; the task's log gets a line every
/// few seconds. Stops when `ctx.progress.cancel` is set.
pub fn download(req: &HubRequest, settings: &HubSettings, ctx: &StepContext) -> Result<Value, StepError> {
    let (client, cache) = client(req, settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| StepError::transient(format!("starting the download runtime: {e}")))?;
    // The newest progress line; the loop below logs it every few seconds.
    let latest = Arc::new(Mutex::new(None::<String>));
    let progress_fn = {
        let progress = ctx.progress.clone();
        let total = ctx.bytes_total.clone();
        let latest = latest.clone();
        Arc::new(move |p: &DownloadProgress| {
            report(&progress, &total, p);
            if let Ok(mut l) = latest.lock() {
                *l = Some(format!(
                    "downloaded {} of {} bytes ({} reused from the cache), {} of {} files",
                    p.bytes_downloaded + p.bytes_reused,
                    p.bytes_total,
                    p.bytes_reused,
                    p.files_done,
                    p.files_total
                ));
            }
        })
    };
    let opts = DownloadOptions {
        allow: req.allow.to_vec(),
        ignore: req.ignore.to_vec(),
        cache_dir: Some(cache.clone()),
        progress: Some(progress_fn),
        ..DownloadOptions::default()
    };
    (ctx.log)(format!(
        "downloading `{}` at `{}` from {} into {}",
        req.repo,
        req.revision,
        client.endpoint(),
        cache.display()
    ));
    let progress = ctx.progress.clone();
    let log = ctx.log;
    let snap = runtime.block_on(async {
        let fut = client.download(req.repo, req.revision, &opts);
        tokio::pin!(fut);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut logged = Instant::now();
        loop {
            tokio::select! {
                r = &mut fut => break r.map_err(|e| hub_error(req, e)),
                _ = tick.tick() => {
                    if progress.cancel.load(Ordering::Relaxed) {
                        break Err(StepError::transient("download stopped: the task was cancelled or lost its lease"));
                    }
                    if logged.elapsed() >= Duration::from_secs(5) {
                        if let Some(line) = latest.lock().ok().and_then(|mut l| l.take()) {
                            log(line);
                            logged = Instant::now();
                        }
                    }
                }
            }
        }
    })?;
    // Dropping the runtime stops whatever the download left running (nothing, on success).
    drop(runtime);
    if snap.files.is_empty() {
        return Err(StepError::fatal(format!(
            "`{}` at {} has no file matching allow {:?} and ignore {:?}",
            req.repo, snap.sha, req.allow, req.ignore
        )));
    }
    let bytes: u64 = snap.files.iter().map(|f| f.size).sum();
    (ctx.log)(format!(
        "snapshot of `{}` at commit {}: {} files, {} bytes ({} downloaded, {} reused from the cache) in {}",
        snap.repo,
        snap.sha,
        snap.files.len(),
        bytes,
        snap.bytes_downloaded,
        snap.bytes_reused,
        snap.dir.display()
    ));
    let file_list: Vec<Value> = snap
        .files
        .iter()
        .map(|f| json!({"path": f.path, "size": f.size, "sha256": f.lfs_sha256, "blob": f.cache_blob_name()}))
        .collect();
    Ok(json!({
        "path": snap.dir,
        "digest": snapshot_digest(&snap),
        "bytes": bytes,
        "files": snap.files.len(),
        "repo": snap.repo,
        "revision": snap.revision,
        "sha": snap.sha,
        "bytes_downloaded": snap.bytes_downloaded,
        "bytes_reused": snap.bytes_reused,
        "file_list": file_list,
        "cache_key": cache_key(&snap.repo, &snap.sha, req.allow, req.ignore),
        // What the manifest of a publish records as the checkpoint's source.
        "source": {
            "kind": "hf.download",
            "repo": snap.repo,
            "revision": snap.revision,
            "sha": snap.sha,
            "endpoint": client.endpoint(),
            "allow": req.allow,
            "ignore": req.ignore,
        },
    }))
}

fn report(progress: &Progress, total: &AtomicU64, p: &DownloadProgress) {
    progress.bytes_written.store(p.bytes_downloaded + p.bytes_reused, Ordering::Relaxed);
    progress.files_done.store(p.files_done as u64, Ordering::Relaxed);
    total.store(p.bytes_total, Ordering::Relaxed);
}
