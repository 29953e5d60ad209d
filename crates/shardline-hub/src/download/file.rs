//! One file of a snapshot: a verified blob already in the cache is reused; otherwise it is
//! fetched under the blob's lock (once more after a digest mismatch) and renamed into `blobs/`;
//! then it is linked into the snapshot.

use std::fs;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cache::{digest_file, BlobLock, Expected};
use crate::client::encode_path;
use crate::{HubError, RepoFile, Result};

use super::Job;

impl Job {
    pub(super) async fn ensure_file(self: &Arc<Self>, f: &RepoFile) -> Result<()> {
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
}
