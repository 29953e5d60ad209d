//! Reading one box of one tensor of a checkpoint: only the chunks that meet the box, only the
//! bytes of theirs it holds, with positioned reads and no other state (what a lazy reader such
//! as `shardline.open` needs: the tensor's slice, with no process group and no load of the rest).
//!
//! The runs a chunk contributes come from the layout's pure box math
//! ([`shardline_layout::reshard::runs`]). Runs of one chunk that lie close together in its file
//! (a column slice of a row-major chunk: one short run per row) are read with one `pread` of the
//! span that holds them and scattered, so a slice costs a few large reads, not one per row.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use shardline_layout::reshard::{check_tiling, runs, ChunkBox, Run};

use super::{io_err, CheckpointError, StoredTensor};

/// Runs of one chunk whose gap in the file is at most this are read together.
const GAP_BYTES: u64 = 64 << 10;
/// The most one read of a run group spans (its buffer is this long at most).
const SPAN_BYTES: u64 = 16 << 20;

/// What reading a box cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SliceRead {
    /// Chunks that met the box (each read at least once).
    pub chunks: usize,
    /// Bytes read from the checkpoint's files (the box's bytes, and the gaps read with them).
    pub bytes_read: u64,
    /// `pread` calls.
    pub reads: u64,
}

/// Why a box cannot be read, beyond the checkpoint's own errors.
fn bad_box(tensor: &StoredTensor, message: String) -> CheckpointError {
    CheckpointError::Inconsistent { key: tensor.key.clone(), offsets: Vec::new(), message }
}

/// Fills `out` (row-major, `want.sizes`, the tensor's dtype) with the box `want` of `tensor`,
/// reading the chunks that meet it from the files of the checkpoint in `dir`. The tensor's chunks
/// must tile it exactly (otherwise some of the box would be read twice or not at all).
pub fn read_box(
    dir: &Path,
    tensor: &StoredTensor,
    want: &ChunkBox,
    out: &mut [u8],
) -> Result<SliceRead, CheckpointError> {
    let elem = tensor.dtype.size() as u64;
    let rank = tensor.shape.len();
    if want.offsets.len() != rank || want.sizes.len() != rank {
        return Err(bad_box(tensor, format!("a box of {} dims for a tensor of {rank}", want.offsets.len())));
    }
    // Every offset below is within the tensor's bytes, so this product bounds them all.
    let total = tensor.shape.iter().try_fold(elem, |n, &d| n.checked_mul(d));
    if total.is_none_or(|t| t > i64::MAX as u64) {
        return Err(bad_box(tensor, format!("its shape {:?} is too large to address", tensor.shape)));
    }
    let inside = (0..rank).all(|d| want.offsets[d].checked_add(want.sizes[d]).is_some_and(|e| e <= tensor.shape[d]));
    if !inside {
        return Err(bad_box(tensor, format!("{want} reaches past its shape {:?}", tensor.shape)));
    }
    if want.numel().checked_mul(elem) != Some(out.len() as u64) {
        return Err(bad_box(
            tensor,
            format!("{want} is {} elements; the buffer holds {} bytes", want.numel(), out.len()),
        ));
    }
    let boxes: Vec<ChunkBox> =
        tensor.chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
    check_tiling(&tensor.shape, &boxes).map_err(|p| bad_box(tensor, format!("cannot be read: {p}")))?;
    let mut files: HashMap<Arc<str>, File> = HashMap::new();
    let mut stats = SliceRead::default();
    for (chunk, chunk_box) in tensor.chunks.iter().zip(&boxes) {
        let chunk_runs: Vec<Run> = runs(want, chunk_box).collect();
        if chunk_runs.is_empty() {
            continue;
        }
        if chunk.data_len != chunk_box.numel() * elem {
            return Err(CheckpointError::Inconsistent {
                key: tensor.key.clone(),
                offsets: chunk.offsets.clone(),
                message: format!("{} bytes stored for {} elements of {elem} bytes", chunk.data_len, chunk_box.numel()),
            });
        }
        let file = match files.get(&chunk.file) {
            Some(f) => f,
            None => {
                let path = dir.join(&*chunk.file);
                let f = File::open(&path).map_err(io_err(&path, "open"))?;
                files.entry(chunk.file.clone()).or_insert(f)
            }
        };
        stats.chunks += 1;
        let path = dir.join(&*chunk.file);
        for group in run_groups(&chunk_runs, elem) {
            if let [run] = group {
                // One run: straight into its place.
                let to = (run.target * elem) as usize;
                let len = (run.len * elem) as usize;
                let at = chunk.data_offset + run.source * elem;
                file.read_exact_at(&mut out[to..to + len], at).map_err(io_err(&path, "read"))?;
                stats.reads += 1;
                stats.bytes_read += len as u64;
                continue;
            }
            let first = group[0];
            let last = group[group.len() - 1];
            let start = first.source * elem;
            let span = (last.source + last.len) * elem - start;
            let mut buf = vec![0u8; span as usize];
            file.read_exact_at(&mut buf, chunk.data_offset + start).map_err(io_err(&path, "read"))?;
            stats.reads += 1;
            stats.bytes_read += span;
            for run in group {
                let from = (run.source * elem - start) as usize;
                let to = (run.target * elem) as usize;
                let len = (run.len * elem) as usize;
                out[to..to + len].copy_from_slice(&buf[from..from + len]);
            }
        }
    }
    Ok(stats)
}

/// Splits a chunk's runs (in increasing file order) into groups read with one `pread` each:
/// a run joins the group before it when the gap between them is at most [`GAP_BYTES`] and the
/// group then spans at most [`SPAN_BYTES`]. A run longer than that is a group of its own, read
/// straight into the output with no buffer.
fn run_groups(runs: &[Run], elem: u64) -> Vec<&[Run]> {
    let mut groups = Vec::new();
    let mut begin = 0;
    for i in 1..runs.len() {
        let (first, prev, next) = (runs[begin], runs[i - 1], runs[i]);
        let gap = (next.source - (prev.source + prev.len)) * elem;
        let span = (next.source + next.len - first.source) * elem;
        if gap > GAP_BYTES || span > SPAN_BYTES {
            groups.push(&runs[begin..i]);
            begin = i;
        }
    }
    if !runs.is_empty() {
        groups.push(&runs[begin..]);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(source: u64, target: u64, len: u64) -> Run {
        Run { source, target, len }
    }

    #[test]
    fn close_runs_share_a_read_and_far_ones_do_not() {
        let runs = [run(0, 0, 4), run(8, 4, 4), run(1 << 20, 8, 4)];
        let groups = run_groups(&runs, 2);
        assert_eq!(groups, vec![&runs[0..2], &runs[2..3]]);
    }

    #[test]
    fn a_group_never_spans_more_than_its_bound() {
        let len = SPAN_BYTES / 2;
        let runs = [run(0, 0, len), run(len, len, len), run(2 * len, 2 * len, 1)];
        let groups = run_groups(&runs, 1);
        assert_eq!(groups, vec![&runs[0..2], &runs[2..3]]);
    }
}
