//! `hf.download` of an object-store prefix (`path: s3://bucket/prefix`, `gs://…`, `az://…`,
//! `file:///abs/dir`): the store is opened exactly as `store.upload` opens its destinations
//! (`shardline_publish::Destination`: object_store configured from the environment), the objects
//! under the prefix are listed, and downloaded in parallel into a local cache directory that
//! later steps read like a local `path` source.
//!
//! The cache directory is keyed by the URL and the listing (every object's name, size, ETag or
//! version, and the manifest's bytes): an unchanged prefix is found complete on disk (and is a
//! step-cache hit), a changed object downloads again into a directory of its own. Objects are
//! streamed to disk under temporary names, checked (size; SHA-256 against the manifest when the
//! prefix has one) and renamed; the directory is filled under `<key>.partial` and renamed to
//! `<key>` when every file is there, so an interrupted download never looks complete, and the
//! files a failed attempt finished are kept for the next one.
//!
//! A prefix with a Shardline manifest (`shardline-manifest.json`, as `store.upload` writes it)
//! is downloaded as the manifest lists it: every listed file must be there with its size, every
//! byte is hashed on the way to disk and a file whose SHA-256 differs fails the step; objects the
//! manifest does not list are left out. A prefix with a publish in progress (its pending record
//! and no manifest) is refused.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::stream::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shardline_publish::object_store::path::Path as ObjPath;
use shardline_publish::object_store::{self, GetOptions, ObjectStore, ObjectStoreExt};
use shardline_publish::{Destination, Manifest, MANIFEST, MANIFEST_FORMAT, PENDING};
use tokio::io::AsyncWriteExt;

use crate::steps::{StepContext, StepError};

/// Files downloaded at once when the settings say nothing.
pub const DEFAULT_FILES_IN_FLIGHT: usize = 4;
/// The largest manifest read (it lists files; a release has at most thousands).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;
/// Suffix of a file being downloaded (in the `.partial` directory only).
const TMP_SUFFIX: &str = ".shardline-download";

/// How a worker reaches object-store sources. By default everything comes from the environment,
/// as object_store's builders read it (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, …,
/// `GOOGLE_SERVICE_ACCOUNT`, …, `AZURE_STORAGE_ACCOUNT_NAME`, …), the same as `store.upload`.
#[derive(Clone, Default)]
pub struct ObjectSourceSettings {
    /// The download cache instead of `<work>/cache/objects` of the run's work directory.
    pub cache_dir: Option<PathBuf>,
    /// object_store configuration keys over the environment's, for `s3://`, `gs://` and `az://`
    /// sources (`aws_endpoint`, `aws_allow_http`, …). Values are never printed.
    pub store_options: Vec<(String, String)>,
    /// Files downloaded at once (0: [`DEFAULT_FILES_IN_FLIGHT`]).
    pub max_files_in_flight: usize,
    /// Bytes of a rank file a rank task on an artifact store stages at a time: the release
    /// bytes it is written from are fetched, it is written and uploaded, and the disk freed,
    /// section by section (0: [`DEFAULT_RANK_SECTION_BYTES`]).
    pub rank_section_bytes: u64,
}

/// Default of [`ObjectSourceSettings::rank_section_bytes`].
pub const DEFAULT_RANK_SECTION_BYTES: u64 = 256 << 20;

impl fmt::Debug for ObjectSourceSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectSourceSettings")
            .field("cache_dir", &self.cache_dir)
            .field("store_options", &self.store_options.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .field("max_files_in_flight", &self.max_files_in_flight)
            .finish()
    }
}

/// One object of the source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceObject {
    /// Path relative to the prefix, `/`-separated (the file's path in the local directory).
    pub name: String,
    pub location: ObjPath,
    pub size: u64,
    pub e_tag: Option<String>,
    pub version: Option<String>,
    /// The SHA-256 the manifest records, when the prefix has a manifest.
    pub sha256: Option<String>,
}

/// What is under a prefix now.
#[derive(Clone, Debug)]
pub struct Listing {
    /// The URL without credentials.
    pub url: String,
    /// The objects to download, by name.
    pub objects: Vec<SourceObject>,
    /// Whether the prefix has a Shardline manifest (then `objects` is what it lists).
    pub manifest: bool,
    /// Objects under the prefix that the manifest does not list (not downloaded).
    pub unlisted: Vec<String>,
    /// Digest of the objects' names, sizes, ETags and versions and of the manifest's bytes.
    pub digest: String,
}

impl Listing {
    /// The step cache key, also the name of the local directory: the URL and the listing.
    pub fn cache_key(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"shardline hf.download object store\0");
        h.update(self.url.as_bytes());
        h.update(b"\0");
        h.update(self.digest.as_bytes());
        hex::encode(h.finalize())
    }

    pub fn bytes(&self) -> u64 {
        self.objects.iter().map(|o| o.size).sum()
    }
}

/// Opens the source's store as `store.upload` opens a destination. Explicit options apply to
/// remote stores only (a local directory takes none).
pub fn open(url: &str, settings: &ObjectSourceSettings) -> Result<Destination, StepError> {
    let options: &[(String, String)] = if url.starts_with("file://") { &[] } else { &settings.store_options };
    Destination::open(url, options).map_err(|e| StepError::fatal(format!("opening source {}: {e}", shown(url))))
}

/// `url` for a message: without user info, query or fragment (the store's errors are redacted by
/// the store; this is for the URL as written, before a store exists).
fn shown(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or_default();
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{scheme}://{host}{path}")
        }
        None => url.to_string(),
    }
}

fn store_error(src: &Destination, what: &str, e: object_store::Error) -> StepError {
    let fatal = matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
            | object_store::Error::NotSupported { .. }
    );
    let text = src.redact(&e.to_string());
    let message = format!("{src}: {what}: {text}");
    if fatal || text.contains("NoSuchBucket") || text.contains("AccessDenied") {
        StepError::fatal(message)
    } else {
        StepError::transient(message)
    }
}

/// The relative name of `location` under `prefix`, when it is under it.
fn relative_name(location: &ObjPath, prefix: &ObjPath) -> Option<String> {
    let parts: Vec<String> = location.prefix_match(prefix)?.map(|p| p.as_ref().to_string()).collect();
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// Lists the prefix and reads its manifest, if any.
pub async fn list(src: &Destination) -> Result<Listing, StepError> {
    let store = src.store().clone();
    let prefix = src.prefix().clone();
    let metas: Vec<object_store::ObjectMeta> =
        store.list(Some(&prefix)).try_collect().await.map_err(|e| store_error(src, "listing", e))?;
    let mut objects: BTreeMap<String, SourceObject> = BTreeMap::new();
    let mut manifest_meta = None;
    let mut pending = false;
    for m in metas {
        let Some(name) = relative_name(&m.location, &prefix) else { continue };
        match name.as_str() {
            MANIFEST => manifest_meta = Some(m),
            PENDING => pending = true,
            _ => {
                objects.insert(
                    name.clone(),
                    SourceObject {
                        name,
                        location: m.location,
                        size: m.size,
                        // A store without ETags (none known today) is keyed by modification time.
                        e_tag: m.e_tag.or_else(|| Some(format!("mtime:{}", m.last_modified.to_rfc3339()))),
                        version: m.version,
                        sha256: None,
                    },
                );
            }
        }
    }
    let mut h = Sha256::new();
    h.update(b"shardline object-store listing\0");
    let mut unlisted = Vec::new();
    let manifest = match manifest_meta {
        None if pending => {
            return Err(StepError::fatal(format!(
                "{src} has a publish in progress or interrupted (`{PENDING}`) and no manifest: its objects are not a \
                 complete release; publish it again or remove `{PENDING}`"
            )))
        }
        None => None,
        Some(meta) => {
            if meta.size > MAX_MANIFEST_BYTES {
                return Err(StepError::fatal(format!(
                    "{src}: `{MANIFEST}` is {} bytes, more than a manifest can be ({MAX_MANIFEST_BYTES})",
                    meta.size
                )));
            }
            let bytes = store
                .get(&meta.location)
                .await
                .map_err(|e| store_error(src, "reading the manifest", e))?
                .bytes()
                .await
                .map_err(|e| store_error(src, "reading the manifest", e))?;
            h.update(b"manifest\0");
            h.update(Sha256::digest(&bytes));
            let m: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| StepError::fatal(format!("{src}: `{MANIFEST}` is not a Shardline manifest: {e}")))?;
            if m.format != MANIFEST_FORMAT {
                return Err(StepError::fatal(format!(
                    "{src}: `{MANIFEST}` has format `{}`, expected `{MANIFEST_FORMAT}`",
                    m.format
                )));
            }
            Some(m)
        }
    };
    let selected: Vec<SourceObject> = match &manifest {
        None => objects.into_values().collect(),
        Some(m) => {
            let mut selected = Vec::with_capacity(m.files.len());
            for f in &m.files {
                let Some(mut o) = objects.remove(&f.path) else {
                    return Err(StepError::fatal(format!(
                        "{src}: the manifest lists `{}` ({} bytes) but there is no such object",
                        f.path, f.size
                    )));
                };
                if o.size != f.size {
                    return Err(StepError::fatal(format!(
                        "{src}: `{}` is {} bytes but the manifest says {}: the object was replaced or truncated",
                        f.path, o.size, f.size
                    )));
                }
                o.sha256 = Some(f.sha256.to_ascii_lowercase());
                selected.push(o);
            }
            unlisted = objects.into_keys().collect();
            selected.sort_by(|a, b| a.name.cmp(&b.name));
            selected
        }
    };
    if selected.is_empty() {
        return Err(StepError::fatal(if manifest.is_some() {
            format!("{src}: the manifest lists no files")
        } else {
            format!("{src} has no objects: nothing to download (check the bucket and the prefix)")
        }));
    }
    for o in &selected {
        let line = format!(
            "\0{}\0{}\0{}\0{}",
            o.name,
            o.size,
            o.e_tag.as_deref().unwrap_or(""),
            o.version.as_deref().unwrap_or("")
        );
        h.update(line.as_bytes());
    }
    Ok(Listing {
        url: src.to_string(),
        objects: selected,
        manifest: manifest.is_some(),
        unlisted,
        digest: hex::encode(h.finalize()),
    })
}

/// Whether `dir` holds every object of the listing with its size.
fn complete(dir: &Path, listing: &Listing) -> bool {
    listing.objects.iter().all(|o| fs::metadata(dir.join(&o.name)).is_ok_and(|m| m.is_file() && m.len() == o.size))
}

/// Byte and file counters of a download, shared by its file tasks.
#[derive(Default)]
struct Counters {
    downloaded: AtomicU64,
    reused: AtomicU64,
    files_done: AtomicU64,
}

/// Streams one object to `partial/<name>` (through a temporary name) and checks it.
async fn fetch(
    src: &Destination,
    o: &SourceObject,
    partial: &Path,
    counters: &Counters,
) -> Result<Option<String>, StepError> {
    let target = partial.join(&o.name);
    let mut tmp_name = target.as_os_str().to_owned();
    tmp_name.push(TMP_SUFFIX);
    let tmp = PathBuf::from(tmp_name);
    if fs::metadata(&target).is_ok_and(|m| m.is_file() && m.len() == o.size) {
        // Finished (and checked) by an earlier attempt; what another one left half-written goes.
        let _ = tokio::fs::remove_file(&tmp).await;
        counters.reused.fetch_add(o.size, Ordering::Relaxed);
        counters.files_done.fetch_add(1, Ordering::Relaxed);
        return Ok(None);
    }
    let io = |what: &str, p: &Path, e: std::io::Error| StepError::transient(format!("{}: {what}: {e}", p.display()));
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(|e| io("create", parent, e))?;
    }
    // The object as listed: a replaced object fails the GET instead of mixing versions.
    let options = GetOptions {
        if_match: o.e_tag.clone().filter(|t| !t.starts_with("mtime:")),
        version: o.version.clone(),
        ..GetOptions::default()
    };
    let what = format!("downloading `{}`", o.name);
    let result = src.store().get_opts(&o.location, options).await.map_err(|e| match e {
        object_store::Error::Precondition { .. } => StepError::transient(format!(
            "{src}: `{}` changed after it was listed; the next attempt lists the prefix again",
            o.name
        )),
        e => store_error(src, &what, e),
    })?;
    let mut stream = result.into_stream();
    let mut file = tokio::fs::File::create(&tmp).await.map_err(|e| io("create", &tmp, e))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| store_error(src, &what, e))?;
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(|e| io("write", &tmp, e))?;
        written += chunk.len() as u64;
        counters.downloaded.fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    file.flush().await.map_err(|e| io("write", &tmp, e))?;
    file.sync_all().await.map_err(|e| io("sync", &tmp, e))?;
    drop(file);
    let on_disk = tokio::fs::metadata(&tmp).await.map_err(|e| io("stat", &tmp, e))?.len();
    if written != o.size || on_disk != o.size {
        let _ = tokio::fs::remove_file(&tmp).await;
        counters.downloaded.fetch_sub(written, Ordering::Relaxed);
        return Err(StepError::transient(format!(
            "{src}: `{}`: downloaded {written} bytes ({on_disk} on disk), the listing says {}",
            o.name, o.size
        )));
    }
    let sha = hex::encode(hasher.finalize());
    if let Some(expected) = &o.sha256 {
        if *expected != sha {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(StepError::fatal(format!(
                "{src}: `{}` does not match the manifest: SHA-256 {sha}, the manifest records {expected} \
                 ({} bytes both): the object is corrupt or was replaced after publishing",
                o.name, o.size
            )));
        }
    }
    tokio::fs::rename(&tmp, &target).await.map_err(|e| io("rename", &target, e))?;
    counters.files_done.fetch_add(1, Ordering::Relaxed);
    Ok(Some(sha))
}

/// An exclusive lock on `path` (a file), taken without blocking the runtime; released on drop.
async fn lock(path: &Path, cancel: &std::sync::atomic::AtomicBool) -> Result<fs::File, StepError> {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| StepError::transient(format!("{}: {e}", path.display())))?;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) => {
                if cancel.load(Ordering::Relaxed) {
                    return Err(StepError::transient("download stopped: the task was cancelled or lost its lease"));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(StepError::transient(format!("{}: lock: {e}", path.display())));
            }
        }
    }
}

/// What a download did.
struct Fetched {
    dir: PathBuf,
    bytes_downloaded: u64,
    bytes_reused: u64,
    /// SHA-256 of each file downloaded now (files already on disk have none).
    sha256: BTreeMap<String, String>,
}

async fn fetch_all(
    src: &Destination,
    listing: &Listing,
    cache_root: &Path,
    in_flight: usize,
    counters: &Arc<Counters>,
    cancel: &std::sync::atomic::AtomicBool,
) -> Result<Fetched, StepError> {
    let key = listing.cache_key();
    let dir = cache_root.join(&key);
    let partial = cache_root.join(format!("{key}.partial"));
    fs::create_dir_all(cache_root).map_err(|e| StepError::transient(format!("{}: {e}", cache_root.display())))?;
    // One download of a key at a time on this machine; the next one finds it complete.
    let _lock = lock(&cache_root.join(format!("{key}.lock")), cancel).await?;
    if complete(&dir, listing) {
        let bytes = listing.bytes();
        counters.reused.store(bytes, Ordering::Relaxed);
        counters.files_done.store(listing.objects.len() as u64, Ordering::Relaxed);
        return Ok(Fetched { dir, bytes_downloaded: 0, bytes_reused: bytes, sha256: BTreeMap::new() });
    }
    if dir.exists() {
        // Not what the listing says (a file removed by hand): downloaded again.
        fs::remove_dir_all(&dir).map_err(|e| StepError::transient(format!("{}: {e}", dir.display())))?;
    }
    fs::create_dir_all(&partial).map_err(|e| StepError::transient(format!("{}: {e}", partial.display())))?;
    let partial_dir: &Path = &partial;
    let results: Vec<(String, Option<String>)> = futures_util::stream::iter(listing.objects.iter())
        .map(|o| async move { fetch(src, o, partial_dir, counters).await.map(|sha| (o.name.clone(), sha)) })
        .buffer_unordered(in_flight.max(1))
        .try_collect()
        .await?;
    if !complete(&partial, listing) {
        return Err(StepError::transient(format!("{}: not every file is there after the download", partial.display())));
    }
    fs::rename(&partial, &dir).map_err(|e| StepError::transient(format!("{}: {e}", dir.display())))?;
    if let Ok(d) = fs::File::open(cache_root) {
        let _ = d.sync_all();
    }
    Ok(Fetched {
        dir,
        bytes_downloaded: counters.downloaded.load(Ordering::Relaxed),
        bytes_reused: counters.reused.load(Ordering::Relaxed),
        sha256: results.into_iter().filter_map(|(n, s)| s.map(|s| (n, s))).collect(),
    })
}

/// Whether a remembered output still describes a complete directory (every file with its size).
pub fn cached_output_usable(output: &shardline_control::TaskOutput) -> bool {
    crate::hub::cached_snapshot_usable(output)
}

/// Downloads the prefix `url` into `cache_root` (blocking: runs on a runtime of its own).
/// Progress goes to `ctx.progress` and `ctx.bytes_total`; the task's log gets a line every few
/// seconds. Stops when `ctx.progress.cancel` is set.
pub fn download(
    url: &str,
    cache_root: &Path,
    settings: &ObjectSourceSettings,
    ctx: &StepContext,
) -> Result<Value, StepError> {
    let src = open(url, settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| StepError::transient(format!("starting the download runtime: {e}")))?;
    let in_flight =
        if settings.max_files_in_flight == 0 { DEFAULT_FILES_IN_FLIGHT } else { settings.max_files_in_flight };
    let counters = Arc::new(Counters::default());
    let progress = ctx.progress.clone();
    let total = ctx.bytes_total.clone();
    let log = ctx.log;
    let listing_slot: Mutex<Option<Listing>> = Mutex::new(None);
    let fetched = runtime.block_on(async {
        let work = async {
            let listing = list(&src).await?;
            total.store(listing.bytes(), Ordering::Relaxed);
            log(format!(
                "{}: {} objects, {} bytes{}; into {}",
                listing.url,
                listing.objects.len(),
                listing.bytes(),
                if listing.manifest { ", checked against its manifest" } else { " (no manifest: sizes checked)" },
                cache_root.join(listing.cache_key()).display()
            ));
            if !listing.unlisted.is_empty() {
                log(format!(
                    "not in the manifest, not downloaded: {}",
                    listing.unlisted.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
                ));
            }
            let fetched = fetch_all(&src, &listing, cache_root, in_flight, &counters, &progress.cancel).await?;
            if let Ok(mut slot) = listing_slot.lock() {
                *slot = Some(listing);
            }
            Ok::<Fetched, StepError>(fetched)
        };
        tokio::pin!(work);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut logged = Instant::now();
        loop {
            tokio::select! {
                r = &mut work => break r,
                _ = tick.tick() => {
                    let done = counters.downloaded.load(Ordering::Relaxed) + counters.reused.load(Ordering::Relaxed);
                    progress.bytes_written.store(done, Ordering::Relaxed);
                    progress.files_done.store(counters.files_done.load(Ordering::Relaxed), Ordering::Relaxed);
                    if progress.cancel.load(Ordering::Relaxed) {
                        break Err(StepError::transient("download stopped: the task was cancelled or lost its lease"));
                    }
                    if logged.elapsed() >= Duration::from_secs(5) {
                        log(format!(
                            "downloaded {done} of {} bytes, {} files",
                            total.load(Ordering::Relaxed),
                            counters.files_done.load(Ordering::Relaxed)
                        ));
                        logged = Instant::now();
                    }
                }
            }
        }
    })?;
    drop(runtime);
    let listing = listing_slot
        .into_inner()
        .ok()
        .flatten()
        .ok_or_else(|| StepError::transient("the download finished without a listing"))?;
    let bytes = listing.bytes();
    ctx.progress.bytes_written.store(bytes, Ordering::Relaxed);
    ctx.progress.files_done.store(listing.objects.len() as u64, Ordering::Relaxed);
    (ctx.log)(format!(
        "{}: {} files, {} bytes in {} ({} downloaded, {} already there){}",
        listing.url,
        listing.objects.len(),
        bytes,
        fetched.dir.display(),
        fetched.bytes_downloaded,
        fetched.bytes_reused,
        if listing.manifest { "; every file matches the manifest" } else { "" }
    ));
    Ok(output(&listing, &fetched))
}

fn output(listing: &Listing, fetched: &Fetched) -> Value {
    let file_list: Vec<Value> = listing
        .objects
        .iter()
        .map(|o| {
            json!({
                "path": o.name,
                "size": o.size,
                "sha256": o.sha256.clone().or_else(|| fetched.sha256.get(&o.name).cloned()),
                "etag": o.e_tag,
            })
        })
        .collect();
    let key = listing.cache_key();
    json!({
        "path": fetched.dir,
        // What the shard step's cache key reads: the URL and the listing, not file times.
        "digest": key,
        "bytes": listing.bytes(),
        "files": listing.objects.len(),
        "url": listing.url,
        "listing_digest": listing.digest,
        "manifest": listing.manifest,
        "bytes_downloaded": fetched.bytes_downloaded,
        "bytes_reused": fetched.bytes_reused,
        "file_list": file_list,
        "cache_key": key,
        // What the manifest of a publish records as the checkpoint's source.
        "source": {
            "kind": "hf.download",
            "url": listing.url,
            "listing_digest": listing.digest,
            "manifest": listing.manifest,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_relative_to_the_prefix() {
        let prefix = ObjPath::from("models/llama");
        assert_eq!(relative_name(&ObjPath::from("models/llama/config.json"), &prefix).as_deref(), Some("config.json"));
        assert_eq!(
            relative_name(&ObjPath::from("models/llama/original/x.pt"), &prefix).as_deref(),
            Some("original/x.pt")
        );
        assert_eq!(relative_name(&ObjPath::from("models/llama2/config.json"), &prefix), None);
        assert_eq!(relative_name(&ObjPath::from("models/llama"), &prefix), None);
    }

    #[test]
    fn urls_are_shown_without_credentials() {
        assert_eq!(shown("s3://AKIA:secret@bucket/models/llama?x-sig=abc"), "s3://bucket/models/llama");
        assert_eq!(shown("gs://bucket/p#frag"), "gs://bucket/p");
        assert_eq!(shown("file:///data/llama"), "file:///data/llama");
        let e = open("ftp://user:pw@host/x", &ObjectSourceSettings::default()).unwrap_err();
        assert!(e.message.contains("ftp://host/x") && !e.message.contains("pw"), "{}", e.message);
        assert!(!e.retryable);
    }

    #[test]
    fn settings_never_print_option_values() {
        let s = ObjectSourceSettings {
            store_options: vec![("aws_secret_access_key".into(), "very-secret-value".into())],
            ..Default::default()
        };
        let text = format!("{s:?}");
        assert!(text.contains("aws_secret_access_key"), "{text}");
        assert!(!text.contains("very-secret-value"), "{text}");
    }
}
