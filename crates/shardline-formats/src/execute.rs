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
//! The data path of a DCP rank file, per byte segment of a chunk (see [`segments`]):
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

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use rustix::io::Errno;
use shardline_layout::recipe::{apply_transform, row_elems, segments, Segment, Transform};
use shardline_layout::{Chunk, DType, Plan, PlanTable, TensorView};
use thiserror::Error;

use crate::dcp_metadata::{EntryRef, MetadataEncoder, PathElem, StorageRef};
use crate::safetensors::{FileLayout, Release, SafetensorsError, SafetensorsWriter, SourceLocations};
use crate::torch_save::TensorArchive;

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
    #[error("cancelled")]
    Cancelled,
}

fn io_err<'a>(path: &'a Path, action: &'static str) -> impl FnOnce(io::Error) -> ExecuteError + 'a {
    move |error| ExecuteError::Io { path: path.to_path_buf(), action, error }
}

/// Counters a caller can watch while the executor runs (progress bars, task progress).
#[derive(Debug, Default)]
pub struct Progress {
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

/// The release files a plan reads, open, and where each of the plan's sources sits in them:
/// Opens release files for reading.
fn open_release_files<'a>(paths: impl Iterator<Item = &'a Path>) -> Result<Vec<(PathBuf, File)>, ExecuteError> {
    let mut files = Vec::new();
    for p in paths {
        let f = File::open(p).map_err(io_err(p, "open release file"))?;
        // Larger readahead when the release is not in the page cache, as `cp` asks; a hint that
        // may be refused.
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Sequential);
        files.push((p.to_path_buf(), f));
    }
    Ok(files)
}

/// `(file index, absolute data offset, byte length)`. All the writers need of the release, so a
/// caller can let the release's header descriptions go before the bytes are copied.
pub struct SourceMap {
    files: Vec<(PathBuf, File)>,
    locs: Vec<(usize, u64, u64)>,
}

impl SourceMap {
    /// Opens the files of `release` and locates every source of `plan` in them, checking that
    /// each has the dtype and shape the plan was made for.
    pub fn new(plan: &Plan, release: &Release) -> Result<SourceMap, ExecuteError> {
        let files = open_release_files(release.file_paths())?;
        let mut locs = Vec::with_capacity(plan.sources.len());
        for s in &plan.sources {
            let t = release.tensor(&s.name).ok_or_else(|| ExecuteError::MissingSource(s.name.clone()))?;
            if t.info.dtype != s.dtype || t.info.shape != s.shape {
                return Err(ExecuteError::SourceMismatch {
                    name: s.name.clone(),
                    planned: format!("{} {:?}", s.dtype, s.shape),
                    actual: format!("{} {:?}", t.info.dtype, t.info.shape),
                });
            }
            locs.push((t.file_index, t.info.file_offset, t.info.byte_len));
        }
        Ok(SourceMap { files, locs })
    }

    /// Opens the files of a release whose sources `plan` was made from, as
    /// [`Release::into_sources`] gave them with `locations`.
    pub fn open(plan: &Plan, locations: SourceLocations) -> Result<SourceMap, ExecuteError> {
        if locations.tensors.len() != plan.sources.len() {
            return Err(ExecuteError::SourceCount { planned: plan.sources.len(), located: locations.tensors.len() });
        }
        let files = open_release_files(locations.files.iter().map(PathBuf::as_path))?;
        let locs = locations.tensors.into_iter().map(|(file, offset, len)| (file as usize, offset, len)).collect();
        Ok(SourceMap { files, locs })
    }

    /// Reads `buf.len()` bytes of source `id` at byte `offset` within the tensor.
    fn read(&self, id: usize, offset: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        let (fi, at) = self.locate(id, offset, buf.len() as u64);
        self.read_at(fi, at, buf)
    }

    /// `(file index, absolute offset)` of byte `offset` of source `id`, for `len` bytes.
    fn locate(&self, id: usize, offset: u64, len: u64) -> (usize, u64) {
        let (fi, start, tensor_len) = self.locs[id];
        debug_assert!(offset + len <= tensor_len);
        (fi, start + offset)
    }

    fn read_at(&self, fi: usize, at: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        let (path, file) = &self.files[fi];
        file.read_exact_at(buf, at).map_err(io_err(path, "read release tensor"))
    }
}

/// Streams the bytes of one chunk through `sink`, in bounded pieces.
pub(crate) fn stream_chunk(
    t: TensorView<'_>,
    offsets: &[u64],
    sizes: &[u64],
    sources: &SourceMap,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]) -> Result<(), ExecuteError>,
) -> Result<(), ExecuteError> {
    let item = t.dtype.size();
    // Keep pieces element-aligned so transforms see whole elements.
    let piece = (buf.len() / item).max(1) * item;
    for Segment { source, len, transform } in segments(t.shape, t.dtype, t.recipe, offsets, sizes) {
        let mut done = 0u64;
        while done < len {
            let n = ((len - done) as usize).min(piece);
            let b = &mut buf[..n];
            match source {
                Some((id, off)) => {
                    sources.read(id, off + done, b)?;
                    apply_transform(transform, t.dtype, b);
                }
                None => b.fill(0),
            }
            sink(b)?;
            done += n as u64;
        }
    }
    Ok(())
}

/// At most this many buffers in one `preadv` (Linux's `UIO_MAXIOV`; a handful in unit tests, to
/// exercise the batch boundaries on tiny fixtures).
const MAX_IOVECS: usize = if cfg!(test) { 11 } else { 1024 };
/// Source bytes between two gathered reads that are read (into scratch) rather than skipped with
/// a new syscall: copying a few KiB costs about what a syscall does.
const MAX_GATHER_GAP: u64 = 8 << 10;
/// Scratch space for those gap bytes, per `preadv`.
const GAP_SCRATCH: usize = if cfg!(test) { 300 } else { 256 << 10 };
/// Written bytes of a rank file between two requests to start their writeback.
const SYNC_EVERY: u64 = 32 << 20;

/// A read of release bytes into the buffer, not yet done.
#[derive(Clone, Copy, Debug)]
struct PendingRead {
    file: usize,
    src: u64,
    at: usize,
    len: usize,
}

/// Whether `copy_file_range` failed because this pair of files cannot use it (rather than an I/O
/// error): the read/write path then does the copy.
fn copy_unsupported(e: Errno) -> bool {
    [Errno::XDEV, Errno::NOSYS, Errno::INVAL, Errno::OPNOTSUPP, Errno::PERM, Errno::TXTBSY, Errno::BADF].contains(&e)
}

/// How a rank file gets its bytes, shared by the writer threads.
struct DataPath<'a> {
    sources: &'a SourceMap,
    /// Cleared, for every thread, the first time the kernel refuses `copy_file_range`.
    kernel_copy: AtomicBool,
    copy_min_bytes: u64,
    zip_crc32: bool,
    buffer_bytes: usize,
    /// Bytes copied by `copy_file_range`.
    kernel_copied: AtomicU64,
}

impl<'a> DataPath<'a> {
    fn new(sources: &'a SourceMap, options: &ExecuteOptions) -> DataPath<'a> {
        DataPath {
            sources,
            kernel_copy: AtomicBool::new(options.copy_file_range),
            copy_min_bytes: options.copy_min_bytes.max(1),
            zip_crc32: options.zip_crc32,
            // Room for whole elements and a page at least.
            buffer_bytes: options.buffer_bytes.max(1 << 12),
            kernel_copied: AtomicU64::new(0),
        }
    }
}

/// A sequential rank-file writer: a fixed buffer that source bytes are read into directly, kernel
/// copies for large plain segments, and patching of bytes already written.
struct RankFile<'a> {
    path: PathBuf,
    file: Arc<File>,
    data: &'a DataPath<'a>,
    syncer: &'a mpsc::Sender<SyncJob>,
    /// `flushed` when writeback was last requested.
    sync_requested: u64,
    /// Fixed size; `buf[..fill]` is pending output (some of it awaiting `pending` reads).
    buf: Vec<u8>,
    fill: usize,
    /// Bytes of the file already written.
    flushed: u64,
    pending: Vec<PendingRead>,
    gaps: Vec<u8>,
    /// While a CRC'd data entry is being written: the hasher, and where in `buf` the bytes not
    /// yet hashed start.
    crc: Option<(crc32fast::Hasher, usize)>,
}

impl<'a> RankFile<'a> {
    fn create(
        path: PathBuf,
        data: &'a DataPath<'a>,
        syncer: &'a mpsc::Sender<SyncJob>,
    ) -> Result<RankFile<'a>, ExecuteError> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io_err(&path, "create rank file"))?;
        Ok(RankFile {
            path,
            file: Arc::new(file),
            data,
            syncer,
            sync_requested: 0,
            buf: vec![0u8; data.buffer_bytes],
            fill: 0,
            flushed: 0,
            pending: Vec::new(),
            gaps: Vec::new(),
            crc: None,
        })
    }

    fn pos(&self) -> u64 {
        self.flushed + self.fill as u64
    }

    fn free(&self) -> usize {
        self.buf.len() - self.fill
    }

    /// Appends bytes outside a data entry (archive headers and trailers).
    fn write(&mut self, bytes: &[u8]) -> Result<(), ExecuteError> {
        if bytes.len() > self.free() {
            self.flush()?;
        }
        if bytes.len() > self.buf.len() {
            self.file.write_all_at(bytes, self.flushed).map_err(io_err(&self.path, "write rank file"))?;
            self.flushed += bytes.len() as u64;
        } else {
            self.buf[self.fill..self.fill + bytes.len()].copy_from_slice(bytes);
            self.fill += bytes.len();
        }
        Ok(())
    }

    /// Starts a data entry: with `zip_crc32`, the bytes from here to [`RankFile::end_data`] are hashed.
    fn begin_data(&mut self) {
        if self.data.zip_crc32 {
            self.crc = Some((crc32fast::Hasher::new(), self.fill));
        }
    }

    /// Ends a data entry; its CRC-32, or 0 without `zip_crc32`.
    fn end_data(&mut self) -> Result<u32, ExecuteError> {
        match self.crc.take() {
            Some((mut h, from)) => {
                self.resolve_reads()?;
                h.update(&self.buf[from..self.fill]);
                Ok(h.finalize())
            }
            None => Ok(0),
        }
    }

    /// Appends `len` zero bytes.
    fn zeros(&mut self, mut len: u64) -> Result<(), ExecuteError> {
        while len > 0 {
            if self.free() == 0 {
                self.flush()?;
            }
            let n = len.min(self.free() as u64) as usize;
            self.buf[self.fill..self.fill + n].fill(0);
            self.fill += n;
            len -= n as u64;
        }
        Ok(())
    }

    /// Appends `len` bytes of source `id` from byte `offset`, transformed as `transform` says.
    fn copy(
        &mut self,
        id: usize,
        offset: u64,
        len: u64,
        transform: Transform,
        dtype: DType,
    ) -> Result<(), ExecuteError> {
        let (fi, mut src) = self.data.sources.locate(id, offset, len);
        let mut left = len;
        if transform != Transform::Identity {
            // Read into the buffer and transform in place, whole elements at a time.
            let item = dtype.size();
            while left > 0 {
                if self.free() < item {
                    self.flush()?;
                }
                let n = (left.min(self.free() as u64) as usize) / item * item;
                let piece = &mut self.buf[self.fill..self.fill + n];
                self.data.sources.read_at(fi, src, piece)?;
                apply_transform(transform, dtype, piece);
                self.fill += n;
                src += n as u64;
                left -= n as u64;
            }
            return Ok(());
        }
        if self.crc.is_none() && left >= self.data.copy_min_bytes && self.data.kernel_copy.load(Ordering::Relaxed) {
            self.flush()?;
            let copied = self.kernel_copy(fi, src, left)?;
            src += copied;
            left -= copied;
        }
        while left > 0 {
            if self.free() == 0 {
                self.flush()?;
            }
            let n = left.min(self.free() as u64) as usize;
            self.queue_read(fi, src, n);
            src += n as u64;
            left -= n as u64;
        }
        Ok(())
    }

    /// Copies up to `len` bytes of release file `fi` from `src` to the end of the (flushed) file
    /// with `copy_file_range`; returns how many were copied (fewer when the kernel refuses).
    fn kernel_copy(&mut self, fi: usize, mut src: u64, len: u64) -> Result<u64, ExecuteError> {
        let source = &self.data.sources.files[fi].1;
        let mut done = 0u64;
        while done < len {
            let (mut off_in, mut off_out) = (src, self.flushed);
            let want = (len - done).min(1 << 30) as usize;
            match rustix::fs::copy_file_range(source, Some(&mut off_in), &self.file, Some(&mut off_out), want) {
                // End of the source file (it shrank?) or a file the kernel copies nothing from:
                // the read path finishes and reports a short file as such.
                Ok(0) => break,
                Ok(n) => {
                    done += n as u64;
                    src += n as u64;
                    self.flushed += n as u64;
                    self.data.kernel_copied.fetch_add(n as u64, Ordering::Relaxed);
                    self.request_writeback(false);
                }
                Err(Errno::INTR) => {}
                Err(e) if copy_unsupported(e) => {
                    self.data.kernel_copy.store(false, Ordering::Relaxed);
                    break;
                }
                Err(e) => {
                    return Err(ExecuteError::Io {
                        path: self.path.clone(),
                        action: "copy release bytes into rank file (copy_file_range)",
                        error: e.into(),
                    })
                }
            }
        }
        Ok(done)
    }

    /// Reserves `len` bytes of the buffer for release bytes read at flush time.
    fn queue_read(&mut self, file: usize, src: u64, len: usize) {
        let at = self.fill;
        self.fill += len;
        if let Some(last) = self.pending.last_mut() {
            if last.file == file && last.src + last.len as u64 == src && last.at + last.len == at {
                last.len += len;
                return;
            }
        }
        self.pending.push(PendingRead { file, src, at, len });
    }

    /// Does every queued read, gathering runs of nearby reads from one file into one `preadv`.
    fn resolve_reads(&mut self) -> Result<(), ExecuteError> {
        let pending = std::mem::take(&mut self.pending);
        let mut i = 0;
        while i < pending.len() {
            let mut j = i + 1;
            let (mut iovecs, mut gap_bytes) = (1usize, 0usize);
            while j < pending.len() {
                let (prev, next) = (&pending[j - 1], &pending[j]);
                let prev_end = prev.src + prev.len as u64;
                if next.file != prev.file || next.src < prev_end || next.src - prev_end > MAX_GATHER_GAP {
                    break;
                }
                let gap = (next.src - prev_end) as usize;
                let more = if gap > 0 { 2 } else { 1 };
                if iovecs + more > MAX_IOVECS || gap_bytes + gap > GAP_SCRATCH {
                    break;
                }
                iovecs += more;
                gap_bytes += gap;
                j += 1;
            }
            self.gather(&pending[i..j], gap_bytes)?;
            i = j;
        }
        self.pending = pending;
        self.pending.clear();
        Ok(())
    }

    /// Reads `run` (ascending in the file and in the buffer) with one `preadv`.
    fn gather(&mut self, run: &[PendingRead], gap_bytes: usize) -> Result<(), ExecuteError> {
        let first = run[0];
        let (path, source) = &self.data.sources.files[first.file];
        if run.len() == 1 {
            return source
                .read_exact_at(&mut self.buf[first.at..first.at + first.len], first.src)
                .map_err(io_err(path, "read release tensor"));
        }
        if self.gaps.len() < gap_bytes {
            self.gaps.resize(gap_bytes, 0);
        }
        let last = run[run.len() - 1];
        let total = (last.src + last.len as u64 - first.src) as usize;
        let got = {
            let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(2 * run.len());
            let mut rest: &mut [u8] = &mut self.buf[first.at..];
            let mut base = first.at;
            let mut scratch: &mut [u8] = &mut self.gaps[..];
            let mut src_end = first.src;
            for r in run {
                let gap = (r.src - src_end) as usize;
                if gap > 0 {
                    let (g, tail) = std::mem::take(&mut scratch).split_at_mut(gap);
                    iov.push(IoSliceMut::new(g));
                    scratch = tail;
                }
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.at - base);
                let (d, tail) = tail.split_at_mut(r.len);
                iov.push(IoSliceMut::new(d));
                rest = tail;
                base = r.at + r.len;
                src_end = r.src + r.len as u64;
            }
            loop {
                match rustix::io::preadv(source, &mut iov, first.src) {
                    Err(Errno::INTR) => continue,
                    other => break other,
                }
            }
        };
        match got {
            Ok(n) if n == total => Ok(()),
            // A short read (end of file, or the kernel stopping early): read each piece on its
            // own, which finishes the job or reports the short file.
            Ok(_) => {
                for r in run {
                    source
                        .read_exact_at(&mut self.buf[r.at..r.at + r.len], r.src)
                        .map_err(io_err(path, "read release tensor"))?;
                }
                Ok(())
            }
            Err(e) => Err(ExecuteError::Io { path: path.clone(), action: "read release tensor", error: e.into() }),
        }
    }

    /// Overwrites bytes at absolute `offset` (before the current position).
    fn patch(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ExecuteError> {
        if offset >= self.flushed {
            let at = (offset - self.flushed) as usize;
            self.buf[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        } else {
            self.file.write_all_at(bytes, offset).map_err(io_err(&self.path, "patch rank file"))
        }
    }

    fn flush(&mut self) -> Result<(), ExecuteError> {
        self.resolve_reads()?;
        if let Some((h, from)) = &mut self.crc {
            h.update(&self.buf[*from..self.fill]);
            *from = 0;
        }
        if self.fill > 0 {
            self.file
                .write_all_at(&self.buf[..self.fill], self.flushed)
                .map_err(io_err(&self.path, "write rank file"))?;
            self.flushed += self.fill as u64;
            self.fill = 0;
        }
        self.request_writeback(false);
        Ok(())
    }

    /// Hands the file to the sync thread: every [`SYNC_EVERY`] bytes so the device writes while
    /// we copy, and once complete (`last`) for the `fsync` the commit waits for.
    fn request_writeback(&mut self, last: bool) {
        if last || self.flushed - self.sync_requested >= SYNC_EVERY {
            self.sync_requested = self.flushed;
            let job = SyncJob { file: self.file.clone(), path: self.path.clone(), last };
            // A closed channel means the sync thread is gone; the commit then fails on the count.
            let _ = self.syncer.send(job);
        }
    }

    /// Writes out the buffer and queues the final `fsync`; returns the file length.
    fn finish(mut self) -> Result<u64, ExecuteError> {
        self.flush()?;
        self.request_writeback(true);
        Ok(self.flushed)
    }
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

/// A request to the sync thread.
struct SyncJob {
    file: Arc<File>,
    path: PathBuf,
    /// The file is complete: `fsync` it (else `fdatasync`, to start writeback early).
    last: bool,
}

/// The sync thread: makes rank files durable while the writer threads go on copying, so no
/// writer waits on the device. Jobs queued while one runs are merged (a file's latest request
/// wins). Returns how many files were completely synced, or the first error.
fn run_syncer(jobs: mpsc::Receiver<SyncJob>) -> Result<usize, ExecuteError> {
    let mut synced = 0;
    let mut first_error = None;
    while let Ok(job) = jobs.recv() {
        let mut batch = vec![job];
        while let Ok(more) = jobs.try_recv() {
            match batch.iter_mut().find(|j| Arc::ptr_eq(&j.file, &more.file)) {
                Some(j) => j.last |= more.last,
                None => batch.push(more),
            }
        }
        if first_error.is_some() {
            continue;
        }
        for job in batch {
            let result = if job.last { job.file.sync_all() } else { job.file.sync_data() };
            match result {
                Ok(()) => synced += usize::from(job.last),
                Err(e) => {
                    first_error.get_or_insert(ExecuteError::Io { path: job.path, action: "sync rank file", error: e });
                    break;
                }
            }
        }
    }
    first_error.map_or(Ok(synced), Err)
}

/// Runs `work(unit)` for every unit `0..units` (a rank file, or a group of them) on `threads`
/// threads; the first error wins and stops the rest.
fn for_each_unit<T: Send>(
    units: usize,
    threads: usize,
    progress: &Progress,
    work: impl Fn(usize) -> Result<T, ExecuteError> + Sync,
) -> Result<Vec<T>, ExecuteError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..units).map(|_| None).collect());
    let first_error: Mutex<Option<ExecuteError>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, units.max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) || progress.cancel.load(Ordering::Relaxed) {
                    return;
                }
                let unit = next.fetch_add(1, Ordering::Relaxed);
                if unit >= units {
                    return;
                }
                match work(unit) {
                    Ok(r) => {
                        if let Ok(mut g) = results.lock() {
                            g[unit] = Some(r);
                        }
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        if let Ok(mut g) = first_error.lock() {
                            g.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    if progress.cancel.load(Ordering::Relaxed) {
        return Err(ExecuteError::Cancelled);
    }
    Ok(results.into_inner().unwrap_or_default().into_iter().flatten().collect())
}

/// Prepares the output directory: refuses to clobber a checkpoint unless asked, and removes the
/// commit marker first so a half-replaced checkpoint never looks complete.
fn prepare_dir(out: &Path, format: OutputFormat, overwrite: bool) -> Result<(), ExecuteError> {
    fs::create_dir_all(out).map_err(io_err(out, "create output directory"))?;
    let marker = out.join(".metadata");
    let existing: Vec<PathBuf> = fs::read_dir(out)
        .map_err(io_err(out, "list output directory"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name == ".metadata" || name.ends_with(".distcp") || name.ends_with(".safetensors")
        })
        .collect();
    if !existing.is_empty() {
        if !overwrite {
            let what = if marker.exists() { ".metadata" } else { "rank files" };
            return Err(ExecuteError::Exists(out.to_path_buf(), what));
        }
        if marker.exists() {
            fs::remove_file(&marker).map_err(io_err(&marker, "remove old .metadata"))?;
        }
        for p in existing {
            if p != marker {
                fs::remove_file(&p).map_err(io_err(&p, "remove old rank file"))?;
            }
        }
    }
    let _ = format;
    Ok(())
}

/// Writes the checkpoint of `plan` from `release` into `out`.
pub fn write_checkpoint(
    plan: &Plan,
    release: &Release,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    write_checkpoint_from(&PlanTable::new(plan), &SourceMap::new(plan, release)?, out, options, progress)
}

/// Writes the checkpoint of a plan, frozen as `plan`, into `out`, reading through `sources`:
/// a caller that drops the [`Plan`] first copies in the memory of the table alone.
pub fn write_checkpoint_from(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    prepare_dir(out, options.format, options.overwrite)?;
    let result = match options.format {
        OutputFormat::Dcp => write_dcp(plan, sources, out, options, progress),
        OutputFormat::DcpSafetensors => write_dcp_safetensors(plan, sources, out, options, progress),
    };
    if result.is_err() {
        // Leave nothing that could be mistaken for output: no marker was written; drop rank files.
        if let Ok(entries) = fs::read_dir(out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".distcp") || name.ends_with(".safetensors") || name.starts_with(".metadata") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
    }
    result
}

/// One DCP item of a rank file: a written chunk, where it goes, and its archive framing.
struct DcpItem {
    tensor: usize,
    chunk: Chunk,
    offset: u64,
    length: u64,
    /// Index into [`DcpLayout::archives`].
    archive: usize,
}

/// What every rank file holds and where, known before any byte is written (the archive of a
/// chunk depends only on its dtype and shape). Items are recomputed from the plan as each file
/// is written, so the layout holds a few numbers per rank and per distinct chunk shape, however
/// many chunks the checkpoint has.
struct DcpLayout {
    /// Archives and their trailer with CRC 0, by `(dtype, chunk sizes)`; most chunks share a few.
    archives: Vec<(TensorArchive, Vec<u8>)>,
    archive_of: HashMap<(DType, Vec<u64>), usize>,
    file_lens: Vec<u64>,
    items: u64,
}

impl DcpLayout {
    fn new(plan: &PlanTable) -> DcpLayout {
        let mut layout =
            DcpLayout { archives: Vec::new(), archive_of: HashMap::new(), file_lens: Vec::new(), items: 0 };
        for rank in 0..plan.world() {
            for (tensor, _, chunk) in plan.rank_chunks(rank) {
                layout.add_archive(plan.tensor(tensor).dtype, &chunk.sizes);
                layout.items += 1;
            }
        }
        layout.file_lens = (0..plan.world() as usize)
            .map(|r| layout.rank(plan, r).last().map_or(0, |i| i.offset + i.length))
            .collect();
        layout
    }

    /// Adds the framing of a chunk shape the first time it is seen.
    fn add_archive(&mut self, dtype: DType, sizes: &[u64]) {
        let key = (dtype, sizes.to_vec());
        if !self.archive_of.contains_key(&key) {
            let a = TensorArchive::new(dtype, sizes);
            let trailer = a.suffix(0);
            self.archives.push((a, trailer));
            self.archive_of.insert(key, self.archives.len() - 1);
        }
    }

    /// The items of `rank`'s file, in order.
    fn rank<'a>(&'a self, plan: &'a PlanTable, rank: usize) -> impl Iterator<Item = DcpItem> + 'a {
        let mut offset = 0u64;
        plan.rank_chunks(rank as u64).map(move |(tensor, _, chunk)| {
            let archive = self.archive_of[&(plan.tensor(tensor).dtype, chunk.sizes.clone())];
            let length = self.archives[archive].0.total_len();
            let item = DcpItem { tensor, chunk, offset, length, archive };
            offset += length;
            item
        })
    }

    fn file_len(&self, rank: usize) -> u64 {
        self.file_lens[rank]
    }

    fn world(&self) -> usize {
        self.file_lens.len()
    }

    /// Streams the checkpoint's `.metadata` to `sink` straight from the plan, so its size never
    /// sits in memory; chunks are listed in rank order, as torch does.
    fn write_metadata<W: io::Write>(&self, plan: &PlanTable, sink: W) -> io::Result<W> {
        let mut e = MetadataEncoder::new(sink);
        for t in plan.tensors() {
            let mut listed: Vec<Chunk> = t.chunks(&plan.mesh).filter(|c| c.written && c.numel() > 0).collect();
            listed.sort_by_key(|c| c.rank);
            let chunks = listed.iter().map(|c| (c.offsets.as_slice(), c.sizes.as_slice()));
            e.entry(t.key, EntryRef::Tensor { dtype: t.dtype, size: t.shape, chunks })?;
        }
        e.begin_planner_data();
        for t in plan.tensors() {
            e.planner_path(t.key, &planner_path(t.key))?;
        }
        e.begin_storage_data();
        for rank in 0..self.world() {
            let name = dcp_rank_file(rank as u64);
            for item in self.rank(plan, rank) {
                e.storage(&StorageRef {
                    fqn: plan.tensor(item.tensor).key,
                    chunk_offset: Some(&item.chunk.offsets),
                    relative_path: &name,
                    offset: item.offset,
                    length: item.length,
                    transform_descriptors: None,
                })?;
            }
        }
        e.finish(None)
    }
}

fn layout_mismatch(path: &Path, what: &str) -> ExecuteError {
    ExecuteError::Io {
        path: path.to_path_buf(),
        action: "write rank file",
        error: io::Error::other(format!("internal error: {what} differs from the precomputed layout")),
    }
}

/// Writes one DCP rank file at `path`; returns its length.
fn write_dcp_rank(
    plan: &PlanTable,
    layout: &DcpLayout,
    rank: usize,
    path: PathBuf,
    data: &DataPath<'_>,
    syncer: &mpsc::Sender<SyncJob>,
    progress: &Progress,
) -> Result<u64, ExecuteError> {
    let mut file = RankFile::create(path, data, syncer)?;
    for item in layout.rank(plan, rank) {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(ExecuteError::Cancelled);
        }
        write_item(plan, layout, &item, &mut file, progress)?;
    }
    file.finish()
}

/// Column stripes of the same rows of one tensor held by different ranks (row-parallel weights
/// under TP or expert TP): their full rows are read once and each rank's columns written from
/// there, instead of each rank reading its columns with the other ranks' columns as gaps. The
/// ranks whose stripes meet are written by one writer, their files advancing together, so the
/// members of a set are the files whose next items are stripes of the same rows.
struct StripeSets {
    /// Whether stripes are gathered across the files of a unit (otherwise rank by rank).
    shared: bool,
    /// Ranks written together by one writer: those linked by sets (a TP group), or each alone.
    units: Vec<Vec<usize>>,
}

/// Whether `item` is a column stripe that a stripe set can gather: plain bytes (a read lands
/// where it is written, untransformed).
fn is_stripe(t: TensorView<'_>, c: &Chunk) -> bool {
    let stripe = t.shape.len() >= 2 && !(c.offsets[1] == 0 && c.sizes[1] == t.shape[1]);
    let plain = t.recipe.iter().all(|b| b.transform == Transform::Identity);
    stripe && plain
}

impl StripeSets {
    fn new(plan: &PlanTable, threads: usize) -> StripeSets {
        let world = plan.world() as usize;
        // Ranks holding stripes of the same rows of a tensor (each rank once) form a set; the
        // ranks a set links are written by one writer (union-find), tensor by tensor so that
        // nothing is kept per chunk.
        let mut parent: Vec<usize> = (0..world).collect();
        fn root(parent: &mut [usize], mut r: usize) -> usize {
            while parent[r] != r {
                parent[r] = parent[parent[r]];
                r = parent[r];
            }
            r
        }
        let mut any_set = false;
        for t in plan.tensors().filter(|t| t.shape.len() >= 2) {
            let mut stripes: Vec<(u64, u64, usize)> = t
                .chunks(&plan.mesh)
                .filter(|c| c.written && c.numel() > 0 && is_stripe(t, c))
                .map(|c| (c.offsets[0], c.sizes[0], c.rank as usize))
                .collect();
            stripes.sort_unstable();
            for set in stripes.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
                if set.len() >= 2 && set.windows(2).all(|w| w[0].2 < w[1].2) {
                    any_set = true;
                    for w in set.windows(2) {
                        let (a, b) = (root(&mut parent, w[0].2), root(&mut parent, w[1].2));
                        parent[a.max(b)] = a.min(b);
                    }
                }
            }
        }
        let mut units: Vec<Vec<usize>> = Vec::new();
        let mut unit_of: HashMap<usize, usize> = HashMap::new();
        for rank in 0..world {
            let r = root(&mut parent, rank);
            let u = *unit_of.entry(r).or_insert_with(|| {
                units.push(Vec::new());
                units.len() - 1
            });
            units[u].push(rank);
        }
        // Sharing reads must not cost parallelism: with fewer units than writers, every rank is
        // its own unit and stripes are gathered rank by rank.
        let mut shared = any_set;
        if units.len() < threads.min(world) {
            shared = false;
            units = (0..world).map(|r| vec![r]).collect();
        }
        StripeSets { shared, units }
    }
}

/// Writes the rank files of one unit; returns `(rank, file length)` for each.
#[allow(clippy::too_many_arguments)]
fn write_dcp_unit(
    plan: &PlanTable,
    layout: &DcpLayout,
    stripes: &StripeSets,
    unit: &[usize],
    out: &Path,
    data: &DataPath<'_>,
    syncer: &mpsc::Sender<SyncJob>,
    progress: &Progress,
) -> Result<Vec<(usize, u64)>, ExecuteError> {
    let mut files = Vec::with_capacity(unit.len());
    for &rank in unit {
        files.push(RankFile::create(out.join(dcp_rank_file(rank as u64)), data, syncer)?);
    }
    let mut next: Vec<_> = unit.iter().map(|&rank| layout.rank(plan, rank).peekable()).collect();
    let mut scratch = Vec::new();
    // The unit's files advance together in tensor order, so the members of a set meet.
    while let Some(k) = (0..unit.len()).filter_map(|k| Some((next[k].peek()?.tensor, k))).min().map(|(_, k)| k) {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(ExecuteError::Cancelled);
        }
        // The stripe set of this item: the files whose next items are stripes of the same rows.
        let members: Vec<usize> = match next[k].peek() {
            Some(item) if stripes.shared && is_stripe(plan.tensor(item.tensor), &item.chunk) => {
                let rows = (item.tensor, item.chunk.offsets[0], item.chunk.sizes[0]);
                (0..unit.len())
                    .filter(|&kk| {
                        next[kk].peek().is_some_and(|other| {
                            (other.tensor, other.chunk.offsets[0], other.chunk.sizes[0]) == rows
                                && is_stripe(plan.tensor(other.tensor), &other.chunk)
                        })
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        if members.len() >= 2 {
            let items: Vec<DcpItem> = members.iter().filter_map(|&kk| next[kk].next()).collect();
            write_stripe_set(plan, layout, &mut files, &members, &items, &mut scratch, data, progress)?;
        } else if let Some(item) = next[k].next() {
            write_item(plan, layout, &item, &mut files[k], progress)?;
        }
    }
    let mut lengths = Vec::with_capacity(unit.len());
    for (file, &rank) in files.into_iter().zip(unit) {
        lengths.push((rank, file.finish()?));
        progress.files_done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(lengths)
}

/// Starts an item: checks its place and writes the archive's header bytes.
fn begin_item(layout: &DcpLayout, item: &DcpItem, file: &mut RankFile<'_>) -> Result<(), ExecuteError> {
    if file.pos() != item.offset {
        return Err(layout_mismatch(&file.path, "an item offset"));
    }
    file.write(layout.archives[item.archive].0.prefix())?;
    file.begin_data();
    Ok(())
}

/// Ends an item: its CRC when asked for, the archive's trailer, and a check of its length.
fn end_item(
    layout: &DcpLayout,
    item: &DcpItem,
    file: &mut RankFile<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let (archive, trailer) = &layout.archives[item.archive];
    if file.data.zip_crc32 {
        let crc = file.end_data()?;
        file.patch(item.offset + archive.crc_offset(), &crc.to_le_bytes())?;
        file.write(&archive.suffix(crc))?;
    } else {
        file.write(trailer)?;
    }
    if file.pos() != item.offset + item.length {
        return Err(layout_mismatch(&file.path, "an item length"));
    }
    progress.chunks_written.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Writes one item, segment by segment.
fn write_item(
    plan: &PlanTable,
    layout: &DcpLayout,
    item: &DcpItem,
    file: &mut RankFile<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let t = plan.tensor(item.tensor);
    let c = &item.chunk;
    begin_item(layout, item, file)?;
    for Segment { source, len, transform } in segments(t.shape, t.dtype, t.recipe, &c.offsets, &c.sizes) {
        match source {
            Some((id, off)) => file.copy(id, off, len, transform, t.dtype)?,
            None => file.zeros(len)?,
        }
        progress.bytes_written.fetch_add(len, Ordering::Relaxed);
    }
    end_item(layout, item, file, progress)
}

/// Writes the items of a stripe set, `items[j]` being the next item of `files[ks[j]]`: each batch
/// of full rows is read once, by one `preadv` that scatters every row's columns straight into
/// the buffers of the files holding them (and columns no member holds into `scratch`).
#[allow(clippy::too_many_arguments)]
fn write_stripe_set(
    plan: &PlanTable,
    layout: &DcpLayout,
    files: &mut [RankFile<'_>],
    ks: &[usize],
    items: &[DcpItem],
    scratch: &mut Vec<u8>,
    data: &DataPath<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let t = plan.tensor(items[0].tensor);
    let itemsize = t.dtype.size() as u64;
    let row_bytes = row_elems(t.shape) * itemsize;
    let column_bytes = t.shape[2..].iter().product::<u64>() * itemsize;
    // `(first byte in the row, bytes, file)` of each member's columns, in column order.
    let mut columns: Vec<(u64, u64, usize)> = ks
        .iter()
        .zip(items)
        .map(|(&k, item)| (item.chunk.offsets[1] * column_bytes, item.chunk.sizes[1] * column_bytes, k))
        .collect();
    columns.sort_unstable();
    let held: u64 = columns.iter().map(|c| c.1).sum();
    let gap_per_row = row_bytes - held.min(row_bytes);
    let disjoint = columns.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
    // A buffer per member and one per run of columns between members (or rows).
    let between = columns.windows(2).filter(|w| w[0].0 + w[0].1 < w[1].0).count();
    let iovecs_per_row = columns.len() + between + 1;
    if !disjoint
        || gap_per_row > GAP_SCRATCH as u64
        || iovecs_per_row > MAX_IOVECS
        || columns.iter().any(|c| c.1 > data.buffer_bytes as u64)
    {
        // Not one read's worth (overlapping replicas, far-apart, very wide or very many
        // stripes): each file reads its own columns.
        for (&k, item) in ks.iter().zip(items) {
            write_item(plan, layout, item, &mut files[k], progress)?;
        }
        return Ok(());
    }
    let first = &items[0].chunk;
    let mut full_offsets = vec![0; t.shape.len()];
    full_offsets[0] = first.offsets[0];
    let mut full_sizes = t.shape.to_vec();
    full_sizes[0] = first.sizes[0];
    for (&k, item) in ks.iter().zip(items) {
        begin_item(layout, item, &mut files[k])?;
    }
    // The full-width rows are whole rows of sources or zeros, segment by segment.
    for Segment { source, len, .. } in segments(t.shape, t.dtype, t.recipe, &full_offsets, &full_sizes) {
        let (nrows, mut row) = (len / row_bytes, 0u64);
        while row < nrows {
            let mut batch = (nrows - row).min((MAX_IOVECS / iovecs_per_row).max(1) as u64);
            if gap_per_row > 0 {
                batch = batch.min(GAP_SCRATCH as u64 / gap_per_row);
            }
            for &(_, width, k) in &columns {
                if (files[k].free() as u64) < width {
                    files[k].flush()?;
                }
                batch = batch.min(files[k].free() as u64 / width);
            }
            match source {
                Some((id, off)) => {
                    let from = off + row * row_bytes;
                    scatter_rows(files, &columns, data, (id, from), batch, row_bytes, gap_per_row, scratch)?
                }
                None => {
                    for &(_, width, k) in &columns {
                        files[k].zeros(batch * width)?;
                    }
                }
            }
            progress.bytes_written.fetch_add(batch * held, Ordering::Relaxed);
            row += batch;
        }
    }
    for (&k, item) in ks.iter().zip(items) {
        end_item(layout, item, &mut files[k], progress)?;
    }
    Ok(())
}

/// Reads `batch` full rows of source `id` from byte `from` with one `preadv`: each row's
/// `columns` go to the end of their file's buffer, the bytes between them to `scratch`.
#[allow(clippy::too_many_arguments)]
fn scatter_rows(
    files: &mut [RankFile<'_>],
    columns: &[(u64, u64, usize)],
    data: &DataPath<'_>,
    (id, from): (usize, u64),
    batch: u64,
    row_bytes: u64,
    gap_per_row: u64,
    scratch: &mut Vec<u8>,
) -> Result<(), ExecuteError> {
    let first_col = columns[0].0;
    let (last_col, last_width, _) = columns[columns.len() - 1];
    // From the first member's first byte of the first row to the last member's last byte of the
    // last row.
    let span = (batch - 1) * row_bytes + last_col + last_width - first_col;
    let (fi, at) = data.sources.locate(id, from + first_col, span);
    let gaps = (gap_per_row * batch) as usize;
    if scratch.len() < gaps {
        scratch.resize(gaps, 0);
    }
    let mut place: Vec<usize> = vec![usize::MAX; files.len()];
    for (j, c) in columns.iter().enumerate() {
        place[c.2] = j;
    }
    // Each member's room in its buffer, cut into one piece per row.
    let mut rooms: Vec<(usize, std::slice::ChunksExactMut<'_, u8>)> = files
        .iter_mut()
        .enumerate()
        .filter(|(k, _)| place[*k] != usize::MAX)
        .map(|(k, f)| {
            let width = columns[place[k]].1 as usize;
            let start = f.fill;
            (place[k], f.buf[start..start + batch as usize * width].chunks_exact_mut(width))
        })
        .collect();
    rooms.sort_unstable_by_key(|r| r.0);
    let mut spare: &mut [u8] = &mut scratch[..gaps];
    let mut take_gap = |n: u64| {
        let (g, rest) = std::mem::take(&mut spare).split_at_mut(n as usize);
        spare = rest;
        IoSliceMut::new(g)
    };
    let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(2 * columns.len() * batch as usize);
    for row in 0..batch {
        for (j, room) in rooms.iter_mut() {
            let (col, width, _) = columns[*j];
            // Before a member: the columns since the previous one (or since the end of the
            // previous row's last member).
            let gap = if *j == 0 {
                if row == 0 {
                    0
                } else {
                    row_bytes - (last_col + last_width) + first_col
                }
            } else {
                let (prev_col, prev_width, _) = columns[*j - 1];
                col - (prev_col + prev_width)
            };
            if gap > 0 {
                iov.push(take_gap(gap));
            }
            if let Some(piece) = room.next() {
                debug_assert_eq!(piece.len() as u64, width);
                iov.push(IoSliceMut::new(piece));
            }
        }
    }
    let (path, source) = &data.sources.files[fi];
    preadv_exact(source, &mut iov, at).map_err(io_err(path, "read release tensor"))?;
    drop(iov);
    for &(_, width, k) in columns {
        files[k].fill += (batch * width) as usize;
    }
    Ok(())
}

/// Fills every buffer of `iov` from `file` at `at`, resuming after short reads.
fn preadv_exact(file: &File, mut iov: &mut [IoSliceMut<'_>], mut at: u64) -> io::Result<()> {
    while !iov.is_empty() {
        match rustix::io::preadv(file, iov, at) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                at += n as u64;
                IoSliceMut::advance_slices(&mut iov, n);
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// DCP: rank files written by `options.threads` writers and synced by the sync thread while
/// another thread encodes and stages `.metadata`; the rename that commits comes after every sync.
fn write_dcp(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let layout = DcpLayout::new(plan);
    let stripes = StripeSets::new(plan, options.threads);
    let world = plan.world() as usize;
    let data = DataPath::new(sources, options);
    let (sync_tx, sync_rx) = mpsc::channel();
    let (written, synced, staged) = std::thread::scope(|s| {
        let syncer = s.spawn(move || run_syncer(sync_rx));
        let metadata = s.spawn(|| stage_metadata(out, &layout, plan));
        let written = {
            let tx = sync_tx; // dropped when the writers are done, which ends the sync thread
            for_each_unit(stripes.units.len(), options.threads, progress, |u| {
                write_dcp_unit(plan, &layout, &stripes, &stripes.units[u], out, &data, &tx, progress)
            })
        };
        (written, syncer.join(), metadata.join())
    });
    let mut lengths = vec![0u64; world];
    for (rank, len) in written?.into_iter().flatten() {
        lengths[rank] = len;
    }
    let stopped = || ExecuteError::Io {
        path: out.to_path_buf(),
        action: "sync rank files",
        error: io::Error::other("the sync thread stopped early"),
    };
    match synced {
        Ok(Ok(n)) if n == world => {}
        Ok(Err(e)) => return Err(e),
        _ => return Err(stopped()),
    }
    staged.map_err(|_| stopped())??;
    for (rank, len) in lengths.iter().enumerate() {
        if *len != layout.file_len(rank) {
            return Err(layout_mismatch(&out.join(dcp_rank_file(rank as u64)), "the file length"));
        }
    }
    publish_metadata(out)?;
    Ok(WriteReport {
        files: (0..world).map(|r| out.join(dcp_rank_file(r as u64))).collect(),
        tensor_bytes: plan.bytes_per_rank().iter().sum(),
        file_bytes: lengths.iter().sum(),
        chunks: layout.items,
        kernel_copy_bytes: data.kernel_copied.load(Ordering::Relaxed),
    })
}

/// Writes `.metadata.tmp` and syncs it; [`publish_metadata`] renames it into place.
fn stage_metadata(out: &Path, layout: &DcpLayout, plan: &PlanTable) -> Result<(), ExecuteError> {
    let tmp = out.join(".metadata.tmp");
    let f = File::create(&tmp).map_err(io_err(&tmp, "create .metadata.tmp"))?;
    let f = layout.write_metadata(plan, f).map_err(io_err(&tmp, "write .metadata.tmp"))?;
    f.sync_all().map_err(io_err(&tmp, "sync .metadata.tmp"))?;
    Ok(())
}

/// Renames the synced `.metadata.tmp` into place and syncs the directory: the checkpoint's commit
/// point, reached only once every rank file is complete and synced.
fn publish_metadata(out: &Path) -> Result<(), ExecuteError> {
    let tmp = out.join(".metadata.tmp");
    let fin = out.join(".metadata");
    let dir = File::open(out).map_err(io_err(out, "open output directory"))?;
    // The rank files' names first: without a journal (ext4 nojournal, some network
    // filesystems) nothing orders their creation before the rename.
    dir.sync_all().map_err(io_err(out, "sync output directory"))?;
    fs::rename(&tmp, &fin).map_err(io_err(&fin, "rename .metadata.tmp into place"))?;
    dir.sync_all().map_err(io_err(out, "sync output directory"))?;
    Ok(())
}

/// Writes one DCP-safetensors rank file (through a temporary name); returns `(path, length, chunks)`.
fn write_safetensors_rank(
    plan: &PlanTable,
    rank: usize,
    out: &Path,
    sources: &SourceMap,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<(PathBuf, u64, u64), ExecuteError> {
    let world = plan.world() as usize;
    let name = dcp_safetensors_rank_file(rank as u64, world as u64);
    let items: Vec<(usize, Chunk)> = plan.rank_chunks(rank as u64).map(|(ti, _, c)| (ti, c)).collect();
    let sharding: serde_json::Map<String, serde_json::Value> = items
        .iter()
        .map(|(ti, c)| (plan.tensor(*ti).key.to_string(), serde_json::json!({ "saved_offsets": c.offsets })))
        .collect();
    let metadata = [
        ("DCP_SHARDING_INFO".to_string(), serde_json::Value::Object(sharding).to_string()),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("format".to_string(), "pt".to_string()),
    ]
    .into_iter()
    .collect();
    let layout = FileLayout::new(
        items.iter().map(|(ti, c)| {
            let t = plan.tensor(*ti);
            (t.key, t.dtype, c.sizes.as_slice())
        }),
        &metadata,
    )?;
    let mut writer = SafetensorsWriter::create(out.join(&name), layout)?;
    let mut buf = vec![0u8; options.buffer_bytes];
    let mut pending: Vec<u8> = Vec::with_capacity(options.buffer_bytes);
    for (ti, c) in &items {
        let t = plan.tensor(*ti);
        stream_chunk(t, &c.offsets, &c.sizes, sources, &mut buf, |b| {
            progress.bytes_written.fetch_add(b.len() as u64, Ordering::Relaxed);
            if pending.len() + b.len() > pending.capacity() {
                writer.write_next(&pending)?;
                pending.clear();
            }
            if b.len() >= pending.capacity() {
                writer.write_next(b)?;
            } else {
                pending.extend_from_slice(b);
            }
            Ok(())
        })?;
        progress.chunks_written.fetch_add(1, Ordering::Relaxed);
    }
    writer.write_next(&pending)?;
    let path = writer.finish()?;
    let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    Ok((path, len, items.len() as u64))
}

fn write_dcp_safetensors(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let world = plan.world() as usize;
    let per_rank = for_each_unit(world, options.threads, progress, |rank| {
        let written = write_safetensors_rank(plan, rank, out, sources, options, progress)?;
        progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(written)
    })?;
    let mut report = WriteReport { files: Vec::new(), tensor_bytes: 0, file_bytes: 0, chunks: 0, kernel_copy_bytes: 0 };
    for (path, len, n) in per_rank {
        report.files.push(path);
        report.file_bytes += len;
        report.chunks += n;
    }
    report.tensor_bytes = plan.bytes_per_rank().iter().sum();
    Ok(report)
}

/// Writes rank `rank`'s file of `plan` into `dir` — one task of a distributed run. The file is
/// written under a temporary name, synced, and renamed into place, so a killed writer never
/// leaves a rank file that looks complete. Returns the file's length.
pub fn write_rank_file(
    plan: &Plan,
    release: &Release,
    dir: &Path,
    rank: u64,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<u64, ExecuteError> {
    let sources = SourceMap::new(plan, release)?;
    let plan = &PlanTable::new(plan);
    fs::create_dir_all(dir).map_err(io_err(dir, "create output directory"))?;
    match options.format {
        OutputFormat::Dcp => {
            let layout = DcpLayout::new(plan);
            let name = dcp_rank_file(rank);
            let tmp = dir.join(format!(".{name}.partial"));
            let data = DataPath::new(&sources, options);
            let (sync_tx, sync_rx) = mpsc::channel();
            let (written, synced) = std::thread::scope(|s| {
                let syncer = s.spawn(move || run_syncer(sync_rx));
                let written = write_dcp_rank(plan, &layout, rank as usize, tmp.clone(), &data, &sync_tx, progress);
                drop(sync_tx);
                (written, syncer.join())
            });
            let len = match written {
                Ok(len) => len,
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    return Err(e);
                }
            };
            match synced {
                Ok(Ok(1)) => {}
                Ok(Err(e)) => return Err(e),
                _ => return Err(io_err(&tmp, "sync rank file")(io::Error::other("the sync thread stopped early"))),
            }
            if len != layout.file_len(rank as usize) {
                return Err(layout_mismatch(&tmp, "the file length"));
            }
            let fin = dir.join(&name);
            fs::rename(&tmp, &fin).map_err(io_err(&fin, "rename rank file into place"))?;
            Ok(len)
        }
        OutputFormat::DcpSafetensors => {
            let (_, len, _) = write_safetensors_rank(plan, rank as usize, dir, &sources, options, progress)?;
            Ok(len)
        }
    }
}

/// Commits a checkpoint whose rank files [`write_rank_file`] wrote into `dir`: checks that every
/// rank file is there with the length the plan implies, then (DCP) writes `.metadata` through
/// `.metadata.tmp` + fsync + rename. Needs no state from the writers: the layout follows from the
/// plan alone.
pub fn commit_checkpoint(plan: &Plan, dir: &Path, options: &ExecuteOptions) -> Result<(), ExecuteError> {
    let plan = &PlanTable::new(plan);
    let world = plan.world() as usize;
    match options.format {
        OutputFormat::Dcp => {
            let layout = DcpLayout::new(plan);
            for rank in 0..world {
                let path = dir.join(dcp_rank_file(rank as u64));
                let len = fs::metadata(&path).map_err(io_err(&path, "check rank file"))?.len();
                if len != layout.file_len(rank) {
                    return Err(ExecuteError::Io {
                        path,
                        action: "check rank file",
                        error: io::Error::other(format!("{len} bytes, the plan implies {}", layout.file_len(rank))),
                    });
                }
            }
            stage_metadata(dir, &layout, plan)?;
            publish_metadata(dir)
        }
        OutputFormat::DcpSafetensors => {
            for rank in 0..world {
                let path = dir.join(dcp_safetensors_rank_file(rank as u64, world as u64));
                crate::safetensors::read_header(&path)?;
            }
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync output directory"))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use shardline_layout::{build_plan, Mesh, ModelConfig, PlanOptions, SourceTensor};

    use super::*;
    use crate::dcp_metadata::{
        self, decode_metadata, encode_metadata, ChunkMeta, EntryMeta, Metadata, StorageInfo, StorageKey,
    };
    use crate::torch_save::read_tensor_archive;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
    }

    fn plan(release: &Release, mesh: Mesh, optimizer_state: bool) -> Plan {
        let config = ModelConfig::from_json(release.config_json()).unwrap();
        let sources = release
            .tensors()
            .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
            .collect();
        let options = PlanOptions { optimizer_state, ..PlanOptions::default() };
        build_plan(&config, sources, mesh, &options).unwrap()
    }

    /// Converts into a fresh directory; every file's bytes, by name, and the report.
    fn convert(release: &Release, plan: &Plan, options: &ExecuteOptions) -> (BTreeMap<String, Vec<u8>>, WriteReport) {
        let dir = tempfile::tempdir().unwrap();
        let report = write_checkpoint(plan, release, dir.path(), options, &Progress::default()).unwrap();
        let files = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap())
            .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap()))
            .collect();
        (files, report)
    }

    fn meshes() -> Vec<(&'static str, Mesh, bool)> {
        let m = |tp, dp, ep| Mesh { tp, cp: 1, dp, ep, etp: tp };
        vec![
            ("llama", m(2, 2, 1), true),
            ("qwen3_moe", m(2, 2, 2), false),
            ("qwen3_moe", Mesh { etp: 1, ..m(2, 3, 2) }, true),
            ("qwen3_next", m(2, 1, 1), false),
        ]
    }

    #[test]
    fn rank_by_rank_writes_and_a_separate_commit_equal_a_whole_write() {
        for (name, mesh, optimizer_state) in meshes() {
            let release = Release::open(fixture(name)).unwrap();
            let plan = plan(&release, mesh, optimizer_state);
            for format in [OutputFormat::Dcp, OutputFormat::DcpSafetensors] {
                let options = ExecuteOptions { format, ..ExecuteOptions::default() };
                let (whole, _) = convert(&release, &plan, &options);
                let dir = tempfile::tempdir().unwrap();
                // Ranks in reverse order, as independent tasks would finish in any order.
                for rank in (0..plan.world()).rev() {
                    write_rank_file(&plan, &release, dir.path(), rank, &options, &Progress::default()).unwrap();
                }
                assert!(!dir.path().join(".metadata").exists(), "no commit marker before the commit");
                commit_checkpoint(&plan, dir.path(), &options).unwrap();
                let parts: BTreeMap<String, Vec<u8>> = fs::read_dir(dir.path())
                    .unwrap()
                    .map(|e| e.unwrap())
                    .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap()))
                    .collect();
                assert_eq!(
                    parts.keys().collect::<Vec<_>>(),
                    whole.keys().collect::<Vec<_>>(),
                    "{name} {mesh} {format:?}"
                );
                assert!(parts == whole, "{name} {mesh} {format:?}: bytes differ");
            }
        }
    }

    /// The `.metadata` the plan implies, built as a whole [`Metadata`] the plain way.
    fn whole_metadata(layout: &DcpLayout, plan: &Plan) -> Metadata {
        let mut storage_data = Vec::new();
        let mut chunk_lists: Vec<Vec<ChunkMeta>> = vec![Vec::new(); plan.tensors.len()];
        for rank in 0..layout.world() {
            for item in layout.rank(&PlanTable::new(plan), rank) {
                let t = &plan.tensors[item.tensor];
                let c = &item.chunk;
                chunk_lists[item.tensor].push(ChunkMeta { offsets: c.offsets.clone(), sizes: c.sizes.clone() });
                let key = StorageKey { fqn: t.key.clone(), offset: Some(c.offsets.clone()) };
                let info = StorageInfo {
                    relative_path: dcp_rank_file(rank as u64),
                    offset: item.offset,
                    length: item.length,
                    transform_descriptors: None,
                };
                storage_data.push((key, info));
            }
        }
        let state_dict_metadata = plan
            .tensors
            .iter()
            .zip(chunk_lists)
            .map(|(t, chunks)| (t.key.clone(), EntryMeta::Tensor { dtype: t.dtype, size: t.shape.clone(), chunks }))
            .collect();
        let planner_data = plan.tensors.iter().map(|t| (t.key.clone(), planner_path(&t.key))).collect();
        Metadata { state_dict_metadata, storage_data, planner_data, version: None }
    }

    #[test]
    fn streamed_metadata_equals_the_whole_encoding() {
        for (name, mesh, optimizer_state) in meshes() {
            let release = Release::open(fixture(name)).unwrap();
            let plan = plan(&release, mesh, optimizer_state);
            let layout = DcpLayout::new(&PlanTable::new(&plan));
            let streamed = layout.write_metadata(&PlanTable::new(&plan), Vec::new()).unwrap();
            let whole = whole_metadata(&layout, &plan);
            assert!(whole.storage_data.len() > plan.tensors.len(), "{name} {mesh}");
            assert!(streamed == encode_metadata(&whole), "{name} {mesh}: bytes differ");
            assert_eq!(decode_metadata(&streamed).unwrap(), whole, "{name} {mesh}");
        }
    }

    #[test]
    fn commit_refuses_a_missing_or_short_rank_file() {
        let release = Release::open(fixture("llama")).unwrap();
        let plan = plan(&release, Mesh::new(1, 1, 2, 1), false);
        let options = ExecuteOptions::default();
        let dir = tempfile::tempdir().unwrap();
        write_rank_file(&plan, &release, dir.path(), 0, &options, &Progress::default()).unwrap();
        let err = commit_checkpoint(&plan, dir.path(), &options).unwrap_err().to_string();
        assert!(err.contains("__1_0.distcp"), "{err}");
        write_rank_file(&plan, &release, dir.path(), 1, &options, &Progress::default()).unwrap();
        let f = dir.path().join("__1_0.distcp");
        let len = fs::metadata(&f).unwrap().len();
        fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 1).unwrap();
        let err = commit_checkpoint(&plan, dir.path(), &options).unwrap_err().to_string();
        assert!(err.contains("the plan implies"), "{err}");
        assert!(!dir.path().join(".metadata").exists());
    }

    #[test]
    fn kernel_copy_and_read_paths_write_identical_bytes() {
        for (name, mesh, optimizer_state) in meshes() {
            let release = Release::open(fixture(name)).unwrap();
            let plan = plan(&release, mesh, optimizer_state);
            let what = format!("{name} {mesh}");
            let base = ExecuteOptions { copy_file_range: false, threads: 2, ..ExecuteOptions::default() };
            let (want, report) = convert(&release, &plan, &base);
            assert_eq!(report.kernel_copy_bytes, 0, "{what}");
            assert!(want.contains_key(".metadata") && !want.contains_key(".metadata.tmp"), "{what}");
            let variants = [
                // Every plain segment copied by the kernel.
                ExecuteOptions { copy_min_bytes: 1, ..base.clone() }.with_kernel_copy(),
                // Mixed: larger segments by the kernel, the rest gathered through a tiny,
                // odd-sized buffer (many flushes mid-segment and mid-gather).
                ExecuteOptions { copy_min_bytes: 700, buffer_bytes: 4099, threads: 3, ..base.clone() }
                    .with_kernel_copy(),
                // The read path alone with the tiny buffer.
                ExecuteOptions { buffer_bytes: 4096, threads: 1, ..base.clone() },
            ];
            for options in variants {
                let (got, report) = convert(&release, &plan, &options);
                if options.copy_file_range {
                    // /tmp's filesystem copies in the kernel (ext4, xfs, btrfs, tmpfs all do).
                    assert!(report.kernel_copy_bytes > 0, "{what}: {options:?}");
                }
                assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}");
                for (file, bytes) in &want {
                    assert!(got[file] == *bytes, "{what}: {file} differs with {options:?}");
                }
            }
        }
    }

    #[test]
    fn column_stripes_of_tp_peers_are_written_together() {
        let release = Release::open(fixture("qwen3_moe")).unwrap();
        let plan = plan(&release, Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 }, false);
        let plan = PlanTable::new(&plan);
        let shared = StripeSets::new(&plan, 2);
        assert!(shared.shared);
        assert_eq!(shared.units, vec![vec![0, 1], vec![2, 3]]);
        // More writers than groups: each rank alone, stripes gathered per rank.
        let alone = StripeSets::new(&plan, 4);
        assert!(!alone.shared);
        assert_eq!(alone.units.len(), 4);
    }

    #[test]
    fn a_release_consumed_into_sources_converts_as_the_release_does() {
        let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 };
        let release = Release::open(fixture("qwen3_moe")).unwrap();
        let planned = plan(&release, mesh, false);
        let options = ExecuteOptions { threads: 2, ..ExecuteOptions::default() };
        let (want, _) = convert(&release, &planned, &options);
        let config = ModelConfig::from_json(release.config_json()).unwrap();
        let (sources, locations) = release.into_sources();
        assert_eq!(sources, planned.sources, "the same sources, in the same order");
        let plan = build_plan(&config, sources, mesh, &PlanOptions::default()).unwrap();
        let mut short = locations.clone();
        short.tensors.pop();
        assert!(matches!(
            SourceMap::open(&plan, short),
            Err(ExecuteError::SourceCount { planned, located }) if located + 1 == planned
        ));
        let map = SourceMap::open(&plan, locations).unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint_from(&PlanTable::new(&plan), &map, dir.path(), &options, &Progress::default()).unwrap();
        for (file, bytes) in &want {
            assert!(fs::read(dir.path().join(file)).unwrap() == *bytes, "{file}");
        }
    }

    #[test]
    fn stripe_sets_with_columns_between_and_around_them_write_what_ranks_alone_write() {
        let release = Release::open(fixture("qwen3_moe")).unwrap();
        let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 };
        let mut plan = plan(&release, mesh, false);
        // Narrow the TP stripes of the row-parallel dense weights so that source columns lie
        // before, between and after those any rank holds: a set then reads them into scratch.
        let mut narrowed = 0;
        for t in plan.tensors.iter_mut().filter(|t| t.tp_mode == shardline_layout::arch::TpMode::Row) {
            for c in t.listed_chunks(&mesh).iter_mut().filter(|c| c.sizes[1] > 2) {
                c.offsets[1] += 1;
                c.sizes[1] -= 2;
                narrowed += 1;
            }
        }
        assert!(narrowed > 0);
        let base = ExecuteOptions { copy_file_range: false, ..ExecuteOptions::default() };
        // Eight writers for four TP groups: every rank alone, reading its own columns.
        let (alone, _) = convert(&release, &plan, &ExecuteOptions { threads: 8, ..base.clone() });
        let table = PlanTable::new(&plan);
        assert!(!StripeSets::new(&table, 8).shared && StripeSets::new(&table, 2).shared);
        for options in [
            ExecuteOptions { threads: 2, ..base.clone() },
            // A buffer of a few rows: sets flush their files between batches.
            ExecuteOptions { threads: 2, buffer_bytes: 4099, ..base.clone() },
        ] {
            let (together, _) = convert(&release, &plan, &options);
            assert_eq!(together.keys().collect::<Vec<_>>(), alone.keys().collect::<Vec<_>>());
            for (file, bytes) in &alone {
                assert!(together[file] == *bytes, "{file} differs with {options:?}");
            }
        }
    }

    #[test]
    fn zip_crc32_fills_in_the_crcs_and_changes_nothing_else() {
        for (name, mesh, optimizer_state) in meshes() {
            let release = Release::open(fixture(name)).unwrap();
            let plan = plan(&release, mesh, optimizer_state);
            let base = ExecuteOptions { threads: 2, ..ExecuteOptions::default() };
            let (plain, _) = convert(&release, &plan, &base);
            let crc = ExecuteOptions { zip_crc32: true, buffer_bytes: 4099, ..base.clone() };
            let (with_crc, _) = convert(&release, &plan, &crc);
            assert_eq!(with_crc[".metadata"], plain[".metadata"], "{name}: same items at the same places");
            let md = dcp_metadata::decode_metadata(&plain[".metadata"]).unwrap();
            assert!(!md.storage_data.is_empty());
            for (key, info) in &md.storage_data {
                let range = info.offset as usize..(info.offset + info.length) as usize;
                let (a, b) = (&plain[&info.relative_path][range.clone()], &with_crc[&info.relative_path][range]);
                let (ta, tb) =
                    (read_tensor_archive(a, 0, info.length).unwrap(), read_tensor_archive(b, 0, info.length).unwrap());
                let data = ta.data_offset_in_item as usize..(ta.data_offset_in_item + ta.data_len) as usize;
                assert_eq!(a[data.clone()], b[data.clone()], "{name} {}: same data", key.fqn);
                let want = crc32fast::hash(&b[data.clone()]);
                assert_eq!(tb.data_crc32, Some(want), "{name} {}", key.fqn);
                assert_eq!(ta.data_crc32, (want == 0).then_some(0), "{name} {}: no crc computed", key.fqn);
                // Only the data entry's two CRC fields differ: in its local header (just
                // before the data) and in the central directory (after it).
                let archive = TensorArchive::new(ta.dtype, &ta.shape);
                let local = archive.crc_offset() as usize..archive.crc_offset() as usize + 4;
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(x == y || local.contains(&i) || i >= data.end, "{name} {}: byte {i}", key.fqn);
                }
                assert!(a.iter().zip(b).filter(|(x, y)| x != y).count() <= 8);
            }
        }
    }

    impl ExecuteOptions {
        fn with_kernel_copy(self) -> ExecuteOptions {
            ExecuteOptions { copy_file_range: true, ..self }
        }
    }
}
