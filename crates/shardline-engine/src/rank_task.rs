//! A rank task of a run whose outputs live in an artifact store. The release bytes its rank file
//! is written from are fetched — a release file whole, into the worker's file cache, when the
//! ranks the worker can expect to run need half of it or more; otherwise just the byte ranges —
//! and the file is written and uploaded a section of at most `rank_section_bytes` at a time: the
//! section's ranges fetched into the sparse staged release, the section written at its offsets,
//! its whole parts uploaded, then the disk both took given back (holes punched) before the next
//! section. So a rank needs a few sections' worth of disk, whatever the size of its file. The
//! upload is recorded in the job store under the lease before its first part and left open for
//! the commit.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use rustix::fs::{fallocate, FallocateFlags};
use serde_json::json;
use shardline_artifacts::{Artifacts, PartsUpload, PART_BYTES};
use shardline_control::graph::ShardJob;
use shardline_control::{PartUpload, TaskOutput};
use shardline_formats::execute::{self, ByteRange, OutputFormat, SourceMap};
use shardline_layout::PlanTable;
use shardline_store::WorkerState;

use crate::objects::DEFAULT_RANK_SECTION_BYTES;
use crate::remote::{
    ledger, link_whole, open_artifacts, staged_plan, transient, whole_file_lock, whole_file_path, Staged,
};
use crate::steps::{StepContext, StepError};

/// A worker whose rank tasks can be expected to read at least this share of a release file
/// between them reads it whole instead (once, kept in its file cache for its next tasks): a few
/// streamed requests instead of one per tensor piece, per rank. Every rank of an FSDP plan reads
/// a slice of nearly every tensor, so ranged reads cost about (ranks × tensors) requests, which
/// a store serves at a fixed cost each; reading whole fetches at most 1/share of what the ranges
/// would.
const WHOLE_FILE_SHARE: f64 = 0.5;
/// Free bytes a whole-file read must leave on the worker's disk.
const WHOLE_FILE_RESERVE: u64 = 1 << 30;

/// Runs rank `rank` of the plan `plan_task` recorded.
pub fn rank(job: &ShardJob, plan_task: &str, rank: u64, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let remote = job.remote.as_deref().ok_or_else(|| StepError::fatal("no artifact prefix for the checkpoint"))?;
    let (staged, plan) = staged_plan(ctx, job, Some(plan_task), ctx.scratch)?;
    let options = crate::steps::exec_options(job);
    let (name, _) = execute::rank_files(&plan, options.format)
        .into_iter()
        .nth(rank as usize)
        .ok_or_else(|| StepError::fatal(format!("rank {rank} is outside the plan")))?;
    let release_dir = ctx.scratch.join("release");
    let (names, all) = {
        let sources = SourceMap::new(&plan, &staged.release).map_err(|e| StepError::fatal(e.to_string()))?;
        let names: Vec<String> = sources
            .file_paths()
            .map(|p| p.strip_prefix(&release_dir).unwrap_or(p).to_string_lossy().into_owned())
            .collect();
        (names, sources.rank_ranges(&PlanTable::new(&plan), rank))
    };
    let mut fetched = read_whole_files(ctx, &staged, &names, &all, plan.world())?;
    // Opened after the whole files are linked in: it reads nothing, it only locates ranges.
    let sources = SourceMap::new(&plan, &staged.release).map_err(|e| StepError::fatal(e.to_string()))?;
    let table = PlanTable::new(&plan);
    let out = ctx.scratch.join("out");
    fs::create_dir_all(&out).map_err(|e| transient(format!("{}: {e}", out.display())))?;
    let path = out.join(&name);
    let artifacts = open_artifacts(&crate::remote::dcp_prefix(job, remote)?, ctx)?;
    let ledger = ledger(ctx)?;
    let mut upload = ctx
        .runtime
        .block_on(artifacts.begin_upload(&name, |id: String| {
            let (artifacts, name) = (&artifacts, &name);
            async move { ledger.opened(artifacts, name, &id).await }
        }))
        .map_err(transient)?;
    let section_bytes = match ctx.objects.rank_section_bytes {
        0 => DEFAULT_RANK_SECTION_BYTES,
        n => n,
    };
    let stage = SparseRelease { ctx, staged: &staged, names: &names, release_dir: &release_dir };
    let ship = |upload: &mut PartsUpload, upto, last| ship(ctx, &artifacts, upload, &path, upto, last);
    let written = match options.format {
        OutputFormat::Dcp => {
            let spans = execute::rank_item_spans(&plan, rank);
            let sections = sections(&spans, section_bytes);
            let mut done = Ok(0);
            for (i, items) in sections.iter().enumerate() {
                let ranges = sources.rank_ranges_of(&table, rank, items.clone());
                done = stage.fetch(&ranges).and_then(|n| {
                    fetched += n;
                    let (_, end) = execute::write_rank_section(
                        &plan,
                        &staged.release,
                        &path,
                        rank,
                        items.clone(),
                        &options,
                        ctx.progress,
                    )
                    .map_err(|e| StepError::transient(e.to_string()))?;
                    let last = i + 1 == sections.len();
                    ship(&mut upload, if last { end } else { end / PART_BYTES * PART_BYTES }, last)?;
                    stage.free(&ranges);
                    Ok(end)
                });
                if done.is_err() {
                    break;
                }
            }
            if sections.is_empty() {
                done = File::create(&path)
                    .map_err(|e| transient(format!("{}: {e}", path.display())))
                    .and_then(|_| ship(&mut upload, 0, true))
                    .map(|()| 0);
            }
            done.map(|len| (len, sections.len()))
        }
        // A safetensors rank file is written whole (its header says where everything is).
        OutputFormat::DcpSafetensors => stage.fetch(&all).and_then(|n| {
            fetched += n;
            let len = execute::write_rank_file(&plan, &staged.release, &out, rank, &options, ctx.progress)
                .map_err(|e| StepError::transient(e.to_string()))?;
            ship(&mut upload, len, true)?;
            Ok((len, 1))
        }),
    };
    let (len, sections) = match written {
        Ok(w) => w,
        Err(e) => {
            ctx.runtime.block_on(artifacts.abort_parts(&upload));
            return Err(e);
        }
    };
    (ctx.log)(format!(
        "fetched {fetched} release bytes ({} ranges needed) for rank {rank}; written in {sections} section(s) of at \
         most {section_bytes} bytes",
        all.len()
    ));
    let upload = upload.open();
    (ctx.log)(format!("rank {rank}: {len} file bytes uploaded in {} parts (open)", upload.parts.len()));
    let (name, upload_id, parts, size) = (upload.name, upload.upload_id, upload.parts, upload.size);
    Ok(TaskOutput {
        bytes: Some(len),
        artifact: Some(remote.to_string()),
        upload: Some(PartUpload { name, upload_id, parts, size }),
        ..TaskOutput::default()
    }
    .with("rank", json!(rank)))
}

/// Consecutive items of a rank file, cut where a section reaches `max` bytes (an item larger
/// than that is a section of its own).
fn sections(spans: &[(u64, u64)], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, (_, len)) in spans.iter().enumerate() {
        if i > start && bytes + len > max {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += len;
    }
    if start < spans.len() {
        out.push(start..spans.len());
    }
    out
}

/// A release staged as sparse files in a task's directory, filled in by ranges as the task needs
/// them (files the worker read whole are links into its file cache and are left alone).
pub(crate) struct SparseRelease<'a> {
    pub(crate) ctx: &'a StepContext<'a>,
    pub(crate) staged: &'a Staged,
    /// The release files' names, by the index a [`ByteRange`] gives.
    pub(crate) names: &'a [String],
    pub(crate) release_dir: &'a Path,
}

impl SparseRelease<'_> {
    /// A staged release file that is this task's own sparse copy (not a link into the file cache).
    fn sparse(&self, file: usize) -> Option<std::path::PathBuf> {
        let path = self.release_dir.join(self.names.get(file)?);
        fs::metadata(&path).is_ok_and(|m| m.nlink() == 1).then_some(path)
    }

    /// Fetches `ranges` of the release files not read whole into the staged copies.
    pub(crate) fn fetch(&self, ranges: &[ByteRange]) -> Result<u64, StepError> {
        self.ctx.runtime.block_on(async {
            let mut total = 0;
            for (fi, name) in self.names.iter().enumerate() {
                let mine: Vec<(u64, u64)> = ranges.iter().filter(|r| r.file == fi).map(|r| (r.start, r.end)).collect();
                let Some(path) = self.sparse(fi).filter(|_| !mine.is_empty()) else { continue };
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| transient(format!("{}: {e}", path.display())))?;
                let tag = self.staged.tags.get(name).cloned().flatten();
                total += self
                    .staged
                    .artifacts
                    .fetch_ranges(name, tag.as_deref(), &mine, Arc::new(file))
                    .await
                    .map_err(transient)?;
            }
            Ok(total)
        })
    }

    /// Gives back the disk `ranges` took in the staged copies (a later section that needs some
    /// of those bytes fetches them again).
    pub(crate) fn free(&self, ranges: &[ByteRange]) {
        for r in ranges {
            if let Some(file) = self.sparse(r.file).and_then(|p| OpenOptions::new().write(true).open(p).ok()) {
                punch(&file, r.start, r.end - r.start);
            }
        }
    }
}

/// Uploads the bytes of the file at `path` up to `upto` that `upload` has not yet sent (`last`:
/// the rest of the file), then frees them on disk.
fn ship(
    ctx: &StepContext,
    artifacts: &Artifacts,
    upload: &mut PartsUpload,
    path: &Path,
    upto: u64,
    last: bool,
) -> Result<(), StepError> {
    let file = Arc::new(File::open(path).map_err(|e| transient(format!("{}: {e}", path.display())))?);
    ctx.runtime.block_on(artifacts.put_parts(upload, &file, path, upto, last)).map_err(transient)?;
    punch(&file, 0, upload.size());
    Ok(())
}

/// Punches a hole over `[offset, offset + len)` of `file`, keeping its size. Best effort: a file
/// system without holes keeps the bytes, which only costs disk.
fn punch(file: &File, offset: u64, len: u64) {
    if len > 0 {
        let _ = fallocate(file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len);
    }
}

/// Reads whole, into the worker's file cache, the release files the ranks this worker can
/// expect to run need half of or more (when the disk has room), and links them into the staged
/// release. Returns the bytes read. `world`: the tasks like this one the run has.
pub(crate) fn read_whole_files(
    ctx: &StepContext,
    staged: &Staged,
    names: &[String],
    ranges: &[ByteRange],
    world: u64,
) -> Result<u64, StepError> {
    let ranks_here = ranks_per_worker(ctx, world);
    ctx.runtime.block_on(async {
        let mut total = 0;
        for (fi, name) in names.iter().enumerate() {
            let needed: u64 = ranges.iter().filter(|r| r.file == fi).map(|r| r.end - r.start).sum();
            if needed == 0 {
                continue;
            }
            let path = ctx.scratch.join("release").join(name);
            let tag = staged.tags.get(name).cloned().flatten();
            let whole = whole_file_path(ctx, staged.artifacts.url(), name, tag.as_deref());
            let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            // One read of a whole file at a time per worker: a second task waits and links it.
            let lock = whole_file_lock(&whole);
            let _held = lock.lock().await;
            if fs::metadata(&whole).is_ok_and(|m| m.len() == size) {
                link_whole(&whole, &path)?;
            } else if reads_whole(needed, size, ranks_here, &whole) {
                total += read_whole(&staged.artifacts, name, tag.as_deref(), &whole).await?;
                link_whole(&whole, &path)?;
            }
        }
        Ok(total)
    })
}

/// Whether a rank needing `needed` bytes of a file of `size` bytes reads it whole into `whole`:
/// when the `ranks` tasks this worker can expect to run of the plan need at least
/// [`WHOLE_FILE_SHARE`] of it (ranks' needs are alike in size) and the disk has room to keep it.
fn reads_whole(needed: u64, size: u64, ranks: u64, whole: &Path) -> bool {
    let share = needed as f64 / size.max(1) as f64 * ranks as f64;
    let room = crate::disk::measure(whole).is_ok_and(|d| d.free >= size.saturating_add(WHOLE_FILE_RESERVE));
    share >= WHOLE_FILE_SHARE && room
}

/// The rank tasks of a `world`-rank plan this worker can expect to run: the world shared among
/// the active workers (1 when the job store cannot say).
fn ranks_per_worker(ctx: &StepContext, world: u64) -> u64 {
    let Some(ledger) = ctx.ledger else { return 1 };
    let active = ctx
        .runtime
        .block_on(ledger.store.list_workers())
        .map(|ws| ws.iter().filter(|w| w.state == WorkerState::Active).count() as u64)
        .unwrap_or(0);
    if active == 0 {
        1
    } else {
        world.div_ceil(active)
    }
}

/// Reads `name` whole into the worker's file cache at `whole` (through a temporary name, so a
/// concurrent or interrupted read never leaves a short file there).
async fn read_whole(artifacts: &Artifacts, name: &str, tag: Option<&str>, whole: &Path) -> Result<u64, StepError> {
    let dir = whole.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| transient(format!("{}: {e}", dir.display())))?;
    let tmp = tempfile_path(whole);
    let read = artifacts.fetch_whole(name, tag, &tmp).await;
    match read {
        Ok(n) => {
            fs::rename(&tmp, whole).map_err(|e| transient(format!("{}: {e}", whole.display())))?;
            Ok(n)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(transient(e))
        }
    }
}

/// A name next to `path` no other task uses.
fn tempfile_path(path: &Path) -> std::path::PathBuf {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".partial-{}-{n}", std::process::id()));
    std::path::PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::sections;

    #[test]
    fn sections_cut_where_they_reach_the_limit_and_keep_large_items_whole() {
        let spans: Vec<(u64, u64)> = [4, 4, 4, 10, 1, 1, 1]
            .iter()
            .scan(0, |at, &l| {
                let s = (*at, l);
                *at += l;
                Some(s)
            })
            .collect();
        assert_eq!(sections(&spans, 8), vec![0..2, 2..3, 3..4, 4..7]);
        assert_eq!(sections(&spans, 100), vec![0..7]);
        assert_eq!(sections(&[], 8), Vec::<std::ops::Range<usize>>::new());
    }
}
