//! What a download is asked ([`DownloadOptions`]), what it reports as it goes
//! ([`DownloadProgress`]) and what it returns ([`Snapshot`]).

use std::path::PathBuf;
use std::sync::Arc;

use crate::RepoFile;

/// Called as a download progresses (after each few MiB and each finished file).
pub type ProgressFn = Arc<dyn Fn(&DownloadProgress) + Send + Sync>;

/// What to download and how.
#[derive(Clone)]
pub struct DownloadOptions {
    /// Keep only files matching one of these (`fnmatch` globs; `*` crosses `/`). Empty keeps all.
    pub allow: Vec<String>,
    /// Then drop files matching one of these.
    pub ignore: Vec<String>,
    /// The cache (`…/huggingface/hub`); `None` uses the client's (from the environment).
    pub cache_dir: Option<PathBuf>,
    /// HTTP streams open at once, across files and ranges. Default 8.
    pub concurrency: usize,
    /// Files with at least this many bytes left are fetched as parallel ranges. Default 64 MiB.
    pub split_threshold: u64,
    /// Size of one range. Default 32 MiB.
    pub part_size: u64,
    /// Re-hash blobs already in the cache before reusing them (a corrupt one is downloaded again).
    /// Default true.
    pub verify_cached: bool,
    /// Progress callback.
    pub progress: Option<ProgressFn>,
}

impl Default for DownloadOptions {
    fn default() -> Self {
        DownloadOptions {
            allow: Vec::new(),
            ignore: Vec::new(),
            cache_dir: None,
            concurrency: 8,
            split_threshold: 64 << 20,
            part_size: 32 << 20,
            verify_cached: true,
            progress: None,
        }
    }
}

impl std::fmt::Debug for DownloadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadOptions")
            .field("allow", &self.allow)
            .field("ignore", &self.ignore)
            .field("cache_dir", &self.cache_dir)
            .field("concurrency", &self.concurrency)
            .field("split_threshold", &self.split_threshold)
            .field("part_size", &self.part_size)
            .field("verify_cached", &self.verify_cached)
            .field("progress", &self.progress.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

/// A progress report.
#[derive(Clone, Debug)]
pub struct DownloadProgress {
    /// The file the report is about.
    pub path: String,
    /// Files verified and linked so far.
    pub files_done: usize,
    /// Files selected.
    pub files_total: usize,
    /// Bytes received over the network so far (a retried range counts again).
    pub bytes_downloaded: u64,
    /// Bytes of files found verified in the cache.
    pub bytes_reused: u64,
    /// Bytes of all selected files.
    pub bytes_total: u64,
}

/// A downloaded, verified snapshot.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The repository id.
    pub repo: String,
    /// The revision asked for.
    pub revision: String,
    /// The commit it resolved to.
    pub sha: String,
    /// `{cache}/models--org--name/snapshots/{sha}`: the files, as symlinks into `blobs/`.
    pub dir: PathBuf,
    /// The files selected by the patterns, sorted by path; every one is in `dir`, verified.
    pub files: Vec<RepoFile>,
    /// Bytes received over the network.
    pub bytes_downloaded: u64,
    /// Bytes of files that were already in the cache.
    pub bytes_reused: u64,
}

impl Snapshot {
    /// The local path of a repository file.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}
