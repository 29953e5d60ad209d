//! Reading the artifact store: listings, and byte ranges of objects written straight into local
//! files at their own offsets (a sparse local copy holding just the bytes a task reads).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use shardline_publish::object_store::{GetOptions, GetRange, GetResult, ObjectStoreExt, PutPayload};

use crate::{ArtifactError, Artifacts, Result};

/// Largest byte range one request reads: long ranges are split so that they spread over the
/// requests in flight.
pub const PIECE_BYTES: u64 = 8 << 20;
/// Requests in flight at once for one fetch (memory: their response buffers, each streamed).
pub const MAX_IN_FLIGHT: usize = 8;

/// An object under the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedObject {
    /// Relative to the prefix, `/`-separated.
    pub name: String,
    pub size: u64,
    pub e_tag: Option<String>,
    pub modified: chrono::DateTime<chrono::Utc>,
}

impl Artifacts {
    /// Every object under the prefix, sorted by name.
    pub async fn list(&self) -> Result<Vec<ListedObject>> {
        let prefix = self.dest.prefix().clone();
        let strip = format!("{prefix}/");
        let mut out: Vec<ListedObject> = self
            .dest
            .store()
            .list(Some(&prefix))
            .map_err(|e| self.store_err("", "list", e))
            .map_ok(|m| ListedObject {
                name: m.location.as_ref().strip_prefix(&strip).unwrap_or(m.location.as_ref()).to_string(),
                size: m.size,
                e_tag: m.e_tag,
                modified: m.last_modified,
            })
            .try_collect()
            .await?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The size of `name`, or `None` when there is no such object.
    pub async fn head(&self, name: &str) -> Result<Option<u64>> {
        match self.dest.store().head(&self.object(name)).await {
            Ok(m) => Ok(Some(m.size)),
            Err(shardline_publish::object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.store_err(name, "head", e)),
        }
    }

    /// Reads the byte ranges `[start, end)` of `name` into `file` at the same offsets, at most
    /// [`MAX_IN_FLIGHT`] requests at a time. With `e_tag`, every read is pinned to that version
    /// of the object. Returns the bytes read.
    pub async fn fetch_ranges(
        &self,
        name: &str,
        e_tag: Option<&str>,
        ranges: &[(u64, u64)],
        file: Arc<File>,
    ) -> Result<u64> {
        let pieces: Vec<(u64, u64)> = ranges
            .iter()
            .flat_map(|&(start, end)| {
                (start..end).step_by(PIECE_BYTES as usize).map(move |s| (s, (s + PIECE_BYTES).min(end)))
            })
            .collect();
        let location = self.object(name);
        let total: u64 = stream::iter(pieces)
            .map(|(start, end)| {
                let (location, file) = (location.clone(), file.clone());
                async move {
                    let options = pinned(e_tag, Some(start..end));
                    let got = self
                        .dest
                        .store()
                        .get_opts(&location, options)
                        .await
                        .map_err(|e| self.store_err(name, "read", e))?;
                    let mut body = got.into_stream();
                    let mut at = start;
                    while let Some(chunk) = body.next().await {
                        let chunk: Bytes = chunk.map_err(|e| self.store_err(name, "read", e))?;
                        if at + chunk.len() as u64 > end {
                            return Err(self.size_err(name, end - start, at + chunk.len() as u64 - start));
                        }
                        write_at(&file, &chunk, at, name)?;
                        at += chunk.len() as u64;
                    }
                    if at != end {
                        return Err(self.size_err(name, end - start, at - start));
                    }
                    Ok(end - start)
                }
            })
            .buffer_unordered(MAX_IN_FLIGHT)
            .try_fold(0u64, |sum, n| async move { Ok(sum + n) })
            .await?;
        Ok(total)
    }

    /// Writes `bytes` as the object `name` in one request (small objects: markers, `.metadata`).
    pub async fn put_small(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        self.dest
            .store()
            .put(&self.object(name), PutPayload::from(bytes))
            .await
            .map_err(|e| self.store_err(name, "write", e))?;
        Ok(())
    }

    /// Deletes the object `name`, if there is one (a commit marker withdrawn before its files
    /// are written again).
    pub async fn delete(&self, name: &str) -> Result<()> {
        match self.dest.store().delete(&self.object(name)).await {
            Ok(()) | Err(shardline_publish::object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err(name, "delete", e)),
        }
    }

    /// Reads the whole of a small object (at most `max` bytes).
    pub async fn read_small(&self, name: &str, max: u64) -> Result<Option<Vec<u8>>> {
        let got = match self.dest.store().get(&self.object(name)).await {
            Ok(g) => g,
            Err(shardline_publish::object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.store_err(name, "read", e)),
        };
        if got.meta.size > max {
            return Err(self.size_err(name, max, got.meta.size));
        }
        let bytes = got.bytes().await.map_err(|e| self.store_err(name, "read", e))?;
        Ok(Some(bytes.to_vec()))
    }

    fn size_err(&self, name: &str, expected: u64, actual: u64) -> ArtifactError {
        ArtifactError::Size { url: self.url.clone(), name: name.to_string(), expected, actual }
    }
}

/// A read of `range` (all of it: `None`) of the object's version `e_tag` (any: `None`).
fn pinned(e_tag: Option<&str>, range: Option<std::ops::Range<u64>>) -> GetOptions {
    GetOptions { range: range.map(GetRange::Bounded), if_match: e_tag.map(str::to_string), ..GetOptions::default() }
}

fn write_at(file: &File, bytes: &[u8], at: u64, name: &str) -> Result<()> {
    file.write_all_at(bytes, at).map_err(|error| ArtifactError::Io {
        path: name.to_string(),
        action: "write fetched bytes",
        error,
    })
}

impl Artifacts {
    /// Deletes every object under the prefix; returns how many.
    pub async fn delete_all(&self) -> Result<usize> {
        let listed = self.list().await?;
        for o in &listed {
            self.dest.store().delete(&self.object(&o.name)).await.map_err(|e| self.store_err(&o.name, "delete", e))?;
        }
        Ok(listed.len())
    }
}

impl Artifacts {
    /// A read of `name` with `options`.
    async fn get_opts(&self, name: &str, options: GetOptions) -> Result<GetResult> {
        self.dest.store().get_opts(&self.object(name), options).await.map_err(|e| self.store_err(name, "read", e))
    }

    /// Reads the whole of `name` (pinned to `e_tag`) into a new file at `path`, in one streamed
    /// request: a store then reads the object once, however it keeps it. Returns its size.
    pub async fn fetch_whole(&self, name: &str, e_tag: Option<&str>, path: &std::path::Path) -> Result<u64> {
        let options = GetOptions { if_match: e_tag.map(str::to_string), ..GetOptions::default() };
        let got = self.get_opts(name, options).await?;
        let expected = got.meta.size;
        let io = |action| move |error| ArtifactError::Io { path: path.display().to_string(), action, error };
        let mut file = tokio::fs::File::create(path).await.map_err(io("create"))?;
        let mut body = got.into_stream();
        let mut written = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk: Bytes = chunk.map_err(|e| self.store_err(name, "read", e))?;
            tokio::io::AsyncWriteExt::write_all(&mut file, &chunk).await.map_err(io("write"))?;
            written += chunk.len() as u64;
        }
        tokio::io::AsyncWriteExt::flush(&mut file).await.map_err(io("flush"))?;
        if written != expected {
            return Err(self.size_err(name, expected, written));
        }
        Ok(written)
    }
}

impl Artifacts {
    /// The bytes `[start, end)` of `name` (pinned to `e_tag`), in memory: for small ranges.
    pub async fn read_range(&self, name: &str, e_tag: Option<&str>, start: u64, end: u64) -> Result<Vec<u8>> {
        let options = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            if_match: e_tag.map(str::to_string),
            ..GetOptions::default()
        };
        let got = self.get_opts(name, options).await?;
        let bytes = got.bytes().await.map_err(|e| self.store_err(name, "read", e))?;
        if bytes.len() as u64 != end - start {
            return Err(self.size_err(name, end - start, bytes.len() as u64));
        }
        Ok(bytes.to_vec())
    }
}
