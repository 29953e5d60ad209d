//! Writing a resharded training checkpoint: every rank file's items placed before a byte is
//! written, each rank file filled by copying the runs of the source chunks that meet its chunks
//! (each source byte read once, through one fixed buffer per writer), then `.metadata` staged,
//! synced and renamed into place last. Rows no source chunk holds (vocab padding added for a
//! larger TP) are skipped: they read as zeros without being written.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{merged_runs, ChunkBox, ReshardPlan};
use shardline_layout::Chunk;

use super::copier::{Copier, Input};
use super::{save_dir, torch_dist_save, ItemData, TrainingCheckpoint, TrainingError};
use crate::dcp_metadata::{EntryRef, MetadataEncoder, StorageRef};
use crate::execute::{
    dcp_rank_file, for_each_unit, object_file, publish_metadata, run_syncer, write_object_files, ExecuteError,
    Progress, SyncJob,
};
use crate::pickle::set_int_fields;
use crate::torch_save::{edit_object_archive, TensorArchive, TorchSaveError};

/// Bytes of a rank file between two requests to start their writeback.
const SYNC_EVERY: u64 = 32 << 20;

/// What was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshardReport {
    pub files: u64,
    pub tensor_bytes: u64,
    pub file_bytes: u64,
    pub chunks: u64,
    /// `args` fields set to the target mesh, and those `args` did not have.
    pub args_set: Vec<String>,
    pub args_missing: Vec<String>,
}

/// One item of a target rank file and where it goes.
pub(super) enum OutItem {
    /// A chunk as DCP stores it: a `torch.save` archive of the tensor.
    Chunk { tensor: usize, chunk: Chunk, offset: u64, archive: TensorArchive },
    /// A chunk's bytes alone (a safetensors file's data section), `len` bytes at `offset`.
    Raw { tensor: usize, chunk: Chunk, offset: u64, len: u64 },
    /// `object` indexes the plan's objects (an RNG state copied for a new TP rank shares its
    /// source with the original but is an item of its own).
    Object { object: usize, offset: u64, length: u64 },
}

pub(super) fn io_err<'p>(path: &'p Path, action: &'static str) -> impl FnOnce(io::Error) -> ExecuteError + 'p {
    move |error| ExecuteError::Io { path: path.to_path_buf(), action, error }
}

/// Writes `plan` of `source` into `out` (created; an existing checkpoint there is an error
/// unless `overwrite`). On any error what was written is removed.
pub fn write_resharded(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    threads: usize,
    overwrite: bool,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    if out.join(".metadata").exists() && !overwrite {
        return Err(ExecuteError::Exists(out.to_path_buf(), ".metadata").into());
    }
    let src_dir = fs::canonicalize(&source.checkpoint.dir).ok();
    if src_dir.is_some() && fs::canonicalize(out).ok() == src_dir {
        return Err(ExecuteError::Io {
            path: out.to_path_buf(),
            action: "write the resharded checkpoint",
            error: io::Error::other("the output directory is the source checkpoint"),
        }
        .into());
    }
    if plan.dialect == Dialect::TorchDist {
        return write_torch_dist(source, plan, out, threads, overwrite, progress);
    }
    // Everything that can fail on the source's content fails before the output exists.
    let (edited, args_set, args_missing) = edit_args(source, plan)?;
    let created = crate::out_dir::create(out).map_err(io_err(out, "create output directory"))?;
    withdraw_old_checkpoint(out)?;
    let result = write_all(source, plan, out, threads, progress, &edited, &[]);
    match result {
        Ok((files, tensor_bytes, file_bytes, chunks)) => {
            Ok(ReshardReport { files, tensor_bytes, file_bytes, chunks, args_set, args_missing })
        }
        Err(e) => {
            remove_partial(out, plan);
            created.remove();
            Err(e)
        }
    }
}

fn remove_partial(dir: &Path, plan: &ReshardPlan) {
    for rank in 0..plan.mesh.world() {
        let _ = fs::remove_file(dir.join(dcp_rank_file(rank)));
        let _ = fs::remove_file(dir.join(object_file(rank)));
        let _ = fs::remove_file(dir.join(torch_dist_save::rng_file(rank)));
    }
    let _ = fs::remove_file(dir.join(".metadata.tmp"));
}

/// A `torch_dist` target: a Megatron-LM save directory in `root` — the checkpoint directory
/// written as any reshard (`.metadata` last), then `common.pt`, `metadata.json` and the tracker
/// (see `save_dir`).
fn write_torch_dist(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    root: &Path,
    threads: usize,
    overwrite: bool,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    if root.join(save_dir::TRACKER).exists() && !overwrite {
        return Err(ExecuteError::Exists(root.to_path_buf(), save_dir::TRACKER).into());
    }
    let common = torch_dist_save::common_state(source, plan)?;
    let rng = torch_dist_save::rng_objects(source, plan)?;
    let dir = torch_dist_save::checkpoint_dir(root, &common);
    let created_root = crate::out_dir::create(root).map_err(io_err(root, "create output directory"))?;
    save_dir::withdraw_tracker(root)?;
    let created = crate::out_dir::create(&dir).map_err(io_err(&dir, "create checkpoint directory"))?;
    withdraw_old_checkpoint(&dir)?;
    let edited = HashMap::new();
    let result = write_all(source, plan, &dir, threads, progress, &edited, &rng).and_then(|totals| {
        save_dir::finish_save(root, &common.dir_name, &common.archive)?;
        Ok(totals)
    });
    match result {
        Ok((files, tensor_bytes, file_bytes, chunks)) => {
            let args_set = plan.args_updates().iter().map(|(k, _)| k.to_string()).collect();
            Ok(ReshardReport { files, tensor_bytes, file_bytes, chunks, args_set, args_missing: Vec::new() })
        }
        Err(e) => {
            remove_partial(&dir, plan);
            created.remove();
            created_root.remove();
            Err(e)
        }
    }
}

/// Removes a checkpoint being replaced: its `.metadata` first (so no reader takes the directory
/// for a checkpoint from here on), then its rank files.
pub(super) fn withdraw_old_checkpoint(out: &Path) -> Result<(), TrainingError> {
    let marker = out.join(".metadata");
    match fs::remove_file(&marker) {
        Ok(()) => File::open(out).and_then(|d| d.sync_all()).map_err(io_err(out, "sync output directory"))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&marker, "withdraw the old .metadata")(e).into()),
    }
    for e in fs::read_dir(out).map_err(io_err(out, "list output directory"))?.flatten() {
        if e.file_name().to_string_lossy().ends_with(".distcp") {
            fs::remove_file(e.path()).map_err(io_err(&e.path(), "remove old rank file"))?;
        }
    }
    Ok(())
}

/// The `args` items rewritten with the target mesh: `(object index, archive)`, the fields set
/// and the fields `args` does not have.
#[allow(clippy::type_complexity)]
pub(super) fn edit_args(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
) -> Result<(HashMap<usize, Vec<u8>>, Vec<String>, Vec<String>), TrainingError> {
    let updates = plan.args_updates();
    let mut edited = HashMap::new();
    let mut set = Vec::new();
    for o in plan.objects.iter().filter(|o| o.is_args) {
        let mut edit = |pkl: &[u8]| {
            let (new, found) = set_int_fields(pkl, &updates).map_err(TorchSaveError::from)?;
            set = found;
            Ok(new)
        };
        let archive = match source.data[o.source] {
            ItemData::Object(i) => {
                let stored = &source.checkpoint.objects[i];
                let path = source.checkpoint.dir.join(&*stored.file);
                let f = File::open(&path).map_err(io_err(&path, "open rank file"))?;
                edit_object_archive(&f, stored.offset, stored.length, &mut edit)
            }
            ItemData::Inline(j) => {
                let bytes = &source.inline[j][..];
                edit_object_archive(bytes, 0, bytes.len() as u64, &mut edit)
            }
            ItemData::Tensor(_) => continue,
        }
        .map_err(|source| TrainingError::Object { key: o.key.clone(), source })?;
        edited.insert(o.source, archive);
    }
    let missing = if edited.is_empty() {
        Vec::new()
    } else {
        updates.iter().map(|(k, _)| k.to_string()).filter(|k| !set.contains(k)).collect()
    };
    Ok((edited, set, missing))
}

/// The items of `rank`'s file, in file order: its chunks in key order, then (rank 0) the
/// objects. Computed from the plan when asked for, by the writer of the file and again for
/// `.metadata`, so no list of every rank's chunks is ever held.
pub(super) fn rank_items<'p>(
    source: &'p TrainingCheckpoint,
    plan: &'p ReshardPlan,
    edited: &'p HashMap<usize, Vec<u8>>,
    rank: u64,
) -> impl Iterator<Item = OutItem> + 'p {
    let mesh = &plan.mesh;
    let chunks = plan.tensors.iter().enumerate().flat_map(move |(ti, t)| {
        t.out
            .chunks_of_rank(mesh, rank)
            .map(move |ci| t.out.chunk(mesh, ci))
            .filter(|c| c.written && c.numel() > 0)
            .map(move |c| (ti, c))
    });
    // torch_dist keeps the bytes items in its common state, and writes its `_extra_state`s.
    let in_dcp = plan.dialect != Dialect::TorchDist;
    let objects = plan.objects.iter().enumerate().filter(move |_| rank == 0 && in_dcp).filter_map(move |(oi, o)| {
        let stored = match source.data[o.source] {
            ItemData::Object(i) => source.checkpoint.objects[i].length,
            ItemData::Inline(j) => source.inline[j].len() as u64,
            ItemData::Tensor(_) => return None,
        };
        Some((oi, edited.get(&o.source).map_or(stored, |b| b.len() as u64)))
    });
    let mut end = 0u64;
    let chunk_items = chunks.map(move |(ti, c)| {
        // A placed chunk is stored with its placed shape (leading axes of size 1); same bytes.
        let t = &plan.tensors[ti].out;
        let (_, sizes) = plan.disk.place(&t.key, &t.shape).chunk(&c.offsets, &c.sizes);
        let archive = TensorArchive::new(t.dtype, &sizes);
        OutItem::Chunk { tensor: ti, chunk: c, offset: 0, archive }
    });
    let object_items = objects.map(|(oi, length)| OutItem::Object { object: oi, offset: 0, length });
    chunk_items.chain(object_items).map(move |mut item| {
        match &mut item {
            OutItem::Chunk { offset, archive, .. } => {
                *offset = end;
                end += archive.total_len();
            }
            OutItem::Object { offset, length, .. } | OutItem::Raw { offset, len: length, .. } => {
                *offset = end;
                end += *length;
            }
        }
        item
    })
}

/// What one rank file holds: its length, chunks and tensor bytes.
#[derive(Clone, Copy, Default)]
pub(super) struct FileTotals {
    pub len: u64,
    pub chunks: u64,
    pub tensor_bytes: u64,
}

/// One output file: where it goes, the bytes it starts with (a safetensors header), its items.
pub(super) struct OutFile {
    pub path: PathBuf,
    pub header: Vec<u8>,
    pub items: Vec<OutItem>,
}

/// Writes the `files` of `plan` from `source`, `threads` at a time, each made durable by a sync
/// thread as it grows; `file(i)` lays out file `i` (of `count`) when its writer starts.
pub(super) fn write_files(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    count: usize,
    threads: usize,
    progress: &Progress,
    edited: &HashMap<usize, Vec<u8>>,
    file: impl Fn(usize) -> Result<OutFile, ExecuteError> + Sync,
) -> Result<Vec<FileTotals>, TrainingError> {
    let mut inputs: HashMap<&str, File> = HashMap::new();
    let chunk_files = source.checkpoint.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| &*c.file));
    for name in chunk_files.chain(source.checkpoint.objects.iter().map(|o| &*o.file)) {
        if !inputs.contains_key(name) {
            let p = source.checkpoint.dir.join(name);
            inputs.insert(name, File::open(&p).map_err(io_err(&p, "open source rank file"))?);
        }
    }
    let kernel_copy = AtomicBool::new(true);
    // A sync thread makes the files durable while the writers go on (as `convert` does).
    let (sync_tx, sync_rx) = mpsc::channel();
    let (totals, synced) = std::thread::scope(|s| {
        let syncer = s.spawn(move || run_syncer(sync_rx));
        let tx = sync_tx; // dropped when the writers are done, which ends the sync thread
        let totals = for_each_unit(count, threads, progress, |i| {
            let f = file(i)?;
            let w =
                RankWriter { kernel_copy: &kernel_copy, source, plan, inputs: &inputs, edited, progress, syncer: &tx };
            let len = w.write(&f.path, &f.header, &f.items)?;
            let (mut chunks, mut tensor_bytes) = (0, 0);
            for item in &f.items {
                match item {
                    OutItem::Chunk { archive, .. } => tensor_bytes += archive.data_len(),
                    OutItem::Raw { len, .. } => tensor_bytes += len,
                    OutItem::Object { .. } => continue,
                }
                chunks += 1;
            }
            Ok(FileTotals { len, chunks, tensor_bytes })
        });
        drop(tx);
        (totals, syncer.join())
    });
    let totals = totals?;
    match synced {
        Ok(Ok(n)) if n == count => Ok(totals),
        Ok(Err(e)) => Err(e.into()),
        _ => Err(ExecuteError::Io {
            path: source.checkpoint.dir.clone(),
            action: "sync rank files",
            error: io::Error::other("the sync thread stopped early"),
        }
        .into()),
    }
}

fn write_all(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    threads: usize,
    progress: &Progress,
    edited: &HashMap<usize, Vec<u8>>,
    rng: &[torch_dist_save::RngArchive],
) -> Result<(u64, u64, u64, u64), TrainingError> {
    let world = plan.mesh.world();
    let totals = write_rank_files(source, plan, out, 0..world, threads, progress, edited)?;
    finish(source, plan, out, edited, rng)?;
    let sum = |f: fn(&FileTotals) -> u64| totals.iter().map(f).sum::<u64>();
    Ok((world, sum(|t| t.tensor_bytes), sum(|t| t.len), sum(|t| t.chunks)))
}

/// Writes the rank files `ranks` of `plan` into `out`.
fn write_rank_files(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    ranks: std::ops::Range<u64>,
    threads: usize,
    progress: &Progress,
    edited: &HashMap<usize, Vec<u8>>,
) -> Result<Vec<FileTotals>, TrainingError> {
    let count = (ranks.end - ranks.start) as usize;
    write_files(source, plan, count, threads, progress, edited, |i| {
        let rank = ranks.start + i as u64;
        let items = rank_items(source, plan, edited, rank).collect();
        Ok(OutFile { path: out.join(dcp_rank_file(rank)), header: Vec::new(), items })
    })
}

/// What names the rank files, once they are all written: a dialect's object files (`torch_dist`'s
/// `_extra_state`s, in a second file per rank as convert writes them), its RNG files, then
/// `.metadata`, staged, synced and renamed into place.
pub(super) fn finish(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    edited: &HashMap<usize, Vec<u8>>,
    rng: &[torch_dist_save::RngArchive],
) -> Result<(), TrainingError> {
    write_object_files(plan.disk.objects(), out)?;
    torch_dist_save::write_rng_files(rng, out)?;
    let tmp = out.join(".metadata.tmp");
    let f = File::create(&tmp).map_err(io_err(&tmp, "create .metadata.tmp"))?;
    let f = match plan.dialect {
        Dialect::FsdpDtensor | Dialect::Torchtitan(_) | Dialect::Automodel => write_metadata(source, plan, edited, f),
        Dialect::TorchDist => torch_dist_save::write_placed_metadata(
            plan,
            rng,
            |rank| rank_items(source, plan, edited, rank).map(|item| stored_of(plan, item)),
            f,
        ),
    }
    .map_err(io_err(&tmp, "write .metadata.tmp"))?;
    f.sync_all().map_err(io_err(&tmp, "sync .metadata.tmp"))?;
    publish_metadata(out)?;
    Ok(())
}

/// What rank file `rank` of `plan` holds once written: its length, chunks and tensor bytes.
pub(super) fn planned_totals(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    edited: &HashMap<usize, Vec<u8>>,
    rank: u64,
) -> FileTotals {
    let mut totals = FileTotals::default();
    for item in rank_items(source, plan, edited, rank) {
        match item {
            OutItem::Chunk { offset, archive, .. } => {
                totals.len = offset + archive.total_len();
                totals.tensor_bytes += archive.data_len();
                totals.chunks += 1;
            }
            OutItem::Raw { offset, len, .. } => {
                totals.len = offset + len;
                totals.tensor_bytes += len;
                totals.chunks += 1;
            }
            OutItem::Object { offset, length, .. } => totals.len = offset + length,
        }
    }
    totals
}

/// Where a placed layout's item is, for its `.metadata`.
fn stored_of(plan: &ReshardPlan, item: OutItem) -> torch_dist_save::Stored<'_> {
    match item {
        OutItem::Chunk { tensor, chunk, offset, archive } => {
            let t = &plan.tensors[tensor].out;
            let place = plan.disk.place(&t.key, &t.shape);
            let (offsets, _) = place.chunk(&chunk.offsets, &chunk.sizes);
            torch_dist_save::Stored { fqn: place.key, offsets: Some(offsets), offset, length: archive.total_len() }
        }
        OutItem::Object { object, offset, length } => {
            torch_dist_save::Stored { fqn: Cow::Borrowed(&plan.objects[object].key), offsets: None, offset, length }
        }
        OutItem::Raw { tensor, chunk, offset, len } => torch_dist_save::Stored {
            fqn: Cow::Borrowed(&plan.tensors[tensor].out.key),
            offsets: Some(chunk.offsets),
            offset,
            length: len,
        },
    }
}

/// `.metadata`: tensors with their chunks in rank order, bytes items, every key's path, and
/// every item's place.
fn write_metadata<W: io::Write>(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    edited: &HashMap<usize, Vec<u8>>,
    sink: W,
) -> io::Result<W> {
    let mut e = MetadataEncoder::new(sink);
    for (ti, t) in plan.tensors.iter().enumerate() {
        let mut listed: Vec<Chunk> = plan.written_chunks(ti).collect();
        listed.sort_by_key(|c| c.rank);
        let chunks = listed.iter().map(|c| (c.offsets.as_slice(), c.sizes.as_slice()));
        e.entry(&t.out.key, EntryRef::Tensor { dtype: t.out.dtype, size: &t.out.shape, chunks })?;
    }
    for o in &plan.objects {
        e.entry(&o.key, EntryRef::Bytes::<std::iter::Empty<(&[u64], &[u64])>>)?;
    }
    e.begin_planner_data();
    for t in &plan.tensors {
        e.planner_path(&t.out.key, &t.path)?;
    }
    for o in &plan.objects {
        e.planner_path(&o.key, &o.path)?;
    }
    e.begin_storage_data();
    for rank in 0..plan.mesh.world() {
        let name = dcp_rank_file(rank);
        for item in rank_items(source, plan, edited, rank) {
            let (fqn, chunk_offset, offset, length) = match &item {
                OutItem::Chunk { tensor, chunk, offset, archive } => (
                    plan.tensors[*tensor].out.key.as_str(),
                    Some(chunk.offsets.as_slice()),
                    *offset,
                    archive.total_len(),
                ),
                OutItem::Object { object, offset, length } => {
                    (plan.objects[*object].key.as_str(), None, *offset, *length)
                }
                OutItem::Raw { tensor, chunk, offset, len } => {
                    (plan.tensors[*tensor].out.key.as_str(), Some(chunk.offsets.as_slice()), *offset, *len)
                }
            };
            e.storage(&StorageRef {
                fqn,
                chunk_offset,
                relative_path: &name,
                offset,
                length,
                transform_descriptors: None,
            })?;
        }
    }
    let _ = source;
    e.finish(None)
}

/// Writes one rank file.
pub(super) struct RankWriter<'a> {
    /// Where a writer asks for its file's writeback as it grows, and its final sync.
    syncer: &'a mpsc::Sender<SyncJob>,
    /// Cleared for every writer the first time the kernel refuses `copy_file_range`.
    kernel_copy: &'a AtomicBool,
    source: &'a TrainingCheckpoint,
    plan: &'a ReshardPlan,
    inputs: &'a HashMap<&'a str, File>,
    edited: &'a HashMap<usize, Vec<u8>>,
    progress: &'a Progress,
}

impl<'a> RankWriter<'a> {
    fn write(&self, path: &Path, header: &[u8], items: &[OutItem]) -> Result<u64, ExecuteError> {
        let file = Arc::new(
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .map_err(io_err(path, "create rank file"))?,
        );
        let sync = |last: bool| {
            // A closed channel means the sync thread is gone; the commit then fails on the count.
            let _ = self.syncer.send(SyncJob { file: Arc::clone(&file), path: path.to_path_buf(), last });
        };
        let mut sync_requested = 0u64;
        let len = items.last().map_or(header.len() as u64, |i| match i {
            OutItem::Chunk { offset, archive, .. } => offset + archive.total_len(),
            OutItem::Object { offset, length, .. } => offset + length,
            OutItem::Raw { offset, len, .. } => offset + len,
        });
        let mut copier = Copier::new(&file, path, &self.source.checkpoint.dir, self.kernel_copy);
        copier.put(header, 0)?;
        for item in items {
            if self.progress.cancel.load(Ordering::Relaxed) {
                return Err(ExecuteError::Cancelled);
            }
            let at = match item {
                OutItem::Chunk { offset, .. } | OutItem::Object { offset, .. } | OutItem::Raw { offset, .. } => *offset,
            };
            if at - sync_requested >= SYNC_EVERY {
                sync_requested = at;
                sync(false);
            }
            match item {
                OutItem::Chunk { tensor, chunk, offset, archive } => {
                    // Framing and data go through the buffer alike: a rank file's bytes are one
                    // stream, written in a few large writes.
                    copier.put(archive.prefix(), *offset)?;
                    let data_at = offset + archive.data_offset();
                    self.fill(&mut copier, *tensor, chunk, data_at)?;
                    copier.put(&archive.suffix(0), data_at + archive.data_len())?;
                    self.progress.chunks_written.fetch_add(1, Ordering::Relaxed);
                    self.progress.bytes_written.fetch_add(archive.data_len(), Ordering::Relaxed);
                }
                OutItem::Raw { tensor, chunk, offset, len } => {
                    self.fill(&mut copier, *tensor, chunk, *offset)?;
                    self.progress.chunks_written.fetch_add(1, Ordering::Relaxed);
                    self.progress.bytes_written.fetch_add(*len, Ordering::Relaxed);
                }
                OutItem::Object { object, offset, .. } => {
                    let source_item = self.plan.objects[*object].source;
                    match (self.edited.get(&source_item), &self.source.data[source_item]) {
                        (Some(bytes), _) => copier.put(bytes, *offset)?,
                        (None, ItemData::Inline(j)) => copier.put(&self.source.inline[*j], *offset)?,
                        (None, ItemData::Object(i)) => {
                            let stored = &self.source.checkpoint.objects[*i];
                            let input = self.input(&stored.file)?;
                            copier.copy(input, stored.offset, *offset, stored.length)?;
                        }
                        (None, ItemData::Tensor(_)) => continue,
                    }
                }
            }
        }
        copier.flush()?;
        // Written front to back, the file grew as it was written (appending is cheaper for the
        // filesystem than filling a sparse file); rows no source holds were skipped and read
        // as zeros, and this makes the length exact even if they were last.
        file.set_len(len).map_err(io_err(path, "size rank file"))?;
        sync(true);
        self.progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(len)
    }

    fn input(&self, name: &str) -> Result<Input<'a>, ExecuteError> {
        let found = self.inputs.get_key_value(name).map(|(name, file)| Input { file, name });
        found.ok_or_else(|| ExecuteError::Io {
            path: self.source.checkpoint.dir.join(name),
            action: "open source rank file",
            error: io::Error::other("not among the files the checkpoint names"),
        })
    }

    /// Copies every run of the source chunks that meet `chunk` into its data at `data_at`, cast
    /// where the target keeps another dtype (a `torch_dist` model weight rounded from its master).
    fn fill(&self, copier: &mut Copier<'a>, tensor: usize, chunk: &Chunk, data_at: u64) -> Result<(), ExecuteError> {
        let t = &self.plan.tensors[tensor];
        let size = t.out.dtype.size() as u64;
        let from = self.source.items[t.source].tensor.as_ref().map_or(t.out.dtype, |m| m.dtype);
        let target = ChunkBox { offsets: chunk.offsets.clone(), sizes: chunk.sizes.clone() };
        let stored = self.source.chunks_of(t.source);
        let boxes: Vec<ChunkBox> =
            stored.iter().map(|sc| ChunkBox { offsets: sc.offsets.clone(), sizes: sc.sizes.clone() }).collect();
        // In target order, so the chunk is written front to back in a few large writes.
        for (i, run) in merged_runs(&target, &boxes) {
            let sc = &stored[i];
            let input = self.input(&sc.file)?;
            if from == t.out.dtype {
                copier.copy(input, sc.data_offset + run.source * size, data_at + run.target * size, run.len * size)?;
                continue;
            }
            copier.copy_cast(
                input,
                (from, sc.data_offset + run.source * from.size() as u64),
                (t.out.dtype, data_at + run.target * size),
                run.len,
            )?;
        }
        Ok(())
    }
}
