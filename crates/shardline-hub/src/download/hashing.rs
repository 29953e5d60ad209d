//! Hashing a file beside its transfer: the digest follows the contiguous prefix, from recent
//! batches kept in memory, else reading the bytes back.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use crate::cache::{Digester, Expected};

use super::writer::{contiguous, Part, WRITE_BUF};

/// Batches written to disk recently, kept in memory when they are near the hash frontier so the
/// hasher need not read them back.
#[derive(Default)]
pub(super) struct Hashing {
    /// Bytes hashed from offset 0.
    pub(super) hashed: AtomicU64,
    /// Written batches by offset, at most [`KEEP_AHEAD`] beyond `hashed`.
    recent: std::sync::Mutex<std::collections::BTreeMap<u64, Arc<Batch>>>,
}

pub(super) const KEEP_AHEAD: u64 = 64 << 20;

pub(super) struct Batch {
    pub(super) chunks: Vec<Bytes>,
    pub(super) len: u64,
}

impl Hashing {
    pub(super) fn recent(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Arc<Batch>>> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Hashes `file` from 0 as its contiguous prefix grows (from the batches in memory, else reading
/// it back); the digest once all `size` bytes are in, `None` if `stop` is set first (blocking;
/// runs beside the transfer).
pub(super) fn ordered_digest(
    file: &File,
    expected: &Expected,
    size: u64,
    have: u64,
    parts: &[Arc<Part>],
    hashing: &Hashing,
    stop: &AtomicBool,
) -> io::Result<Option<String>> {
    let mut d = Digester::new(expected, size);
    let mut hashed = 0u64;
    let mut buf = vec![0u8; WRITE_BUF];
    loop {
        let avail = contiguous(have, parts);
        if hashed < avail {
            let (batch, next_key) = {
                let m = hashing.recent();
                (m.get(&hashed).cloned(), m.range(hashed + 1..).next().map(|(k, _)| *k))
            };
            match batch {
                Some(b) if hashed + b.len <= avail => {
                    for c in &b.chunks {
                        d.update(c);
                    }
                    hashed += b.len;
                }
                Some(_) => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    continue;
                }
                None => {
                    let mut n = (avail - hashed).min(WRITE_BUF as u64);
                    if let Some(k) = next_key {
                        n = n.min(k - hashed);
                    }
                    let buf = &mut buf[..n as usize];
                    file.read_exact_at(buf, hashed)?;
                    d.update(buf);
                    hashed += n;
                }
            }
            hashing.hashed.store(hashed, Ordering::Release);
            let mut m = hashing.recent();
            let keep = m.split_off(&hashed);
            *m = keep;
            continue;
        }
        if hashed >= size {
            return Ok(Some(d.finish()));
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
