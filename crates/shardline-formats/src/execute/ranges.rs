//! Which bytes of the release one rank file reads: what a worker without the release on its disk
//! fetches (ranged reads of an object store) before it writes the rank file.
//!
//! Exact for plain copies and casts (the segments' own source bytes); a transposed or dequantized
//! segment takes its whole source tensor and, for dequantization, its scales (these are the
//! packed experts and quantized weights, read whole by the ranks that hold any of them anyway).
//! Ranges of one file closer than [`MERGE_GAP`] are merged: a ranged request costs about what
//! that many bytes do.

use shardline_layout::recipe::{segments, Segment, Transform};
use shardline_layout::{PlanTable, TensorView};

use super::SourceMap;

/// Release bytes between two ranges of one file that are fetched rather than skipped.
pub const MERGE_GAP: u64 = 256 << 10;

/// A byte range `[start, end)` of release file `file` (an index of the plan's source files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteRange {
    pub file: usize,
    pub start: u64,
    pub end: u64,
}

impl SourceMap {
    /// The release files' paths, by the index [`ByteRange::file`] names.
    pub fn file_paths(&self) -> impl Iterator<Item = &std::path::Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// The byte ranges of the release that rank `rank`'s file is written from, sorted and merged.
    pub fn rank_ranges(&self, plan: &PlanTable, rank: u64) -> Vec<ByteRange> {
        self.rank_ranges_of(plan, rank, 0..usize::MAX)
    }

    /// [`rank_ranges`](Self::rank_ranges) of the items `items` of the rank's file alone (its
    /// chunks, in file order): what writing that section of it reads.
    pub fn rank_ranges_of(&self, plan: &PlanTable, rank: u64, items: std::ops::Range<usize>) -> Vec<ByteRange> {
        let mut ranges = Vec::new();
        for (ti, _, chunk) in plan.rank_chunks(rank).skip(items.start).take(items.len()) {
            self.chunk_ranges(plan.tensor(ti), &chunk.offsets, &chunk.sizes, &mut ranges);
        }
        merge_ranges(ranges)
    }

    /// Appends the byte ranges of the release the chunk `offsets`/`sizes` of `t` is made from
    /// (unmerged: see [`merge_ranges`]).
    pub fn chunk_ranges(&self, t: TensorView<'_>, offsets: &[u64], sizes: &[u64], ranges: &mut Vec<ByteRange>) {
        let whole = |id: usize, ranges: &mut Vec<ByteRange>| {
            let (file, start, len) = self.locs[id];
            ranges.push(ByteRange { file, start, end: start + len });
        };
        for seg in segments(t.shape, t.dtype, t.recipe, offsets, sizes) {
            let Segment { source: Some((id, offset)), transform, .. } = seg else { continue };
            match transform {
                Transform::Identity | Transform::SubtractOne | Transform::Cast(_) => {
                    let (file, start, _) = self.locs[id];
                    let begin = start + offset;
                    ranges.push(ByteRange { file, start: begin, end: begin + seg.source_len(t.dtype) });
                }
                Transform::Transpose { .. } => whole(id, ranges),
                Transform::DequantFp8 { scale, .. } => {
                    whole(id, ranges);
                    whole(scale as usize, ranges);
                }
                Transform::DequantMxfp4 { scales } => {
                    whole(id, ranges);
                    whole(scales as usize, ranges);
                }
            }
        }
    }
}

/// Sorted, with overlapping, touching and nearby ranges of a file joined.
pub fn merge_ranges(mut ranges: Vec<ByteRange>) -> Vec<ByteRange> {
    ranges.retain(|r| r.end > r.start);
    ranges.sort_unstable();
    let mut out: Vec<ByteRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.file == r.file && r.start <= last.end.saturating_add(MERGE_GAP) => {
                last.end = last.end.max(r.end);
            }
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: usize, start: u64, end: u64) -> ByteRange {
        ByteRange { file, start, end }
    }

    #[test]
    fn ranges_merge_per_file_across_small_gaps_only() {
        let merged = merge_ranges(vec![
            r(1, 0, 10),
            r(0, MERGE_GAP * 4, MERGE_GAP * 5),
            r(0, 0, 100),
            r(0, 50, 60),
            r(0, 100 + MERGE_GAP, 100 + MERGE_GAP + 1),
            r(1, 10, 10),
        ]);
        assert_eq!(merged, vec![r(0, 0, 100 + MERGE_GAP + 1), r(0, MERGE_GAP * 4, MERGE_GAP * 5), r(1, 0, 10)]);
    }
}
