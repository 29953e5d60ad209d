//! What a reshard costs per target rank file, from its plan alone: the bytes each file holds,
//! and the source bytes and ranged reads it is made from. These are the figures a reshard split
//! into one task per target rank file is sized by, and they need no data: a checkpoint's
//! `.metadata` (or a planner-level model of one) says where every stored chunk is.
//!
//! A read is a run of one stored chunk's bytes: consecutive runs of the same chunk that follow
//! each other in it are one read, as one ranged request fetches them.

use std::collections::{BTreeSet, HashMap};

use super::boxes::{runs, ChunkBox};
use super::plan::{ReshardPlan, SourceItem};

/// One target rank file's share of a reshard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankCost {
    /// Chunks it holds.
    pub chunks: u64,
    /// Tensor bytes it holds.
    pub bytes_written: u64,
    /// Source tensor bytes it is made from (rows past the source, vocab padding, are zeros).
    pub bytes_read: u64,
    /// Ranged reads of the source those bytes take.
    pub reads: u64,
    /// Source rank files it reads from.
    pub source_files: u64,
}

/// The whole reshard's cost: each target rank file's, and the source's size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReshardCost {
    /// By target rank.
    pub ranks: Vec<RankCost>,
    /// Tensor bytes of the source.
    pub source_bytes: u64,
    /// Stored chunks of the source.
    pub source_chunks: u64,
}

impl ReshardCost {
    /// The largest share any target rank file takes of `field`.
    pub fn max(&self, field: impl Fn(&RankCost) -> u64) -> u64 {
        self.ranks.iter().map(field).max().unwrap_or(0)
    }

    /// The sum of `field` over the target rank files.
    pub fn total(&self, field: impl Fn(&RankCost) -> u64) -> u64 {
        self.ranks.iter().map(field).sum()
    }
}

/// A source tensor's stored chunks, ordered by their first row so that the chunks meeting a box
/// are found without a scan of all of them.
struct ChunkIndex<'a> {
    /// `(first row, chunk index)`, sorted.
    by_row: Vec<(u64, usize)>,
    /// The most rows any chunk spans.
    max_rows: u64,
    chunks: &'a [ChunkBox],
}

impl<'a> ChunkIndex<'a> {
    fn new(chunks: &'a [ChunkBox]) -> Self {
        let row = |c: &ChunkBox| c.offsets.first().copied().unwrap_or(0);
        let mut by_row: Vec<(u64, usize)> = chunks.iter().enumerate().map(|(i, c)| (row(c), i)).collect();
        by_row.sort_unstable();
        let max_rows = chunks.iter().map(|c| c.sizes.first().copied().unwrap_or(1)).max().unwrap_or(0);
        ChunkIndex { by_row, max_rows, chunks }
    }

    /// The chunks whose rows meet `[start, end)` (they may still miss along other dims).
    fn meeting(&self, start: u64, end: u64) -> impl Iterator<Item = usize> + '_ {
        let upto = self.by_row.partition_point(|&(first, _)| first < end);
        let from = self.by_row[..upto].partition_point(|&(first, _)| first + self.max_rows <= start);
        self.by_row[from..upto].iter().map(|&(_, i)| i)
    }
}

/// The cost of `plan` per target rank file. `items` are the source items it was planned from
/// and `files[i][k]` the source rank file holding chunk `k` of item `i`.
pub fn reshard_cost(items: &[SourceItem], files: &[Vec<u64>], plan: &ReshardPlan) -> ReshardCost {
    let mesh = &plan.mesh;
    let mut ranks = vec![RankCost::default(); mesh.world() as usize];
    let mut read_files: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); ranks.len()];
    let mut cost = ReshardCost::default();
    for item in items {
        if let Some(t) = &item.tensor {
            cost.source_chunks += t.chunks.len() as u64;
            cost.source_bytes += t.shape.iter().product::<u64>() * t.dtype.size() as u64;
        }
    }
    // Several target tensors can read one source item (an RNG state copied for a new TP rank).
    let mut indexes: HashMap<usize, ChunkIndex<'_>> = HashMap::new();
    for (ti, t) in plan.tensors.iter().enumerate() {
        let Some(source) = items.get(t.source).and_then(|i| i.tensor.as_ref()) else { continue };
        let index = indexes.entry(t.source).or_insert_with(|| ChunkIndex::new(&source.chunks));
        let (out_size, in_size) = (t.out.dtype.size() as u64, source.dtype.size() as u64);
        for c in plan.written_chunks(ti) {
            let r = &mut ranks[c.rank as usize];
            r.chunks += 1;
            r.bytes_written += c.numel() * out_size;
            let start = c.offsets.first().copied().unwrap_or(0);
            let end = start + c.sizes.first().copied().unwrap_or(1);
            let target = ChunkBox { offsets: c.offsets, sizes: c.sizes };
            for k in index.meeting(start, end) {
                let mut last_end = None;
                for run in runs(&target, &index.chunks[k]) {
                    r.bytes_read += run.len * in_size;
                    if last_end != Some(run.source) {
                        r.reads += 1;
                    }
                    last_end = Some(run.source + run.len);
                    if let Some(file) = files.get(t.source).and_then(|f| f.get(k)) {
                        read_files[c.rank as usize].insert(*file);
                    }
                }
            }
        }
    }
    for (r, f) in ranks.iter_mut().zip(read_files) {
        r.source_files = f.len() as u64;
    }
    cost.ranks = ranks;
    cost
}
