//! A reshard written as HF-storage safetensors, as torch's `HuggingFaceStorageWriter(
//! save_distributed=True)` writes them and NeMo Automodel saves `model/`: one
//! `shard-{r+1:05}-model-00001-of-00001.safetensors` per rank, its header naming each chunk's
//! offsets in `DCP_SHARDING_INFO`, its data contiguous and filled from the source's runs as DCP
//! rank files are. No `.metadata` marks the set — torch's reader takes every `*.safetensors` it
//! finds — so the files are written in a staging directory and take their names once all are
//! complete.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use shardline_layout::reshard::ReshardPlan;
use shardline_layout::Chunk;

use super::write::{io_err, write_files, OutFile, OutItem};
use super::{ReshardReport, TrainingCheckpoint, TrainingError};
use crate::execute::{dcp_safetensors_rank_file, sharding_metadata, ExecuteError, Progress, SAFETENSORS_STAGING};
use crate::safetensors::FileLayout;

/// Writes `plan` of `source` into `out` as HF-storage safetensors (created; safetensors files
/// already there are an error unless `overwrite`, and are then replaced). On any error what was
/// written is removed.
pub fn write_resharded_hf_storage(
    source: &TrainingCheckpoint,
    plan: &ReshardPlan,
    out: &Path,
    threads: usize,
    overwrite: bool,
    progress: &Progress,
) -> Result<ReshardReport, TrainingError> {
    let existing = safetensors_files(out);
    if !existing.is_empty() && !overwrite {
        return Err(ExecuteError::Exists(out.to_path_buf(), "*.safetensors").into());
    }
    let created = crate::out_dir::create(out).map_err(io_err(out, "create output directory"))?;
    let staging = out.join(SAFETENSORS_STAGING);
    let world = plan.mesh.world();
    let result = fs::create_dir_all(&staging).map_err(io_err(&staging, "create staging directory")).map_err(Into::into);
    let result = result.and_then(|()| {
        write_files(source, plan, world as usize, threads.max(1), progress, &HashMap::new(), |rank| {
            rank_file(plan, rank as u64, &staging)
        })
    });
    let totals = match result {
        Ok(t) => t,
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            created.remove();
            return Err(e);
        }
    };
    // Every file is complete and synced: the old set goes, then the new one takes its names.
    for old in existing {
        fs::remove_file(&old).map_err(io_err(&old, "remove the replaced checkpoint's file"))?;
    }
    for rank in 0..world {
        let name = dcp_safetensors_rank_file(rank, world);
        let (from, to) = (staging.join(&name), out.join(&name));
        fs::rename(&from, &to).map_err(io_err(&to, "rename rank file into place"))?;
    }
    fs::remove_dir(&staging).map_err(io_err(&staging, "remove staging directory"))?;
    fs::File::open(out).and_then(|d| d.sync_all()).map_err(io_err(out, "sync output directory"))?;
    let sum = |f: fn(&super::write::FileTotals) -> u64| totals.iter().map(f).sum::<u64>();
    Ok(ReshardReport {
        files: world,
        tensor_bytes: sum(|t| t.tensor_bytes),
        file_bytes: sum(|t| t.len),
        chunks: sum(|t| t.chunks),
        args_set: Vec::new(),
        args_missing: Vec::new(),
    })
}

/// Rank `rank`'s file: its chunks laid out after a header that names their offsets.
fn rank_file(plan: &ReshardPlan, rank: u64, dir: &Path) -> Result<OutFile, ExecuteError> {
    let mesh = &plan.mesh;
    let chunks: Vec<(usize, Chunk)> = plan
        .tensors
        .iter()
        .enumerate()
        .flat_map(|(ti, t)| t.out.chunks_of_rank(mesh, rank).map(move |ci| (ti, t.out.chunk(mesh, ci))))
        .filter(|(_, c)| c.written && c.numel() > 0)
        .collect();
    let metadata =
        sharding_metadata(chunks.iter().map(|(ti, c)| (plan.tensors[*ti].out.key.as_str(), c.offsets.as_slice())));
    let layout = FileLayout::new(
        chunks.iter().map(|(ti, c)| {
            let t = &plan.tensors[*ti].out;
            (t.key.as_str(), t.dtype, c.sizes.as_slice())
        }),
        &metadata,
    )?;
    let items = chunks
        .into_iter()
        .zip(layout.tensors())
        .map(|((tensor, chunk), info)| OutItem::Raw { tensor, chunk, offset: info.file_offset, len: info.byte_len })
        .collect();
    Ok(OutFile {
        path: dir.join(dcp_safetensors_rank_file(rank, mesh.world())),
        header: layout.header_bytes().to_vec(),
        items,
    })
}

fn safetensors_files(dir: &Path) -> Vec<std::path::PathBuf> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect()
}
