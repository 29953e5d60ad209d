//! DCP: the layout of every rank file, known before a byte is written, the rank files written by
//! the pool, and `.metadata` staged and renamed into place last.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use shardline_layout::{Chunk, DType, PlanTable};

use crate::dcp_metadata::{EntryRef, MetadataEncoder, StorageRef};
use crate::torch_save::TensorArchive;

use super::*;
use super::{rank_file::*, sources::*, stripes::*, threads::*};

/// One DCP item of a rank file: a written chunk, where it goes, and its archive framing.
pub(super) struct DcpItem {
    pub(super) tensor: usize,
    pub(super) chunk: Chunk,
    pub(super) offset: u64,
    pub(super) length: u64,
    /// Index into [`DcpLayout::archives`].
    pub(super) archive: usize,
}

/// What every rank file holds and where, known before any byte is written (the archive of a
/// chunk depends only on its dtype and shape). Items are recomputed from the plan as each file
/// is written, so the layout holds a few numbers per rank and per distinct chunk shape, however
/// many chunks the checkpoint has.
pub(super) struct DcpLayout {
    /// Archives and their trailer with CRC 0, by `(dtype, chunk sizes)`; most chunks share a few.
    pub(super) archives: Vec<(TensorArchive, Vec<u8>)>,
    archive_of: HashMap<(DType, Vec<u64>), usize>,
    file_lens: Vec<u64>,
    pub(super) items: u64,
}

impl DcpLayout {
    pub(super) fn new(plan: &PlanTable) -> DcpLayout {
        let mut layout =
            DcpLayout { archives: Vec::new(), archive_of: HashMap::new(), file_lens: Vec::new(), items: 0 };
        for rank in 0..plan.world() {
            for (tensor, _, chunk) in plan.rank_chunks(rank) {
                let t = plan.tensor(tensor);
                layout.add_archive(t.dtype, &stored_sizes(plan, tensor, &chunk));
                layout.items += 1;
            }
        }
        layout.file_lens = (0..plan.world() as usize)
            .map(|r| layout.rank(plan, r).last().map_or(0, |i| i.offset + i.length))
            .collect();
        layout
    }

    /// Adds the framing of a chunk shape the first time it is seen.
    fn add_archive(&mut self, dtype: DType, sizes: &[u64]) {
        let key = (dtype, sizes.to_vec());
        if !self.archive_of.contains_key(&key) {
            let a = TensorArchive::new(dtype, sizes);
            let trailer = a.suffix(0);
            self.archives.push((a, trailer));
            self.archive_of.insert(key, self.archives.len() - 1);
        }
    }

    /// The items of `rank`'s file, in order.
    pub(super) fn rank<'a>(&'a self, plan: &'a PlanTable, rank: usize) -> impl Iterator<Item = DcpItem> + 'a {
        let mut offset = 0u64;
        plan.rank_chunks(rank as u64).map(move |(tensor, _, chunk)| {
            let archive = self.archive_of[&(plan.tensor(tensor).dtype, stored_sizes(plan, tensor, &chunk))];
            let length = self.archives[archive].0.total_len();
            let item = DcpItem { tensor, chunk, offset, length, archive };
            offset += length;
            item
        })
    }

    pub(super) fn file_len(&self, rank: usize) -> u64 {
        self.file_lens[rank]
    }

    pub(super) fn world(&self) -> usize {
        self.file_lens.len()
    }

    /// Streams the checkpoint's `.metadata` to `sink` straight from the plan, so its size never
    /// sits in memory; chunks are listed in rank order, as torch does.
    pub(super) fn write_metadata<W: io::Write>(&self, plan: &PlanTable, sink: W) -> io::Result<W> {
        if plan.disk.regroups() {
            return super::placed::write_placed_metadata(self, plan, sink);
        }
        let mut e = MetadataEncoder::new(sink);
        for t in plan.tensors() {
            let mut listed: Vec<Chunk> = t.chunks(&plan.mesh).filter(|c| c.written && c.numel() > 0).collect();
            listed.sort_by_key(|c| c.rank);
            let chunks = listed.iter().map(|c| (c.offsets.as_slice(), c.sizes.as_slice()));
            e.entry(t.key, EntryRef::Tensor { dtype: t.dtype, size: t.shape, chunks })?;
        }
        e.begin_planner_data();
        for t in plan.tensors() {
            e.planner_path(t.key, &planner_path(t.key))?;
        }
        e.begin_storage_data();
        for rank in 0..self.world() {
            let name = dcp_rank_file(rank as u64);
            for item in self.rank(plan, rank) {
                e.storage(&StorageRef {
                    fqn: plan.tensor(item.tensor).key,
                    chunk_offset: Some(&item.chunk.offsets),
                    relative_path: &name,
                    offset: item.offset,
                    length: item.length,
                    transform_descriptors: None,
                })?;
            }
        }
        e.finish(None)
    }
}

/// The shape a chunk is stored with: the on-disk chunk's (a placed chunk has the leading axes
/// of its key; DCP narrows the stored tensor by the chunk's dims).
fn stored_sizes(plan: &PlanTable, tensor: usize, chunk: &Chunk) -> Vec<u64> {
    if !plan.disk.regroups() {
        return chunk.sizes.clone();
    }
    let t = plan.tensor(tensor);
    plan.disk.place(t.key, t.shape).chunk(&chunk.offsets, &chunk.sizes).1
}

pub(super) fn layout_mismatch(path: &Path, what: &str) -> ExecuteError {
    ExecuteError::Io {
        path: path.to_path_buf(),
        action: "write rank file",
        error: io::Error::other(format!("internal error: {what} differs from the precomputed layout")),
    }
}

/// Writes one DCP rank file at `path`; returns its length.
pub(super) fn write_dcp_rank(
    plan: &PlanTable,
    layout: &DcpLayout,
    rank: usize,
    path: PathBuf,
    data: &DataPath<'_>,
    syncer: &mpsc::Sender<SyncJob>,
    progress: &Progress,
) -> Result<u64, ExecuteError> {
    let mut file = RankFile::create(path, data, syncer)?;
    for item in layout.rank(plan, rank) {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(ExecuteError::Cancelled);
        }
        write_item(plan, layout, &item, &mut file, progress)?;
    }
    file.finish()
}

/// Writes items `items` (in file order) of one DCP rank file at `path`, at their offsets; returns
/// the span `[start, end)` they fill. The rest of the file is left as it is.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_dcp_rank_items(
    plan: &PlanTable,
    layout: &DcpLayout,
    rank: usize,
    items: std::ops::Range<usize>,
    path: PathBuf,
    data: &DataPath<'_>,
    syncer: &mpsc::Sender<SyncJob>,
    progress: &Progress,
) -> Result<(u64, u64), ExecuteError> {
    let mut chosen = layout.rank(plan, rank).skip(items.start).take(items.len()).peekable();
    let start = chosen.peek().map_or(0, |item| item.offset);
    let mut file = RankFile::resume(path, start, data, syncer)?;
    for item in chosen {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(ExecuteError::Cancelled);
        }
        write_item(plan, layout, &item, &mut file, progress)?;
    }
    Ok((start, file.finish()?))
}

/// With fewer rank files than writers, each file cut into sections of its items of about equal
/// bytes, `threads / world` of them (rounded up), so that every writer has work: a file's layout
/// is known before any byte is written, and a section is written at its offset. Empty otherwise
/// (a rank file is then written whole by one writer).
pub(super) fn sections(plan: &PlanTable, layout: &DcpLayout, threads: usize) -> Vec<(usize, std::ops::Range<usize>)> {
    let world = layout.world();
    if world == 0 || world >= threads {
        return Vec::new();
    }
    let per_file = threads.div_ceil(world) as u64;
    let mut out = Vec::new();
    for rank in 0..world {
        let target = layout.file_len(rank).div_ceil(per_file).max(1);
        let (mut first, mut next_cut, mut count) = (0usize, target, 0usize);
        for (i, item) in layout.rank(plan, rank).enumerate() {
            count = i + 1;
            if item.offset + item.length >= next_cut {
                out.push((rank, first..i + 1));
                first = i + 1;
                next_cut = item.offset + item.length + target;
            }
        }
        if first < count {
            out.push((rank, first..count));
        }
    }
    out
}

/// DCP: rank files written by `options.threads` writers and synced by the sync thread while
/// another thread encodes and stages `.metadata`; the rename that commits comes after every sync.
pub(super) fn write_dcp(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let layout = DcpLayout::new(plan);
    let stripes = StripeSets::new(plan, options.threads);
    let world = plan.world() as usize;
    let data = DataPath::new(sources, options);
    let sections = if stripes.shared { Vec::new() } else { sections(plan, &layout, options.threads) };
    if !sections.is_empty() {
        for rank in 0..world {
            let path = out.join(dcp_rank_file(rank as u64));
            File::create(&path).map_err(io_err(&path, "create rank file"))?;
        }
    }
    // One final sync per rank file, or per section of one.
    let files = if sections.is_empty() { world } else { sections.len() };
    let (sync_tx, sync_rx) = mpsc::channel();
    let (written, synced, staged) = std::thread::scope(|s| {
        let syncer = s.spawn(move || run_syncer(sync_rx));
        let metadata = s.spawn(|| stage_metadata(out, &layout, plan));
        let written = {
            let tx = sync_tx; // dropped when the writers are done, which ends the sync thread
            if sections.is_empty() {
                for_each_unit(stripes.units.len(), options.threads, progress, |u| {
                    write_dcp_unit(plan, &layout, &stripes, &stripes.units[u], out, &data, &tx, progress)
                })
            } else {
                for_each_unit(sections.len(), options.threads, progress, |u| {
                    let (rank, items) = sections[u].clone();
                    let path = out.join(dcp_rank_file(rank as u64));
                    let (_, end) = write_dcp_rank_items(plan, &layout, rank, items, path, &data, &tx, progress)?;
                    Ok(vec![(rank, end)])
                })
            }
        };
        (written, syncer.join(), metadata.join())
    });
    let mut lengths = vec![0u64; world];
    for (rank, len) in written?.into_iter().flatten() {
        lengths[rank] = lengths[rank].max(len);
    }
    let stopped = || ExecuteError::Io {
        path: out.to_path_buf(),
        action: "sync rank files",
        error: io::Error::other("the sync thread stopped early"),
    };
    match synced {
        Ok(Ok(n)) if n == files => {}
        Ok(Err(e)) => return Err(e),
        _ => return Err(stopped()),
    }
    staged.map_err(|_| stopped())??;
    for (rank, len) in lengths.iter().enumerate() {
        if *len != layout.file_len(rank) {
            return Err(layout_mismatch(&out.join(dcp_rank_file(rank as u64)), "the file length"));
        }
    }
    publish_metadata(out)?;
    Ok(WriteReport {
        files: (0..world).map(|r| out.join(dcp_rank_file(r as u64))).collect(),
        tensor_bytes: plan.bytes_per_rank().iter().sum(),
        file_bytes: lengths.iter().sum(),
        chunks: layout.items,
        kernel_copy_bytes: data.kernel_copied.load(Ordering::Relaxed),
    })
}

/// Writes `.metadata.tmp` and syncs it, after the dialect's object files (if any), which are
/// small enough to write here; [`publish_metadata`] renames it into place.
pub(super) fn stage_metadata(out: &Path, layout: &DcpLayout, plan: &PlanTable) -> Result<(), ExecuteError> {
    super::placed::write_object_files(plan.disk.objects(), out)?;
    let tmp = out.join(".metadata.tmp");
    let f = File::create(&tmp).map_err(io_err(&tmp, "create .metadata.tmp"))?;
    let f = layout.write_metadata(plan, f).map_err(io_err(&tmp, "write .metadata.tmp"))?;
    f.sync_all().map_err(io_err(&tmp, "sync .metadata.tmp"))?;
    Ok(())
}

/// Renames the synced `.metadata.tmp` into place and syncs the directory: the checkpoint's commit
/// point, reached only once every rank file is complete and synced.
pub(crate) fn publish_metadata(out: &Path) -> Result<(), ExecuteError> {
    let tmp = out.join(".metadata.tmp");
    let fin = out.join(".metadata");
    let dir = File::open(out).map_err(io_err(out, "open output directory"))?;
    // The rank files' names first: without a journal (ext4 nojournal, some network
    // filesystems) nothing orders their creation before the rename.
    dir.sync_all().map_err(io_err(out, "sync output directory"))?;
    fs::rename(&tmp, &fin).map_err(io_err(&fin, "rename .metadata.tmp into place"))?;
    dir.sync_all().map_err(io_err(out, "sync output directory"))?;
    Ok(())
}
