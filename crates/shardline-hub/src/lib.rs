/*!
A HuggingFace Hub client for the first step of every Shardline pipeline (`hf.download`).

**Owns:** talking to the Hub and the HF cache layout. **Must not depend on:** any workspace
crate: the engine and the trigger poller use it, never the other way round.

It resolves a revision to a commit sha and the commit's files (sizes, LFS sha256), downloads the
selected files with bounded parallel streams (large files as parallel ranges, partial files
resumed with `Range`), **verifies every file's digest before it is linked** (sha256 for LFS,
git blob sha1 for the rest; a mismatch is deleted, retried once, then reported), retries 429/5xx
and connection errors with backoff and `Retry-After`, and writes the standard HF cache layout
so a cache that `huggingface_hub` filled is reused and ours stays valid for it.

With the `test-server` feature, `fake` is a local server speaking the same HTTP API, with
faults on demand, for this crate's tests and other crates' (add
`shardline-hub = { path = "../shardline-hub", features = ["test-server"] }` to `[dev-dependencies]`).

# Invariants

- **Nothing unverified is linked.** A file reaches `snapshots/{sha}/` only after its digest
  matched the one the tree listing published: sha256 for LFS files, git blob sha1 (which also
  fixes the size) for the rest. Blobs already in the cache are re-hashed before reuse
  ([`DownloadOptions::verify_cached`]); a bad one is deleted and fetched again.
- **`.incomplete` is always a prefix** of the blob, so any client (this one with
  `Range: bytes=N-`, or `huggingface_hub`) can resume it. Parallel ranges are written to
  `.split.incomplete` and only their contiguous prefix comes back.
- **`refs/{revision}` is written last**, after every selected file is linked.
- **The token goes only to the endpoint's origin** (not to a CDN) and appears in no error,
  `Debug` output or log line.
- **Downloads are by commit sha**, resolved once, so a push during a download cannot mix commits
  (`X-Repo-Commit` is checked).

# Examples

```no_run
# async fn run() -> Result<(), shardline_hub::HubError> {
use shardline_hub::{DownloadOptions, HubClient};

let hub = HubClient::from_env()?;
let opts = DownloadOptions { allow: vec!["*.safetensors".into(), "*.json".into()], ..Default::default() };
let snap = hub.download("Qwen/Qwen3-30B-A3B", "main", &opts).await?;
println!("{} at {}: {} bytes downloaded", snap.repo, snap.sha, snap.bytes_downloaded);

// A watcher: `None` while `main` still points at the commit seen last.
if let Some(new_sha) = hub.head_sha("Qwen/Qwen3-30B-A3B", "main", Some(&snap.sha)).await? {
    println!("new commit {new_sha}");
}
# Ok(()) }
```

Against the local server (feature `test-server`):

```no_run
# #[cfg(feature = "test-server")]
# async fn demo(bytes: Vec<u8>) -> Result<(), Box<dyn std::error::Error>> {
use shardline_hub::fake::{Fault, FaultKind, FaultTarget, FakeFile, FakeHub};

let hub = FakeHub::start().await?;
let sha = hub.publish("acme/tiny", vec![FakeFile::new("model.safetensors", bytes)])?;
hub.inject(Fault::new(FaultTarget::File("model.safetensors".into()), FaultKind::CutAfter(1000)).times(1));
let client = shardline_hub::HubClient::new(hub.endpoint(), None)?;
let snap = client.download("acme/tiny", "main", &shardline_hub::DownloadOptions {
    cache_dir: Some("/tmp/cache".into()),
    ..Default::default()
}).await?;
assert_eq!(snap.sha, sha);
# Ok(()) }
```
*/
#![deny(missing_docs)]

pub use cache::RepoCache;
pub use client::{normalize_etag, HubClient, ModelListing, RetryPolicy, RevisionCheck};
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
