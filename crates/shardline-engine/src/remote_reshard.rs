//! A reshard split by rank on an object-store artifact store, for a Megatron-FSDP
//! (`fsdp_dtensor`) source kept in its dialect. No task reads the source whole:
//!
//! - a rank task reads the source's `.metadata` and bytes items, plans the reshard, then fetches
//!   only the storage items of the source chunks its target rank file is made from (ranged
//!   requests pinned to the listed versions, into a sparse local copy), locates their bytes,
//!   writes the file in its scratch and puts it under the step's prefix;
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
use shardline_formats::training::common_state::{COMMON_PT, METADATA_JSON};
use shardline_formats::training::{commit_resharded_listed, rank_sources, TrainingCheckpoint};
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

/// `[start, end)` ranges sorted, touching and overlapping ones joined.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
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
    // The storage items of the source chunks the file is made from, by rank file; an unlocated
    // chunk's offset and length are its whole item's.
    let wanted = rank_sources(&source.planned.source, &source.planned.plan, rank);
    let mut by_file: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    for &(t, c) in &wanted {
        let chunk = &source.planned.source.checkpoint.tensors[t].chunks[c];
        by_file
            .entry(chunk.file.to_string())
            .or_default()
            .push((chunk.data_offset, chunk.data_offset + chunk.data_len));
    }
    let total: u64 = source.listing.iter().filter(|o| o.name.ends_with(".distcp")).map(|o| o.size).sum();
    let (mut fetched, mut requests) = (0u64, 0usize);
    ctx.runtime.block_on(async {
        for (name, ranges) in by_file {
            let ranges = merged(ranges);
            let object = source.listing.iter().find(|o| o.name == name).ok_or_else(|| {
                StepError::fatal(format!("{}: rank file `{name}` named by `.metadata` is not in the store", source.url))
            })?;
            let path = source.dir.join(&name);
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| transient(format!("{}: {e}", path.display())))?;
            requests += ranges.len();
            fetched += source
                .artifacts
                .fetch_ranges(&name, object.e_tag.as_deref(), &ranges, Arc::new(file))
                .await
                .map_err(transient)?;
        }
        Ok::<(), StepError>(())
    })?;
    source.planned.source.locate(&wanted).map_err(|e| StepError::fatal(e.to_string()))?;
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
         requests ({} source chunks); wrote {bytes} bytes and put `{name}` under {remote}",
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
