//! `HF_HUB_OFFLINE`: a snapshot read from the cache alone, its files verified.

use std::fs;

use crate::cache::{digest_file, Expected, RepoCache};
use crate::repo::{is_commit_sha, PathFilter};
use crate::{HubError, RepoFile, Result};

use super::Snapshot;

/// `HF_HUB_OFFLINE`: the snapshot from the cache alone (refs for branch names), verified.
pub(super) async fn offline_snapshot(
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
