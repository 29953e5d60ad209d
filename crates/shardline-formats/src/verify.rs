//! `validate`: proves a written checkpoint bit-exact against its source release.
//!
//! For every key, the stored chunks must tile the global shape exactly, and every chunk's bytes
//! must equal the bytes the reference mapping produces for that box, streamed from the release
//! piece by piece. A SHA-256 of each key's stored bytes (chunks in offset order) is reported.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use sha2::{Digest, Sha256};
use shardline_layout::invariants::{tiling_violations, Piece};
use shardline_layout::recipe::rows_of;
use shardline_layout::{OutputTensor, Plan, RowBlock};
use thiserror::Error;

use crate::checkpoint::{Checkpoint, StoredTensor};
use crate::execute::{stream_chunk, ExecuteError, Progress, SourceMap};
use crate::safetensors::Release;

/// One finding: the key and what is wrong, with offsets and shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub key: String,
    pub message: String,
}

/// A checked key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyDigest {
    pub key: String,
    pub sha256: String,
    pub bytes: u64,
}

/// The outcome of validation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub digests: Vec<KeyDigest>,
    pub findings: Vec<Finding>,
    pub bytes_checked: u64,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.findings.is_empty()
    }
}

/// Errors that stop validation (as opposed to findings, which are reported).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VerifyError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: std::io::Error },
    #[error(transparent)]
    Execute(#[from] ExecuteError),
}

/// Keys whose vocab dim may be padded with zero rows beyond the release's rows.
fn is_vocab_key(key: &str) -> bool {
    key.ends_with("embedding.word_embeddings.weight") || key.ends_with("output_layer.weight")
}

/// Validates `ckpt` against `release`, whose expected tensors are described by `reference` (a plan
/// of the release without vocab padding; any mesh: global tensors do not depend on it).
pub fn verify(
    ckpt: &Checkpoint,
    release: &Release,
    reference: &Plan,
    progress: &Progress,
) -> Result<VerifyReport, VerifyError> {
    let sources = SourceMap::new(reference, release)?;
    let mut report = VerifyReport::default();
    let expected: BTreeMap<&str, &OutputTensor> = reference.tensors.iter().map(|t| (t.key.as_str(), t)).collect();
    let stored: BTreeMap<&str, &StoredTensor> = ckpt.tensors.iter().map(|t| (t.key.as_str(), t)).collect();
    let mut find = |key: &str, message: String| report.findings.push(Finding { key: key.to_string(), message });
    for key in expected.keys().filter(|k| !stored.contains_key(*k)) {
        find(key, "missing from the checkpoint".to_string());
    }
    for key in stored.keys().filter(|k| !expected.contains_key(*k)) {
        find(key, "in the checkpoint but not produced by the mapping of this release".to_string());
    }
    let mut files: BTreeMap<String, File> = BTreeMap::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut actual = vec![0u8; 4 << 20];
    for (key, st) in &stored {
        let Some(want) = expected.get(key) else { continue };
        let mut want = (*want).clone();
        if st.dtype != want.dtype {
            find(key, format!("dtype {} but the source gives {}", st.dtype, want.dtype));
            continue;
        }
        let padded_ok = is_vocab_key(key)
            && st.shape.len() == want.shape.len()
            && st.shape.len() >= 1
            && st.shape[0] >= want.shape[0]
            && st.shape[1..] == want.shape[1..];
        if st.shape != want.shape {
            if !padded_ok {
                find(key, format!("global shape {:?} but the source gives {:?}", st.shape, want.shape));
                continue;
            }
            // Vocab padding: the rows beyond the release's vocab must be zeros.
            want.recipe.push(RowBlock::zeros(st.shape[0] - rows_of(&want.shape)));
            want.shape = st.shape.clone();
        }
        let mut bad_box = false;
        for c in &st.chunks {
            let ok = c.offsets.len() == st.shape.len()
                && c.sizes.len() == st.shape.len()
                && c.offsets
                    .iter()
                    .zip(&c.sizes)
                    .zip(&st.shape)
                    .all(|((o, s), g)| o.checked_add(*s).is_some_and(|e| e <= *g));
            let bytes = c.sizes.iter().product::<u64>() * st.dtype.size() as u64;
            if !ok || bytes != c.data_len {
                find(
                    key,
                    format!(
                        "chunk offsets {:?} sizes {:?} does not fit global shape {:?} or its {} stored bytes",
                        c.offsets, c.sizes, st.shape, c.data_len
                    ),
                );
                bad_box = true;
            }
        }
        if bad_box {
            continue;
        }
        let pieces = st
            .chunks
            .iter()
            .map(|c| Piece { offsets: c.offsets.clone(), sizes: c.sizes.clone(), owner: c.file.clone() })
            .collect();
        let tiling = tiling_violations(&st.shape, pieces);
        let tiled = tiling.is_empty();
        for m in tiling {
            find(key, m);
        }
        if !tiled {
            continue;
        }
        let mut order: Vec<usize> = (0..st.chunks.len()).collect();
        order.sort_by(|a, b| st.chunks[*a].offsets.cmp(&st.chunks[*b].offsets));
        let mut hasher = Sha256::new();
        let mut total = 0u64;
        for i in order {
            let c = &st.chunks[i];
            if !files.contains_key(&c.file) {
                let p = ckpt.dir.join(&c.file);
                let f = File::open(&p).map_err(|error| VerifyError::Io { path: p, action: "open", error })?;
                files.insert(c.file.clone(), f);
            }
            let f = &files[&c.file];
            let mut cursor = 0u64;
            let mut mismatch: Option<u64> = None;
            let mut io_error: Option<std::io::Error> = None;
            stream_chunk(want.view(), &c.offsets, &c.sizes, &sources, &mut buf, |piece| {
                let got = &mut actual[..piece.len()];
                if let Err(e) = f.read_exact_at(got, c.data_offset + cursor) {
                    io_error.get_or_insert(e);
                    return Ok(());
                }
                hasher.update(&*got);
                if mismatch.is_none() {
                    if let Some(p) = got.iter().zip(piece).position(|(a, b)| a != b) {
                        mismatch = Some(cursor + p as u64);
                    }
                }
                cursor += piece.len() as u64;
                progress.bytes_written.fetch_add(piece.len() as u64, Ordering::Relaxed);
                Ok(())
            })?;
            if let Some(e) = io_error {
                find(key, format!("chunk offsets {:?} in {}: cannot read stored bytes: {e}", c.offsets, c.file));
                continue;
            }
            total += cursor;
            if let Some(byte) = mismatch {
                let elem = byte / st.dtype.size() as u64;
                // Chunk-local element index → global coordinates.
                let mut rem = elem;
                let mut coord = vec![0u64; c.sizes.len()];
                for d in (0..c.sizes.len()).rev() {
                    coord[d] = c.offsets[d] + rem % c.sizes[d].max(1);
                    rem /= c.sizes[d].max(1);
                }
                find(
                    key,
                    format!(
                        "bytes differ from the source mapping at global index {coord:?} (chunk offsets {:?} sizes {:?} in {}, byte {byte} of the chunk)",
                        c.offsets, c.sizes, c.file
                    ),
                );
            }
        }
        report.bytes_checked += total;
        report.digests.push(KeyDigest { key: key.to_string(), sha256: hex::encode(hasher.finalize()), bytes: total });
    }
    Ok(report)
}
