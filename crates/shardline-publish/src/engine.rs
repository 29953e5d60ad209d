//! One object at a time, for the protocol (`protocol.rs`): HEAD, streamed read-back and hash,
//! single or multipart upload (left open when asked), verification, resume of what an
//! interrupted publish completed.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use object_store::{
    Attribute, Attributes, GetOptions, GetResultPayload, MultipartUpload, ObjectStoreExt, PutMultipartOptions,
    PutOptions, PutPayload,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::{
    hash_file, io_err, Destination, FileEntry, Manifest, PublishError, PublishOptions, Verify, MANIFEST,
    SHA256_METADATA,
};

pub(crate) const PENDING_FORMAT: &str = "shardline-publish-pending/v1";
/// S3's (and GCS's XML API's) limit on the parts of one upload.
const MAX_PARTS: u64 = 10_000;
/// HEAD requests in flight while planning.
pub(crate) const HEADS_IN_FLIGHT: usize = 16;

/// The record of a publish in progress: what is known good at the destination and what this
/// publish (or an interrupted one) may have overwritten.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Pending {
    pub(crate) format: String,
    /// Entries of the last manifest whose objects no publish since has touched.
    pub(crate) trusted: Vec<FileEntry>,
    /// Paths that a publish since the last manifest set out to write.
    pub(crate) touching: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// The manifest vouches for it and a HEAD agrees.
    Skip,
    /// Known to differ: upload.
    Upload,
    /// Unknown: an interrupted publish may have completed it; look, read back, else upload.
    Check,
}

pub(crate) enum Outcome {
    Copied {
        bytes: u64,
        parts: u64,
        verified: u64,
    },
    Resumed {
        verified: u64,
    },
    /// Uploaded but not completed: invisible until [`complete_staged`] (DCP-safetensors).
    Staged {
        parts: u64,
        upload: UploadGuard,
    },
}

pub(crate) struct Ctx<'a> {
    pub(crate) dest: &'a Destination,
    pub(crate) src: &'a Path,
    pub(crate) opts: &'a PublishOptions,
    pub(crate) parts: Arc<Semaphore>,
    pub(crate) failed: AtomicBool,
}

pub(crate) fn store_err(dest: &Destination, name: &str, action: &'static str, e: object_store::Error) -> PublishError {
    PublishError::Store {
        object: format!("{}/{}", dest.display, name),
        action,
        message: dest.redactor.redact(&e.to_string()),
    }
}

fn join<T>(r: Result<T, tokio::task::JoinError>) -> T {
    r.unwrap_or_else(|e| match e.try_into_panic() {
        Ok(p) => std::panic::resume_unwind(p),
        Err(e) => panic!("publish task cancelled: {e}"),
    })
}

/// Size and recorded SHA-256 of an object, or `None` when there is no object.
pub(crate) struct Head {
    pub(crate) size: u64,
    pub(crate) sha256: Option<String>,
    pub(crate) e_tag: Option<String>,
}

pub(crate) async fn head(dest: &Destination, name: &str) -> Result<Option<Head>, PublishError> {
    let opts = GetOptions { head: true, ..Default::default() };
    match dest.store.get_opts(&dest.object(name), opts).await {
        Ok(r) => Ok(Some(Head {
            size: r.meta.size,
            e_tag: r.meta.e_tag.clone(),
            sha256: r.attributes.get(&Attribute::Metadata(SHA256_METADATA.into())).map(|v| v.as_ref().to_string()),
        })),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(store_err(dest, name, "head", e)),
    }
}

/// Reads an object back and hashes it, streaming. A big object is read in ranged GETs of at most
/// `range` bytes (so no request outlives the client's request timeout), all pinned to the version
/// the HEAD saw (`If-Match` its ETag). The local filesystem hands out the file itself, which is
/// hashed off the runtime.
async fn read_back(dest: &Destination, name: &str, head: &Head, range: u64) -> Result<(u64, String), PublishError> {
    let obj = dest.object(name);
    let ranged = head.size > range && !matches!(dest.backend, crate::Backend::Local(_));
    let mut h = Sha256::new();
    let mut n = 0u64;
    loop {
        let opts = GetOptions {
            range: ranged.then(|| (n..head.size.min(n + range)).into()),
            if_match: head.e_tag.clone(),
            ..Default::default()
        };
        let r = dest.store.get_opts(&obj, opts).await.map_err(|e| store_err(dest, name, "read back", e))?;
        let mut s = match r.payload {
            GetResultPayload::File(_, path) => {
                return join(tokio::task::spawn_blocking(move || hash_file(&path)).await);
            }
            GetResultPayload::Stream(s) => s,
        };
        while let Some(chunk) = s.next().await {
            let chunk = chunk.map_err(|e| store_err(dest, name, "read back", e))?;
            h.update(&chunk);
            n += chunk.len() as u64;
        }
        if !ranged || n >= head.size || r.range.end <= r.range.start {
            break;
        }
    }
    Ok((n, hex::encode(h.finalize())))
}

/// Whether an object matches its entry; what it was when not.
enum Check {
    Matches { bytes_read: u64 },
    Differs { size: u64, sha256: String },
}

async fn check_object(ctx: &Ctx<'_>, entry: &FileEntry, read_back_always: bool) -> Result<Check, PublishError> {
    let Some(h) = head(ctx.dest, &entry.path).await? else {
        return Ok(Check::Differs { size: 0, sha256: "(no object)".into() });
    };
    if h.size != entry.size {
        return Ok(Check::Differs { size: h.size, sha256: h.sha256.unwrap_or_else(|| "(not read)".into()) });
    }
    if let Some(sha) = &h.sha256 {
        if *sha != entry.sha256 {
            return Ok(Check::Differs { size: h.size, sha256: format!("{sha} (recorded)") });
        }
    }
    if ctx.opts.verify == Verify::Head && !read_back_always {
        return Ok(Check::Matches { bytes_read: 0 });
    }
    let (n, sha) = read_back(ctx.dest, &entry.path, &h, ctx.opts.part_size as u64).await?;
    if n != entry.size || sha != entry.sha256 {
        return Ok(Check::Differs { size: n, sha256: sha });
    }
    Ok(Check::Matches { bytes_read: n })
}

/// Reads `len` bytes at `offset` of a source file and feeds them to the hash.
async fn read_chunk(path: PathBuf, offset: u64, len: usize, mut h: Sha256) -> Result<(Bytes, Sha256), PublishError> {
    join(
        tokio::task::spawn_blocking(move || {
            let f = File::open(&path).map_err(io_err(&path, "open"))?;
            let mut buf = vec![0u8; len];
            f.read_exact_at(&mut buf, offset).map_err(io_err(&path, "read"))?;
            h.update(&buf);
            Ok((Bytes::from(buf), h))
        })
        .await,
    )
}

/// Part size for a file: the configured one, grown so no upload needs more than 10,000 parts.
fn part_size_for(size: u64, configured: usize) -> usize {
    let min = size.div_ceil(MAX_PARTS);
    let mib = 1u64 << 20;
    (configured as u64).max(min.div_ceil(mib) * mib) as usize
}

/// Aborts a multipart upload that is dropped unfinished (the publish future itself dropped).
pub(crate) struct UploadGuard(Option<Box<dyn MultipartUpload>>);

impl Drop for UploadGuard {
    fn drop(&mut self) {
        if let Some(mut u) = self.0.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = u.abort().await;
                });
            }
        }
    }
}

fn attributes(ctx: &Ctx<'_>, entry: &FileEntry) -> Attributes {
    let mut a = Attributes::new();
    if ctx.dest.object_metadata() {
        a.insert(Attribute::Metadata(SHA256_METADATA.into()), entry.sha256.clone().into());
    }
    a
}

fn source_changed(ctx: &Ctx<'_>, entry: &FileEntry, actual: String) -> PublishError {
    PublishError::SourceChanged { path: ctx.src.join(&entry.path), expected: entry.sha256.clone(), actual }
}

/// Uploads one file: one PUT, or a multipart upload with parts in flight bounded by the shared
/// semaphore. Returns the number of parts, and with `defer` the multipart upload still open (a
/// file of any size then goes as a multipart upload, so that it stays invisible until completed).
/// A multipart upload that fails is aborted.
async fn upload(ctx: &Ctx<'_>, entry: &FileEntry, defer: bool) -> Result<(u64, Option<UploadGuard>), PublishError> {
    let obj = ctx.dest.object(&entry.path);
    let from = ctx.src.join(&entry.path);
    let part_size = part_size_for(entry.size, ctx.opts.part_size);
    if entry.size <= part_size as u64 && !defer {
        let permit = ctx.parts.clone().acquire_owned().await.expect("the part semaphore is never closed");
        let (data, h) = read_chunk(from, 0, entry.size as usize, Sha256::new()).await?;
        let actual = hex::encode(h.finalize());
        if actual != entry.sha256 {
            return Err(source_changed(ctx, entry, actual));
        }
        let opts = PutOptions { attributes: attributes(ctx, entry), ..Default::default() };
        ctx.dest
            .store
            .put_opts(&obj, PutPayload::from(data), opts)
            .await
            .map_err(|e| store_err(ctx.dest, &entry.path, "upload", e))?;
        drop(permit);
        return Ok((0, None));
    }
    let opts = PutMultipartOptions { attributes: attributes(ctx, entry), ..Default::default() };
    let upload = ctx
        .dest
        .store
        .put_multipart_opts(&obj, opts)
        .await
        .map_err(|e| store_err(ctx.dest, &entry.path, "start multipart upload", e))?;
    let mut guard = UploadGuard(Some(upload));
    let mut tasks: JoinSet<Result<(), object_store::Error>> = JoinSet::new();
    let part_err = |e: object_store::Error| store_err(ctx.dest, &entry.path, "upload part", e);
    let result: Result<u64, PublishError> = async {
        let upload = guard.0.as_mut().expect("upload present until completed");
        let mut h = Sha256::new();
        let mut offset = 0u64;
        let mut parts = 0u64;
        // An empty file still needs one (empty) part to be completed.
        while offset < entry.size || parts == 0 {
            if ctx.failed.load(Ordering::Relaxed) {
                return Err(PublishError::Cancelled);
            }
            let permit = ctx.parts.clone().acquire_owned().await.expect("the part semaphore is never closed");
            let len = (entry.size - offset).min(part_size as u64) as usize;
            let (data, next) = read_chunk(from.clone(), offset, len, h).await?;
            h = next;
            let part = upload.put_part(PutPayload::from(data));
            tasks.spawn(async move {
                let r = part.await;
                drop(permit);
                r
            });
            parts += 1;
            offset += len as u64;
            while let Some(r) = tasks.try_join_next() {
                join(r).map_err(part_err)?;
            }
        }
        let actual = hex::encode(h.finalize());
        if actual != entry.sha256 {
            return Err(source_changed(ctx, entry, actual));
        }
        while let Some(r) = tasks.join_next().await {
            join(r).map_err(part_err)?;
        }
        if !defer {
            upload.complete().await.map_err(|e| store_err(ctx.dest, &entry.path, "complete multipart upload", e))?;
        }
        Ok(parts)
    }
    .await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    match result {
        Ok(parts) if defer => Ok((parts, Some(guard))),
        Ok(parts) => {
            guard.0 = None;
            Ok((parts, None))
        }
        Err(e) => {
            if let Some(mut upload) = guard.0.take() {
                let _ = upload.abort().await;
            }
            Err(e)
        }
    }
}

/// Completes uploads left open by [`upload`] with `defer`, several at once, then verifies each
/// object. On an error the uploads not yet completed are aborted (their guards dropped).
pub(crate) async fn complete_staged(
    ctx: &Ctx<'_>,
    staged: Vec<(usize, &FileEntry, u64, UploadGuard)>,
) -> Result<Vec<(usize, Outcome)>, PublishError> {
    stream::iter(staged)
        .map(|(i, entry, parts, mut guard)| async move {
            let mut upload = guard.0.take().expect("a staged upload is open");
            if let Err(e) = upload.complete().await {
                let _ = upload.abort().await;
                return Err(store_err(ctx.dest, &entry.path, "complete multipart upload", e));
            }
            let verified = verify_uploaded(ctx, entry).await?;
            Ok((i, Outcome::Copied { bytes: entry.size, parts, verified }))
        })
        .buffer_unordered(ctx.opts.max_files_in_flight)
        .collect::<Vec<Result<(usize, Outcome), PublishError>>>()
        .await
        .into_iter()
        .collect()
}

/// fsyncs a published local file (a no-op for object stores).
pub(crate) async fn sync_local(ctx: &Ctx<'_>, name: &str) -> Result<(), PublishError> {
    if let Some(path) = ctx.dest.local_file(name) {
        join(
            tokio::task::spawn_blocking(move || {
                File::open(&path).and_then(|f| f.sync_all()).map_err(io_err(&path, "sync"))
            })
            .await,
        )?;
    }
    Ok(())
}

/// Removes what `LocalFileSystem` left of uploads of these files that a killed publish never
/// finished (`{name}#{n}` next to `{name}`). Best effort: they are never taken for data.
pub(crate) async fn remove_local_staging(dest: &Destination, names: &[String]) {
    let crate::Backend::Local(dir) = &dest.backend else { return };
    let (dir, names) = (dir.clone(), names.iter().cloned().collect::<BTreeSet<String>>());
    let _ = tokio::task::spawn_blocking(move || {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if let Some((name, n)) = file.rsplit_once('#') {
                if names.contains(name) && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    })
    .await;
}

pub(crate) async fn sync_local_dir(dest: &Destination) -> Result<(), PublishError> {
    if let crate::Backend::Local(dir) = &dest.backend {
        let dir = dir.clone();
        join(
            tokio::task::spawn_blocking(move || {
                File::open(&dir).and_then(|f| f.sync_all()).map_err(io_err(&dir, "sync"))
            })
            .await,
        )?;
    }
    Ok(())
}

/// Resumes, or uploads and verifies, one file; with `defer`, uploads it and leaves it open.
pub(crate) async fn process(
    ctx: &Ctx<'_>,
    entry: &FileEntry,
    plan: Plan,
    defer: bool,
) -> Result<Outcome, PublishError> {
    if ctx.failed.load(Ordering::Relaxed) {
        return Err(PublishError::Cancelled);
    }
    if plan == Plan::Check {
        // Left complete by an interrupted publish? Only a full read-back (or, with Verify::Head,
        // a recorded SHA-256) lets it stand in for an upload.
        if let Some(h) = head(ctx.dest, &entry.path).await? {
            let recorded = h.sha256.as_deref() == Some(entry.sha256.as_str());
            if h.size == entry.size && (h.sha256.is_none() || recorded) {
                if let Check::Matches { bytes_read } = check_object(ctx, entry, !recorded).await? {
                    sync_local(ctx, &entry.path).await?;
                    return Ok(Outcome::Resumed { verified: bytes_read });
                }
            }
        }
    }
    let (parts, open) = upload(ctx, entry, defer).await?;
    if let Some(upload) = open {
        return Ok(Outcome::Staged { parts, upload });
    }
    let verified = verify_uploaded(ctx, entry).await?;
    Ok(Outcome::Copied { bytes: entry.size, parts, verified })
}

/// Checks a just uploaded object against its entry (after the test hook) and syncs it; a wrong
/// object is deleted. Returns the bytes read back.
async fn verify_uploaded(ctx: &Ctx<'_>, entry: &FileEntry) -> Result<u64, PublishError> {
    if let Some(hook) = &ctx.opts.after_upload {
        hook(&entry.path).await;
    }
    match check_object(ctx, entry, false).await? {
        Check::Matches { bytes_read } => {
            sync_local(ctx, &entry.path).await?;
            Ok(bytes_read)
        }
        Check::Differs { size, sha256 } => {
            // A wrong object must not be taken for a good one by a later publish.
            let _ = ctx.dest.store.delete(&ctx.dest.object(&entry.path)).await;
            Err(PublishError::Verify {
                path: PathBuf::from(format!("{}/{}", ctx.dest.display, entry.path)),
                expected: entry.sha256.clone(),
                actual: sha256,
                expected_size: entry.size,
                actual_size: size,
            })
        }
    }
}

pub(crate) async fn get_bytes(dest: &Destination, name: &str) -> Result<Option<Bytes>, PublishError> {
    match dest.store.get(&dest.object(name)).await {
        Ok(r) => Ok(Some(r.bytes().await.map_err(|e| store_err(dest, name, "read", e))?)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(store_err(dest, name, "read", e)),
    }
}

pub(crate) async fn delete_if_present(
    dest: &Destination,
    name: &str,
    action: &'static str,
) -> Result<(), PublishError> {
    match dest.store.delete(&dest.object(name)).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(store_err(dest, name, action, e)),
    }
}

/// Reads the manifest at a destination; `None` when there is none.
pub async fn read_manifest_at(dest: &Destination) -> Result<Option<Manifest>, PublishError> {
    match get_bytes(dest, MANIFEST).await? {
        None => Ok(None),
        Some(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
            PublishError::BadManifest(PathBuf::from(format!("{}/{MANIFEST}", dest.display)), e.to_string())
        }),
    }
}

/// Hashes the source files, a few at once.
pub(crate) async fn hash_sources(src: &Path, names: &[String]) -> Result<Vec<FileEntry>, PublishError> {
    let width = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).clamp(1, 4);
    stream::iter(names.iter().cloned())
        .map(|name| {
            let path = src.join(&name);
            async move {
                let (size, sha256) = join(tokio::task::spawn_blocking(move || hash_file(&path)).await)?;
                Ok(FileEntry { path: name, size, sha256 })
            }
        })
        .buffered(width)
        .collect::<Vec<Result<FileEntry, PublishError>>>()
        .await
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_size_grows_past_ten_thousand_parts() {
        assert_eq!(part_size_for(1 << 30, 64 << 20), 64 << 20);
        let huge = 10_000u64 * (64 << 20) + 1;
        let p = part_size_for(huge, 64 << 20) as u64;
        assert!(huge.div_ceil(p) <= MAX_PARTS, "{p}");
        assert_eq!(p % (1 << 20), 0);
    }
}
