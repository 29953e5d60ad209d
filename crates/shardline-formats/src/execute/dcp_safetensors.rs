//! DCP-safetensors: one safetensors file per rank, with `DCP_SHARDING_INFO`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use shardline_layout::{Chunk, PlanTable};

use crate::safetensors::{FileLayout, SafetensorsWriter};

use super::*;
use super::{sources::*, threads::*};

/// Writes one DCP-safetensors rank file (through a temporary name); returns `(path, length, chunks)`.
pub(super) fn write_safetensors_rank(
    plan: &PlanTable,
    rank: usize,
    out: &Path,
    sources: &SourceMap,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<(PathBuf, u64, u64), ExecuteError> {
    let world = plan.world() as usize;
    let name = dcp_safetensors_rank_file(rank as u64, world as u64);
    let items: Vec<(usize, Chunk)> = plan.rank_chunks(rank as u64).map(|(ti, _, c)| (ti, c)).collect();
    let metadata = sharding_metadata(items.iter().map(|(ti, c)| (plan.tensor(*ti).key, c.offsets.as_slice())));
    let layout = FileLayout::new(
        items.iter().map(|(ti, c)| {
            let t = plan.tensor(*ti);
            (t.key, t.dtype, c.sizes.as_slice())
        }),
        &metadata,
    )?;
    let mut writer = SafetensorsWriter::create(out.join(&name), layout)?;
    let mut buf = vec![0u8; options.buffer_bytes];
    let mut pending: Vec<u8> = Vec::with_capacity(options.buffer_bytes);
    for (ti, c) in &items {
        let t = plan.tensor(*ti);
        stream_chunk(t, &c.offsets, &c.sizes, sources, &mut buf, |b| {
            progress.bytes_written.fetch_add(b.len() as u64, Ordering::Relaxed);
            if pending.len() + b.len() > pending.capacity() {
                writer.write_next(&pending)?;
                pending.clear();
            }
            if b.len() >= pending.capacity() {
                writer.write_next(b)?;
            } else {
                pending.extend_from_slice(b);
            }
            Ok(())
        })?;
        progress.chunks_written.fetch_add(1, Ordering::Relaxed);
    }
    writer.write_next(&pending)?;
    let path = writer.finish()?;
    let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    Ok((path, len, items.len() as u64))
}

/// The `__metadata__` of a DCP-safetensors rank file holding `chunks` (`(key, offsets)`): torch's
/// `HuggingFaceStorageWriter` records each chunk's offsets in `DCP_SHARDING_INFO`.
pub fn sharding_metadata<'a>(chunks: impl Iterator<Item = (&'a str, &'a [u64])>) -> BTreeMap<String, String> {
    let sharding: serde_json::Map<String, serde_json::Value> =
        chunks.map(|(key, offsets)| (key.to_string(), serde_json::json!({ "saved_offsets": offsets }))).collect();
    [
        ("DCP_SHARDING_INFO".to_string(), serde_json::Value::Object(sharding).to_string()),
        ("DCP_VERSION".to_string(), "1.0".to_string()),
        ("format".to_string(), "pt".to_string()),
    ]
    .into_iter()
    .collect()
}

/// Where a whole DCP-safetensors checkpoint is written before its files take their names: torch's
/// `HuggingFaceStorageReader` reads every `*.safetensors` its (non-recursive) listing of the
/// directory finds, with no marker naming the set, so no file may appear there before all are
/// complete.
pub const SAFETENSORS_STAGING: &str = ".shardline-staging";

pub(super) fn write_dcp_safetensors(
    plan: &PlanTable,
    sources: &SourceMap,
    out: &Path,
    options: &ExecuteOptions,
    progress: &Progress,
) -> Result<WriteReport, ExecuteError> {
    let world = plan.world() as usize;
    let staging = out.join(SAFETENSORS_STAGING);
    fs::create_dir_all(&staging).map_err(io_err(&staging, "create staging directory"))?;
    let per_rank = for_each_unit(world, options.threads, progress, |rank| {
        let written = write_safetensors_rank(plan, rank, &staging, sources, options, progress)?;
        progress.files_done.fetch_add(1, Ordering::Relaxed);
        Ok(written)
    })?;
    let mut report = WriteReport { files: Vec::new(), tensor_bytes: 0, file_bytes: 0, chunks: 0, kernel_copy_bytes: 0 };
    // Every file is complete and synced: now they take their names, one rename each.
    for (path, len, n) in per_rank {
        let fin = out.join(path.file_name().expect("a rank file has a name"));
        fs::rename(&path, &fin).map_err(io_err(&fin, "rename rank file into place"))?;
        report.files.push(fin);
        report.file_bytes += len;
        report.chunks += n;
    }
    fs::remove_dir(&staging).map_err(io_err(&staging, "remove staging directory"))?;
    fs::File::open(out).and_then(|d| d.sync_all()).map_err(io_err(out, "sync output directory"))?;
    report.tensor_bytes = plan.bytes_per_rank().iter().sum();
    Ok(report)
}
