//! Copying byte ranges of source rank files into one output file through a fixed buffer, cast on
//! the way where the target keeps another dtype. A rank file is written front to back in a few
//! large writes; the reads behind them are gathered per source file, however finely the runs of
//! several sources interleave (a row-split weight merged from several TP ranks is a run per row
//! and rank: one `pread` each would cost more than the copy).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use shardline_layout::recipe::cast_into;
use shardline_layout::DType;

use super::write::io_err;
use crate::execute::{copy_unsupported, ExecuteError};

/// Bytes of each writer's copy buffer (and, once a cast is met, of its staging buffer).
const BUFFER_BYTES: usize = 8 << 20;
/// Runs of at least this many bytes are copied file to file by the kernel (`copy_file_range`),
/// as `convert` copies its large segments (see `execute::DEFAULT_COPY_MIN_BYTES`).
const KERNEL_COPY_MIN: u64 = 64 << 10;
/// Source bytes between two reads that are read (into scratch) rather than skipped with another
/// `pread` (as `convert` gathers its reads).
const MAX_GATHER_GAP: u64 = 8 << 10;
/// Longest span one gathered read covers.
const GATHER_SPAN: u64 = 4 << 20;

/// Where a read lands: the output buffer, or the staging buffer of a cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dest {
    Buf(usize),
    Stage(usize),
}

impl Dest {
    fn advanced(self, n: usize) -> Dest {
        match self {
            Dest::Buf(at) => Dest::Buf(at + n),
            Dest::Stage(at) => Dest::Stage(at + n),
        }
    }
}

/// A source rank file, and its name in the source checkpoint's directory (for errors).
#[derive(Clone, Copy)]
pub(super) struct Input<'a> {
    pub file: &'a File,
    pub name: &'a str,
}

/// A pending read: `len` bytes of `input` at `offset` into `dest`.
struct Read<'a> {
    input: Input<'a>,
    offset: u64,
    dest: Dest,
    len: usize,
}

/// A pending cast: staged source elements into their place in the output buffer.
struct Cast {
    from: DType,
    to: DType,
    stage: usize,
    stage_len: usize,
    buf: usize,
    buf_len: usize,
}

/// Copies byte ranges from source files into one output file through a fixed buffer: reads of
/// nearby source bytes and writes of contiguous output bytes are merged.
pub(super) struct Copier<'a> {
    out: &'a File,
    path: &'a Path,
    /// The source checkpoint's directory, which the inputs' names are in.
    source_dir: &'a Path,
    kernel_copy: &'a AtomicBool,
    buf: Vec<u8>,
    fill: usize,
    /// Source bytes of pending casts; allocated when the first cast comes.
    stage: Vec<u8>,
    stage_fill: usize,
    reads: Vec<Read<'a>>,
    casts: Vec<Cast>,
    /// `(output offset, buffer start, length)`.
    writes: Vec<(u64, usize, usize)>,
    /// Gathered reads' spans.
    scratch: Vec<u8>,
}

impl<'a> Copier<'a> {
    pub(super) fn new(out: &'a File, path: &'a Path, source_dir: &'a Path, kernel_copy: &'a AtomicBool) -> Copier<'a> {
        Copier {
            out,
            path,
            source_dir,
            kernel_copy,
            buf: vec![0u8; BUFFER_BYTES],
            fill: 0,
            stage: Vec::new(),
            stage_fill: 0,
            reads: Vec::new(),
            casts: Vec::new(),
            writes: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Queues `bytes` to be written at `to`.
    pub(super) fn put(&mut self, mut bytes: &[u8], mut to: u64) -> Result<(), ExecuteError> {
        while !bytes.is_empty() {
            if self.fill == self.buf.len() {
                self.flush()?;
            }
            let n = bytes.len().min(self.buf.len() - self.fill);
            let at = self.fill;
            self.buf[at..at + n].copy_from_slice(&bytes[..n]);
            self.queue_write(to, at, n);
            self.fill += n;
            (bytes, to) = (&bytes[n..], to + n as u64);
        }
        Ok(())
    }

    /// Records that `buf[at..at + n]` goes to `to`, merged with the previous write if adjacent.
    fn queue_write(&mut self, to: u64, at: usize, n: usize) {
        match self.writes.last_mut() {
            Some((off, start, l)) if *off + *l as u64 == to && *start + *l == at => *l += n,
            _ => self.writes.push((to, at, n)),
        }
    }

    /// Records a read, merged with the previous one when both are contiguous.
    fn queue_read(&mut self, input: Input<'a>, offset: u64, dest: Dest, len: usize) {
        match self.reads.last_mut() {
            Some(r)
                if std::ptr::eq(r.input.file, input.file)
                    && r.offset + r.len as u64 == offset
                    && r.dest.advanced(r.len) == dest =>
            {
                r.len += len
            }
            _ => self.reads.push(Read { input, offset, dest, len }),
        }
    }

    /// Copies what it can of a large run inside the kernel; returns the bytes copied.
    fn kernel_copy(&self, input: &File, from: u64, to: u64, len: u64) -> Result<u64, ExecuteError> {
        let mut done = 0u64;
        while done < len && self.kernel_copy.load(Ordering::Relaxed) {
            let (mut off_in, mut off_out) = (from + done, to + done);
            let want = (len - done).min(1 << 30) as usize;
            match rustix::fs::copy_file_range(input, Some(&mut off_in), self.out, Some(&mut off_out), want) {
                Ok(0) => break,
                Ok(n) => done += n as u64,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) if copy_unsupported(e) => self.kernel_copy.store(false, Ordering::Relaxed),
                Err(e) => {
                    return Err(ExecuteError::Io {
                        path: self.path.to_path_buf(),
                        action: "copy_file_range into rank file",
                        error: e.into(),
                    })
                }
            }
        }
        Ok(done)
    }

    /// Copies `len` bytes of `input` at `from` to `to` in the output.
    pub(super) fn copy(
        &mut self,
        input: Input<'a>,
        mut from: u64,
        mut to: u64,
        mut len: u64,
    ) -> Result<(), ExecuteError> {
        if len >= KERNEL_COPY_MIN && self.kernel_copy.load(Ordering::Relaxed) {
            // What is buffered before it goes first: the file is written front to back.
            self.flush()?;
            let done = self.kernel_copy(input.file, from, to, len)?;
            (from, to, len) = (from + done, to + done, len - done);
        }
        while len > 0 {
            if self.fill == self.buf.len() {
                self.flush()?;
            }
            let n = (len.min((self.buf.len() - self.fill) as u64)) as usize;
            let at = self.fill;
            self.queue_read(input, from, Dest::Buf(at), n);
            self.queue_write(to, at, n);
            self.fill += n;
            from += n as u64;
            to += n as u64;
            len -= n as u64;
        }
        Ok(())
    }

    /// Copies `elems` elements of dtype `from` at `at` in `input` to `to` in the output as
    /// elements of dtype `dtype` (a `torch_dist` model weight rounded from its master, a bf16
    /// master widened).
    pub(super) fn copy_cast(
        &mut self,
        input: Input<'a>,
        (from, mut at): (DType, u64),
        (dtype, mut to): (DType, u64),
        mut elems: u64,
    ) -> Result<(), ExecuteError> {
        let (from_size, to_size) = (from.size(), dtype.size());
        if self.stage.is_empty() {
            self.stage = vec![0u8; BUFFER_BYTES];
        }
        while elems > 0 {
            let room = ((self.buf.len() - self.fill) / to_size).min((self.stage.len() - self.stage_fill) / from_size);
            if room == 0 {
                self.flush()?;
                continue;
            }
            let n = (elems as usize).min(room);
            let (stage, buf) = (self.stage_fill, self.fill);
            self.queue_read(input, at, Dest::Stage(stage), n * from_size);
            match self.casts.last_mut() {
                Some(c)
                    if c.from == from
                        && c.to == dtype
                        && c.stage + c.stage_len == stage
                        && c.buf + c.buf_len == buf =>
                {
                    c.stage_len += n * from_size;
                    c.buf_len += n * to_size;
                }
                _ => self.casts.push(Cast {
                    from,
                    to: dtype,
                    stage,
                    stage_len: n * from_size,
                    buf,
                    buf_len: n * to_size,
                }),
            }
            self.queue_write(to, buf, n * to_size);
            self.stage_fill += n * from_size;
            self.fill += n * to_size;
            at += (n * from_size) as u64;
            to += (n * to_size) as u64;
            elems -= n as u64;
        }
        Ok(())
    }

    /// Reads what is queued (gathered per file), casts what is staged, writes the buffer.
    pub(super) fn flush(&mut self) -> Result<(), ExecuteError> {
        let mut reads = std::mem::take(&mut self.reads);
        // Each read has its own place in the buffers, so their order does not matter.
        reads.sort_unstable_by_key(|r| (std::ptr::from_ref(r.input.file) as usize, r.offset));
        let mut i = 0;
        while i < reads.len() {
            let (input, first) = (reads[i].input, reads[i].offset);
            let mut j = i + 1;
            let mut end = first + reads[i].len as u64;
            while let Some(r) = reads.get(j) {
                let near =
                    std::ptr::eq(input.file, r.input.file) && r.offset >= end && r.offset - end <= MAX_GATHER_GAP;
                if !near || r.offset + r.len as u64 - first > GATHER_SPAN {
                    break;
                }
                end = end.max(r.offset + r.len as u64);
                j += 1;
            }
            let read_err = |error| ExecuteError::Io {
                path: self.source_dir.join(input.name),
                action: "read source rank file",
                error,
            };
            if j == i + 1 {
                let r = &reads[i];
                input.file.read_exact_at(self.dest(r.dest, r.len), r.offset).map_err(read_err)?;
            } else {
                let mut scratch = std::mem::take(&mut self.scratch);
                scratch.resize((end - first) as usize, 0);
                input.file.read_exact_at(&mut scratch, first).map_err(read_err)?;
                for r in &reads[i..j] {
                    let at = (r.offset - first) as usize;
                    self.dest(r.dest, r.len).copy_from_slice(&scratch[at..at + r.len]);
                }
                self.scratch = scratch;
            }
            i = j;
        }
        reads.clear();
        self.reads = reads;
        for c in self.casts.drain(..) {
            cast_into(
                c.from,
                c.to,
                &self.stage[c.stage..c.stage + c.stage_len],
                &mut self.buf[c.buf..c.buf + c.buf_len],
            );
        }
        for (off, start, len) in self.writes.drain(..) {
            self.out.write_all_at(&self.buf[start..start + len], off).map_err(io_err(self.path, "write rank file"))?;
        }
        self.fill = 0;
        self.stage_fill = 0;
        Ok(())
    }

    fn dest(&mut self, dest: Dest, len: usize) -> &mut [u8] {
        match dest {
            Dest::Buf(at) => &mut self.buf[at..at + len],
            Dest::Stage(at) => &mut self.stage[at..at + len],
        }
    }
}
