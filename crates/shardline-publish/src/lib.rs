//! Publishing a finished checkpoint directory to its destination: a local directory or an object
//! store (`file://`, `s3://`, `gs://`, `az://`), all through the `object_store` crate — a local
//! destination is object_store's `LocalFileSystem`, so both take the same code path.
//!
//! **Owns:** destinations and object stores (the one place they are configured) and the
//! manifest. **Must not depend on:** any workspace crate.
//!
//! # The protocol
//!
//! 1. Every source file is hashed (size and SHA-256).
//! 2. The destination's manifest (`shardline-manifest.json`) is read. A file it lists with the same
//!    path, size and SHA-256, whose object exists with that size (and, where the store keeps
//!    object metadata, the same recorded SHA-256), is **skipped**. If nothing differs and the
//!    manifest would be byte-identical, nothing at all is written.
//! 3. Otherwise a pending record (`.shardline-publish-pending.json`: what the old manifest vouched
//!    for, and which paths this publish is about to write) is written, and then the old commit
//!    is **withdrawn**, before any other object is touched: the manifest, then every file that
//!    makes the destination a checkpoint for readers that never read our manifest (`.metadata`
//!    for torch's DCP reader; see [`CommitRule`]). From here until the new commit the
//!    destination is no checkpoint to anyone, so a half-updated destination never looks complete.
//! 4. Data objects are uploaded, several files at once: a file larger than
//!    [`PublishOptions::part_size`] as a multipart upload (parts in flight bounded by
//!    [`PublishOptions::max_parts_in_flight`] over all files, so memory stays near
//!    `part_size × max_parts_in_flight`), a smaller one with a single PUT. Each object carries
//!    its SHA-256 as user metadata (`shardlinesha256`, i.e. `x-amz-meta-shardlinesha256` on S3)
//!    where the store keeps metadata. On any error the multipart upload is aborted.
//!    DCP-safetensors files, which torch's reader takes one by one with no marker, stay open
//!    multipart uploads (no object yet) until every file's bytes are up, and are then completed
//!    together.
//! 5. Every uploaded object is **verified**: a HEAD for its size (and recorded SHA-256), then —
//!    with [`Verify::ReadBack`], the default — the object is read back, streaming, and hashed.
//!    Read-back is the check that holds on every S3-compatible server: it needs no checksum
//!    support from the server (S3's `x-amz-checksum-sha256` is optional, composite for multipart
//!    uploads and missing on many compatible servers; ETags are not content hashes for multipart
//!    or encrypted objects). Big objects are read back in part-sized ranged GETs pinned to the
//!    HEAD's ETag (`If-Match`). A mismatch deletes the object and fails the publish. In transit,
//!    SigV4 already signs each request body's SHA-256 (S3 rejects a body that does not match);
//!    where the server supports it, `AWS_CHECKSUM_ALGORITHM=SHA256` adds S3's own per-request
//!    checksums on top. [`Verify::Head`] skips the read-back (size and recorded SHA-256 only).
//! 6. Only when every data object is complete and verified are the commit markers written
//!    (`.metadata`; an HF index), one at a time, each verified.
//! 7. The manifest is written last (and read back): Shardline's consumers treat it as the commit.
//!    Then the pending record is deleted.
//!
//! On a failure the markers (and, for DCP-safetensors, the files completed) and the manifest are
//! withdrawn first, then the error is returned: a reader sees the previous complete checkpoint,
//! nothing, or the new complete one, never a torn one.
//!
//! A publish that fails or is killed leaves no manifest. A retry reads the pending record: files
//! the old manifest vouched for and that were not being written are skipped as usual; an object
//! that a failed attempt completed is found by a HEAD (right size, no contradicting metadata),
//! read back and hashed, and kept if it matches (reported as `resumed`); everything else is
//! uploaded again. Multipart uploads are aborted on errors; one interrupted by a kill stays
//! invisible (never an object) until the bucket's lifecycle rule
//! (`AbortIncompleteMultipartUpload`) removes it.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

mod commit;
mod destination;
mod engine;
/// moto's S3 server for tests of this and other crates.
#[cfg(feature = "test-server")]
pub mod moto;
mod protocol;
mod s3_uploads;
mod survey;

pub use commit::{CommitRule, DCP_METADATA, HF_INDEX, MEGATRON_TRACKER};
pub use destination::{Backend, Destination};
pub use engine::read_manifest_at;
pub use object_store;
pub use protocol::publish_to;
pub use s3_uploads::OpenMultipart;
pub use survey::{clean, survey, LocationReport, LocationState};

/// Name of the manifest in a published directory.
pub const MANIFEST: &str = "shardline-manifest.json";
/// Format tag of the manifest.
pub const MANIFEST_FORMAT: &str = "shardline-manifest/v1";
/// Name of the record a publish in progress keeps at the destination (removed after the commit).
pub const PENDING: &str = ".shardline-publish-pending.json";
/// Name of the user metadata entry that records an object's SHA-256 (lowercase alphanumerics:
/// valid as an S3/GCS header suffix and as an Azure metadata name).
pub const SHA256_METADATA: &str = "shardlinesha256";

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

/// What a publish did. Lists are in publish order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishReport {
    /// Files uploaded (and verified).
    pub copied: Vec<String>,
    /// Files the destination already had, as its manifest says and a HEAD confirms.
    pub skipped: Vec<String>,
    /// Files an interrupted earlier publish had completed: verified and kept, not uploaded again.
    pub resumed: Vec<String>,
    /// Bytes uploaded.
    pub bytes_copied: u64,
    /// Bytes read back from the destination and hashed.
    pub bytes_verified: u64,
    /// Multipart parts uploaded (a file uploaded with one PUT counts none).
    pub parts_uploaded: u64,
    /// Whether a manifest was written (false when the destination already had this one).
    pub manifest_written: bool,
}

/// How an uploaded object is checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verify {
    /// HEAD (size, recorded SHA-256) and a streaming read-back hashed with SHA-256. Works on
    /// every store; costs one download of what was uploaded.
    #[default]
    ReadBack,
    /// HEAD only: the size, and the recorded SHA-256 where the store keeps metadata. Catches
    /// truncation and replaced objects but not corrupted bytes of the right length.
    Head,
}

/// A hook run after a file's object is uploaded and before it is verified (tests use it to
/// tamper with the object). It gets the file's path relative to the checkpoint.
pub type AfterUpload = Arc<dyn Fn(&str) -> BoxFuture<'static, ()> + Send + Sync>;

/// How to publish.
#[derive(Clone)]
pub struct PublishOptions {
    /// Files larger than this are uploaded in parts of this size; smaller ones with one PUT.
    /// S3 and GCS need parts of at least 5 MiB (the last one excepted); the part size grows by
    /// itself when a file would need more than 10,000 parts. Default 64 MiB.
    pub part_size: usize,
    /// Parts (and single-PUT bodies) being uploaded at once, over all files. Default 8.
    pub max_parts_in_flight: usize,
    /// Files being uploaded or verified at once. Default 4.
    pub max_files_in_flight: usize,
    pub verify: Verify,
    /// Store configuration over the environment's, as object_store's configuration keys
    /// (`aws_endpoint`, `aws_allow_http`, `aws_access_key_id`, …). Values are never printed.
    pub store_options: Vec<(String, String)>,
    pub after_upload: Option<AfterUpload>,
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            part_size: 64 << 20,
            max_parts_in_flight: 8,
            max_files_in_flight: 4,
            verify: Verify::ReadBack,
            store_options: Vec::new(),
            after_upload: None,
        }
    }
}

impl fmt::Debug for PublishOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PublishOptions")
            .field("part_size", &self.part_size)
            .field("max_parts_in_flight", &self.max_parts_in_flight)
            .field("max_files_in_flight", &self.max_files_in_flight)
            .field("verify", &self.verify)
            .field("store_options", &self.store_options.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>())
            .field("after_upload", &self.after_upload.is_some())
            .finish()
    }
}

/// Why publishing failed. The destination then has no (new) manifest.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PublishError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },
    #[error("destination `{0}` is not supported (use an absolute path or a file://, s3://, gs:// or az:// URL)")]
    UnsupportedDestination(String),
    #[error(
        "{path}: copied {actual_size} bytes with SHA-256 {actual}, expected {expected_size} bytes with {expected}"
    )]
    Verify { path: PathBuf, expected: String, actual: String, expected_size: u64, actual_size: u64 },
    #[error("{0}: the manifest is not valid JSON: {1}")]
    BadManifest(PathBuf, String),
    #[error("source {0} has no files to publish")]
    Empty(PathBuf),
    /// An object store request failed (the message has no credentials).
    #[error("{object}: {action}: {message}")]
    Store { object: String, action: &'static str, message: String },
    /// The destination or the options are misconfigured (the message has no credentials).
    #[error("configuration: {0}")]
    Config(String),
    /// A source file changed while it was being published.
    #[error("{path}: changed while being published (hashed {expected}, uploaded {actual})")]
    SourceChanged { path: PathBuf, expected: String, actual: String },
    /// Stopped because another file of the same publish failed (never the error a publish returns).
    #[error("stopped after another file failed")]
    Cancelled,
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

/// Reads the manifest of a published local directory, if it has one.
pub fn read_manifest(dir: &Path) -> Result<Option<Manifest>, PublishError> {
    let p = dir.join(MANIFEST);
    match fs::read(&p) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| PublishError::BadManifest(p, e.to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(PublishError::Io { path: p, action: "read", error: e }),
    }
}

/// Files to publish from `src`, in publish order: the data by name, then the commit markers in
/// their order (see [`commit::marker_order`]). The files of one directory; for a Megatron-LM save
/// directory (its tracker at the top), the files under it too, by relative path; for a torchtitan
/// checkpoint folder (`step-N/` directories and nothing else), every step's files, each step's
/// `.metadata` last (torchtitan takes a step for complete when it has one); for a NeMo Automodel
/// save (`model/` beside the rest), every file under it.
fn source_files(src: &Path) -> Result<Vec<String>, PublishError> {
    let mut names = Vec::new();
    if src.join("model").is_dir() {
        if src.join(AUTOMODEL_INCOMPLETE).exists() {
            return Err(PublishError::Config(format!(
                "{} is marked `{AUTOMODEL_INCOMPLETE}`: a NeMo Automodel save that did not finish",
                src.display()
            )));
        }
        list_files(src, "", true, &mut names)?;
    }
    match megatron_checkpoint(src)? {
        _ if !names.is_empty() => {}
        // A save directory: its tracker and the checkpoint it names (older iterations stay).
        Some(named) => {
            names.push(commit::MEGATRON_TRACKER.to_string());
            list_files(&src.join(&named), &format!("{named}/"), true, &mut names)?;
        }
        None => {
            list_files(src, "", false, &mut names)?;
            if names.is_empty() {
                for step in torchtitan_steps(src)? {
                    list_files(&src.join(&step), &format!("{step}/"), false, &mut names)?;
                }
            }
        }
    }
    names.retain(|n| {
        let base = n.rsplit('/').next().unwrap_or(n);
        n != MANIFEST && n != PENDING && !base.ends_with(".partial") && !base.ends_with(".tmp") && !base.contains('#')
    });
    names.sort_by_key(|n| (commit::marker_order(n), n.clone()));
    if names.is_empty() {
        return Err(PublishError::Empty(src.to_path_buf()));
    }
    Ok(names)
}

/// NeMo Automodel's marker of a save still being written.
const AUTOMODEL_INCOMPLETE: &str = ".incomplete";

/// The checkpoint directory a Megatron-LM save directory's tracker names (`release`,
/// `iter_NNNNNNN`), when `src` is one.
fn megatron_checkpoint(src: &Path) -> Result<Option<String>, PublishError> {
    let tracker = src.join(commit::MEGATRON_TRACKER);
    let text = match fs::read_to_string(&tracker) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(PublishError::Io { path: tracker, action: "read", error: e }),
    };
    let named = match text.trim() {
        "release" => "release".to_string(),
        t => match t.parse::<u64>() {
            Ok(n) => format!("iter_{n:07}"),
            Err(_) => return Err(PublishError::Config(format!("{}: `{t}` names no checkpoint", tracker.display()))),
        },
    };
    Ok(Some(named))
}

/// The `step-N` directories of a torchtitan checkpoint folder `src`.
fn torchtitan_steps(src: &Path) -> Result<Vec<String>, PublishError> {
    let mut steps = Vec::new();
    for e in fs::read_dir(src).map_err(io_err(src, "list"))?.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let numbered = name.strip_prefix("step-").is_some_and(|n| n.parse::<u64>().is_ok());
        if numbered && e.file_type().is_ok_and(|t| t.is_dir()) {
            steps.push(name);
        }
    }
    steps.sort();
    Ok(steps)
}

/// Adds the files of `dir` (under the relative path `rel`) to `out`, and those of its
/// subdirectories when `nested`.
fn list_files(dir: &Path, rel: &str, nested: bool, out: &mut Vec<String>) -> Result<(), PublishError> {
    for e in fs::read_dir(dir).map_err(io_err(dir, "list"))?.filter_map(|e| e.ok()) {
        let name = format!("{rel}{}", e.file_name().to_string_lossy());
        match e.file_type() {
            Ok(t) if t.is_file() => out.push(name),
            Ok(t) if t.is_dir() && nested => list_files(&e.path(), &format!("{name}/"), nested, out)?,
            _ => {}
        }
    }
    Ok(())
}

/// Publishes the checkpoint in `src` to `to` (an absolute path or a `file://`, `s3://`, `gs://`
/// or `az://` URL), configured from the environment and `options.store_options`.
pub async fn publish(
    src: &Path,
    to: &str,
    source: serde_json::Value,
    layout: serde_json::Value,
    options: &PublishOptions,
) -> Result<(Manifest, PublishReport), PublishError> {
    let dest = Destination::open(to, &options.store_options)?;
    publish_to(&dest, src, source, layout, options).await
}

/// Reads the manifest at `to` (configured from the environment); `None` when there is none,
/// i.e. the destination is not (or not yet) a complete checkpoint.
pub async fn read_remote_manifest(to: &str) -> Result<Option<Manifest>, PublishError> {
    let dest = Destination::open(to, &[])?;
    read_manifest_at(&dest).await
}

/// Publishes the checkpoint in `src` to the local directory `dest`: [`publish`] to
/// `file://{dest}` with default options, run to completion on a runtime of its own (on a thread
/// of its own, so it may be called from anywhere, async code included).
pub fn publish_dir(
    src: &Path,
    dest: &Path,
    source: serde_json::Value,
    layout: serde_json::Value,
) -> Result<(Manifest, PublishReport), PublishError> {
    let destination = Destination::local(dest)?;
    let options = PublishOptions::default();
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(io_err(dest, "start the publish runtime"))?;
            rt.block_on(publish_to(&destination, src, source, layout, &options))
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
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
    fn a_torchtitan_folder_publishes_each_step_with_its_metadata_last() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        make_src(&src.join("step-0"));
        make_src(&src.join("step-10"));
        fs::create_dir_all(src.join("notes")).unwrap();
        fs::write(src.join("notes").join("x"), b"not a step").unwrap();
        let names = source_files(&src).unwrap();
        assert_eq!(
            names,
            [
                "step-0/__0_0.distcp",
                "step-0/__1_0.distcp",
                "step-10/__0_0.distcp",
                "step-10/__1_0.distcp",
                "step-0/.metadata",
                "step-10/.metadata"
            ]
        );
        let dest = tmp.path().join("dest");
        let (_, r) = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        assert_eq!(r.copied.last().map(String::as_str), Some("step-10/.metadata"));
        assert_eq!(fs::read(dest.join("step-10").join(".metadata")).unwrap(), b"meta");
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
        assert!(!dest.join(PENDING).exists());
        // Second publish of identical content copies nothing.
        let (_, r2) = publish_dir(&src, &dest, serde_json::json!({"path": "x"}), serde_json::json!({"tp": 1})).unwrap();
        assert!(r2.copied.is_empty());
        assert_eq!(r2.skipped.len(), 3);
        assert!(!r2.manifest_written);
        // A changed file is copied again.
        fs::write(src.join("__1_0.distcp"), b"rank 1 v2").unwrap();
        let (_, r3) = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        // `.metadata` was withdrawn before the change and is written again after it.
        assert_eq!(r3.copied, vec!["__1_0.distcp", ".metadata"]);
        assert_eq!(fs::read(dest.join("__1_0.distcp")).unwrap(), b"rank 1 v2");
    }

    #[test]
    fn failed_publish_leaves_no_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let dest = tmp.path().join("dest");
        make_src(&src);
        publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        // The destination becomes unwritable for one file (a directory stands where it goes):
        // the old manifest is withdrawn first and no new one appears.
        fs::remove_file(dest.join("__1_0.distcp")).unwrap();
        fs::create_dir(dest.join("__1_0.distcp")).unwrap();
        fs::write(dest.join("__1_0.distcp").join("x"), b"x").unwrap();
        fs::write(src.join("__1_0.distcp"), b"changed!!").unwrap();
        let err = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap_err();
        assert!(err.to_string().contains("__1_0.distcp"), "{err}");
        assert!(read_manifest(&dest).unwrap().is_none());
        assert!(!dest.join(".metadata").exists(), "the old .metadata survived a failed publish");
        // Once the obstacle is gone a retry completes, keeping what is already there.
        fs::remove_dir_all(dest.join("__1_0.distcp")).unwrap();
        // What a killed multipart upload leaves on a local destination is cleared away.
        fs::write(dest.join("__1_0.distcp#3"), b"stale part").unwrap();
        let (m, r) = publish_dir(&src, &dest, serde_json::json!({}), serde_json::json!({})).unwrap();
        assert_eq!(r.copied, vec!["__1_0.distcp", ".metadata"]);
        assert_eq!(r.skipped, vec!["__0_0.distcp"]);
        assert_eq!(read_manifest(&dest).unwrap().unwrap(), m);
        assert!(!dest.join("__1_0.distcp#3").exists());
    }

    #[tokio::test]
    async fn publish_dir_works_inside_a_runtime() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        make_src(&src);
        let (m, _) = publish_dir(&src, &tmp.path().join("dest"), serde_json::json!({}), serde_json::json!({})).unwrap();
        assert_eq!(m.files.len(), 3);
    }

    #[test]
    fn destinations() {
        assert_eq!(local_destination("file:///a/b").unwrap(), PathBuf::from("/a/b"));
        assert_eq!(local_destination("/a/b").unwrap(), PathBuf::from("/a/b"));
        assert!(local_destination("s3://bucket/x").is_err());
        assert!(local_destination("relative/x").is_err());
    }
}
