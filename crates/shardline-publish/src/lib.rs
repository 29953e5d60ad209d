//! Publishing a finished checkpoint directory to its destination.
//!
//! Data files go first, each copied under a temporary name, checked (size and SHA-256) and renamed
//! into place; the manifest — every file with its size and checksum, the source and the mesh — is
//! written last. Consumers treat the manifest as the commit: a destination without one is not a
//! checkpoint, whatever else it holds. A file whose destination already has identical content
//! (same size and SHA-256 as the manifest of an earlier publish says) is not copied again.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Name of the manifest in a published directory.
pub const MANIFEST: &str = "shardline-manifest.json";
/// Format tag of the manifest.
pub const MANIFEST_FORMAT: &str = "shardline-manifest/v1";

/// One published file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

/// The commit record of a published checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub files: Vec<FileEntry>,
    /// Where the weights came from (repo and revision, or a local path and its digest).
    pub source: serde_json::Value,
    /// The target mesh and output format.
    pub layout: serde_json::Value,
    pub shardline_version: String,
}

/// What a publish did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishReport {
    pub copied: Vec<String>,
    pub skipped: Vec<String>,
    pub bytes_copied: u64,
}

/// Why publishing failed. The destination then has no (new) manifest.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PublishError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },
    #[error("destination `{0}` is not supported (use a file:// URL or an absolute path)")]
    UnsupportedDestination(String),
    #[error("{path}: copied {actual_size} bytes with SHA-256 {actual}, expected {expected_size} bytes with {expected}")]
    Verify { path: PathBuf, expected: String, actual: String, expected_size: u64, actual_size: u64 },
    #[error("{0}: the manifest is not valid JSON: {1}")]
    BadManifest(PathBuf, String),
    #[error("source {0} has no files to publish")]
    Empty(PathBuf),
}

fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> PublishError + 'a {
    move |error| PublishError::Io { path: path.to_path_buf(), action, error }
}

/// Resolves a destination (`file:///abs/dir` or `/abs/dir`) to a directory path.
pub fn local_destination(to: &str) -> Result<PathBuf, PublishError> {
    let path = to.strip_prefix("file://").unwrap_or(to);
    let p = PathBuf::from(path);
    if !p.is_absolute() || to.contains("://") && !to.starts_with("file://") {
        return Err(PublishError::UnsupportedDestination(to.to_string()));
    }
    Ok(p)
}

/// SHA-256 and size of a file, streamed.
pub fn hash_file(path: &Path) -> Result<(u64, String), PublishError> {
    let mut f = File::open(path).map_err(io_err(path, "open"))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io_err(path, "read"))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex::encode(h.finalize())))
}

/// Reads the manifest of a published directory, if it has one.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>, PublishError> {
    let p = dir.join(MANIFEST);
    match fs::read(&p) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| PublishError::BadManifest(p, e.to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(PublishError::Io { path: p, action: "read", error: e }),
    }
}

/// Files to publish from `src`, in publish order: everything but `.metadata` by name, then
/// `.metadata` (the checkpoint's own commit marker) last among the data.
fn source_files(src: &Path) -> Result<Vec<String>, PublishError> {
    let mut names: Vec<String> = fs::read_dir(src)
        .map_err(io_err(src, "list"))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != MANIFEST && !n.ends_with(".partial") && !n.ends_with(".tmp"))
        .collect();
    names.sort_by_key(|n| (n == ".metadata", n.clone()));
    if names.is_empty() {
        return Err(PublishError::Empty(src.to_path_buf()));
    }
    Ok(names)
}

/// Copies `from` to `to` through `to.partial`, hashing what it writes, and renames into place.
fn copy_verified(from: &Path, to: &Path, want: &FileEntry) -> Result<u64, PublishError> {
    let partial = to.with_file_name(format!(
        "{}.partial",
        to.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    let mut src = File::open(from).map_err(io_err(from, "open"))?;
    let mut dst = File::create(&partial).map_err(io_err(&partial, "create"))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut n = 0u64;
    loop {
        let k = src.read(&mut buf).map_err(io_err(from, "read"))?;
        if k == 0 {
            break;
        }
        dst.write_all(&buf[..k]).map_err(io_err(&partial, "write"))?;
        h.update(&buf[..k]);
        n += k as u64;
    }
    dst.sync_all().map_err(io_err(&partial, "sync"))?;
    drop(dst);
    let got = hex::encode(h.finalize());
    // What landed must be what was hashed at the source (the source may have changed under us).
    if got != want.sha256 || n != want.size {
        let _ = fs::remove_file(&partial);
        return Err(PublishError::Verify {
            path: to.to_path_buf(),
            expected: want.sha256.clone(),
            actual: got,
            expected_size: want.size,
            actual_size: n,
        });
    }
    fs::rename(&partial, to).map_err(io_err(to, "rename into place"))?;
    Ok(n)
}

/// Publishes the checkpoint in `src` to the local directory `dest`.
pub fn publish_dir(
    src: &Path,
    dest: &Path,
    source: serde_json::Value,
    layout: serde_json::Value,
) -> Result<(Manifest, PublishReport), PublishError> {
    let names = source_files(src)?;
    fs::create_dir_all(dest).map_err(io_err(dest, "create destination"))?;
    let previous: BTreeMap<String, FileEntry> = read_manifest(dest)?
        .map(|m| m.files.into_iter().map(|f| (f.path.clone(), f)).collect())
        .unwrap_or_default();
    // A new publish first withdraws the old commit: a half-updated destination is never "complete".
    let manifest_path = dest.join(MANIFEST);
    if manifest_path.exists() {
        fs::remove_file(&manifest_path).map_err(io_err(&manifest_path, "withdraw old manifest"))?;
    }
    let mut report = PublishReport::default();
    let mut files = Vec::new();
    for name in &names {
        let from = src.join(name);
        let (size, sha256) = hash_file(&from)?;
        let entry = FileEntry { path: name.clone(), size, sha256 };
        let to = dest.join(name);
        let same = previous.get(name) == Some(&entry) && fs::metadata(&to).map(|m| m.len() == size).unwrap_or(false);
        if same {
            report.skipped.push(name.clone());
        } else {
            report.bytes_copied += copy_verified(&from, &to, &entry)?;
            report.copied.push(name.clone());
        }
        files.push(entry);
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_string(),
        files,
        source,
        layout,
        shardline_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let tmp = dest.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| PublishError::BadManifest(tmp.clone(), e.to_string()))?;
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp, "create"))?;
        f.write_all(&text).map_err(io_err(&tmp, "write"))?;
        f.sync_all().map_err(io_err(&tmp, "sync"))?;
    }
    fs::rename(&tmp, &manifest_path).map_err(io_err(&manifest_path, "commit manifest"))?;
    File::open(dest).and_then(|d| d.sync_all()).map_err(io_err(dest, "sync destination"))?;
    Ok((manifest, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make_src(dir: &Path) {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join("__0_0.distcp"), b"rank zero").unwrap();
        fs::write(dir.join("__1_0.distcp"), b"rank one!").unwrap();
        fs::write(dir.join(".metadata"), b"meta").unwrap();
    }

    #[test]
    fn publishes_data_then_manifest_and_skips_identical_content() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let dest = tmp.path().join("dest");
        make_src(&src);
        let (m, r) = publish_dir(&src, &dest, serde_json::json!({"path": "x"}), serde_json::json!({"tp": 1})).unwrap();
        assert_eq!(r.copied, vec!["__0_0.distcp", "__1_0.distcp", ".metadata"]);
        assert_eq!(m.files[0].size, 9);
        assert_eq!(read_manifest(&dest).unwrap().unwrap(), m);
        // Second publish of identical content copies nothing.
        let (_, r2) = publish_dir(&src, &dest, serde_json::json!({"path": "x"}), serde_json::json!({"tp": 1})).unwrap();
        assert!(r2.copied.is_empty());
        assert_eq!(r2.skipped.len(), 3);
        // A changed file is copied again.
        fs::write(src.join("__1_0.distcp"), b"rank 1 v2").unwrap();
        let (_, r3) = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        assert_eq!(r3.copied, vec!["__1_0.distcp"]);
        assert_eq!(fs::read(dest.join("__1_0.distcp")).unwrap(), b"rank 1 v2");
    }

    #[test]
    fn failed_publish_leaves_no_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let dest = tmp.path().join("dest");
        make_src(&src);
        publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        // The destination becomes unwritable for one file: the old manifest is withdrawn first and
        // no new one appears.
        fs::remove_file(dest.join("__1_0.distcp")).unwrap();
        fs::create_dir(dest.join("__1_0.distcp.partial")).unwrap();
        fs::write(src.join("__1_0.distcp"), b"changed!!").unwrap();
        let err = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap_err();
        assert!(err.to_string().contains("__1_0.distcp.partial"), "{err}");
        assert!(read_manifest(&dest).unwrap().is_none());
    }

    #[test]
    fn destinations() {
        assert_eq!(local_destination("file:///a/b").unwrap(), PathBuf::from("/a/b"));
        assert_eq!(local_destination("/a/b").unwrap(), PathBuf::from("/a/b"));
        assert!(local_destination("s3://bucket/x").is_err());
        assert!(local_destination("relative/x").is_err());
    }
}
