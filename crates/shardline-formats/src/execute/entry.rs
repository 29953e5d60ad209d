//! The entry points: a whole checkpoint, one rank file of a distributed run, and the commit
//! that follows the rank files.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use shardline_layout::{Plan, PlanTable};

use crate::safetensors::Release;

use super::*;
use super::{dcp::*, dcp_safetensors::*, rank_file::*, sources::*, threads::*};

/// Prepares the output directory: refuses to clobber a checkpoint unless asked, and removes the
/// commit marker first so a half-replaced checkpoint never looks complete. Returns the
/// directories it created, to remove if the write fails.
fn prepare_dir(out: &Path, format: OutputFormat, overwrite: bool) -> Result<crate::out_dir::Created, ExecuteError> {
    let created = crate::out_dir::create(out).map_err(io_err(out, "create output directory"))?;
    let marker = out.join(".metadata");
    let existing: Vec<PathBuf> = fs::read_dir(out)
        .map_err(io_err(out, "list output directory"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            name == ".metadata" || name.ends_with(".distcp") || name.ends_with(".safetensors")
        })
        .collect();
    if !existing.is_empty() {
        if !overwrite {
            let what = if marker.exists() { ".metadata" } else { "rank files" };
            return Err(ExecuteError::Exists(out.to_path_buf(), what));
        }
        if marker.exists() {
            fs::remove_file(&marker).map_err(io_err(&marker, "remove old .metadata"))?;
        }
        for p in existing {
            if p != marker {
                fs::remove_file(&p).map_err(io_err(&p, "remove old rank file"))?;
            }
        }
    }
    let _ = format;
    Ok(created)
}

/// Writes the checkpoint of `plan` from `release` into `out`.
pub fn write_checkpoint(
    plan: &Plan,
    release: &Release,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    write_checkpoint_from(&PlanTable::new(plan), &SourceMap::new(plan, release)?, out, options, progress)
}

/// Writes the checkpoint of a plan, frozen as `plan`, into `out`, reading through `sources`:
/// a caller that drops the [`Plan`] first copies in the memory of the table alone.
pub fn write_checkpoint_from(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let created = prepare_dir(out, options.format, options.overwrite)?;
    let result = match options.format {
        OutputFormat::Dcp => write_dcp(plan, sources, out, options, progress),
        OutputFormat::DcpSafetensors => write_dcp_safetensors(plan, sources, out, options, progress),
    };
    if result.is_err() {
        // Leave nothing that could be mistaken for output: no marker was written; drop rank files.
        if let Ok(entries) = fs::read_dir(out) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".distcp") || name.ends_with(".safetensors") || name.starts_with(".metadata") {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let _ = fs::remove_dir_all(out.join(SAFETENSORS_STAGING));
        created.remove();
    }
    result
}

/// Writes rank `rank`'s file of `plan` into `dir` — one task of a distributed run. The file is
/// written under a temporary name, synced, and renamed into place, so a killed writer never
/// leaves a rank file that looks complete. Returns the file's length.
pub fn write_rank_file(
    plan: &Plan,
    release: &Release,
    dir: &Path,
    rank: u64,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<u64, ExecuteError> {
    let sources = SourceMap::new(plan, release)?;
    let plan = &PlanTable::new(plan);
    fs::create_dir_all(dir).map_err(io_err(dir, "create output directory"))?;
    match options.format {
        OutputFormat::Dcp => {
            let layout = DcpLayout::new(plan);
            let name = dcp_rank_file(rank);
            let tmp = dir.join(format!(".{name}.partial"));
            let data = DataPath::new(&sources, options);
            let (sync_tx, sync_rx) = mpsc::channel();
            let (written, synced) = std::thread::scope(|s| {
                let syncer = s.spawn(move || run_syncer(sync_rx));
                let written = write_dcp_rank(plan, &layout, rank as usize, tmp.clone(), &data, &sync_tx, progress);
                drop(sync_tx);
                (written, syncer.join())
            });
            let len = match written {
                Ok(len) => len,
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    return Err(e);
                }
            };
            match synced {
                Ok(Ok(1)) => {}
                Ok(Err(e)) => return Err(e),
                _ => return Err(io_err(&tmp, "sync rank file")(io::Error::other("the sync thread stopped early"))),
            }
            if len != layout.file_len(rank as usize) {
                return Err(layout_mismatch(&tmp, "the file length"));
            }
            let fin = dir.join(&name);
            fs::rename(&tmp, &fin).map_err(io_err(&fin, "rename rank file into place"))?;
            Ok(len)
        }
        OutputFormat::DcpSafetensors => {
            let (_, len, _) = write_safetensors_rank(plan, rank as usize, dir, &sources, options, progress)?;
            Ok(len)
        }
    }
}

/// The byte spans `(offset, length)` of the items of rank `rank`'s DCP file, in file order: the
/// units [`write_rank_section`] writes.
pub fn rank_item_spans(plan: &Plan, rank: u64) -> Vec<(u64, u64)> {
    let plan = &PlanTable::new(plan);
    let layout = DcpLayout::new(plan);
    layout.rank(plan, rank as usize).map(|item| (item.offset, item.length)).collect()
}

/// Writes items `items` of rank `rank`'s DCP file into `path` at their offsets, leaving the rest
/// of the file as it is, and syncs it: a rank file written (and shipped) a section at a time by
/// a worker with little disk. `release` needs to hold only the bytes
/// [`SourceMap::rank_ranges_of`] names for these items. Returns the span `[start, end)` written.
pub fn write_rank_section(
    plan: &Plan,
    release: &Release,
    path: &Path,
    rank: u64,
    items: std::ops::Range<usize>,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<(u64, u64), ExecuteError> {
    let sources = SourceMap::new(plan, release)?;
    let plan = &PlanTable::new(plan);
    let layout = DcpLayout::new(plan);
    let data = DataPath::new(&sources, options);
    let (sync_tx, sync_rx) = mpsc::channel();
    let (written, synced) = std::thread::scope(|s| {
        let syncer = s.spawn(move || run_syncer(sync_rx));
        let written =
            write_dcp_rank_items(plan, &layout, rank as usize, items, path.to_path_buf(), &data, &sync_tx, progress);
        drop(sync_tx);
        (written, syncer.join())
    });
    let span = written?;
    match synced {
        Ok(Ok(1)) => Ok(span),
        Ok(Err(e)) => Err(e),
        _ => Err(io_err(path, "sync rank file")(io::Error::other("the sync thread stopped early"))),
    }
}

/// Commits a checkpoint whose rank files [`write_rank_file`] wrote into `dir`: checks that every
/// rank file is there with the length the plan implies, then (DCP) writes `.metadata` through
/// `.metadata.tmp` + fsync + rename. Needs no state from the writers: the layout follows from the
/// plan alone.
pub fn commit_checkpoint(plan: &Plan, dir: &Path, options: &ExecuteOptions) -> Result<(), ExecuteError> {
    let plan = &PlanTable::new(plan);
    let world = plan.world() as usize;
    match options.format {
        OutputFormat::Dcp => {
            let layout = DcpLayout::new(plan);
            for rank in 0..world {
                let path = dir.join(dcp_rank_file(rank as u64));
                let len = fs::metadata(&path).map_err(io_err(&path, "check rank file"))?.len();
                if len != layout.file_len(rank) {
                    return Err(ExecuteError::Io {
                        path,
                        action: "check rank file",
                        error: io::Error::other(format!("{len} bytes, the plan implies {}", layout.file_len(rank))),
                    });
                }
            }
            stage_metadata(dir, &layout, plan)?;
            publish_metadata(dir)
        }
        OutputFormat::DcpSafetensors => {
            for rank in 0..world {
                let path = dir.join(dcp_safetensors_rank_file(rank as u64, world as u64));
                crate::safetensors::read_header(&path)?;
            }
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync output directory"))
        }
    }
}

/// The rank files of the checkpoint of `plan`, by rank: each file's name and, for DCP, the length
/// the plan implies (a DCP-safetensors file's length is its writer's to decide).
pub fn rank_files(plan: &Plan, format: OutputFormat) -> Vec<(String, Option<u64>)> {
    let plan = &PlanTable::new(plan);
    let world = plan.world();
    match format {
        OutputFormat::Dcp => {
            let layout = DcpLayout::new(plan);
            (0..world).map(|r| (dcp_rank_file(r), Some(layout.file_len(r as usize)))).collect()
        }
        OutputFormat::DcpSafetensors => (0..world).map(|r| (dcp_safetensors_rank_file(r, world), None)).collect(),
    }
}

/// Writes the `.metadata` of the DCP checkpoint of `plan` into `dir` (through `.metadata.tmp`,
/// synced and renamed), without its rank files: for a checkpoint whose rank files are elsewhere
/// (uploaded to an object store). Returns its path.
pub fn write_metadata_alone(plan: &Plan, dir: &Path) -> Result<PathBuf, ExecuteError> {
    let plan = &PlanTable::new(plan);
    fs::create_dir_all(dir).map_err(io_err(dir, "create output directory"))?;
    stage_metadata(dir, &DcpLayout::new(plan), plan)?;
    publish_metadata(dir)?;
    Ok(dir.join(".metadata"))
}
