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
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use shardline_layout::reshard::{check_tiling, runs, ChunkBox, Run};

use super::{io_err, CheckpointError, StoredTensor};

/// Runs of one chunk whose gap in the file is at most this are read together.
const GAP_BYTES: u64 = 64 << 10;
/// The most one read of a run group spans (its buffer is this long at most).
const SPAN_BYTES: u64 = 16 << 20;
/// Boxes at least this large are read by several threads (`read_box`: one per core).
const PARALLEL_BYTES: u64 = 8 << 20;
/// The most threads one read uses.
const MAX_THREADS: usize = 8;

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
    let mut files: HashMap<&str, File> = HashMap::new();
    for (chunk, chunk_box) in tensor.chunks.iter().zip(&boxes) {
        if runs(want, chunk_box).next().is_none() {
            continue;
        }
        if chunk.data_len != chunk_box.numel() * elem {
            return Err(CheckpointError::Inconsistent {
                key: tensor.key.clone(),
                offsets: chunk.offsets.clone(),
                message: format!("{} bytes stored for {} elements of {elem} bytes", chunk.data_len, chunk_box.numel()),
            });
        }
        if !files.contains_key(&*chunk.file) {
            let path = dir.join(&*chunk.file);
            files.insert(&chunk.file, File::open(&path).map_err(io_err(&path, "open"))?);
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS);
    read_box_from(&files, tensor, want, out, threads).map_err(|e| {
        let path = dir.join(&*e.file);
        CheckpointError::Io { path, action: "read", error: e.error }
    })
}

/// A read of a chunk's file that failed.
#[derive(Debug)]
pub struct ChunkReadError {
    pub file: Arc<str>,
    pub error: io::Error,
}

/// [`read_box`] from files already open (by name), for callers that checked the tensor's
/// tiling and its chunks' lengths once and read many boxes of it (`export` reads bands of
/// rows). `out` must hold the box's bytes exactly. A large box is read by up to `threads`
/// threads, each a band of its leading rows: copying out of the page cache is the work, and it
/// parallelizes (callers already running one read per core pass 1).
pub fn read_box_from(
    files: &HashMap<&str, File>,
    tensor: &StoredTensor,
    want: &ChunkBox,
    out: &mut [u8],
    threads: usize,
) -> Result<SliceRead, ChunkReadError> {
    let rows = want.sizes.first().copied().unwrap_or(1);
    if threads < 2 || (out.len() as u64) < PARALLEL_BYTES || rows < 2 {
        return read_box_serial(files, tensor, want, out);
    }
    // Bands count a chunk once each they meet; the box meets it once.
    let chunks = tensor
        .chunks
        .iter()
        .filter(|c| runs(want, &ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).next().is_some())
        .count();
    Ok(SliceRead { chunks, ..read_in_bands(files, tensor, want, out, threads)? })
}

/// The box read by `threads` threads, each the next band of its leading rows.
fn read_in_bands(
    files: &HashMap<&str, File>,
    tensor: &StoredTensor,
    want: &ChunkBox,
    out: &mut [u8],
    threads: usize,
) -> Result<SliceRead, ChunkReadError> {
    let rows = want.sizes.first().copied().unwrap_or(1).max(1);
    let row_bytes = (out.len() / rows as usize).max(1);
    let band_rows = rows.div_ceil(threads.max(1) as u64);
    std::thread::scope(|s| {
        let workers: Vec<_> = out
            .chunks_mut(band_rows as usize * row_bytes)
            .enumerate()
            .map(|(i, band)| {
                let mut part = want.clone();
                part.offsets[0] += i as u64 * band_rows;
                part.sizes[0] = (band.len() / row_bytes) as u64;
                s.spawn(move || read_box_serial(files, tensor, &part, band))
            })
            .collect();
        let mut total = SliceRead::default();
        for worker in workers {
            let part = worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
            total.bytes_read += part.bytes_read;
            total.reads += part.reads;
        }
        Ok(total)
    })
}

fn read_box_serial(
    files: &HashMap<&str, File>,
    tensor: &StoredTensor,
    want: &ChunkBox,
    out: &mut [u8],
) -> Result<SliceRead, ChunkReadError> {
    let elem = tensor.dtype.size() as u64;
    let mut stats = SliceRead::default();
    for chunk in &tensor.chunks {
        let chunk_box = ChunkBox { offsets: chunk.offsets.clone(), sizes: chunk.sizes.clone() };
        let chunk_runs: Vec<Run> = runs(want, &chunk_box).collect();
        if chunk_runs.is_empty() {
            continue;
        }
        let failed = |error| ChunkReadError { file: chunk.file.clone(), error };
        let file = files.get(&*chunk.file).ok_or_else(|| failed(io::Error::from(io::ErrorKind::NotFound)))?;
        stats.chunks += 1;
        for group in run_groups(&chunk_runs, elem) {
            if let [run] = group {
                // One run: straight into its place.
                let to = (run.target * elem) as usize;
                let len = (run.len * elem) as usize;
                file.read_exact_at(&mut out[to..to + len], chunk.data_offset + run.source * elem).map_err(failed)?;
                stats.reads += 1;
                stats.bytes_read += len as u64;
                continue;
            }
            let (first, last) = (group[0], group[group.len() - 1]);
            let start = first.source * elem;
            let span = (last.source + last.len) * elem - start;
            let mut buf = vec![0u8; span as usize];
            file.read_exact_at(&mut buf, chunk.data_offset + start).map_err(failed)?;
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
    use super::super::StoredChunk;
    use super::*;
    use proptest::prelude::*;
    use shardline_layout::DType;

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

    /// A tensor of `shape` cut at `cuts` (per dimension, the sorted inner cut points), each
    /// chunk's elements (u16, the global flat index) written row-major at its own offset of one
    /// file, with a gap before each; and the reference: every element, by index.
    fn stored(dir: &Path, shape: &[u64], cuts: &[Vec<u64>]) -> StoredTensor {
        let edges: Vec<Vec<u64>> = shape
            .iter()
            .zip(cuts)
            .map(|(&n, c)| std::iter::once(0).chain(c.iter().copied().filter(|&x| x > 0 && x < n)).chain([n]).collect())
            .collect();
        let strides: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
        let mut boxes = vec![(Vec::new(), Vec::new())];
        for e in &edges {
            let mut next = Vec::new();
            for (o, s) in &boxes {
                for w in e.windows(2).filter(|w| w[0] < w[1]) {
                    next.push(([o.clone(), vec![w[0]]].concat(), [s.clone(), vec![w[1] - w[0]]].concat()));
                }
            }
            boxes = next;
        }
        let mut bytes = Vec::new();
        let mut chunks = Vec::new();
        for (offsets, sizes) in boxes {
            bytes.extend_from_slice(&[0xAB; 13]);
            let data_offset = bytes.len() as u64;
            let numel: u64 = sizes.iter().product();
            for i in 0..numel {
                let mut rest = i;
                let mut flat = 0;
                for d in (0..sizes.len()).rev() {
                    flat += (offsets[d] + rest % sizes[d]) * strides[d];
                    rest /= sizes[d];
                }
                bytes.extend_from_slice(&(flat as u16).to_le_bytes());
            }
            chunks.push(StoredChunk { offsets, sizes, file: Arc::from("data"), data_offset, data_len: numel * 2 });
        }
        std::fs::write(dir.join("data"), &bytes).unwrap();
        StoredTensor { key: "t".into(), dtype: DType::BF16, shape: shape.to_vec(), chunks }
    }

    fn expected(shape: &[u64], want: &ChunkBox) -> Vec<u8> {
        let strides: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
        let mut out = Vec::new();
        for i in 0..want.numel() {
            let mut rest = i;
            let mut flat = 0;
            for d in (0..want.sizes.len()).rev() {
                flat += (want.offsets[d] + rest % want.sizes[d]) * strides[d];
                rest /= want.sizes[d];
            }
            out.extend_from_slice(&(flat as u16).to_le_bytes());
        }
        out
    }

    /// A shape, the cut points of each dimension, and a box (offset, size per dimension).
    type Case = (Vec<u64>, Vec<Vec<u64>>, Vec<(u64, u64)>);

    fn case() -> impl Strategy<Value = Case> {
        prop::collection::vec(1u64..9, 1..4).prop_flat_map(|shape| {
            let cuts: Vec<_> = shape
                .iter()
                .map(|&n| prop::collection::btree_set(0..n, 0..3).prop_map(|s| s.into_iter().collect::<Vec<u64>>()))
                .collect();
            let boxes: Vec<_> = shape.iter().map(|&n| (0..n).prop_flat_map(move |o| (Just(o), 0..=n - o))).collect();
            (Just(shape), cuts, boxes)
        })
    }

    proptest! {
        /// Any box of any chunking reads the elements the index math says, serially and in
        /// bands, and touches only the chunks that meet it.
        #[test]
        fn a_box_holds_exactly_its_elements((shape, cuts, ranges) in case(), threads in 2usize..4) {
            let dir = tempfile::tempdir().unwrap();
            let tensor = stored(dir.path(), &shape, &cuts);
            let want = ChunkBox { offsets: ranges.iter().map(|r| r.0).collect(), sizes: ranges.iter().map(|r| r.1).collect() };
            let mut out = vec![0u8; want.numel() as usize * 2];
            let read = read_box(dir.path(), &tensor, &want, &mut out).unwrap();
            prop_assert_eq!(&out, &expected(&shape, &want));
            let meets = tensor.chunks.iter().filter(|c| (0..shape.len()).all(|d| {
                c.offsets[d] < want.offsets[d] + want.sizes[d] && want.offsets[d] < c.offsets[d] + c.sizes[d]
            })).count();
            prop_assert_eq!(read.chunks, if want.numel() == 0 { 0 } else { meets });
            let file = File::open(dir.path().join("data")).unwrap();
            let files = HashMap::from([("data", file)]);
            let mut banded = vec![0u8; out.len()];
            read_in_bands(&files, &tensor, &want, &mut banded, threads).unwrap();
            prop_assert_eq!(&banded, &out);
        }
    }

    #[test]
    fn a_box_past_the_shape_or_a_short_buffer_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tensor = stored(dir.path(), &[4, 3], &[vec![2], vec![]]);
        let past = ChunkBox { offsets: vec![3, 0], sizes: vec![2, 3] };
        let err = read_box(dir.path(), &tensor, &past, &mut [0u8; 12]).unwrap_err().to_string();
        assert!(err.contains("reaches past its shape [4, 3]"), "{err}");
        let short = ChunkBox { offsets: vec![0, 0], sizes: vec![2, 3] };
        let err = read_box(dir.path(), &tensor, &short, &mut [0u8; 10]).unwrap_err().to_string();
        assert!(err.contains("the buffer holds 10 bytes"), "{err}");
    }

    #[test]
    fn a_chunk_missing_from_the_tiling_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut tensor = stored(dir.path(), &[4, 3], &[vec![2], vec![]]);
        tensor.chunks.pop();
        let whole = ChunkBox { offsets: vec![0, 0], sizes: vec![4, 3] };
        let err = read_box(dir.path(), &tensor, &whole, &mut [0u8; 24]).unwrap_err().to_string();
        assert!(err.contains("a chunk is missing"), "{err}");
    }
}
