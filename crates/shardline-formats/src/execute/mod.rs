//! Executes a plan: streams every written chunk from the release into its rank file, with
//! bounded memory, each source byte read once and each output byte written once.
//!
//! Rank files are independent (the plan says everything, including where every item goes), so
//! they are written in parallel by a small pool of threads, each holding fixed-size buffers. A
//! sync thread makes them durable as they grow (`fdatasync` every 32 MiB written, `fsync`
//! when complete), so writers never wait on the device; meanwhile another thread encodes
//! `.metadata` and stages it as `.metadata.tmp`. The checkpoint becomes visible only when
//! `.metadata.tmp` is renamed into place, after every rank file is complete and synced.
//!
//! The data path of a DCP rank file, per byte segment of a chunk (see
//! [`segments`](shardline_layout::recipe::segments)):
//! - a plain copy of at least [`ExecuteOptions::copy_min_bytes`] goes file to file inside the
//!   kernel (`copy_file_range`), after the buffered bytes before it are written out;
//! - a smaller plain copy is read straight into the buffer's free space at flush time;
//!   consecutive reads from one release file are gathered into one `preadv`, the short gaps
//!   between them landing in a scratch area;
//! - transformed bytes are read into the buffer and transformed there; zero rows are filled there.
//!
//! Column stripes of row-parallel weights (thousands of short rows) are the exception: the TP
//! peers holding the stripes of the same rows are written by one writer, which reads a batch
//! of full rows once, with one `preadv` that scatters each row's columns straight into the
//! buffers of the files holding them (`StripeSets`): no staging copy, no buffer beyond theirs.
//!
//! When `copy_file_range` is refused (another filesystem, no kernel support), every copy takes
//! the buffered path, with the same bytes as result.
//!
//! The module is cut by job: `sources` (the release as the writers read it), `rank_file` (one
//! rank file's buffer, reads and kernel copies), `stripes` (TP peers' column stripes written
//! together), `dcp` and `dcp_safetensors` (the two formats), `threads` (the sync thread and the
//! writer pool), `entry` (the entry points: whole checkpoint, one rank file, commit).

mod dcp;
mod dcp_safetensors;
mod entry;
mod placed;
mod ranges;
mod rank_file;
mod sources;
mod stripes;
mod threads;

#[cfg(test)]
mod tests;

pub(crate) use dcp::publish_metadata;
pub use dcp_safetensors::{sharding_metadata, SAFETENSORS_STAGING};
pub use entry::{
    commit_checkpoint, rank_files, rank_item_spans, write_checkpoint, write_checkpoint_from, write_metadata_alone,
    write_rank_file, write_rank_section,
};
pub use placed::{
    extra_state_payload, object_file, object_storage, object_storage_entries, placed_entries, write_object_files,
    Planned,
};
pub use ranges::{merge_ranges, ByteRange, MERGE_GAP};
pub(crate) use rank_file::copy_unsupported;
pub(crate) use sources::stream_chunk;
pub use sources::SourceMap;
pub(crate) use threads::{for_each_unit, run_syncer, SyncJob};

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};

use thiserror::Error;

use crate::dcp_metadata::PathElem;
use crate::safetensors::SafetensorsError;

/// The checkpoint layouts Shardline writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// `.metadata` + `__<rank>_0.distcp` (torch.save items): what Megatron `fsdp_dtensor` loads.
    Dcp,
    /// One safetensors file per rank with `DCP_SHARDING_INFO` (torch ≥ 2.9 `HuggingFaceStorageReader`).
    DcpSafetensors,
}

/// Smallest plain segment copied file to file by the kernel (default of
/// [`ExecuteOptions::copy_min_bytes`]). Measured on ext4 (Linux 6.18, 2 cores): a kernel copy
/// costs the same CPU per byte as a read and a write through a cache-resident buffer, so small
/// segments lose by their extra syscalls and by breaking up the buffer's merged reads and writes
/// (64 KiB: +10 % CPU on the 1 GB benchmark); from 1 MiB it is neutral, and it is kept for
/// filesystems that offload copies (NFS server-side copy, reflinks).
pub const DEFAULT_COPY_MIN_BYTES: u64 = 1 << 20;

/// Knobs of the executor.
#[derive(Clone, Debug)]
pub struct ExecuteOptions {
    pub format: OutputFormat,
    /// Writer threads (each writes one rank file, or one TP group's files, at a time).
    pub threads: usize,
    /// Bytes of the copy buffer of each rank file being written.
    pub buffer_bytes: usize,
    /// Replace an existing checkpoint in the output directory.
    pub overwrite: bool,
    /// Compute the zip CRC-32 of every tensor entry of a DCP rank file. Off, the data entries
    /// carry CRC 0, as `torch.save` writes them with `torch.serialization.config.save.
    /// compute_crc32 = False`; torch's reader never checks them, so they are only for other zip
    /// tools. On, every data byte passes through the buffer (no kernel-side copy).
    pub zip_crc32: bool,
    /// Copy large plain segments with `copy_file_range`; off forces the read/write path.
    pub copy_file_range: bool,
    /// Plain segments of at least this many bytes are copied with `copy_file_range`.
    pub copy_min_bytes: u64,
}

impl Default for ExecuteOptions {
    fn default() -> Self {
        ExecuteOptions {
            format: OutputFormat::Dcp,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2),
            buffer_bytes: 1 << 20,
            overwrite: false,
            zip_crc32: false,
            copy_file_range: true,
            copy_min_bytes: DEFAULT_COPY_MIN_BYTES,
        }
    }
}

/// Why writing a checkpoint failed. Nothing that looks complete is left behind.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ExecuteError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: io::Error },
    #[error("{0} already holds a checkpoint (`{1}` exists); pass --overwrite to replace it")]
    Exists(PathBuf, &'static str),
    #[error("release tensor `{0}` named by the plan is not in the release")]
    MissingSource(String),
    #[error("release tensor `{name}` is {actual} in the release but {planned} in the plan")]
    SourceMismatch { name: String, planned: String, actual: String },
    #[error("the plan has {planned} source tensors but {located} were located in the release")]
    SourceCount { planned: usize, located: usize },
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error("`{key}`: MXFP4 scale {scale} of its elements from {element} on is out of range (255 is NaN; above {max} some values overflow bf16)")]
    Mxfp4Scale { key: String, element: u64, scale: u8, max: u8 },
    #[error("cancelled")]
    Cancelled,
}

pub(super) fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> ExecuteError + 'a {
    move |error| ExecuteError::Io { path: path.to_path_buf(), action, error }
}

/// Counters a caller can watch while the executor runs (progress bars, task progress).
#[derive(Debug, Default)]
pub struct Progress {
    /// The bytes the operation will move, once it is planned (0 until then).
    pub bytes_total: AtomicU64,
    pub bytes_written: AtomicU64,
    pub chunks_written: AtomicU64,
    pub files_done: AtomicU64,
    /// Set to stop early (the partial output is removed).
    pub cancel: AtomicBool,
}

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteReport {
    pub files: Vec<PathBuf>,
    pub tensor_bytes: u64,
    pub file_bytes: u64,
    pub chunks: u64,
    /// Tensor bytes copied file to file by the kernel (`copy_file_range`); the rest went through
    /// the writers' buffers.
    pub kernel_copy_bytes: u64,
}

/// The DCP file name of a rank.
pub fn dcp_rank_file(rank: u64) -> String {
    format!("__{rank}_0.distcp")
}

/// The DCP-safetensors file name of a rank (torch's `HuggingFaceStorageWriter` naming).
pub fn dcp_safetensors_rank_file(rank: u64, world: u64) -> String {
    let _ = world;
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// `planner_data` path of a key: the top-level dict, then the rest (Megatron nests model keys as
/// `{"model": {"module.decoder…": t}}` and optimizer states as `{"optimizer": {"state": {param: {state: t}}}}`).
pub fn planner_path(key: &str) -> Vec<PathElem> {
    if let Some(rest) = key.strip_prefix("optimizer.state.") {
        if let Some((param, state)) = rest.rsplit_once('.') {
            return vec![
                PathElem::Key("optimizer".into()),
                PathElem::Key("state".into()),
                PathElem::Key(param.into()),
                PathElem::Key(state.into()),
            ];
        }
    }
    match key.split_once('.') {
        Some((top, rest)) => vec![PathElem::Key(top.into()), PathElem::Key(rest.into())],
        None => vec![PathElem::Key(key.into())],
    }
}
