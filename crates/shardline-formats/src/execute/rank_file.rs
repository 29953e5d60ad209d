//! One rank file being written: a fixed buffer filled by gathered reads, kernel copies of large
//! plain segments, patches of bytes already written, and writeback requested as it grows.

use std::fs::{File, OpenOptions};
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use rustix::io::Errno;
use shardline_layout::recipe::{apply_transform, Transform};
use shardline_layout::TensorView;

use super::*;
use super::{sources::*, threads::*};

/// At most this many buffers in one `preadv` (Linux's `UIO_MAXIOV`; a handful in unit tests, to
/// exercise the batch boundaries on tiny fixtures).
pub(super) const MAX_IOVECS: usize = if cfg!(test) { 11 } else { 1024 };
/// Source bytes between two gathered reads that are read (into scratch) rather than skipped with
/// a new syscall: copying a few KiB costs about what a syscall does.
const MAX_GATHER_GAP: u64 = 8 << 10;
/// Scratch space for those gap bytes, per `preadv`.
pub(super) const GAP_SCRATCH: usize = if cfg!(test) { 300 } else { 256 << 10 };
/// Written bytes of a rank file between two requests to start their writeback.
const SYNC_EVERY: u64 = 32 << 20;

/// A read of release bytes into the buffer, not yet done.
#[derive(Clone, Copy, Debug)]
struct PendingRead {
    pub(super) file: usize,
    src: u64,
    pub(super) at: usize,
    pub(super) len: usize,
}

/// Whether `copy_file_range` failed because this pair of files cannot use it (rather than an I/O
/// error): the read/write path then does the copy.
pub(crate) fn copy_unsupported(e: Errno) -> bool {
    [Errno::XDEV, Errno::NOSYS, Errno::INVAL, Errno::OPNOTSUPP, Errno::PERM, Errno::TXTBSY, Errno::BADF].contains(&e)
}

/// How a rank file gets its bytes, shared by the writer threads.
pub(super) struct DataPath<'a> {
    pub(super) sources: &'a SourceMap,
    /// Cleared, for every thread, the first time the kernel refuses `copy_file_range`.
    kernel_copy: AtomicBool,
    pub(super) copy_min_bytes: u64,
    pub(super) zip_crc32: bool,
    pub(super) buffer_bytes: usize,
    /// Bytes copied by `copy_file_range`.
    pub(super) kernel_copied: AtomicU64,
}

impl<'a> DataPath<'a> {
    pub(super) fn new(sources: &'a SourceMap, options: &ExecuteOptions) -> DataPath<'a> {
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
pub(super) struct RankFile<'a> {
    pub(super) path: PathBuf,
    pub(super) file: Arc<File>,
    pub(super) data: &'a DataPath<'a>,
    pub(super) syncer: &'a mpsc::Sender<SyncJob>,
    /// `flushed` when writeback was last requested.
    sync_requested: u64,
    /// Fixed size; `buf[..fill]` is pending output (some of it awaiting `pending` reads).
    pub(super) buf: Vec<u8>,
    pub(super) fill: usize,
    /// Bytes of the file already written.
    flushed: u64,
    pending: Vec<PendingRead>,
    pub(super) gaps: Vec<u8>,
    /// Reads and converts the source bytes of casts and dequantizations.
    converter: Converter,
    /// While a CRC'd data entry is being written: the hasher, and where in `buf` the bytes not
    /// yet hashed start.
    crc: Option<(crc32fast::Hasher, usize)>,
}

impl<'a> RankFile<'a> {
    pub(super) fn create(
        path: PathBuf,
        data: &'a DataPath<'a>,
        syncer: &'a mpsc::Sender<SyncJob>,
    ) -> Result<RankFile<'a>, ExecuteError> {
        Self::open(path, 0, true, data, syncer)
    }

    /// Continues the rank file at `path` from byte `offset`, leaving the rest of it as it is (a
    /// rank file written a section at a time, the sections perhaps side by side).
    pub(super) fn resume(
        path: PathBuf,
        offset: u64,
        data: &'a DataPath<'a>,
        syncer: &'a mpsc::Sender<SyncJob>,
    ) -> Result<RankFile<'a>, ExecuteError> {
        Self::open(path, offset, false, data, syncer)
    }

    /// Opens the file for writing from `offset`, dropping what it held when `truncate`.
    fn open(
        path: PathBuf,
        offset: u64,
        truncate: bool,
        data: &'a DataPath<'a>,
        syncer: &'a mpsc::Sender<SyncJob>,
    ) -> Result<RankFile<'a>, ExecuteError> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(truncate)
            .open(&path)
            .map_err(io_err(&path, "open rank file"))?;
        Ok(RankFile {
            path,
            file: Arc::new(file),
            data,
            syncer,
            sync_requested: offset,
            buf: vec![0u8; data.buffer_bytes],
            fill: 0,
            flushed: offset,
            pending: Vec::new(),
            gaps: Vec::new(),
            converter: Converter::default(),
            crc: None,
        })
    }

    pub(super) fn pos(&self) -> u64 {
        self.flushed + self.fill as u64
    }

    pub(super) fn free(&self) -> usize {
        self.buf.len() - self.fill
    }

    /// Appends bytes outside a data entry (archive headers and trailers).
    pub(super) fn write(&mut self, bytes: &[u8]) -> Result<(), ExecuteError> {
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
    pub(super) fn begin_data(&mut self) {
        if self.data.zip_crc32 {
            self.crc = Some((crc32fast::Hasher::new(), self.fill));
        }
    }

    /// Ends a data entry; its CRC-32, or 0 without `zip_crc32`.
    pub(super) fn end_data(&mut self) -> Result<u32, ExecuteError> {
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
    pub(super) fn zeros(&mut self, mut len: u64) -> Result<(), ExecuteError> {
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
    pub(super) fn copy(
        &mut self,
        id: usize,
        offset: u64,
        len: u64,
        transform: Transform,
        t: TensorView<'_>,
    ) -> Result<(), ExecuteError> {
        let dtype = t.dtype;
        let out_item = dtype.size();
        if transform.converts() {
            // Source elements of another size (or scaled): read aside, converted into the buffer,
            // in pieces of whole source bytes and scale blocks.
            let unit = transform.piece_elems() as usize * out_item;
            let (mut src, mut left) = (offset, len);
            while left > 0 {
                let whole = left as usize <= self.free();
                if !whole && self.free() < unit {
                    self.flush()?;
                    continue;
                }
                let n = if whole { left as usize } else { self.free() / unit * unit };
                let out = &mut self.buf[self.fill..self.fill + n];
                self.converter.convert(self.data.sources, t, id, src, transform, out)?;
                self.fill += n;
                src += transform.source_bytes(dtype, (n / out_item) as u64);
                left -= n as u64;
            }
            return Ok(());
        }
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
    pub(super) fn patch(&mut self, offset: u64, bytes: &[u8]) -> Result<(), ExecuteError> {
        if offset >= self.flushed {
            let at = (offset - self.flushed) as usize;
            self.buf[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        } else {
            self.file.write_all_at(bytes, offset).map_err(io_err(&self.path, "patch rank file"))
        }
    }

    pub(super) fn flush(&mut self) -> Result<(), ExecuteError> {
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
    pub(super) fn finish(mut self) -> Result<u64, ExecuteError> {
        self.flush()?;
        self.request_writeback(true);
        Ok(self.flushed)
    }
}
