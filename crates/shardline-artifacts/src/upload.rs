//! Multipart uploads of local files, opened by one process and completed or aborted by id by
//! another: a rank task uploads its file's parts and leaves the upload open; the commit task
//! completes every rank's upload and then writes `.metadata`; an upload whose attempt failed is
//! aborted (by its worker, or by the server's reaper from the job store's record of it).

use std::fs::File;
use std::future::Future;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use futures_util::stream::{self, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use shardline_publish::object_store::multipart::{MultipartStore, PartId};
use shardline_publish::object_store::{ObjectStoreExt, PutPayload};

use crate::{ArtifactError, Artifacts, Result};

/// Bytes of each part but the last.
pub const PART_BYTES: u64 = 16 << 20;
/// The smallest part object stores accept (but for the last).
pub const MIN_PART_BYTES: u64 = 5 << 20;
/// Parts uploaded at once (memory: this many parts' bytes).
const PARTS_IN_FLIGHT: usize = 4;

/// An uploaded file whose multipart upload is still open: what its completion needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upload {
    /// The object's name under the artifact prefix.
    pub name: String,
    pub upload_id: String,
    /// The parts' ids, in order.
    pub parts: Vec<String>,
    pub size: u64,
}

/// A multipart upload being filled from a local file ([`Artifacts::put_parts`]).
#[derive(Debug)]
pub struct PartsUpload {
    name: String,
    id: String,
    parts: Vec<PartId>,
    /// Bytes sent so far.
    size: u64,
}

impl PartsUpload {
    /// The store's id of the upload.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Bytes sent so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The upload, every part sent, left open for [`Artifacts::complete`].
    pub fn open(self) -> Upload {
        Upload {
            name: self.name,
            upload_id: self.id,
            parts: self.parts.into_iter().map(|p| p.content_id).collect(),
            size: self.size,
        }
    }
}

impl Artifacts {
    fn multipart(&self) -> Result<&Arc<dyn MultipartStore>> {
        self.dest
            .multipart()
            .ok_or_else(|| ArtifactError::Config(self.url.clone(), "the store has no multipart uploads".into()))
    }

    /// Uploads the local file `path` as `name` in parts and leaves the upload open.
    /// `register(upload_id)` runs right after the store creates the upload and before any part
    /// is sent; `false` (the lease is gone) aborts it.
    pub async fn upload_file<F, Fut>(&self, name: &str, path: &Path, register: F) -> Result<Upload>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = bool>,
    {
        let io = |action| move |error| ArtifactError::Io { path: path.display().to_string(), action, error };
        let file = Arc::new(File::open(path).map_err(io("open"))?);
        let size = file.metadata().map_err(io("stat"))?.len();
        let mut upload = self.begin_upload(name, register).await?;
        match self.put_parts(&mut upload, &file, path, size, true).await {
            Ok(()) => Ok(upload.open()),
            Err(e) => {
                self.abort_parts(&upload).await;
                Err(e)
            }
        }
    }

    /// Creates a multipart upload of `name` to be filled a range of a local file at a time
    /// ([`put_parts`](Self::put_parts)); `register` as for [`upload_file`](Self::upload_file).
    pub async fn begin_upload<F, Fut>(&self, name: &str, register: F) -> Result<PartsUpload>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = bool>,
    {
        let mp = self.multipart()?;
        let location = self.object(name);
        let id = mp.create_multipart(&location).await.map_err(|e| self.store_err(name, "create upload", e))?;
        if !register(id.clone()).await {
            let _ = mp.abort_multipart(&location, &id).await;
            return Err(ArtifactError::Fenced(name.to_string()));
        }
        Ok(PartsUpload { name: name.to_string(), id, parts: Vec::new(), size: 0 })
    }

    /// Uploads bytes `[upload.size, end)` of `file` (at `path`, for messages) as the upload's next
    /// parts of [`PART_BYTES`]. Only the `last` call, whose `end` is where the file ends, may
    /// leave a short part (stores refuse short parts but the last): a caller filling the file a
    /// section at a time passes a multiple of [`PART_BYTES`] until then. An upload with nothing
    /// sent by its last call gets one empty part (an empty object).
    pub async fn put_parts(
        &self,
        upload: &mut PartsUpload,
        file: &Arc<File>,
        path: &Path,
        end: u64,
        last: bool,
    ) -> Result<()> {
        if !last && !end.is_multiple_of(PART_BYTES) {
            return Err(ArtifactError::Io {
                path: path.display().to_string(),
                action: "upload parts",
                error: std::io::Error::other(format!("{end} is not a whole number of parts")),
            });
        }
        let io = |action| move |error| ArtifactError::Io { path: path.display().to_string(), action, error };
        let mp = self.multipart()?;
        let location = self.object(&upload.name);
        let (start, first, name) = (upload.size, upload.parts.len(), upload.name.as_str());
        let count = end.saturating_sub(start).div_ceil(PART_BYTES).max(u64::from(last && first == 0));
        let sent: Vec<(usize, PartId)> = stream::iter(0..count)
            .map(|k| {
                let (file, location, id) = (file.clone(), location.clone(), upload.id.clone());
                async move {
                    let from = start + k * PART_BYTES;
                    let len = (end - from).min(PART_BYTES) as usize;
                    let bytes = tokio::task::spawn_blocking(move || {
                        let mut buf = vec![0u8; len];
                        file.read_exact_at(&mut buf, from).map(|()| buf)
                    })
                    .await
                    .map_err(|e| ArtifactError::Io {
                        path: path.display().to_string(),
                        action: "read part",
                        error: std::io::Error::other(e.to_string()),
                    })?
                    .map_err(io("read part"))?;
                    let index = first + k as usize;
                    let part = mp
                        .put_part(&location, &id, index, PutPayload::from(bytes))
                        .await
                        .map_err(|e| self.store_err(name, "upload part", e))?;
                    Ok::<_, ArtifactError>((index, part))
                }
            })
            .buffer_unordered(PARTS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut sent = sent;
        sent.sort_by_key(|(k, _)| *k);
        upload.parts.extend(sent.into_iter().map(|(_, p)| p));
        upload.size = upload.size.max(end);
        Ok(())
    }

    /// Aborts an upload [`begin_upload`](Self::begin_upload) created (best effort: the reaper
    /// aborts what is left).
    pub async fn abort_parts(&self, upload: &PartsUpload) {
        if let Ok(mp) = self.multipart() {
            let _ = mp.abort_multipart(&self.object(&upload.name), &upload.id).await;
        }
    }

    /// Completes an upload [`upload_file`](Self::upload_file) left open. Completing one that an
    /// earlier attempt already completed succeeds when the object is there with its size.
    pub async fn complete(&self, upload: &Upload) -> Result<()> {
        let mp = self.multipart()?;
        let location = self.object(&upload.name);
        let parts: Vec<PartId> = upload.parts.iter().map(|p| PartId { content_id: p.clone() }).collect();
        match mp.complete_multipart(&location, &upload.upload_id, parts).await {
            Ok(_) => Ok(()),
            Err(e) => match self.head(&upload.name).await? {
                Some(size) if size == upload.size => Ok(()),
                _ => Err(self.store_err(&upload.name, "complete upload", e)),
            },
        }
    }

    /// Aborts the upload `upload_id` of `name`; one the store no longer knows counts as aborted.
    /// The multipart uploads open under this prefix (names relative to it), as the store lists
    /// them; `None` where it cannot (see `Destination::open_uploads`).
    pub async fn open_uploads(&self) -> Result<Option<Vec<shardline_publish::OpenMultipart>>> {
        self.dest.open_uploads().await.map_err(|e| self.store_err("", "list open uploads", e))
    }

    pub async fn abort(&self, name: &str, upload_id: &str) -> Result<()> {
        let mp = self.multipart()?;
        match mp.abort_multipart(&self.object(name), &upload_id.to_string()).await {
            Ok(()) | Err(shardline_publish::object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err(name, "abort upload", e)),
        }
    }
}

impl Artifacts {
    /// Copies the object `name` to `to`'s `dest_name` through this client: one streamed read of
    /// the object, cut into parts uploaded as they fill ([`PARTS_IN_FLIGHT`] at a time). A plain
    /// parallel copy of the bytes, the yardstick `shardline bench --s3` measures conversions
    /// against.
    pub async fn copy_through(&self, name: &str, to: &Artifacts, dest_name: &str) -> Result<u64> {
        let mp = to.multipart()?;
        let location = to.object(dest_name);
        let got = self.dest.store().get(&self.object(name)).await.map_err(|e| self.store_err(name, "read", e))?;
        let id = mp.create_multipart(&location).await.map_err(|e| to.store_err(dest_name, "create upload", e))?;
        let mut body = got.into_stream();
        let mut uploads = futures_util::stream::FuturesOrdered::new();
        let mut parts: Vec<PartId> = Vec::new();
        let mut buf: Vec<u8> = Vec::with_capacity(PART_BYTES as usize);
        let mut total = 0u64;
        let mut k = 0usize;
        let result: Result<()> = async {
            loop {
                let chunk = body.next().await.transpose().map_err(|e| self.store_err(name, "read", e))?;
                let end = chunk.is_none();
                if let Some(c) = chunk {
                    total += c.len() as u64;
                    buf.extend_from_slice(&c);
                }
                while buf.len() as u64 >= PART_BYTES || (end && (!buf.is_empty() || k == 0)) {
                    let take = buf.len().min(PART_BYTES as usize);
                    let part: Vec<u8> = buf.drain(..take).collect();
                    let (location, id) = (location.clone(), id.clone());
                    let idx = k;
                    uploads.push_back(async move {
                        mp.put_part(&location, &id, idx, PutPayload::from(part))
                            .await
                            .map_err(|e| to.store_err(dest_name, "upload part", e))
                    });
                    k += 1;
                    if uploads.len() >= PARTS_IN_FLIGHT {
                        if let Some(done) = uploads.next().await {
                            parts.push(done?);
                        }
                    }
                    if end && buf.is_empty() {
                        break;
                    }
                }
                if end {
                    break;
                }
            }
            while let Some(done) = uploads.next().await {
                parts.push(done?);
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            let _ = mp.abort_multipart(&location, &id).await;
            return Err(e);
        }
        mp.complete_multipart(&location, &id, parts)
            .await
            .map_err(|e| to.store_err(dest_name, "complete upload", e))?;
        Ok(total)
    }
}
