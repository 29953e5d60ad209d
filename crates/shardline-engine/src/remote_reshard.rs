//! A reshard split by rank on an object-store artifact store, for a Megatron-FSDP
//! (`fsdp_dtensor`) source kept in its dialect. No task reads the source whole:
//!
//! - a rank task reads the source's `.metadata` and bytes items and plans the reshard; of the
//!   source chunks its target rank file is made from it fetches the framing of each storage item
//!   and just the byte runs its writer copies (ranged requests pinned to the listed versions,
//!   into a sparse local copy): in one pass where an item is laid out as Shardline writes it,
//!   its framing then its data otherwise (the first and last few KiB of the item, the whole item
//!   when that does not hold it); it locates the chunks strictly, writes the file in its scratch
//!   and puts it under the step's prefix;
//! - the commit reads `.metadata` and the bytes items again, checks every listed rank file
//!   against its planned length and puts `.metadata` last.
//!
//! Any other source (a `torch_dist` save directory, a translation, a torchtitan or NeMo Automodel
//! checkpoint) is resharded whole by the commit task, as before the split; its rank tasks say so.

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use shardline_artifacts::{Artifacts, ListedObject};
use shardline_control::graph::{ReshardJob, ReshardSource};
use shardline_control::TaskOutput;
use shardline_formats::checkpoint::torchtitan_target;
use shardline_formats::execute::dcp_rank_file;
use shardline_formats::torch_save::TensorArchive;
use shardline_formats::training::common_state::{COMMON_PT, METADATA_JSON};
use shardline_formats::training::{commit_resharded_listed, rank_source_ranges, TrainingCheckpoint};
use shardline_layout::dialect::Dialect;
use shardline_layout::Mesh;
use shardline_ops::PlannedReshard;

use crate::checkpoints::{plan_megatron, reshard_output};
use crate::remote::{open_artifacts, put_file, transient};
use crate::steps::{StepContext, StepError};

/// The source of a split remote reshard, planned from its `.metadata` and bytes items alone.
struct Source {
    url: String,
    artifacts: Artifacts,
    listing: Vec<ListedObject>,
    /// The sparse local copy the plan was made from.
    dir: PathBuf,
    planned: PlannedReshard,
}

/// The source of `job`, when it is one a split remote reshard reads in place (see the module
/// comment); `None` when the commit task reshards it whole.
fn open_source(job: &ReshardJob, ctx: &StepContext, scratch: &Path) -> Result<Option<Source>, StepError> {
    let ReshardSource::Task { task } = &job.source else { return Ok(None) };
    let upstream = ctx.outputs.get(task);
    let Some(url) = upstream.and_then(|o| o.artifact.clone()) else { return Ok(None) };
    if job.target.as_deref().is_some_and(|t| t != Dialect::FsdpDtensor.name()) {
        return Ok(None);
    }
    let artifacts = open_artifacts(&url, ctx)?;
    let listing = ctx.runtime.block_on(artifacts.list()).map_err(transient)?;
    let listed = |name: &str| listing.iter().any(|o| o.name == name);
    if !listed(".metadata") || listed(METADATA_JSON) || listed(COMMON_PT) {
        return Ok(None);
    }
    let dir = crate::sparse_checkpoint::fetch_sparse(&url, |_| false, &scratch.join("source"), ctx)?;
    // Rank files holding no bytes item were not fetched from at all: sparse files of their size,
    // so the checkpoint opens; their chunks are fetched by the tasks that read them.
    for o in listing.iter().filter(|o| o.name.ends_with(".distcp")) {
        let path = dir.join(&o.name);
        if !path.exists() {
            let file = OpenOptions::new().create(true).truncate(false).write(true).open(&path);
            file.and_then(|f| f.set_len(o.size)).map_err(|e| transient(format!("{}: {e}", path.display())))?;
        }
    }
    let source = TrainingCheckpoint::open_unlocated(&dir).map_err(|e| StepError::fatal(e.to_string()))?;
    if torchtitan_target(&source.checkpoint).is_some() {
        return Ok(None);
    }
    let mesh = Mesh { tp: job.tp, cp: job.cp, dp: job.dp, ep: job.ep, etp: job.etp };
    let planned = plan_megatron(ctx, job, &dir, source, mesh, None, upstream)?;
    Ok(Some(Source { url, artifacts, listing, dir, planned }))
}

/// Bytes of a storage item's start and end fetched to read its framing when it is not laid out
/// as Shardline writes it (a `torch.save` archive's records before and after the tensor's data).
const FRAMING_BYTES: u64 = 2 << 10;
/// Ranges of one file this close are fetched as one request.
const JOIN_GAP: u64 = 4 << 10;

/// `[start, end)` ranges sorted and joined where they overlap or are less than `gap` apart.
fn merged(mut ranges: Vec<(u64, u64)>, gap: u64) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1.saturating_add(gap) => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The byte runs a writer copies from one chunk (sorted), joined where the gap after a run is
/// no longer than it: one request for the column stripes of a row-split weight, while the bytes
/// fetched of the chunk stay under twice the bytes copied.
fn chunk_requests(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    let mut last_piece = 0u64;
    for (start, end) in runs {
        match out.last_mut() {
            Some(last) if start <= last.1.saturating_add(JOIN_GAP.max(last_piece)) => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
        last_piece = end - start;
    }
    out
}

/// `runs` (`(chunk, start, len)` relative to the chunk's data) at `data_at(chunk)`, in each
/// chunk joined by [`chunk_requests`], as rank-file ranges.
fn data_requests(
    runs: &[((usize, usize), u64, u64)],
    mut data_at: impl FnMut((usize, usize)) -> Option<(String, u64)>,
) -> Vec<(String, u64, u64)> {
    let mut by_chunk: BTreeMap<(usize, usize), Vec<(u64, u64)>> = BTreeMap::new();
    for &(chunk, start, len) in runs {
        by_chunk.entry(chunk).or_default().push((start, start + len));
    }
    let mut out = Vec::new();
    for (chunk, runs) in by_chunk {
        let Some((file, at)) = data_at(chunk) else { continue };
        out.extend(chunk_requests(runs).into_iter().map(|(s, e)| (file.clone(), at + s, at + e)));
    }
    out
}

/// Ranges of rank files, by file name.
type FileRanges = BTreeMap<String, Vec<(u64, u64)>>;

fn by_file(ranges: impl IntoIterator<Item = (String, u64, u64)>) -> FileRanges {
    let mut map = FileRanges::new();
    for (file, start, end) in ranges {
        if end > start {
            map.entry(file).or_default().push((start, end));
        }
    }
    map
}

/// Fetches `ranges` of the source into its sparse copy: `(bytes, requests)`.
fn fetch(source: &Source, ranges: FileRanges, ctx: &StepContext) -> Result<(u64, usize), StepError> {
    ctx.runtime.block_on(async {
        let (mut bytes, mut requests) = (0u64, 0usize);
        for (name, ranges) in ranges {
            let ranges = merged(ranges, JOIN_GAP);
            let object = source.listing.iter().find(|o| o.name == name).ok_or_else(|| {
                StepError::fatal(format!("{}: rank file `{name}` named by `.metadata` is not in the store", source.url))
            })?;
            let path = source.dir.join(&name);
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| transient(format!("{}: {e}", path.display())))?;
            requests += ranges.len();
            bytes += source
                .artifacts
                .fetch_ranges(&name, object.e_tag.as_deref(), &ranges, Arc::new(file))
                .await
                .map_err(transient)?;
        }
        Ok((bytes, requests))
    })
}

/// A source chunk a rank task reads: its storage item (unlocated, a chunk's offset and length
/// are its item's) and, when the item is as long as Shardline's archive of the chunk, where that
/// archive puts the data.
struct Item {
    file: String,
    start: u64,
    end: u64,
    predicted: Option<(u64, u64)>,
}

impl Item {
    fn of(source: &TrainingCheckpoint, (t, c): (usize, usize)) -> Item {
        let tensor = &source.checkpoint.tensors[t];
        let chunk = &tensor.chunks[c];
        let (start, end) = (chunk.data_offset, chunk.data_offset + chunk.data_len);
        let ours = TensorArchive::new(tensor.dtype, &chunk.sizes);
        let predicted = (ours.total_len() == end - start)
            .then(|| (start + ours.data_offset(), start + ours.data_offset() + ours.data_len()));
        Item { file: chunk.file.to_string(), start, end, predicted }
    }

    /// The bytes outside the data: all of them around the predicted data, else the item's ends.
    fn framing(&self) -> [(String, u64, u64); 2] {
        let (head_end, tail_start) = match self.predicted {
            Some((data, data_end)) => (data, data_end),
            None => {
                ((self.start + FRAMING_BYTES).min(self.end), self.end.saturating_sub(FRAMING_BYTES).max(self.start))
            }
        };
        [(self.file.clone(), self.start, head_end), (self.file.clone(), tail_start, self.end)]
    }
}

/// Runs a `checkpoint.reshard.rank` task on an artifact store: target rank file `rank`, put
/// under `remote`.
pub fn rank(job: &ReshardJob, rank: u64, remote: &str, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let out = TaskOutput::default().with("rank", json!(rank));
    let Some(mut source) = open_source(job, ctx, ctx.scratch)? else {
        (ctx.log)("this source is resharded whole by the reshard's commit task".into());
        return Ok(out.with("written_by_commit", json!(true)));
    };
    let world = source.planned.plan.mesh.world();
    if rank >= world {
        return Err(StepError::fatal(format!("rank {rank} is not in the target mesh ({world} ranks)")));
    }
    let runs = rank_source_ranges(&source.planned.source, &source.planned.plan, rank);
    let wanted: Vec<(usize, usize)> =
        runs.iter().map(|(chunk, _, _)| *chunk).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    let items: HashMap<(usize, usize), Item> =
        wanted.iter().map(|&chunk| (chunk, Item::of(&source.planned.source, chunk))).collect();
    // One pass: every item's framing, and the data runs where the data's place is predicted.
    let framing = items.values().flat_map(Item::framing);
    let predicted_data = data_requests(&runs, |chunk| {
        let item = &items[&chunk];
        item.predicted.map(|(data, _)| (item.file.clone(), data))
    });
    let (mut fetched, mut requests) = fetch(&source, by_file(framing.chain(predicted_data)), ctx)?;
    if let Err(e) = source.planned.source.locate(&wanted) {
        // A framing the fetched bytes do not hold: the items whole, then located strictly.
        (ctx.log)(format!("the framing of the source items was not where expected ({e}); fetching them whole"));
        let whole = items.values().map(|i| (i.file.clone(), i.start, i.end));
        let (b, r) = fetch(&source, by_file(whole), ctx)?;
        (fetched, requests) = (fetched + b, requests + r);
        source.planned.source.locate(&wanted).map_err(|e| StepError::fatal(e.to_string()))?;
    }
    // The data runs of items whose data is elsewhere than predicted (torch wrote them).
    let checkpoint = &source.planned.source.checkpoint;
    let rest = data_requests(&runs, |(t, c)| {
        let chunk = &checkpoint.tensors[t].chunks[c];
        let item = &items[&(t, c)];
        (item.predicted.map(|(data, _)| data) != Some(chunk.data_offset))
            .then(|| (item.file.clone(), chunk.data_offset))
    });
    let (b, r) = fetch(&source, by_file(rest), ctx)?;
    (fetched, requests) = (fetched + b, requests + r);
    let total: u64 = source.listing.iter().filter(|o| o.name.ends_with(".distcp")).map(|o| o.size).sum();
    let asked: u64 = runs.iter().map(|(_, _, len)| len).sum();
    let out_dir = ctx.scratch.join("out");
    let report = source
        .planned
        .write_ranks(&out_dir, rank..rank + 1, crate::checkpoints::threads(ctx), ctx.progress)
        .map_err(|e| StepError::fatal(e.to_string()))?;
    let name = dcp_rank_file(rank);
    let put = open_artifacts(remote, ctx)?;
    let bytes = ctx.runtime.block_on(put_file(&put, &name, &out_dir.join(&name), ctx))?;
    (ctx.log)(format!(
        "rank {rank} of {world}: read {fetched} of the {total} bytes of {}'s rank files in {requests} ranged \
         requests ({} source chunks, {asked} bytes of their data copied); wrote {bytes} bytes and put `{name}` \
         under {remote}",
        source.url,
        wanted.len()
    ));
    Ok(TaskOutput { bytes: Some(report.file_bytes), files: Some(1), ..out }
        .with("bytes_read", json!(fetched))
        .with("source_bytes", json!(total))
        .with("requests", json!(requests)))
}

/// Commits a reshard whose rank tasks put their files under `remote`: `None` when the source is
/// one the commit reshards whole (see [`open_source`]).
pub fn commit(job: &ReshardJob, remote: &str, ctx: &StepContext) -> Result<Option<TaskOutput>, StepError> {
    let Some(source) = open_source(job, ctx, ctx.scratch)? else { return Ok(None) };
    let put = open_artifacts(remote, ctx)?;
    let listing = ctx.runtime.block_on(put.list()).map_err(transient)?;
    let lengths: HashMap<String, u64> = listing.iter().map(|o| (o.name.clone(), o.size)).collect();
    let out_dir = ctx.scratch.join("out");
    let report = commit_resharded_listed(&source.planned.source, &source.planned.plan, &out_dir, &lengths)
        .map_err(|e| StepError::fatal(e.to_string()))?;
    // `.metadata` last: a reader that finds it finds every rank file it names.
    let bytes = ctx.runtime.block_on(put_file(&put, ".metadata", &out_dir.join(".metadata"), ctx))?;
    (ctx.log)(format!(
        "committed {} rank files ({} bytes) under {remote}; put `.metadata` ({bytes} bytes) last",
        report.files, report.file_bytes
    ));
    let upstream = match &job.source {
        ReshardSource::Task { task } => ctx.outputs.get(task),
        ReshardSource::Local { .. } => None,
    };
    let mut output = reshard_output(job, &source.planned, &source.dir, upstream, report.file_bytes);
    output.dir = None;
    output.artifact = Some(put.url().to_string());
    Ok(Some(output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_of_a_chunk_are_one_request_and_far_runs_are_not() {
        // Half rows of 16 KiB with the other halves between them (a TP 2 → 1 merge): joined.
        let stripes: Vec<(u64, u64)> = (0..4).map(|r| (r * 32768, r * 32768 + 16384)).collect();
        assert_eq!(chunk_requests(stripes), vec![(0, 3 * 32768 + 16384)]);
        // A run, then one three times as far as it is long: two requests.
        assert_eq!(chunk_requests(vec![(0, 10_000), (40_000, 50_000)]), vec![(0, 10_000), (40_000, 50_000)]);
        // Small runs a few bytes apart are one request whatever their size.
        assert_eq!(chunk_requests(vec![(100, 110), (0, 10), (200, 300)]), vec![(0, 300)]);
    }

    #[test]
    fn ranges_of_a_file_join_only_when_close() {
        assert_eq!(merged(vec![(10, 20), (0, 5), (15, 30)], 0), vec![(0, 5), (10, 30)]);
        assert_eq!(merged(vec![(0, 5), (5 + JOIN_GAP, 9000)], JOIN_GAP), vec![(0, 9000)]);
        assert_eq!(merged(vec![(0, 5), (6 + JOIN_GAP, 9000)], JOIN_GAP), vec![(0, 5), (6 + JOIN_GAP, 9000)]);
    }
}
