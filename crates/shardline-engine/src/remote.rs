//! Tasks of a run whose outputs live in an object-store artifact store (`--artifacts s3://…`), so
//! that workers on hosts sharing no disk can run any of them.
//!
//! - A download puts the release in the store once (`<root>/releases/<key>`, a marker object
//!   written last names every file), or, for a source that is already an object-store prefix,
//!   only lists it: later tasks read it in place.
//! - A plan, rank or commit task stages the release locally as *sparse* files: the safetensors
//!   headers and small files (config, index) always; a rank task (`rank_task`) then fetches the
//!   byte ranges its file is written from, a section at a time, and uploads the file in parts,
//!   leaving the upload open, registered in the job store under its lease.
//! - The commit checks every rank's upload against the plan, completes them and writes
//!   `.metadata` last. Until then no object of the checkpoint exists; an upload whose attempt
//!   failed is aborted (by the worker here, or by the server's reaper).
//! - Validation is split by rank file (`validate`): each part fetches its files and the release
//!   ranges they are made from. Upload reads the checkpoint back into the worker's object cache
//!   (`objects::download`); an export reads only the model's byte ranges of its checkpoint
//!   (`sparse_checkpoint`).
//!
//! Every task's staging directory is removed when it ends.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::stream::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shardline_artifacts::{Artifacts, ListedObject, Upload};
use shardline_control::graph::ShardJob;
use shardline_control::{ListedFile, TaskOutput};
use shardline_formats::checkpoint::{tracked_dir, MEGATRON_TRACKER};
use shardline_formats::execute;
use shardline_formats::safetensors::Release;
use shardline_formats::training::common_state::{COMMON_PT, METADATA_JSON};
use shardline_formats::training::save_dir::{finish_seed_save, seed_dir, SeedArgs, RELEASE_DIR};
use shardline_layout::{Dialect, ModelConfig, Plan};
use shardline_store::{Lease, Store, UploadEnd};

use crate::steps::{job_plan, plan_digest, StepContext, StepError};

/// The marker a release's prefix gets last: every file with its size.
pub const RELEASE_MARKER: &str = "shardline-release.json";
/// Files other than safetensors staged whole only up to this size (configs, indexes, tokenizers).
const MAX_SMALL_FILE: u64 = 64 << 20;
/// The largest safetensors header read (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100_000_000;
/// Rank files' uploads the commit completes at a time.
const COMPLETES_IN_FLIGHT: usize = 8;

/// Records, under a task's lease, the multipart uploads it opens and how they end.
#[derive(Clone)]
pub struct UploadLedger {
    pub store: Store,
    pub lease: Lease,
}

impl UploadLedger {
    pub(crate) async fn opened(&self, artifacts: &Artifacts, name: &str, upload_id: &str) -> bool {
        self.store.register_upload(&self.lease, artifacts.url(), name, upload_id).await.unwrap_or(false)
    }

    async fn ended(&self, artifacts: &Artifacts, name: &str, upload_id: &str, end: UploadEnd) {
        if let Err(e) = self.store.end_upload(artifacts.url(), name, upload_id, end).await {
            // The reaper finds the upload by its attempt's end and settles it.
            tracing::warn!("recording the end of upload {upload_id} of `{name}` failed: {e}");
        }
    }
}

pub(crate) fn ledger<'a>(ctx: &StepContext<'a>) -> Result<&'a UploadLedger, StepError> {
    ctx.ledger.ok_or_else(|| StepError::fatal("uploads to the artifact store need a lease to record them under"))
}

pub(crate) fn open_artifacts(url: &str, ctx: &StepContext) -> Result<Artifacts, StepError> {
    Artifacts::open(url, &ctx.objects.store_options).map_err(|e| StepError::fatal(e.to_string()))
}

pub(crate) fn transient(e: impl std::fmt::Display) -> StepError {
    StepError::transient(e.to_string())
}

/// Uploads `path` as `name` and completes it at once (files that are whole outputs by themselves).
pub(crate) async fn put_file(
    artifacts: &Artifacts,
    name: &str,
    path: &Path,
    ctx: &StepContext<'_>,
) -> Result<u64, StepError> {
    let ledger = ledger(ctx)?;
    let upload = artifacts
        .upload_file(name, path, |id: String| async move { ledger.opened(artifacts, name, &id).await })
        .await
        .map_err(transient)?;
    artifacts.complete(&upload).await.map_err(transient)?;
    ledger.ended(artifacts, name, &upload.upload_id, UploadEnd::Completed).await;
    Ok(upload.size)
}

/// A downloaded release's output, with its files put in the artifact store under `root` (once:
/// a complete copy with the same files is reused).
pub fn publish_release(mut output: TaskOutput, root: &str, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let dir = output.path.clone().ok_or_else(|| StepError::fatal("the download reported no directory"))?;
    let files = dir_files(&dir, false)?;
    let mut key = Sha256::new();
    key.update(output.source.as_ref().map(Value::to_string).unwrap_or_else(|| dir.display().to_string()));
    for (name, size) in &files {
        key.update(format!("{name}\0{size}\0").as_bytes());
    }
    let key = hex::encode(key.finalize());
    let artifacts = open_artifacts(&format!("{}/releases/{}", root.trim_end_matches('/'), &key[..24]), ctx)?;
    let marker = serde_json::to_vec(
        &json!({ "files": files.iter().map(|(n, s)| json!({"name": n, "size": s})).collect::<Vec<_>>() }),
    )
    .map_err(transient)?;
    let listing = ctx.runtime.block_on(async {
        let present = artifacts.read_small(RELEASE_MARKER, 16 << 20).await.map_err(transient)?;
        if present.as_deref() == Some(&marker[..]) {
            (ctx.log)(format!("release already in the artifact store at {}", artifacts.url()));
        } else {
            for (name, _) in &files {
                put_file(&artifacts, name, &dir.join(name), ctx).await?;
            }
            artifacts.put_small(RELEASE_MARKER, marker.clone()).await.map_err(transient)?;
            (ctx.log)(format!("release put in the artifact store at {} ({} files)", artifacts.url(), files.len()));
        }
        artifacts.list().await.map_err(transient)
    })?;
    output.headers = Some(copy_headers(&artifacts, &listing, root, ctx)?);
    output.artifact = Some(artifacts.url().to_string());
    output.file_list = Some(listed_files(&listing));
    Ok(output)
}

/// The name of a release file's header copy (see `TaskOutput::headers`).
fn header_name(url: &str, name: &str, tag: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(format!("{url}\0{name}\0{}", tag.unwrap_or("")).as_bytes());
    hex::encode(h.finalize())
}

/// Copies every safetensors file's header of `release` (as `listing` lists it) to
/// `<root>/headers`, once; returns that prefix's URL.
fn copy_headers(
    release: &Artifacts,
    listing: &[ListedObject],
    root: &str,
    ctx: &StepContext,
) -> Result<String, StepError> {
    let headers = open_artifacts(&format!("{}/headers", root.trim_end_matches('/')), ctx)?;
    ctx.runtime.block_on(async {
        for o in listing.iter().filter(|o| o.name.ends_with(".safetensors") && o.size >= 8) {
            let name = header_name(release.url(), &o.name, o.e_tag.as_deref());
            if headers.head(&name).await.map_err(transient)?.is_some() {
                continue;
            }
            let len = release.read_range(&o.name, o.e_tag.as_deref(), 0, 8).await.map_err(transient)?;
            let n = u64::from_le_bytes(len.try_into().unwrap_or([0; 8])).min(MAX_HEADER).min(o.size - 8);
            let mut bytes = len_prefix(n);
            bytes.extend(release.read_range(&o.name, o.e_tag.as_deref(), 8, 8 + n).await.map_err(transient)?);
            headers.put_small(&name, bytes).await.map_err(transient)?;
        }
        Ok::<(), StepError>(())
    })?;
    Ok(headers.url().to_string())
}

fn len_prefix(n: u64) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

/// The files under `dir`, relative names and sizes, sorted (symlinks of a Hub snapshot followed);
/// names starting with `.` only with `hidden` (a release's are tools' state, a checkpoint's
/// `.metadata` is its own).
fn dir_files(dir: &Path, hidden: bool) -> Result<Vec<(String, u64)>, StepError> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let entries = fs::read_dir(dir.join(&rel)).map_err(|e| transient(format!("{}: {e}", dir.display())))?;
        for e in entries.flatten() {
            let name = rel.join(e.file_name());
            let meta = fs::metadata(dir.join(&name)).map_err(|e| transient(format!("{}: {e}", name.display())))?;
            let text = name.to_string_lossy().into_owned();
            if !hidden && e.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            if meta.is_dir() {
                stack.push(name);
            } else {
                out.push((text, meta.len()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn listed_files(listing: &[ListedObject]) -> Vec<ListedFile> {
    listing
        .iter()
        .filter(|o| o.name != RELEASE_MARKER)
        .map(|o| {
            let mut f = ListedFile { path: o.name.clone(), size: o.size, ..ListedFile::default() };
            if let Some(tag) = &o.e_tag {
                f.rest.insert("e_tag".into(), json!(tag));
            }
            f
        })
        .collect()
}

/// The objects under `url`, which must include `marker`, and the digest of their names, sizes
/// and ETags (what a read in place is pinned to).
fn listed_in_place(
    url: &str,
    marker: &str,
    what: &str,
    ctx: &StepContext,
) -> Result<(Artifacts, Vec<ListedObject>, String), StepError> {
    let artifacts = open_artifacts(url, ctx)?;
    let listing = ctx.runtime.block_on(artifacts.list()).map_err(transient)?;
    if !listing.iter().any(|o| o.name == marker) {
        return Err(StepError::fatal(format!("{url} has no `{marker}`: not {what}")));
    }
    let digest = listing_digest(&listing);
    Ok((artifacts, listing, digest))
}

/// The digest of a listing's names, sizes and ETags: a prefix's content, as far as a store says.
fn listing_digest(listing: &[ListedObject]) -> String {
    let mut digest = Sha256::new();
    for o in listing {
        digest.update(format!("{}\0{}\0{}\0", o.name, o.size, o.e_tag.as_deref().unwrap_or("")).as_bytes());
    }
    hex::encode(digest.finalize())
}

/// The [`listing_digest`] of the checkpoint under `url`, when it is there (its `.metadata` listed).
pub async fn checkpoint_digest(url: &str, settings: &crate::objects::ObjectSourceSettings) -> Option<String> {
    let listing = Artifacts::open(url, &settings.store_options).ok()?.list().await.ok()?;
    listing.iter().any(|o| is_checkpoint_marker(&o.name)).then(|| listing_digest(&listing))
}

/// Whether an object is what makes a prefix a checkpoint for its readers: a DCP `.metadata`, or
/// a Megatron-LM save directory's tracker.
fn is_checkpoint_marker(name: &str) -> bool {
    name == ".metadata" || name == MEGATRON_TRACKER
}

/// An object-store source read in place: listed (pinning every object's ETag), never downloaded.
pub fn list_source(url: &str, root: &str, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (artifacts, listing, digest) = listed_in_place(url, "config.json", "a release", ctx)?;
    (ctx.log)(format!("{url}: {} objects, read in place by later tasks", listing.len()));
    let headers = copy_headers(&artifacts, &listing, root, ctx)?;
    Ok(TaskOutput {
        headers: Some(headers),
        artifact: Some(artifacts.url().to_string()),
        digest: Some(digest),
        bytes: Some(listing.iter().map(|o| o.size).sum()),
        files: Some(listing.len() as u64),
        file_list: Some(listed_files(&listing)),
        source: Some(json!({ "url": url })),
        ..TaskOutput::default()
    })
}

/// A release staged as sparse local files: what a plan, rank or commit task reads.
pub(crate) struct Staged {
    pub(crate) release: Release,
    pub(crate) artifacts: Artifacts,
    /// Every staged file with its ETag, by relative name.
    pub(crate) tags: BTreeMap<String, Option<String>>,
}

/// Where a worker keeps a release file it read whole: a directory of its object cache (so its gc
/// frees it, least recently used, under the cache limit) keyed by the object's URL and ETag (an
/// object replaced under the same name gets another entry).
pub(crate) fn whole_file_path(ctx: &StepContext, url: &str, name: &str, tag: Option<&str>) -> PathBuf {
    let mut h = Sha256::new();
    h.update(format!("{url}\0{name}\0{}", tag.unwrap_or("")).as_bytes());
    let file = Path::new(name).file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "file".into());
    object_cache(ctx).join(format!("whole-{}", &hex::encode(h.finalize())[..32])).join(file)
}

/// The worker's object cache: its own setting, else `objects/` under its scratch root.
fn object_cache(ctx: &StepContext) -> PathBuf {
    ctx.objects.cache_dir.clone().unwrap_or_else(|| ctx.scratch_root.join("objects"))
}

/// The lock of the whole-file read into `path`, shared by this process's tasks.
pub(crate) fn whole_file_lock(path: &Path) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: std::sync::OnceLock<std::sync::Mutex<BTreeMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>> =
        std::sync::OnceLock::new();
    let locks = LOCKS.get_or_init(Default::default);
    match locks.lock() {
        Ok(mut map) => map.entry(path.to_path_buf()).or_default().clone(),
        // A poisoned map only loses the sharing: this task reads on its own.
        Err(_) => Arc::default(),
    }
}

/// `path` replaced by a hard link to `whole` (both under the worker's scratch root).
pub(crate) fn link_whole(whole: &Path, path: &Path) -> Result<(), StepError> {
    let _ = fs::remove_file(path);
    fs::hard_link(whole, path).map_err(|e| transient(format!("{} → {}: {e}", whole.display(), path.display())))
}

/// Stages the release a download task recorded (`artifact` and `file_list`) under `dir`: every
/// file created at its size, safetensors headers and small files filled in; a file this worker
/// has already read whole is linked from its file cache instead.
pub(crate) fn stage_release(source: &TaskOutput, dir: &Path, ctx: &StepContext) -> Result<Staged, StepError> {
    let url = source.artifact.as_deref().ok_or_else(|| StepError::fatal("the download recorded no artifact prefix"))?;
    let files = source.file_list.clone().unwrap_or_default();
    let artifacts = open_artifacts(url, ctx)?;
    let headers = source.headers.as_deref().map(|h| open_artifacts(h, ctx)).transpose()?;
    let tags: BTreeMap<String, Option<String>> = files
        .iter()
        .map(|f| (f.path.clone(), f.rest.get("e_tag").and_then(Value::as_str).map(str::to_string)))
        .collect();
    ctx.runtime.block_on(async {
        for f in &files {
            let path = dir.join(&f.path);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| transient(format!("{}: {e}", parent.display())))?;
            }
            let whole = whole_file_path(ctx, artifacts.url(), &f.path, tags.get(&f.path).cloned().flatten().as_deref());
            if fs::metadata(&whole).is_ok_and(|m| m.len() == f.size) {
                link_whole(&whole, &path)?;
                continue;
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| transient(format!("{}: {e}", path.display())))?;
            file.set_len(f.size).map_err(|e| transient(format!("{}: {e}", path.display())))?;
            let file = Arc::new(file);
            let tag = tags.get(&f.path).cloned().flatten();
            if f.path.ends_with(".safetensors") {
                if f.size < 8 {
                    continue; // the reader reports it
                }
                let copy = match &headers {
                    Some(h) => h
                        .read_small(&header_name(artifacts.url(), &f.path, tag.as_deref()), MAX_HEADER + 8)
                        .await
                        .map_err(transient)?,
                    None => None,
                };
                if let Some(bytes) = copy {
                    std::os::unix::fs::FileExt::write_all_at(&*file, &bytes, 0).map_err(transient)?;
                    continue;
                }
                artifacts.fetch_ranges(&f.path, tag.as_deref(), &[(0, 8)], file.clone()).await.map_err(transient)?;
                let mut len = [0u8; 8];
                std::os::unix::fs::FileExt::read_exact_at(&*file, &mut len, 0).map_err(transient)?;
                let header = u64::from_le_bytes(len).min(MAX_HEADER).min(f.size - 8);
                artifacts.fetch_ranges(&f.path, tag.as_deref(), &[(8, 8 + header)], file).await.map_err(transient)?;
            } else if f.size <= MAX_SMALL_FILE {
                artifacts.fetch_ranges(&f.path, tag.as_deref(), &[(0, f.size)], file).await.map_err(transient)?;
            }
        }
        Ok::<(), StepError>(())
    })?;
    let release = Release::open(dir).map_err(|e| StepError::fatal(format!("release at {url}: {e}")))?;
    Ok(Staged { release, artifacts, tags })
}

/// The plan of `job`, from a staged release, checked against the plan task's digest (`None`:
/// the plan task itself).
pub(crate) fn staged_plan(
    ctx: &StepContext,
    job: &ShardJob,
    plan_task: Option<&str>,
    dir: &Path,
) -> Result<(Staged, Plan), StepError> {
    let source =
        ctx.outputs.get(&job.source_task).ok_or_else(|| StepError::transient("the download's output is missing"))?;
    let staged = stage_release(source, &dir.join("release"), ctx)?;
    let plan = job_plan(job, &staged.release)?;
    if let Some(task) = plan_task {
        let recorded = ctx.outputs.get(task).and_then(|o| o.plan_digest.clone()).unwrap_or_default();
        let digest = plan_digest(&plan);
        if digest != recorded {
            return Err(StepError::fatal(format!(
                "the plan rebuilt from the release in the artifact store ({digest}) differs from the one `{task}` recorded ({recorded})"
            )));
        }
    }
    Ok((staged, plan))
}

/// A plan task: the plan of the staged release (no output directory is prepared: rank files go
/// to the store).
pub fn plan(job: &ShardJob, ctx: &StepContext) -> Result<Plan, StepError> {
    Ok(staged_plan(ctx, job, None, ctx.scratch)?.1)
}

/// Where a shard job's DCP files go under its artifact prefix `remote`: the prefix itself, or,
/// for a `torch_dist` save directory, its checkpoint directory `release/`.
pub(crate) fn dcp_prefix(job: &ShardJob, remote: &str) -> Result<String, StepError> {
    Ok(match crate::steps::job_dialect(job)? {
        Dialect::TorchDist => format!("{}/{RELEASE_DIR}", remote.trim_end_matches('/')),
        _ => remote.to_string(),
    })
}

/// The checkpoint under the artifact prefix `url`: the prefix itself, or, for a Megatron-LM save
/// directory (`torch_dist`), the checkpoint directory its tracker names. Returns its URL and
/// whether it is a save directory's.
pub(crate) fn checkpoint_in(url: &str, ctx: &StepContext) -> Result<(String, bool), StepError> {
    let artifacts = open_artifacts(url, ctx)?;
    let tracker = ctx.runtime.block_on(artifacts.read_small(MEGATRON_TRACKER, 1 << 10)).map_err(transient)?;
    let Some(text) = tracker else { return Ok((url.to_string(), false)) };
    let text = String::from_utf8_lossy(&text);
    let dir = tracked_dir(&text)
        .ok_or_else(|| StepError::fatal(format!("{url}/{MEGATRON_TRACKER} names no checkpoint: `{}`", text.trim())))?;
    Ok((format!("{}/{dir}", url.trim_end_matches('/')), true))
}

/// A commit task: every rank's upload checked against the plan and completed, then `.metadata`
/// (for a `torch_dist` save directory: its `_extra_state` objects, `.metadata`, `common.pt` and
/// `metadata.json` in `release/`, then the tracker).
pub fn commit(job: &ShardJob, plan_task: &str, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let remote = job.remote.as_deref().ok_or_else(|| StepError::fatal("no artifact prefix for the checkpoint"))?;
    let (staged, plan) = staged_plan(ctx, job, Some(plan_task), ctx.scratch)?;
    let options = crate::steps::exec_options(job);
    let torch_dist = crate::steps::job_dialect(job)? == Dialect::TorchDist;
    let artifacts = open_artifacts(&dcp_prefix(job, remote)?, ctx)?;
    let mut uploads = Vec::new();
    for (rank, (name, len)) in execute::rank_files(&plan, options.format).into_iter().enumerate() {
        let task = format!("{plan_task}/rank-{rank}");
        let u = ctx
            .outputs
            .get(&task)
            .and_then(|o| o.upload.clone())
            .ok_or_else(|| StepError::fatal(format!("`{task}` recorded no upload")))?;
        if u.name != name || len.is_some_and(|l| l != u.size) {
            return Err(StepError::fatal(format!(
                "`{task}` uploaded `{}` of {} bytes; the plan implies `{name}` of {} bytes",
                u.name,
                u.size,
                len.map_or("any".into(), |l| l.to_string())
            )));
        }
        uploads.push(Upload { name: u.name, upload_id: u.upload_id, parts: u.parts, size: u.size });
    }
    let meta = ctx.scratch.join("meta");
    let metadata = match options.format {
        execute::OutputFormat::Dcp => Some(
            execute::write_metadata_alone(&plan, &seed_dir(&meta)).map_err(|e| StepError::transient(e.to_string()))?,
        ),
        execute::OutputFormat::DcpSafetensors => None,
    };
    // A torch_dist save directory: what completes it, written here and put after `.metadata`.
    let save = if torch_dist {
        let config =
            ModelConfig::from_json(staged.release.config_json()).map_err(|e| StepError::fatal(e.to_string()))?;
        let args = SeedArgs::for_model(&config, staged.release.config_json(), plan.mesh, job.vocab_divisible_by);
        finish_seed_save(&meta, &args).map_err(|e| StepError::transient(e.to_string()))?;
        Some(open_artifacts(remote, ctx)?)
    } else {
        None
    };
    let ledger = ledger(ctx)?;
    ctx.runtime.block_on(async {
        if let Some(root) = &save {
            // A tracker an earlier attempt put there is withdrawn first.
            root.delete(MEGATRON_TRACKER).await.map_err(transient)?;
        }
        // Completing an upload can take a while (a store may assemble its parts then): several
        // at a time, `.metadata` only once all are done.
        futures_util::stream::iter(&uploads)
            .map(|u| {
                let artifacts = &artifacts;
                async move {
                    artifacts.complete(u).await.map_err(transient)?;
                    ledger.ended(artifacts, &u.name, &u.upload_id, UploadEnd::Completed).await;
                    Ok::<(), StepError>(())
                }
            })
            .buffer_unordered(COMPLETES_IN_FLIGHT)
            .try_collect::<Vec<()>>()
            .await?;
        if let Some(path) = &metadata {
            let dir = seed_dir(&meta);
            // The `_extra_state` objects' files before the `.metadata` that names them.
            for (name, _) in dir_files(&dir, false)?.iter().filter(|(n, _)| n.ends_with(".distcp")) {
                put_file(&artifacts, name, &dir.join(name), ctx).await?;
            }
            put_file(&artifacts, ".metadata", path, ctx).await?;
        }
        if let Some(root) = &save {
            for name in [COMMON_PT, METADATA_JSON] {
                put_file(&artifacts, name, &seed_dir(&meta).join(name), ctx).await?;
            }
            put_file(root, MEGATRON_TRACKER, &meta.join(MEGATRON_TRACKER), ctx).await?;
        }
        Ok::<(), StepError>(())
    })?;
    (ctx.log)(format!(
        "committed {remote}: {} rank files completed, then .metadata{}",
        uploads.len(),
        if torch_dist { ", common.pt, metadata.json and the tracker" } else { "" }
    ));
    let world = plan.world();
    Ok(TaskOutput {
        artifact: Some(remote.to_string()),
        mesh: Some(plan.mesh.to_string()),
        world: Some(world),
        keys: Some(plan.tensors.len() as u64),
        bytes: Some(plan.bytes_per_rank().iter().sum::<u64>()),
        split_fused: Some(job.split_fused),
        ..TaskOutput::default()
    }
    .with("format", json!(job.format)))
}

/// A local copy of what `output` names: its directory when it has one on this host, else its
/// artifact prefix downloaded into the worker's object cache.
pub fn materialize(output: &TaskOutput, ctx: &StepContext) -> Result<Option<PathBuf>, StepError> {
    let Some(url) = output.artifact.as_deref() else { return Ok(None) };
    let got = TaskOutput::from_value(&crate::objects::download(url, &object_cache(ctx), ctx.objects, ctx)?);
    Ok(got.path)
}

/// Whether the checkpoint a cached output names is still complete in its artifact store: its
/// `.metadata` is listed, or, for one without (DCP-safetensors), all `world` of its files. (Its
/// run's prefix goes with the run's retention; the cache entry is then no longer served.)
pub async fn checkpoint_listed(output: &TaskOutput, settings: &crate::objects::ObjectSourceSettings) -> bool {
    let Some(url) = output.artifact.as_deref() else { return false };
    let Ok(artifacts) = Artifacts::open(url, &settings.store_options) else { return false };
    let Ok(listing) = artifacts.list().await else { return false };
    let files = listing.iter().filter(|o| o.name.ends_with(".safetensors")).count() as u64;
    listing.iter().any(|o| is_checkpoint_marker(&o.name)) || output.world.is_some_and(|w| w > 0 && files == w)
}

/// Aborts an upload a failed attempt left open and records it.
pub async fn abort(store: &Store, store_url: &str, name: &str, upload_id: &str) -> Result<(), String> {
    let artifacts = Artifacts::open(store_url, &[]).map_err(|e| e.to_string())?;
    artifacts.abort(name, upload_id).await.map_err(|e| e.to_string())?;
    store.end_upload(store_url, name, upload_id, UploadEnd::Aborted).await.map_err(|e| e.to_string())
}

/// Removes a task's staging directory (best effort: it is under the worker's scratch root).
pub fn clean(dir: &Path) {
    if dir.exists() {
        if let Err(e) = fs::remove_dir_all(dir) {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}

/// An object-store checkpoint a reshard reads, only listed (it must have its `.metadata`): the
/// reshard reads it back into its worker's object cache.
pub fn list_checkpoint(url: &str, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (_, save_dir) = checkpoint_in(url, ctx)?;
    let marker = if save_dir { MEGATRON_TRACKER } else { ".metadata" };
    let (artifacts, listing, digest) = listed_in_place(url, marker, "a checkpoint", ctx)?;
    (ctx.log)(format!("{url}: {} objects, read by the reshard", listing.len()));
    Ok(TaskOutput {
        artifact: Some(artifacts.url().to_string()),
        digest: Some(digest),
        bytes: Some(listing.iter().map(|o| o.size).sum()),
        files: Some(listing.len() as u64),
        source: Some(json!({ "url": url, "kind": "checkpoint.reshard" })),
        ..TaskOutput::default()
    })
}

/// Runs a step that reads and writes whole directories (reshard, export, command) on an
/// artifact store: the outputs of `needs` that live only there are read into the worker's object
/// cache and handed to the step as local directories, the step writes into the task's scratch,
/// and what it wrote is put under `remote` file by file, `last` (its completeness marker) last.
pub fn staged_step(
    ctx: &StepContext,
    needs: &[&str],
    remote: &str,
    last: &str,
    run: impl FnOnce(&StepContext, PathBuf) -> Result<TaskOutput, StepError>,
) -> Result<TaskOutput, StepError> {
    let mut outputs = ctx.outputs.clone();
    for task in needs {
        let Some(o) = outputs.get_mut(*task) else { continue };
        let here = |p: &Option<PathBuf>| p.as_ref().is_some_and(|p| p.exists());
        if o.artifact.is_none() || o.upload.is_some() || here(&o.dir) || here(&o.path) {
            continue;
        }
        let local = materialize(o, ctx)?;
        // A download names its release by `path`, a checkpoint or a directory by `dir`.
        if o.path.is_some() {
            o.path = local;
        } else {
            o.dir = local;
        }
    }
    let local_ctx = StepContext { outputs: &outputs, ..*ctx };
    let out = ctx.scratch.join("out");
    let mut output = run(&local_ctx, out.clone())?;
    let artifacts = open_artifacts(remote, ctx)?;
    let mut files = dir_files(&out, true)?;
    // A Megatron-LM save directory's marker is its tracker, whatever the step's.
    let last = if out.join(MEGATRON_TRACKER).is_file() { MEGATRON_TRACKER } else { last };
    // The marker last, and a DCP checkpoint's `.metadata` after its rank files: a reader that
    // finds either finds everything it names.
    files.sort_by_key(|(name, _)| (name == last, name == ".metadata" || name.ends_with("/.metadata")));
    let total = ctx.runtime.block_on(async {
        // A marker an earlier attempt put there is withdrawn before its files are written again.
        artifacts.delete(last).await.map_err(transient)?;
        let mut total = 0;
        for (name, _) in &files {
            total += put_file(&artifacts, name, &out.join(name), ctx).await?;
        }
        Ok::<u64, StepError>(total)
    })?;
    (ctx.log)(format!("put {} files ({total} bytes) under {remote}", files.len()));
    output.dir = None;
    output.artifact = Some(artifacts.url().to_string());
    Ok(output)
}
