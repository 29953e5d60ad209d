//! The standard HF cache layout (`huggingface_hub`'s, also `hf-hub`'s):
//!
//! ```text
//! {cache}/models--{org}--{name}/
//!     blobs/{sha256 | git blob id}          content; `{x}.incomplete` while downloading
//!     snapshots/{sha}/{path}                relative symlinks to ../../blobs/{x}
//!     refs/{revision}                       the commit sha, no trailing newline
//! {cache}/.locks/models--{org}--{name}/{x}.lock   flock, the lock huggingface_hub takes
//! ```

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::{HubError, RepoId, Result};

/// Paths of one repository in a cache.
#[derive(Clone, Debug)]
pub struct RepoCache {
    root: PathBuf,
    folder: String,
}

impl RepoCache {
    /// The repository's folder under `cache_root`.
    pub fn new(cache_root: impl Into<PathBuf>, repo: &RepoId) -> Self {
        RepoCache { root: cache_root.into(), folder: repo.cache_folder() }
    }

    /// `{cache}/models--org--name`.
    pub fn repo_dir(&self) -> PathBuf {
        self.root.join(&self.folder)
    }

    /// `blobs/{name}`.
    pub fn blob(&self, name: &str) -> PathBuf {
        self.repo_dir().join("blobs").join(name)
    }

    /// `blobs/{name}.incomplete`: a prefix of the blob, resumable by any client.
    pub fn incomplete(&self, name: &str) -> PathBuf {
        self.repo_dir().join("blobs").join(format!("{name}.incomplete"))
    }

    /// `blobs/{name}.split.incomplete`: parts written out of order; never a valid prefix, so it
    /// has its own name (removed if found stale).
    pub(crate) fn split_incomplete(&self, name: &str) -> PathBuf {
        self.repo_dir().join("blobs").join(format!("{name}.split.incomplete"))
    }

    /// `snapshots/{sha}`.
    pub fn snapshot_dir(&self, sha: &str) -> PathBuf {
        self.repo_dir().join("snapshots").join(sha)
    }

    /// `refs/{revision}`.
    pub fn ref_path(&self, revision: &str) -> PathBuf {
        self.repo_dir().join("refs").join(revision)
    }

    /// `{cache}/.locks/models--org--name/{name}.lock`.
    pub fn lock_path(&self, name: &str) -> PathBuf {
        self.root.join(".locks").join(&self.folder).join(format!("{name}.lock"))
    }

    /// The commit sha a ref points to, if the cache has it.
    pub fn read_ref(&self, revision: &str) -> Option<String> {
        fs::read_to_string(self.ref_path(revision)).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
    }

    /// Writes `refs/{revision}` atomically (temporary file, rename), without a newline as
    /// `huggingface_hub` writes it.
    pub fn write_ref(&self, revision: &str, sha: &str) -> Result<()> {
        let path = self.ref_path(revision);
        if self.read_ref(revision).as_deref() == Some(sha) {
            return Ok(());
        }
        let dir = path.parent().expect("ref has a parent");
        fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().unwrap().to_string_lossy(), unique()));
        (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(sha.as_bytes())?;
            fs::rename(&tmp, &path)
        })()
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            HubError::io(&path, e)
        })
    }

    /// Points `snapshots/{sha}/{path}` at `blobs/{blob}` with a relative symlink, replacing any
    /// other link atomically.
    pub fn link(&self, sha: &str, path: &str, blob: &str) -> Result<PathBuf> {
        let link = self.snapshot_dir(sha).join(path);
        let depth = path.split('/').count() - 1;
        let target: PathBuf = std::iter::repeat_n("..", depth + 2).collect::<PathBuf>().join("blobs").join(blob);
        if fs::read_link(&link).ok().as_deref() == Some(target.as_path()) {
            return Ok(link);
        }
        let dir = link.parent().expect("link has a parent");
        fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        let tmp = dir.join(format!(".{}.{}.tmp", link.file_name().unwrap().to_string_lossy(), unique()));
        std::os::unix::fs::symlink(&target, &tmp).map_err(|e| HubError::io(&tmp, e))?;
        fs::rename(&tmp, &link).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            HubError::io(&link, e)
        })?;
        Ok(link)
    }
}

/// A value unique enough for temporary names in one directory.
pub(crate) fn unique() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Which digest identifies a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Expected {
    /// LFS: sha256 of the content.
    Sha256(String),
    /// Git: sha1 of `blob {size}\0{content}`.
    GitSha1(String),
}

impl Expected {
    pub(crate) fn algorithm(&self) -> &'static str {
        match self {
            Expected::Sha256(_) => "sha256",
            Expected::GitSha1(_) => "git-sha1",
        }
    }
    pub(crate) fn hex(&self) -> &str {
        match self {
            Expected::Sha256(h) | Expected::GitSha1(h) => h,
        }
    }
}

/// A running digest of the kind `Expected` names.
pub(crate) enum Digester {
    Sha256(Sha256),
    GitSha1(Sha1),
}

impl Digester {
    pub(crate) fn new(expected: &Expected, size: u64) -> Self {
        match expected {
            Expected::Sha256(_) => Digester::Sha256(Sha256::new()),
            Expected::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Digester::GitSha1(h)
            }
        }
    }
    pub(crate) fn update(&mut self, data: &[u8]) {
        match self {
            Digester::Sha256(h) => h.update(data),
            Digester::GitSha1(h) => h.update(data),
        }
    }
    pub(crate) fn finish(self) -> String {
        match self {
            Digester::Sha256(h) => hex::encode(h.finalize()),
            Digester::GitSha1(h) => hex::encode(h.finalize()),
        }
    }
}

/// Feeds the first `len` bytes of `path` to `d` (blocking).
pub(crate) fn digest_prefix(path: &Path, len: u64, d: &mut Digester) -> io::Result<()> {
    let f = File::open(path)?;
    let mut r = f.take(len);
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        d.update(&buf[..n]);
        total += n as u64;
    }
    if total != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("{} is shorter than {len} bytes", path.display()),
        ));
    }
    Ok(())
}

/// The digest of a whole file of `size` bytes, or `None` if its length is not `size` (blocking).
pub(crate) fn digest_file(path: &Path, expected: &Expected, size: u64) -> io::Result<Option<String>> {
    let len = fs::metadata(path)?.len();
    if len != size {
        return Ok(None);
    }
    let mut d = Digester::new(expected, size);
    digest_prefix(path, size, &mut d)?;
    Ok(Some(d.finish()))
}

/// An exclusive `flock` on a lock file, released on drop. `huggingface_hub`'s `filelock` takes the
/// same kind of lock on the same path, so the two never write one blob at once.
pub(crate) struct BlobLock {
    _file: File,
}

impl BlobLock {
    pub(crate) async fn acquire(path: &Path) -> Result<BlobLock> {
        let dir = path.parent().expect("lock has a parent");
        fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| HubError::io(path, e))?;
        let mut waited = false;
        loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(BlobLock { _file: file }),
                Err(e) if e == rustix::io::Errno::WOULDBLOCK || e == rustix::io::Errno::INTR => {
                    if !waited {
                        tracing::debug!(lock = %path.display(), "waiting for another download of the same blob");
                        waited = true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(HubError::io(path, e.into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_sha1_matches_git() {
        // `printf 'hello\n' | git hash-object --stdin`
        let e = Expected::GitSha1(String::new());
        let mut d = Digester::new(&e, 6);
        d.update(b"hello\n");
        assert_eq!(d.finish(), "ce013625030ba8dba906f756967f9e9ca394464a");
    }

    #[test]
    fn links_are_relative() {
        let dir = tempfile::tempdir().unwrap();
        let c = RepoCache::new(dir.path(), &RepoId::parse("o/n").unwrap());
        let sha = "a".repeat(40);
        let l = c.link(&sha, "x/y/z.bin", "b1").unwrap();
        assert_eq!(fs::read_link(&l).unwrap(), PathBuf::from("../../../../blobs/b1"));
        let l = c.link(&sha, "top.json", "b2").unwrap();
        assert_eq!(fs::read_link(&l).unwrap(), PathBuf::from("../../blobs/b2"));
        c.link(&sha, "top.json", "b3").unwrap();
        assert_eq!(fs::read_link(&l).unwrap(), PathBuf::from("../../blobs/b3"));
        c.write_ref("main", &sha).unwrap();
        assert_eq!(fs::read_to_string(c.ref_path("main")).unwrap(), sha);
        c.write_ref("refs/pr/1", &sha).unwrap();
        assert_eq!(c.read_ref("refs/pr/1").unwrap(), sha);
    }
}
