//! A validation split across workers by the files items are stored in: what one part needs of
//! the release, and whether the parts' items add up to what `.metadata` declares.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use shardline_layout::Plan;

use super::items::{Job, Location};
use super::keys::{fits, BoxSet, Keys};
use super::{feed, Finding, Scope, VerifyError, VerifyReport};
use crate::execute::{merge_ranges, ByteRange, SourceMap};
use crate::safetensors::Release;
use crate::torch_save::{read_tensor_archive_with, SpecCache};

/// The byte ranges of `release` that checking the items stored in `files` of the checkpoint in
/// `dir` compares with, sorted and merged: what a worker without the release on its disk fetches
/// before its part. Only `.metadata`, the headers of the release and the items' own headers are
/// read; an item that cannot be read adds nothing (its check reports it).
pub fn part_ranges(
    dir: &Path,
    release: &Release,
    reference: &Plan,
    files: &BTreeSet<String>,
) -> Result<Vec<ByteRange>, VerifyError> {
    let sources = SourceMap::new(reference, release)?;
    let mut keys = Keys::new(reference);
    let mut ranges = Vec::new();
    let mut open: HashMap<Arc<str>, Option<File>> = HashMap::new();
    let mut specs = SpecCache::default();
    feed(dir, &mut keys, &mut Vec::new(), Scope::Files(files), |job: Job| {
        let (Some(offsets), Some(want)) = (&job.offsets, &job.key.want) else { return true };
        let sizes = match &job.location {
            Location::Raw { sizes, .. } => Some(sizes.clone()),
            Location::Archive { offset, length } => {
                let file = open.entry(job.file.clone()).or_insert_with(|| File::open(dir.join(&*job.file)).ok());
                file.as_ref()
                    .and_then(|f| read_tensor_archive_with(f, *offset, *length, &mut specs).ok())
                    .filter(|t| t.dtype == job.key.dtype)
                    .map(|t| t.shape)
            }
        };
        if let Some(sizes) = sizes.filter(|s| fits(offsets, s, &job.key.shape)) {
            for (t, off, sz) in want.pieces(offsets, &sizes) {
                sources.chunk_ranges(t.view(), &off, &sz, &mut ranges);
            }
        }
        true
    })?;
    Ok(merge_ranges(ranges))
}

/// Whether the boxes the parts' items hold add up to the boxes `declared` (a [`Scope::Declared`]
/// report) lists: every declared chunk stored exactly once across the parts. A finding if not.
pub fn parts_agree(declared: &VerifyReport, parts: impl IntoIterator<Item = BoxSet>) -> Option<Finding> {
    let mut held = BoxSet::default();
    for p in parts {
        held.merge(p);
    }
    (held != declared.declared).then(|| Finding {
        key: "(all keys)".into(),
        message: format!(
            "the parts' {} stored item(s) do not hold exactly the {} chunk(s) .metadata declares; validating a \
             local copy whole names the keys",
            held.count, declared.declared.count
        ),
    })
}
