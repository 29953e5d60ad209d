//! A reshard written by several tasks: each writes some of the target rank files
//! ([`write_resharded_ranks`]), then one commit ([`commit_resharded`]) checks that every file is
//! there at its planned length and writes what names them — a dialect's object and RNG files,
//! `.metadata` last, and for `torch_dist` the save directory's `common.pt`, `metadata.json` and
//! tracker. A rank file's layout follows from the plan alone, so the commit needs none of the
//! writers' reports, and a writer killed half-way costs one file written again.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{merged_runs, ChunkBox, ReshardPlan};

use super::write::{edit_args, finish, io_err, planned_totals, rank_items, write_files, FileTotals, OutFile};
use super::{save_dir, torch_dist_save, ItemData, ReshardReport, TrainingCheckpoint, TrainingError};
use crate::execute::{dcp_rank_file, ExecuteError, Progress};

/// Where a reshard's rank files go and what they are made with.
struct Layout {
    /// The directory of the rank files and `.metadata`.
    dir: PathBuf,
    /// `args` rewritten for the target mesh (not for `torch_dist`, which keeps it in its
    /// common state).
    edited: HashMap<usize, Vec<u8>>,
    args_set: Vec<String>,
    args_missing: Vec<String>,
    /// `torch_dist`: its common state, whose name is the checkpoint directory's.
    common: Option<torch_dist_save::CommonState>,
}

impl Layout {
    /// The layout of `plan` written under `out`: the checkpoint directory itself, or for
    /// `torch_dist` the Megatron-LM save directory holding it.
    fn of(source: &TrainingCheckpoint, plan: &ReshardPlan, out: &Path) -> Result<Layout, TrainingError> {
        let src_dir = fs::canonicalize(&source.checkpoint.dir).ok();
        if src_dir.is_some() && fs::canonicalize(out).ok() == src_dir {
            let error = io::Error::other("the output directory is the source checkpoint");
            return Err(
                ExecuteError::Io { path: out.to_path_buf(), action: "write the resharded checkpoint", error }.into()
            );
        }
        if plan.dialect == Dialect::TorchDist {
            let common = torch_dist_save::common_state(source, plan)?;
            let dir = torch_dist_save::checkpoint_dir(out, &common);
            let edited = HashMap::new();
            let args_set = plan.args_updates().iter().map(|(k, _)| k.to_string()).collect();
            return Ok(Layout { dir, edited, args_set, args_missing: Vec::new(), common: Some(common) });
        }
        let (edited, args_set, args_missing) = edit_args(source, plan)?;
        Ok(Layout { dir: out.to_path_buf(), edited, args_set, args_missing, common: None })
    }

    fn report(&self, files: &[FileTotals]) -> ReshardReport {
        let sum = |f: fn(&FileTotals) -> u64| files.iter().map(f).sum::<u64>();
        ReshardReport {
            files: files.len() as u64,
            tensor_bytes: sum(|t| t.tensor_bytes),
            file_bytes: sum(|t| t.len),
            chunks: sum(|t| t.chunks),
            args_set: self.args_set.clone(),
            args_missing: self.args_missing.clone(),
        }
    }
}

/// Writes the target rank files `ranks` of `plan` under `out` (created), `threads` at a time.
/// A checkpoint already named there is withdrawn first (its `.metadata`, or a save directory's
/// tracker) so no reader takes the directory for one while its files change; files of other
/// ranks are left to their writers.
pub fn write_resharded_ranks(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    ranks: Range<u64>,
    threads: usize,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    let world = plan.mesh.world();
    if ranks.start >= ranks.end || ranks.end > world {
        let error = io::Error::other(format!("ranks {ranks:?} are not within the target's {world}"));
        return Err(ExecuteError::Io { path: out.to_path_buf(), action: "write rank files", error }.into());
    }
    let layout = Layout::of(source, plan, out)?;
    if layout.common.is_some() {
        fs::create_dir_all(out).map_err(io_err(out, "create output directory"))?;
        save_dir::withdraw_tracker(out)?;
    }
    fs::create_dir_all(&layout.dir).map_err(io_err(&layout.dir, "create checkpoint directory"))?;
    let marker = layout.dir.join(".metadata");
    match fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&marker, "withdraw the old .metadata")(e).into()),
    }
    // Each file under a temporary name, synced, then renamed into place: a writer killed
    // half-way (or one that lost its lease and wakes up late) never leaves a rank file of the
    // planned name that is not complete, and a late one renames identical bytes.
    let count = (ranks.end - ranks.start) as usize;
    let partial = |rank: u64| layout.dir.join(format!(".{}.partial", dcp_rank_file(rank)));
    let totals = write_files(source, plan, count, threads.max(1), progress, &layout.edited, |i| {
        let rank = ranks.start + i as u64;
        let items = rank_items(source, plan, &layout.edited, rank).collect();
        Ok(OutFile { path: partial(rank), header: Vec::new(), items })
    })?;
    for rank in ranks {
        let fin = layout.dir.join(dcp_rank_file(rank));
        fs::rename(partial(rank), &fin).map_err(io_err(&fin, "rename rank file into place"))?;
    }
    fs::File::open(&layout.dir).and_then(|d| d.sync_all()).map_err(io_err(&layout.dir, "sync checkpoint directory"))?;
    Ok(layout.report(&totals))
}

/// Finishes a reshard whose rank files [`write_resharded_ranks`] wrote under `out`: every one
/// must be there at its planned length (else nothing is written and the error names the first
/// that is not), then what names them is written, `.metadata` last.
pub fn commit_resharded(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
) -> Result<ReshardReport, TrainingError> {
    commit_with(source, plan, out, |path, _| fs::metadata(path).map(|m| m.len()))
}

/// [`commit_resharded`] of rank files that are not under `out` but were put elsewhere (an
/// object store), their lengths `listed` by name relative to `out`: what names them is written
/// into `out`, to be put after them.
pub fn commit_resharded_listed(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    listed: &HashMap<String, u64>,
) -> Result<ReshardReport, TrainingError> {
    fs::create_dir_all(out).map_err(io_err(out, "create output directory"))?;
    commit_with(source, plan, out, |_, name| {
        listed.get(name).copied().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not listed"))
    })
}

/// The commit, with `found(path, name)` the length of the rank file at `path` (`name` relative
/// to `out`).
fn commit_with(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    found: impl Fn(&Path, &str) -> io::Result<u64>,
) -> Result<ReshardReport, TrainingError> {
    let layout = Layout::of(source, plan, out)?;
    let rel_dir = layout.dir.strip_prefix(out).unwrap_or(Path::new("")).to_path_buf();
    let mut files = Vec::new();
    for rank in 0..plan.mesh.world() {
        let planned = planned_totals(source, plan, &layout.edited, rank);
        let path = layout.dir.join(dcp_rank_file(rank));
        let name = rel_dir.join(dcp_rank_file(rank)).to_string_lossy().into_owned();
        let found = found(&path, &name);
        if found.as_ref().ok() != Some(&planned.len) {
            let what = match found {
                Ok(len) => format!("it holds {len} bytes of the {} planned", planned.len),
                Err(e) => e.to_string(),
            };
            let error = io::Error::other(format!("rank {rank}'s file is not complete ({what})"));
            return Err(ExecuteError::Io { path, action: "commit the reshard", error }.into());
        }
        files.push(planned);
    }
    fs::create_dir_all(&layout.dir).map_err(io_err(&layout.dir, "create checkpoint directory"))?;
    let rng = match &layout.common {
        Some(_) => torch_dist_save::rng_objects(source, plan)?,
        None => Vec::new(),
    };
    finish(source, plan, &layout.dir, &layout.edited, &rng)?;
    if let Some(common) = &layout.common {
        save_dir::finish_save(out, &common.dir_name, &common.archive)?;
    }
    Ok(layout.report(&files))
}

/// The stored chunks (`(tensor, chunk)` of the source's checkpoint) that target rank `rank`'s
/// file is made from: every chunk whose box meets one of the rank's chunks.
pub fn rank_sources(source: &TrainingCheckpoint, plan: &ReshardPlan, rank: u64) -> Vec<(usize, usize)> {
    let chunks: std::collections::BTreeSet<(usize, usize)> =
        rank_source_ranges(source, plan, rank).into_iter().map(|(chunk, _, _)| chunk).collect();
    chunks.into_iter().collect()
}

/// What target rank `rank`'s file reads of the source: `((tensor, chunk), start, len)`, byte
/// ranges of stored chunks relative to each chunk's first data byte — the runs its writer
/// copies, so a task writing that file alone fetches exactly these (and the chunks' framing).
pub fn rank_source_ranges(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    rank: u64,
) -> Vec<((usize, usize), u64, u64)> {
    let mut out = Vec::new();
    let mesh = &plan.mesh;
    for t in &plan.tensors {
        let ItemData::Tensor(stored) = source.data[t.source] else { continue };
        let stored_tensor = &source.checkpoint.tensors[stored];
        let size = stored_tensor.dtype.size() as u64;
        let boxes: Vec<ChunkBox> = stored_tensor
            .chunks
            .iter()
            .map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() })
            .collect();
        for ci in t.out.chunks_of_rank(mesh, rank) {
            let c = t.out.chunk(mesh, ci);
            if !c.written || c.numel() == 0 {
                continue;
            }
            let target = ChunkBox { offsets: c.offsets, sizes: c.sizes };
            out.extend(merged_runs(&target, &boxes).map(|(i, run)| ((stored, i), run.source * size, run.len * size)));
        }
    }
    out
}
