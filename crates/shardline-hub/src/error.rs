//! The crate's one error type.
//!
//! No variant carries a token: request headers never reach an error, and URLs are reported
//! without their query string (signed CDN URLs carry credentials there).

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong talking to the Hub or writing the cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // the variant docs say it; the field names say what they hold
pub enum HubError {
    /// 401/403, or 404 with `X-Error-Code: RepoNotFound`: the Hub does not tell a missing repository
    /// from one the caller may not see.
    #[error("repository `{repo}` not found or gated (HTTP {status}): {hint}")]
    RepoNotFoundOrGated { repo: String, status: u16, hint: &'static str },
    /// The repository exists but has no such branch, tag or commit.
    #[error("revision `{revision}` not found in `{repo}`")]
    RevisionNotFound { repo: String, revision: String },
    /// The commit has no such file.
    #[error("`{path}` not found in `{repo}` at {revision}")]
    EntryNotFound { repo: String, revision: String, path: String },
    /// A downloaded file's digest differs from the one the Hub published for it, twice in a row.
    /// The bytes were deleted; nothing was linked into the snapshot.
    #[error(
        "checksum mismatch for `{path}` in `{repo}`: expected {algorithm} {expected}, got {actual} \
         (downloaded twice, corrupt bytes deleted)"
    )]
    ChecksumMismatch { repo: String, path: String, algorithm: &'static str, expected: String, actual: String },
    /// The server sent more bytes than the file has.
    #[error("size mismatch for `{path}` in `{repo}`: expected {expected} bytes, the server sent at least {actual}")]
    SizeMismatch { repo: String, path: String, expected: u64, actual: u64 },
    /// An HTTP status that is not retried, or a retried one that persisted.
    #[error("HTTP {status} from {url} after {attempts} attempt(s){detail}")]
    Http { status: u16, url: String, attempts: u32, detail: String },
    /// Connection refused, reset, timed out or cut, after the retries.
    #[error("network error on {url} after {attempts} attempt(s): {message}")]
    Network { url: String, attempts: u32, message: String },
    /// A local file system operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The server answered something this client cannot use.
    #[error("unexpected response from {url}: {message}")]
    InvalidResponse { url: String, message: String },
    /// Not `name` or `org/name`.
    #[error("invalid repository id `{0}` (expected `name` or `org/name` of letters, digits, `-`, `_` and `.`)")]
    InvalidRepoId(String),
    /// Empty, or with `..`, or otherwise unusable as a cache path.
    #[error("invalid revision `{0}` (expected a branch, tag or 40-hex commit sha)")]
    InvalidRevision(String),
    /// A bad allow/ignore glob.
    #[error("invalid file pattern `{pattern}`: {message}")]
    InvalidPattern { pattern: String, message: String },
    /// Environment or options that cannot work (no home directory for the cache, unreadable token file).
    #[error("hub configuration: {0}")]
    Config(String),
}

impl HubError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        HubError::Io { path: path.into(), source }
    }

    /// True for errors that a later attempt may not hit (network, 429, 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            HubError::Network { .. } => true,
            HubError::Http { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            _ => false,
        }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = HubError> = std::result::Result<T, E>;
