//! `inspect`: a checkpoint's keys, shapes and chunks streamed entry by entry, with a summary of
//! its files, in memory that does not grow with the number of chunks.
//!
//! Only `.metadata` is read (strictly) and the files' sizes looked up: every storage item must lie
//! inside its file. Reading the items themselves is `validate`'s job.

use std::collections::BTreeMap;
use std::path::Path;

use shardline_layout::DType;

use super::dcp::Stop;
use super::{open_checkpoint, safe_name, CheckpointError, CheckpointFormat};
use crate::dcp_metadata::{read_metadata_file, ChunkMeta, EntryMeta, MetadataItem};

/// One tensor entry, as it streams past.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSummary {
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub chunks: Vec<ChunkMeta>,
}

/// Items and bytes stored in one file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileSummary {
    pub items: u64,
    pub bytes: u64,
}

/// What follows the entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanSummary {
    pub format: CheckpointFormat,
    pub tensors: u64,
    pub chunks: u64,
    pub files: BTreeMap<String, FileSummary>,
    pub bytes_items: Vec<String>,
    /// `version` of `.metadata`, when it has one.
    pub version: Option<String>,
}

/// Streams the tensors of the checkpoint in `dir` to `on_tensor`, then returns the summary.
pub fn scan_checkpoint(dir: &Path, mut on_tensor: impl FnMut(TensorSummary)) -> Result<ScanSummary, CheckpointError> {
    let dir = &super::resolve_checkpoint_dir(dir)?;
    let md_path = dir.join(".metadata");
    let mut summary = ScanSummary {
        format: CheckpointFormat::Dcp,
        tensors: 0,
        chunks: 0,
        files: BTreeMap::new(),
        bytes_items: Vec::new(),
        version: None,
    };
    if !md_path.is_file() {
        let ckpt = open_checkpoint(dir)?;
        summary.format = ckpt.format;
        for t in ckpt.tensors {
            summary.tensors += 1;
            summary.chunks += t.chunks.len() as u64;
            for c in &t.chunks {
                let f = summary.files.entry(c.file.to_string()).or_default();
                f.items += 1;
                f.bytes += c.data_len;
            }
            let chunks = t.chunks.into_iter().map(|c| ChunkMeta { offsets: c.offsets, sizes: c.sizes }).collect();
            on_tensor(TensorSummary { key: t.key, dtype: t.dtype, shape: t.shape, chunks });
        }
        return Ok(summary);
    }
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut on_item = |item| -> Result<(), CheckpointError> {
        match item {
            MetadataItem::Entry(key, EntryMeta::Bytes) => summary.bytes_items.push(key),
            MetadataItem::Entry(key, EntryMeta::Tensor { dtype, size, chunks }) => {
                summary.tensors += 1;
                summary.chunks += chunks.len() as u64;
                on_tensor(TensorSummary { key, dtype, shape: size, chunks });
            }
            MetadataItem::PlannerPath(..) => {}
            MetadataItem::Storage(key, info) => {
                safe_name(&info.relative_path)?;
                let size = match sizes.get(&info.relative_path) {
                    Some(s) => *s,
                    None => {
                        let p = dir.join(&info.relative_path);
                        let s = std::fs::metadata(&p).map_err(super::io_err(&p, "stat rank file"))?.len();
                        sizes.insert(info.relative_path.clone(), s);
                        s
                    }
                };
                if info.offset.checked_add(info.length).is_none_or(|end| end > size) {
                    return Err(CheckpointError::Inconsistent {
                        key: key.fqn,
                        offsets: key.offset.unwrap_or_default(),
                        message: format!(
                            "stored at bytes {}..+{} of {}, which has {size} bytes",
                            info.offset, info.length, info.relative_path
                        ),
                    });
                }
                let f = summary.files.entry(info.relative_path).or_default();
                f.items += 1;
                f.bytes += info.length;
            }
        }
        Ok(())
    };
    let tail = read_metadata_file(&md_path, |item| on_item(item).map_err(Stop::Checkpoint)).map_err(|e| match e {
        Stop::Metadata(source) => CheckpointError::Metadata { path: md_path.clone(), source },
        Stop::Checkpoint(e) => e,
    })?;
    summary.version = tail.version;
    Ok(summary)
}
