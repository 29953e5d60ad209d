//! Chunk boxes: whether a tensor's saved chunks tile it exactly, and which contiguous runs of a
//! source chunk fill a target chunk.
//!
//! A chunk is a box of the global tensor stored row-major on its own. Where a target box meets a
//! source box, the shared elements form runs that are contiguous in both: every dimension after
//! the last one where either box is narrower than the intersection is covered whole, so a run
//! spans those dimensions and one row of the intersection in the ones before.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;

/// A box of a tensor: a chunk's offsets and sizes in global coordinates.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkBox {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

impl ChunkBox {
    /// The whole tensor of `shape` as one box.
    pub fn whole(shape: &[u64]) -> ChunkBox {
        ChunkBox { offsets: vec![0; shape.len()], sizes: shape.to_vec() }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.sizes.iter().product()
    }

    fn end(&self, d: usize) -> u64 {
        self.offsets[d] + self.sizes[d]
    }
}

impl fmt::Display for ChunkBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "offsets {:?} sizes {:?}", self.offsets, self.sizes)
    }
}

/// Why a tensor's chunks do not tile it exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TilingProblem {
    /// A chunk of another rank than the tensor, or reaching past it.
    OutOfBounds(ChunkBox),
    /// Two chunks share elements.
    Overlap(ChunkBox, ChunkBox),
    /// Elements no chunk holds (the chunks hold `covered` of `total`).
    Gap { covered: u64, total: u64 },
}

impl fmt::Display for TilingProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TilingProblem::OutOfBounds(b) => write!(f, "chunk at {b} lies outside the tensor"),
            TilingProblem::Overlap(a, b) => write!(f, "chunks at {a} and at {b} overlap"),
            TilingProblem::Gap { covered, total } => write!(
                f,
                "chunks hold {covered} of its {total} elements: {} are in no chunk (a chunk is missing)",
                total - covered
            ),
        }
    }
}

fn overlaps(a: &ChunkBox, b: &ChunkBox) -> bool {
    (0..a.offsets.len()).all(|d| a.offsets[d] < b.end(d) && b.offsets[d] < a.end(d))
}

/// Checks that non-empty `chunks` tile a tensor of `shape` exactly: inside it, disjoint, and
/// covering every element. Chunks are compared only with those whose dim-0 ranges meet, so
/// FSDP row shards cost about one comparison each.
pub fn check_tiling(shape: &[u64], chunks: &[ChunkBox]) -> Result<(), TilingProblem> {
    let total: u64 = shape.iter().product();
    let mut boxes: Vec<&ChunkBox> = chunks.iter().filter(|c| c.numel() > 0).collect();
    for b in &boxes {
        let inside = b.offsets.len() == shape.len()
            && b.sizes.len() == shape.len()
            && (0..shape.len()).all(|d| b.offsets[d].checked_add(b.sizes[d]).is_some_and(|e| e <= shape[d]));
        if !inside {
            return Err(TilingProblem::OutOfBounds((*b).clone()));
        }
    }
    if shape.is_empty() {
        // A 0-d tensor: one element, one chunk.
        return match boxes.len() {
            1 => Ok(()),
            0 => Err(TilingProblem::Gap { covered: 0, total: 1 }),
            _ => Err(TilingProblem::Overlap(boxes[0].clone(), boxes[1].clone())),
        };
    }
    boxes.sort_by_key(|b| b.offsets[0]);
    for (i, a) in boxes.iter().enumerate() {
        for b in boxes[i + 1..].iter().take_while(|b| b.offsets[0] < a.end(0)) {
            if overlaps(a, b) {
                return Err(TilingProblem::Overlap((*a).clone(), (*b).clone()));
            }
        }
    }
    let covered: u64 = boxes.iter().map(|b| b.numel()).sum();
    if covered != total {
        return Err(TilingProblem::Gap { covered, total });
    }
    Ok(())
}

/// A run of elements shared by a target and a source chunk: `len` elements starting at element
/// `source` of the source chunk and at element `target` of the target chunk (row-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub source: u64,
    pub target: u64,
    pub len: u64,
}

/// The runs of `source` that fill `target`, in target order; none when they do not meet.
pub fn runs(target: &ChunkBox, source: &ChunkBox) -> Runs {
    let n = target.offsets.len();
    let mut lo = vec![0u64; n];
    let mut hi = vec![0u64; n];
    let mut meet = n == source.offsets.len();
    for d in 0..n.min(source.offsets.len()) {
        lo[d] = target.offsets[d].max(source.offsets[d]);
        hi[d] = target.end(d).min(source.end(d));
        meet &= lo[d] < hi[d];
    }
    if !meet {
        return Runs { done: true, ..Runs::default() };
    }
    // `split`: the first dimension of the run; every later one is whole in both boxes.
    let mut split = n;
    while split > 0 {
        let d = split - 1;
        let whole = |b: &ChunkBox| b.offsets[d] == lo[d] && b.end(d) == hi[d];
        split = d;
        if !(whole(target) && whole(source)) {
            break;
        }
    }
    let inner: u64 = (split + 1..n).map(|d| hi[d] - lo[d]).product();
    let len = if n == 0 { 1 } else { (hi[split] - lo[split]) * inner };
    Runs {
        target_strides: strides(&target.sizes),
        source_strides: strides(&source.sizes),
        target_offsets: target.offsets.clone(),
        source_offsets: source.offsets.clone(),
        at: lo.clone(),
        lo,
        hi,
        split,
        len,
        done: false,
    }
}

fn strides(sizes: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; sizes.len()];
    for d in (0..sizes.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * sizes[d + 1];
    }
    s
}

/// The iterator [`runs`] returns: the index of the next run over the dimensions before `split`.
#[derive(Clone, Debug, Default)]
pub struct Runs {
    target_strides: Vec<u64>,
    source_strides: Vec<u64>,
    target_offsets: Vec<u64>,
    source_offsets: Vec<u64>,
    lo: Vec<u64>,
    hi: Vec<u64>,
    /// Global coordinates of the next run's first element.
    at: Vec<u64>,
    split: usize,
    len: u64,
    done: bool,
}

impl Iterator for Runs {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        if self.done {
            return None;
        }
        let place = |offsets: &[u64], strides: &[u64]| -> u64 {
            self.at.iter().zip(offsets).zip(strides).map(|((a, o), s)| (a - o) * s).sum()
        };
        let run = Run {
            source: place(&self.source_offsets, &self.source_strides),
            target: place(&self.target_offsets, &self.target_strides),
            len: self.len,
        };
        // Odometer over the dimensions before `split`.
        let mut d = self.split;
        loop {
            if d == 0 {
                self.done = true;
                break;
            }
            d -= 1;
            self.at[d] += 1;
            if self.at[d] < self.hi[d] {
                break;
            }
            self.at[d] = self.lo[d];
        }
        Some(run)
    }
}

/// The runs of every source chunk that fill `target`, merged in target order: `(index of the
/// source in `sources`, run)`. A writer that follows them writes its chunk front to back, one
/// large write at a time, however finely the sources interleave (a row-split weight merged from
/// several TP ranks is a run per row and rank). Holds one pending run per source that meets.
pub fn merged_runs<'s>(target: &ChunkBox, sources: impl IntoIterator<Item = &'s ChunkBox>) -> MergedRuns {
    let mut pending = BinaryHeap::new();
    let mut iters = Vec::new();
    for (i, source) in sources.into_iter().enumerate() {
        let mut it = runs(target, source);
        if let Some(first) = it.next() {
            pending.push(Reverse((first.target, iters.len())));
            iters.push((i, first, it));
        }
    }
    MergedRuns { pending, iters }
}

/// The iterator [`merged_runs`] returns.
#[derive(Debug, Default)]
pub struct MergedRuns {
    /// `(next run's target element, entry of iters)`, smallest first.
    pending: BinaryHeap<Reverse<(u64, usize)>>,
    /// `(source index, its next run, its remaining runs)` for each source that meets the target.
    iters: Vec<(usize, Run, Runs)>,
}

impl Iterator for MergedRuns {
    type Item = (usize, Run);

    fn next(&mut self) -> Option<(usize, Run)> {
        let Reverse((_, k)) = self.pending.pop()?;
        let (source, run, rest) = &mut self.iters[k];
        let out = (*source, *run);
        if let Some(next) = rest.next() {
            *run = next;
            self.pending.push(Reverse((next.target, k)));
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(offsets: &[u64], sizes: &[u64]) -> ChunkBox {
        ChunkBox { offsets: offsets.to_vec(), sizes: sizes.to_vec() }
    }

    #[test]
    fn merged_runs_interleave_sources_in_target_order() {
        // Rows 0..2 of a [2, 4] tensor whose columns 0..2 and 2..4 are two sources (TP 2 → 1).
        let sources = [b(&[0, 0], &[2, 2]), b(&[0, 2], &[2, 2]), b(&[5, 0], &[1, 4])];
        let r: Vec<(usize, Run)> = merged_runs(&b(&[0, 0], &[2, 4]), &sources).collect();
        assert_eq!(
            r,
            vec![
                (0, Run { source: 0, target: 0, len: 2 }),
                (1, Run { source: 0, target: 2, len: 2 }),
                (0, Run { source: 2, target: 4, len: 2 }),
                (1, Run { source: 2, target: 6, len: 2 }),
            ]
        );
    }

    #[test]
    fn row_shards_meet_in_one_run() {
        // Rows 2..6 of a [10, 4] tensor from the source chunk holding rows 4..10.
        let r: Vec<Run> = runs(&b(&[2, 0], &[4, 4]), &b(&[4, 0], &[6, 4])).collect();
        assert_eq!(r, vec![Run { source: 0, target: 8, len: 8 }]);
    }

    #[test]
    fn column_stripes_meet_row_by_row() {
        // Target: rows 0..3, columns 2..4 of [3, 4]; source: every row, columns 0..3.
        let r: Vec<Run> = runs(&b(&[0, 2], &[3, 2]), &b(&[0, 0], &[3, 3])).collect();
        assert_eq!(
            r,
            vec![
                Run { source: 2, target: 0, len: 1 },
                Run { source: 5, target: 2, len: 1 },
                Run { source: 8, target: 4, len: 1 }
            ]
        );
    }

    #[test]
    fn disjoint_boxes_have_no_runs() {
        assert_eq!(runs(&b(&[0, 0], &[2, 4]), &b(&[2, 0], &[2, 4])).count(), 0);
    }

    #[test]
    fn zero_d_tensor_is_one_run() {
        let r: Vec<Run> = runs(&b(&[], &[]), &b(&[], &[])).collect();
        assert_eq!(r, vec![Run { source: 0, target: 0, len: 1 }]);
    }

    #[test]
    fn tiling_problems_are_named() {
        let shape = [10, 4];
        assert_eq!(check_tiling(&shape, &[b(&[0, 0], &[5, 4]), b(&[5, 0], &[5, 4])]), Ok(()));
        assert_eq!(
            check_tiling(&shape, &[b(&[0, 0], &[5, 4]), b(&[6, 0], &[4, 4])]),
            Err(TilingProblem::Gap { covered: 36, total: 40 })
        );
        assert!(matches!(
            check_tiling(&shape, &[b(&[0, 0], &[6, 4]), b(&[5, 0], &[5, 4])]),
            Err(TilingProblem::Overlap(..))
        ));
        assert!(matches!(check_tiling(&shape, &[b(&[0, 0], &[11, 4])]), Err(TilingProblem::OutOfBounds(_))));
        // Empty chunks are ignored, whatever their offsets.
        assert_eq!(check_tiling(&shape, &[b(&[0, 0], &[10, 4]), b(&[10, 0], &[0, 4])]), Ok(()));
    }

    /// A tensor's boxes cut by independent cuts per dimension.
    fn grid(shape: &[u64], cuts: &[Vec<u64>]) -> Vec<ChunkBox> {
        let mut out = vec![b(&[], &[])];
        for (d, &n) in shape.iter().enumerate() {
            let mut edges: Vec<u64> = cuts[d].iter().map(|c| c % (n + 1)).collect();
            edges.extend([0, n]);
            edges.sort();
            edges.dedup();
            let mut next = Vec::new();
            for p in &out {
                for w in edges.windows(2) {
                    let mut q = p.clone();
                    q.offsets.push(w[0]);
                    q.sizes.push(w[1] - w[0]);
                    next.push(q);
                }
            }
            out = next;
        }
        out
    }

    proptest! {
        /// Copying every source chunk's runs into every target chunk rebuilds the target chunks of
        /// the global tensor element for element, each element written exactly once.
        #[test]
        fn runs_move_every_element_once(
            shape in proptest::collection::vec(1u64..7, 1..4),
            source_cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
            target_cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
        ) {
            let sources = grid(&shape, &source_cuts);
            let targets = grid(&shape, &target_cuts);
            prop_assert_eq!(check_tiling(&shape, &sources), Ok(()));
            let global = strides(&shape);
            let id = |coord: &[u64]| coord.iter().zip(&global).map(|(c, s)| c * s).sum::<u64>();
            // Each source chunk's data: the global index of each element.
            let data: Vec<Vec<u64>> = sources.iter().map(|s| {
                let mut v = Vec::new();
                let mut at = s.offsets.clone();
                for _ in 0..s.numel() {
                    v.push(id(&at));
                    for d in (0..at.len()).rev() {
                        at[d] += 1;
                        if at[d] < s.end(d) { break; }
                        at[d] = s.offsets[d];
                    }
                }
                v
            }).collect();
            for t in &targets {
                let mut out = vec![None; t.numel() as usize];
                for (s, d) in sources.iter().zip(&data) {
                    for r in runs(t, s) {
                        for k in 0..r.len {
                            let slot = &mut out[(r.target + k) as usize];
                            prop_assert!(slot.is_none(), "element written twice");
                            *slot = Some(d[(r.source + k) as usize]);
                        }
                    }
                }
                let mut at = t.offsets.clone();
                for slot in &out {
                    prop_assert_eq!(*slot, Some(id(&at)));
                    for d in (0..at.len()).rev() {
                        at[d] += 1;
                        if at[d] < t.end(d) { break; }
                        at[d] = t.offsets[d];
                    }
                }
            }
        }

        /// The merged runs are every source's runs, each once, in strictly increasing target order.
        #[test]
        fn merged_runs_are_all_runs_in_target_order(
            shape in proptest::collection::vec(1u64..7, 1..4),
            source_cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
            target_cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
        ) {
            let sources = grid(&shape, &source_cuts);
            for t in grid(&shape, &target_cuts) {
                let merged: Vec<(usize, Run)> = merged_runs(&t, &sources).collect();
                prop_assert!(merged.windows(2).all(|w| w[0].1.target + w[0].1.len <= w[1].1.target));
                let mut want: Vec<(usize, Run)> =
                    sources.iter().enumerate().flat_map(|(i, s)| runs(&t, s).map(move |r| (i, r))).collect();
                let mut got = merged.clone();
                let key = |x: &(usize, Run)| (x.0, x.1.target);
                want.sort_by_key(key);
                got.sort_by_key(key);
                prop_assert_eq!(got, want);
            }
        }
    }
}
