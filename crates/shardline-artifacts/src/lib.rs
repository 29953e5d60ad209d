//! The artifact store: an object-store prefix (`s3://`, `gs://`, `az://`) where a run's step
//! outputs live when its workers share no disk, so that any worker on any host can run any task.
//!
//! What a worker does with it: lists a prefix ([`Artifacts::list`]); reads byte ranges of an
//! object straight into a local file, in parallel, pinned to the listed ETag so a replaced object
//! fails the read instead of mixing versions (`fetch`); uploads a local file in parts through the
//! store's multipart API, registering the upload's id before the first part so that a killed
//! worker's upload can be aborted by another process, and leaves it open for the commit to
//! complete (`upload`). Transient HTTP errors are retried by object_store's client (its default
//! `RetryConfig`: exponential backoff, up to 10 retries within 3 minutes per request).
//!
//! Depends on the publish crate only (which opens every store from the environment); it knows
//! nothing of checkpoints or releases.

mod fetch;
mod upload;

pub use fetch::{ListedObject, MAX_IN_FLIGHT, PIECE_BYTES};
pub use upload::{PartsUpload, Upload, MIN_PART_BYTES, PART_BYTES};

use shardline_publish::object_store::path::Path as ObjPath;
use shardline_publish::Destination;
use thiserror::Error;

/// Why an artifact-store operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ArtifactError {
    #[error("artifact store {0}: {1}")]
    Config(String, String),
    #[error("artifact store {url}: `{name}`: {action}: {message}")]
    Store { url: String, name: String, action: &'static str, message: String },
    #[error("{path}: {action}: {error}")]
    Io { path: String, action: &'static str, error: std::io::Error },
    #[error("artifact store {url}: `{name}` is {actual} bytes, expected {expected}")]
    Size { url: String, name: String, expected: u64, actual: u64 },
    /// The task's lease was gone when the upload was registered; the upload was aborted.
    #[error("the lease was lost before the upload of `{0}` could be registered; it was aborted")]
    Fenced(String),
}

pub type Result<T> = std::result::Result<T, ArtifactError>;

/// An object-store prefix with a multipart API usable across processes.
#[derive(Clone, Debug)]
pub struct Artifacts {
    dest: Destination,
    url: String,
}

impl Artifacts {
    /// Opens `url` with the environment's configuration (as `store.upload` opens destinations),
    /// overridden by object_store configuration `options` (`aws_endpoint`, …).
    /// Refuses a store without a multipart API usable by id (a local directory: there a shared
    /// file system is the work directory itself).
    pub fn open(url: &str, options: &[(String, String)]) -> Result<Artifacts> {
        let dest =
            Destination::open(url, options).map_err(|e| ArtifactError::Config(url.to_string(), e.to_string()))?;
        if dest.multipart().is_none() {
            return Err(ArtifactError::Config(
                url.to_string(),
                "not an object store with multipart uploads (s3://, gs://, az://); a shared file system \
                 is used as the work directory instead"
                    .into(),
            ));
        }
        Ok(Artifacts { url: url.trim_end_matches('/').to_string(), dest })
    }

    /// The prefix `rel` under this one.
    pub fn child(&self, rel: &str) -> Artifacts {
        Artifacts { dest: self.dest.child(rel), url: format!("{}/{}", self.url, rel.trim_matches('/')) }
    }

    /// The prefix's URL, as opened (credentials are never part of it).
    pub fn url(&self) -> &str {
        &self.url
    }

    fn object(&self, name: &str) -> ObjPath {
        self.dest.object(name)
    }

    fn store_err(&self, name: &str, action: &'static str, e: impl std::fmt::Display) -> ArtifactError {
        ArtifactError::Store {
            url: self.url.clone(),
            name: name.to_string(),
            action,
            message: self.dest.redact(&e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests;
