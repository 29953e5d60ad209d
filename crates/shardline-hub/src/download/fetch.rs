//! One fetch of a file's missing bytes: a single stream into `.incomplete`, or parallel ranges
//! into `.split.incomplete` with the contiguous prefix kept for resuming, hashed as they land.

use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use reqwest::Url;
use tokio::task::JoinSet;

use crate::cache::Expected;
use crate::{HubError, RepoFile, Result};

use super::hashing::{ordered_digest, Hashing};
use super::writer::{contiguous, Part, PartWriter};
use super::Job;

impl Job {
    /// Fetches `[have, size)` and hashes the whole file while it arrives.
    ///
    /// One stream writes `.incomplete` in order, so it is a valid prefix at any moment. Large
    /// files are fetched as parallel ranges into `.split.incomplete` (never a valid prefix); if
    /// that stops early, the contiguous part goes back to `.incomplete` so the next attempt, of
    /// this client or `huggingface_hub`, resumes from it. A hasher thread reads back the
    /// contiguous prefix as it grows, so verification overlaps the transfer.
    /// Returns the file holding the bytes and their digest, or `None` if cancelled.
    pub(super) async fn fetch_once(
        self: &Arc<Self>,
        f: &RepoFile,
        url: &Url,
        incomplete: &Path,
        split: &Path,
        have: u64,
        expected: &Expected,
    ) -> Result<Option<(PathBuf, String)>> {
        let left = f.size - have;
        let parallel = self.concurrency > 1 && left >= self.split_threshold && left > self.part_size;
        let data = if parallel { split } else { incomplete };
        let io_err = |e| HubError::io(data, e);
        if parallel && have > 0 {
            fs::rename(incomplete, split).map_err(io_err)?;
        }
        let file = OpenOptions::new().create(true).truncate(false).read(true).write(true).open(data).map_err(io_err)?;
        file.set_len(have).map_err(io_err)?;
        let file = Arc::new(file);
        if have > 0 {
            tracing::info!(path = %f.path, have, size = f.size, "resuming a partial download");
        }

        let mut parts = Vec::new();
        let mut a = have;
        while a < f.size {
            let b = if parallel { (a + self.part_size).min(f.size) } else { f.size };
            parts.push(Arc::new(Part { start: a, end: b, written: AtomicU64::new(0) }));
            a = b;
        }
        let parts = Arc::new(parts);
        // Ranges go straight to where the Hub redirects (one redirect for all of them, as on a
        // CDN each costs a round trip); a range that fails goes back through the Hub.
        let direct = if parallel && !parts.is_empty() { self.locate(f, url).await? } else { None };
        let stop = Arc::new(AtomicBool::new(false));
        let hashing = Arc::new(Hashing::default());
        let hasher = {
            let (file, parts, stop, expected, size) =
                (file.clone(), parts.clone(), stop.clone(), expected.clone(), f.size);
            let hashing = hashing.clone();
            tokio::task::spawn_blocking(move || ordered_digest(&file, &expected, size, have, &parts, &hashing, &stop))
        };

        let mut set = JoinSet::new();
        for part in parts.iter().cloned() {
            let (job, f, url, file, hashing) = (self.clone(), f.clone(), url.clone(), file.clone(), hashing.clone());
            let direct = direct.clone();
            let single = !parallel;
            set.spawn(async move {
                let mut w = PartWriter::new(file, part.start, part.clone(), hashing);
                let r = job.stream(&f, &url, direct.as_ref(), part.start, part.end, &mut w, single).await;
                let fl = w.flush().await;
                (r, fl)
            });
        }
        let mut complete = true;
        let mut err = None;
        while let Some(j) = set.join_next().await {
            let (r, fl) = match j {
                Ok(v) => v,
                Err(j) if j.is_panic() => std::panic::resume_unwind(j.into_panic()),
                Err(_) => continue,
            };
            match (r, fl) {
                (Ok(true), Ok(())) => {}
                (Ok(false), Ok(())) => complete = false,
                (Err(e), _) => {
                    complete = false;
                    self.cancel.store(true, Ordering::SeqCst);
                    err.get_or_insert(e);
                }
                (Ok(_), Err(e)) => {
                    complete = false;
                    self.cancel.store(true, Ordering::SeqCst);
                    err.get_or_insert(HubError::io(data, e));
                }
            }
        }
        if !complete {
            stop.store(true, Ordering::SeqCst);
        }
        let digest = match hasher.await {
            Ok(r) => r.map_err(io_err)?,
            Err(j) => std::panic::resume_unwind(j.into_panic()),
        };
        if complete {
            let d = digest.expect("every part written, so the hasher finished");
            return Ok(Some((data.to_owned(), d)));
        }
        if parallel {
            let prefix = contiguous(have, &parts);
            file.set_len(prefix).map_err(io_err)?;
            drop(file);
            fs::rename(split, incomplete).map_err(|e| HubError::io(incomplete, e))?;
            tracing::info!(path = %f.path, kept = prefix, "parallel download stopped; the contiguous prefix is kept for resuming");
        }
        match err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }
}
