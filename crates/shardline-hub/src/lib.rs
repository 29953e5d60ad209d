/*!
A HuggingFace Hub client for the first step of every Shardline pipeline (`hf.download`).

It resolves a revision to a commit sha and the commit's files (sizes, LFS sha256), downloads the
selected files with bounded parallel streams (large files as parallel ranges, partial files
resumed with `Range`), **verifies every file's digest before it is linked** (sha256 for LFS,
git blob sha1 for the rest; a mismatch is deleted, retried once, then reported), retries 429/5xx
and connection errors with backoff and `Retry-After`, and writes the standard HF cache layout
so a cache that `huggingface_hub` filled is reused and ours stays valid for it.

With the `test-server` feature, [`fake`] is a local server speaking the same HTTP API, with
faults on demand, for this crate's tests and other crates'.

# Example

```no_run
# async fn run() -> Result<(), shardline_hub::HubError> {
use shardline_hub::{DownloadOptions, HubClient};

let hub = HubClient::from_env()?;
let opts = DownloadOptions { allow: vec!["*.safetensors".into(), "*.json".into()], ..Default::default() };
let snap = hub.download("Qwen/Qwen3-30B-A3B", "main", &opts).await?;
println!("{} at {}: {} bytes downloaded", snap.repo, snap.sha, snap.bytes_downloaded);
# Ok(()) }
```
*/
#![deny(missing_docs)]

pub use cache::RepoCache;
pub use client::{normalize_etag, HubClient, RetryPolicy};
pub use download::{DownloadOptions, DownloadProgress, ProgressFn, Snapshot};
pub use env::{HubEnv, DEFAULT_ENDPOINT};
pub use error::{HubError, Result};
pub use repo::{is_commit_sha, ModelSummary, PathFilter, RepoFile, RepoId, RepoRevision};
pub use secret::Secret;

mod cache;
mod client;
mod download;
mod env;
mod error;
#[cfg(feature = "test-server")]
pub mod fake;
mod repo;
mod secret;
