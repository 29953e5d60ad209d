//! Writing a file's ranges: each [`Part`] and how much of it is on disk, the contiguous prefix
//! of the file, and positional vectored writes off the async threads.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::hashing::{Batch, Hashing, KEEP_AHEAD};

/// Bytes gathered before a write, and read at a time by the hasher.
pub(super) const WRITE_BUF: usize = 4 << 20;

/// One range of a download and how much of it is on disk.
pub(super) struct Part {
    pub(super) start: u64,
    pub(super) end: u64,
    /// Bytes written from `start` on, contiguous (updated after each write completes).
    pub(super) written: AtomicU64,
}

/// How far the file is written without a gap: `have` plus the parts done in order, plus what the
/// first unfinished part has.
pub(super) fn contiguous(have: u64, parts: &[Arc<Part>]) -> u64 {
    let mut end = have;
    for p in parts {
        let w = p.written.load(Ordering::Acquire);
        end = p.start + w;
        if p.start + w < p.end {
            break;
        }
    }
    end
}

/// `pwritev` until every byte of `chunks` is at `offset`.
fn write_all_vectored_at(file: &File, chunks: &[Bytes], mut offset: u64) -> io::Result<()> {
    let (mut i, mut skip) = (0usize, 0usize);
    while i < chunks.len() {
        let slices: Vec<io::IoSlice<'_>> = std::iter::once(&chunks[i][skip..])
            .chain(chunks[i + 1..].iter().map(|c| &c[..]))
            .take(512)
            .map(io::IoSlice::new)
            .collect();
        let mut n = match rustix::io::pwritev(file, &slices, offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing")),
            Ok(n) => n,
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) => return Err(e.into()),
        };
        offset += n as u64;
        while n > 0 {
            let left = chunks[i].len() - skip;
            if n >= left {
                n -= left;
                i += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
        while i < chunks.len() && chunks[i].len() == skip {
            i += 1;
            skip = 0;
        }
    }
    Ok(())
}

/// Sequential positional writes off the async threads, one in flight while the next batch of
/// received chunks gathers (no copy: the chunks go to `pwritev` as they are); each completed
/// write advances the part's `written` and may leave the batch for the hasher.
pub(super) struct PartWriter {
    file: Arc<File>,
    offset: u64,
    chunks: Vec<Bytes>,
    len: usize,
    part: Arc<Part>,
    hashing: Arc<Hashing>,
    pending: Option<tokio::task::JoinHandle<io::Result<()>>>,
}

impl PartWriter {
    pub(super) fn new(file: Arc<File>, offset: u64, part: Arc<Part>, hashing: Arc<Hashing>) -> Self {
        PartWriter { file, offset, chunks: Vec::new(), len: 0, part, hashing, pending: None }
    }

    pub(super) async fn write(&mut self, data: Bytes) -> io::Result<()> {
        self.len += data.len();
        self.chunks.push(data);
        if self.len >= WRITE_BUF {
            self.submit().await?;
        }
        Ok(())
    }

    async fn submit(&mut self) -> io::Result<()> {
        self.wait().await?;
        if self.chunks.is_empty() {
            return Ok(());
        }
        let batch = Batch { chunks: std::mem::take(&mut self.chunks), len: std::mem::take(&mut self.len) as u64 };
        let (file, off, part, hashing) = (self.file.clone(), self.offset, self.part.clone(), self.hashing.clone());
        self.offset += batch.len;
        self.pending = Some(tokio::task::spawn_blocking(move || {
            write_all_vectored_at(&file, &batch.chunks, off)?;
            let len = batch.len;
            let hashed = hashing.hashed.load(Ordering::Acquire);
            if off >= hashed && off < hashed + KEEP_AHEAD {
                hashing.recent().insert(off, Arc::new(batch));
            }
            part.written.fetch_add(len, Ordering::Release);
            Ok(())
        }));
        Ok(())
    }

    async fn wait(&mut self) -> io::Result<()> {
        if let Some(h) = self.pending.take() {
            match h.await {
                Ok(r) => r?,
                Err(j) => std::panic::resume_unwind(j.into_panic()),
            }
        }
        Ok(())
    }

    pub(super) async fn flush(&mut self) -> io::Result<()> {
        self.submit().await?;
        self.wait().await
    }
}
