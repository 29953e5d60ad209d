//! Column stripes of TP peers: the ranks whose stripes share rows are written by one writer,
//! which reads each batch of full rows once and scatters the columns into their files' buffers.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, IoSliceMut};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use rustix::io::Errno;
use shardline_layout::recipe::{row_elems, segments, Segment, Transform};
use shardline_layout::{Chunk, PlanTable, TensorView};

use super::*;
use super::{dcp::*, rank_file::*, threads::*};

/// Column stripes of the same rows of one tensor held by different ranks (row-parallel weights
/// under TP or expert TP): their full rows are read once and each rank's columns written from
/// there, instead of each rank reading its columns with the other ranks' columns as gaps. The
/// ranks whose stripes meet are written by one writer, their files advancing together, so the
/// members of a set are the files whose next items are stripes of the same rows.
pub(super) struct StripeSets {
    /// Whether stripes are gathered across the files of a unit (otherwise rank by rank).
    pub(super) shared: bool,
    /// Ranks written together by one writer: those linked by sets (a TP group), or each alone.
    pub(super) units: Vec<Vec<usize>>,
}

/// Whether `item` is a column stripe that a stripe set can gather: plain bytes (a read lands
/// where it is written, untransformed).
fn is_stripe(t: TensorView<'_>, c: &Chunk) -> bool {
    let stripe = t.shape.len() >= 2 && !(c.offsets[1] == 0 && c.sizes[1] == t.shape[1]);
    let plain = t.recipe.iter().all(|b| b.transform == Transform::Identity);
    stripe && plain
}

impl StripeSets {
    pub(super) fn new(plan: &PlanTable, threads: usize) -> StripeSets {
        let world = plan.world() as usize;
        // Ranks holding stripes of the same rows of a tensor (each rank once) form a set; the
        // ranks a set links are written by one writer (union-find), tensor by tensor so that
        // nothing is kept per chunk.
        let mut parent: Vec<usize> = (0..world).collect();
        fn root(parent: &mut [usize], mut r: usize) -> usize {
            while parent[r] != r {
                parent[r] = parent[parent[r]];
                r = parent[r];
            }
            r
        }
        let mut any_set = false;
        for t in plan.tensors().filter(|t| t.shape.len() >= 2) {
            let mut stripes: Vec<(u64, u64, usize)> = t
                .chunks(&plan.mesh)
                .filter(|c| c.written && c.numel() > 0 && is_stripe(t, c))
                .map(|c| (c.offsets[0], c.sizes[0], c.rank as usize))
                .collect();
            stripes.sort_unstable();
            for set in stripes.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
                if set.len() >= 2 && set.windows(2).all(|w| w[0].2 < w[1].2) {
                    any_set = true;
                    for w in set.windows(2) {
                        let (a, b) = (root(&mut parent, w[0].2), root(&mut parent, w[1].2));
                        parent[a.max(b)] = a.min(b);
                    }
                }
            }
        }
        let mut units: Vec<Vec<usize>> = Vec::new();
        let mut unit_of: HashMap<usize, usize> = HashMap::new();
        for rank in 0..world {
            let r = root(&mut parent, rank);
            let u = *unit_of.entry(r).or_insert_with(|| {
                units.push(Vec::new());
                units.len() - 1
            });
            units[u].push(rank);
        }
        // Sharing reads must not cost parallelism: with fewer units than writers, every rank is
        // its own unit and stripes are gathered rank by rank.
        let mut shared = any_set;
        if units.len() < threads.min(world) {
            shared = false;
            units = (0..world).map(|r| vec![r]).collect();
        }
        StripeSets { shared, units }
    }
}

/// Writes the rank files of one unit; returns `(rank, file length)` for each.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_dcp_unit(
    plan: &PlanTable,
    layout: &DcpLayout,
    stripes: &StripeSets,
    unit: &[usize],
    out: &Path,
    data: &DataPath<'_>,
    syncer: &mpsc::Sender<SyncJob>,
    progress: &Progress,
) -> Result<Vec<(usize, u64)>, ExecuteError> {
    let mut files = Vec::with_capacity(unit.len());
    for &rank in unit {
        files.push(RankFile::create(out.join(dcp_rank_file(rank as u64)), data, syncer)?);
    }
    let mut next: Vec<_> = unit.iter().map(|&rank| layout.rank(plan, rank).peekable()).collect();
    let mut scratch = Vec::new();
    // The unit's files advance together in tensor order, so the members of a set meet.
    while let Some(k) = (0..unit.len()).filter_map(|k| Some((next[k].peek()?.tensor, k))).min().map(|(_, k)| k) {
        if progress.cancel.load(Ordering::Relaxed) {
            return Err(ExecuteError::Cancelled);
        }
        // The stripe set of this item: the files whose next items are stripes of the same rows.
        let members: Vec<usize> = match next[k].peek() {
            Some(item) if stripes.shared && is_stripe(plan.tensor(item.tensor), &item.chunk) => {
                let rows = (item.tensor, item.chunk.offsets[0], item.chunk.sizes[0]);
                (0..unit.len())
                    .filter(|&kk| {
                        next[kk].peek().is_some_and(|other| {
                            (other.tensor, other.chunk.offsets[0], other.chunk.sizes[0]) == rows
                                && is_stripe(plan.tensor(other.tensor), &other.chunk)
                        })
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        if members.len() >= 2 {
            let items: Vec<DcpItem> = members.iter().filter_map(|&kk| next[kk].next()).collect();
            write_stripe_set(plan, layout, &mut files, &members, &items, &mut scratch, data, progress)?;
        } else if let Some(item) = next[k].next() {
            write_item(plan, layout, &item, &mut files[k], progress)?;
        }
    }
    let mut lengths = Vec::with_capacity(unit.len());
    for (file, &rank) in files.into_iter().zip(unit) {
        lengths.push((rank, file.finish()?));
        progress.files_done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(lengths)
}

/// Starts an item: checks its place and writes the archive's header bytes.
fn begin_item(layout: &DcpLayout, item: &DcpItem, file: &mut RankFile<'_>) -> Result<(), ExecuteError> {
    if file.pos() != item.offset {
        return Err(layout_mismatch(&file.path, "an item offset"));
    }
    file.write(layout.archives[item.archive].0.prefix())?;
    file.begin_data();
    Ok(())
}

/// Ends an item: its CRC when asked for, the archive's trailer, and a check of its length.
fn end_item(
    layout: &DcpLayout,
    item: &DcpItem,
    file: &mut RankFile<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let (archive, trailer) = &layout.archives[item.archive];
    if file.data.zip_crc32 {
        let crc = file.end_data()?;
        file.patch(item.offset + archive.crc_offset(), &crc.to_le_bytes())?;
        file.write(&archive.suffix(crc))?;
    } else {
        file.write(trailer)?;
    }
    if file.pos() != item.offset + item.length {
        return Err(layout_mismatch(&file.path, "an item length"));
    }
    progress.chunks_written.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Writes one item, segment by segment.
pub(super) fn write_item(
    plan: &PlanTable,
    layout: &DcpLayout,
    item: &DcpItem,
    file: &mut RankFile<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let t = plan.tensor(item.tensor);
    let c = &item.chunk;
    begin_item(layout, item, file)?;
    for Segment { source, len, transform } in segments(t.shape, t.dtype, t.recipe, &c.offsets, &c.sizes) {
        match source {
            Some((id, off)) => file.copy(id, off, len, transform, t)?,
            None => file.zeros(len)?,
        }
        progress.bytes_written.fetch_add(len, Ordering::Relaxed);
    }
    end_item(layout, item, file, progress)
}

/// Writes the items of a stripe set, `items[j]` being the next item of `files[ks[j]]`: each batch
/// of full rows is read once, by one `preadv` that scatters every row's columns straight into
/// the buffers of the files holding them (and columns no member holds into `scratch`).
#[allow(clippy::too_many_arguments)]
fn write_stripe_set(
    plan: &PlanTable,
    layout: &DcpLayout,
    files: &mut [RankFile<'_>],
    ks: &[usize],
    items: &[DcpItem],
    scratch: &mut Vec<u8>,
    data: &DataPath<'_>,
    progress: &Progress,
) -> Result<(), ExecuteError> {
    let t = plan.tensor(items[0].tensor);
    let itemsize = t.dtype.size() as u64;
    let row_bytes = row_elems(t.shape) * itemsize;
    let column_bytes = t.shape[2..].iter().product::<u64>() * itemsize;
    // `(first byte in the row, bytes, file)` of each member's columns, in column order.
    let mut columns: Vec<(u64, u64, usize)> = ks
        .iter()
        .zip(items)
        .map(|(&k, item)| (item.chunk.offsets[1] * column_bytes, item.chunk.sizes[1] * column_bytes, k))
        .collect();
    columns.sort_unstable();
    let held: u64 = columns.iter().map(|c| c.1).sum();
    let gap_per_row = row_bytes - held.min(row_bytes);
    let disjoint = columns.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
    // A buffer per member and one per run of columns between members (or rows).
    let between = columns.windows(2).filter(|w| w[0].0 + w[0].1 < w[1].0).count();
    let iovecs_per_row = columns.len() + between + 1;
    if !disjoint
        || gap_per_row > GAP_SCRATCH as u64
        || iovecs_per_row > MAX_IOVECS
        || columns.iter().any(|c| c.1 > data.buffer_bytes as u64)
    {
        // Not one read's worth (overlapping replicas, far-apart, very wide or very many
        // stripes): each file reads its own columns.
        for (&k, item) in ks.iter().zip(items) {
            write_item(plan, layout, item, &mut files[k], progress)?;
        }
        return Ok(());
    }
    let first = &items[0].chunk;
    let mut full_offsets = vec![0; t.shape.len()];
    full_offsets[0] = first.offsets[0];
    let mut full_sizes = t.shape.to_vec();
    full_sizes[0] = first.sizes[0];
    for (&k, item) in ks.iter().zip(items) {
        begin_item(layout, item, &mut files[k])?;
    }
    // The full-width rows are whole rows of sources or zeros, segment by segment.
    for Segment { source, len, .. } in segments(t.shape, t.dtype, t.recipe, &full_offsets, &full_sizes) {
        let (nrows, mut row) = (len / row_bytes, 0u64);
        while row < nrows {
            let mut batch = (nrows - row).min((MAX_IOVECS / iovecs_per_row).max(1) as u64);
            if let Some(rows) = (GAP_SCRATCH as u64).checked_div(gap_per_row) {
                batch = batch.min(rows);
            }
            for &(_, width, k) in &columns {
                if (files[k].free() as u64) < width {
                    files[k].flush()?;
                }
                batch = batch.min(files[k].free() as u64 / width);
            }
            match source {
                Some((id, off)) => {
                    let from = off + row * row_bytes;
                    scatter_rows(files, &columns, data, (id, from), batch, row_bytes, gap_per_row, scratch)?
                }
                None => {
                    for &(_, width, k) in &columns {
                        files[k].zeros(batch * width)?;
                    }
                }
            }
            progress.bytes_written.fetch_add(batch * held, Ordering::Relaxed);
            row += batch;
        }
    }
    for (&k, item) in ks.iter().zip(items) {
        end_item(layout, item, &mut files[k], progress)?;
    }
    Ok(())
}

/// Reads `batch` full rows of source `id` from byte `from` with one `preadv`: each row's
/// `columns` go to the end of their file's buffer, the bytes between them to `scratch`.
#[allow(clippy::too_many_arguments)]
fn scatter_rows(
    files: &mut [RankFile<'_>],
    columns: &[(u64, u64, usize)],
    data: &DataPath<'_>,
    (id, from): (usize, u64),
    batch: u64,
    row_bytes: u64,
    gap_per_row: u64,
    scratch: &mut Vec<u8>,
) -> Result<(), ExecuteError> {
    let first_col = columns[0].0;
    let (last_col, last_width, _) = columns[columns.len() - 1];
    // From the first member's first byte of the first row to the last member's last byte of the
    // last row.
    let span = (batch - 1) * row_bytes + last_col + last_width - first_col;
    let (fi, at) = data.sources.locate(id, from + first_col, span);
    let gaps = (gap_per_row * batch) as usize;
    if scratch.len() < gaps {
        scratch.resize(gaps, 0);
    }
    let mut place: Vec<usize> = vec![usize::MAX; files.len()];
    for (j, c) in columns.iter().enumerate() {
        place[c.2] = j;
    }
    // Each member's room in its buffer, cut into one piece per row.
    let mut rooms: Vec<(usize, std::slice::ChunksExactMut<'_, u8>)> = files
        .iter_mut()
        .enumerate()
        .filter(|(k, _)| place[*k] != usize::MAX)
        .map(|(k, f)| {
            let width = columns[place[k]].1 as usize;
            let start = f.fill;
            (place[k], f.buf[start..start + batch as usize * width].chunks_exact_mut(width))
        })
        .collect();
    rooms.sort_unstable_by_key(|r| r.0);
    let mut spare: &mut [u8] = &mut scratch[..gaps];
    let mut take_gap = |n: u64| {
        let (g, rest) = std::mem::take(&mut spare).split_at_mut(n as usize);
        spare = rest;
        IoSliceMut::new(g)
    };
    let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(2 * columns.len() * batch as usize);
    for row in 0..batch {
        for (j, room) in rooms.iter_mut() {
            let (col, width, _) = columns[*j];
            // Before a member: the columns since the previous one (or since the end of the
            // previous row's last member).
            let gap = if *j == 0 {
                if row == 0 {
                    0
                } else {
                    row_bytes - (last_col + last_width) + first_col
                }
            } else {
                let (prev_col, prev_width, _) = columns[*j - 1];
                col - (prev_col + prev_width)
            };
            if gap > 0 {
                iov.push(take_gap(gap));
            }
            if let Some(piece) = room.next() {
                debug_assert_eq!(piece.len() as u64, width);
                iov.push(IoSliceMut::new(piece));
            }
        }
    }
    let (path, source) = &data.sources.files[fi];
    preadv_exact(source, &mut iov, at).map_err(io_err(path, "read release tensor"))?;
    drop(iov);
    for &(_, width, k) in columns {
        files[k].fill += (batch * width) as usize;
    }
    Ok(())
}

/// Fills every buffer of `iov` from `file` at `at`, resuming after short reads.
fn preadv_exact(file: &File, mut iov: &mut [IoSliceMut<'_>], mut at: u64) -> io::Result<()> {
    while !iov.is_empty() {
        match rustix::io::preadv(file, iov, at) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                at += n as u64;
                IoSliceMut::advance_slices(&mut iov, n);
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
