//! gpt-oss's expert fc1 (weight and bias) in the layouts the dialects give it. Megatron-FSDP keeps
//! it whole, fused in a layout of the expert-TP size `t` — expert-TP rank `r`'s gate rows, then
//! its up rows, for each `r` in turn (as `convert` writes it); `torch_dist` stores `[gate; up]`,
//! planned as the SwiGLU sections `_w` and `_v`. Reading one as the other moves whole rows, so a
//! stored piece is cut where a rank's section ends and each cut is still one run of bytes, read
//! in place. Which experts are of this kind the model's layers say: their fc1 has biases.

use shardline_layout::reshard::{flat_key, param_layout, ChunkBox, ItemKind, PathElem, SourceItem, SourceTensorMeta};

use super::{ItemData, TrainingCheckpoint, TrainingError};
use crate::checkpoint::{StoredChunk, StoredTensor};

/// Whether the model key `key` (either dialect's name) is a routed expert's fc1 bias: the mark
/// of gpt-oss's kind of experts.
pub(super) fn marks_fused_experts(key: &str) -> bool {
    key.contains("mlp.experts.linear_fc1.bias") || key.contains("mlp.experts.experts.linear_fc1.bias")
}

/// Whether a table keeps the canonical `key` fused in a layout of the expert-TP size.
pub(super) fn fused(key: &str) -> bool {
    param_layout(key, None).is_some_and(|l| l.tp_dependent)
}

/// Pieces of a `[gate; up]` tensor of `shape` (rows `2·I`) moved to the rows Megatron-FSDP's
/// fused layout for expert-TP size `etp` gives them: expert-TP rank `r`'s gate rows, then its
/// up rows, for each `r` in turn (as `convert` writes gpt-oss's expert fc1). A piece is cut where
/// a rank's section ends; each cut is a run of whole rows, so it stays one run of bytes.
pub(super) fn fused_rows(
    pieces: Vec<StoredChunk>,
    shape: &[u64],
    etp: u64,
    elem: u64,
) -> Result<Vec<StoredChunk>, String> {
    let rows = shape.first().copied().unwrap_or(0);
    if etp == 0 || !rows.is_multiple_of(2 * etp) {
        return Err(format!("{rows} rows of [gate; up] do not split over expert-TP size {etp}"));
    }
    let (half, q) = (rows / 2, rows / 2 / etp);
    let row_elems: u64 = shape[1..].iter().product();
    let mut out = Vec::new();
    for p in pieces {
        if p.sizes[1..] != shape[1..] {
            return Err("a stored chunk holds part of a row; its rows cannot be moved".into());
        }
        for mut cut in cut_rows(&p, q, row_elems * elem) {
            let x = cut.offsets[0];
            let (up, within) = (x >= half, x % half);
            cut.offsets[0] = (within / q) * 2 * q + if up { q } else { 0 } + within % q;
            out.push(cut);
        }
    }
    Ok(out)
}

/// The rows of the piece `c` cut where a block of `q` rows ends, each cut one run of its bytes
/// (rows of `row_bytes`) with its first row still in `offsets[0]`.
fn cut_rows(c: &StoredChunk, q: u64, row_bytes: u64) -> impl Iterator<Item = StoredChunk> + '_ {
    let (a, b) = (c.offsets[0], c.offsets[0] + c.sizes[0]);
    let mut x = a;
    std::iter::from_fn(move || {
        if x >= b {
            return None;
        }
        let y = b.min((x / q + 1) * q);
        let (mut offsets, mut sizes) = (c.offsets.clone(), c.sizes.clone());
        (offsets[0], sizes[0]) = (x, y - x);
        let cut = StoredChunk {
            offsets,
            sizes,
            file: c.file.clone(),
            data_offset: c.data_offset + (x - a) * row_bytes,
            data_len: (y - x) * row_bytes,
        };
        x = y;
        Some(cut)
    })
}

/// Rows of the fused layout (`2·I` rows, expert-TP size `etp`) as `(section, row)`: 0 for gate,
/// 1 for up; `None` when the rows do not split so.
fn section_of(rows: u64, etp: u64) -> Option<impl Fn(u64) -> (usize, u64)> {
    if etp == 0 || !rows.is_multiple_of(2 * etp) {
        return None;
    }
    let q = rows / 2 / etp;
    Some(move |x: u64| {
        let (r, w) = (x / (2 * q), x % (2 * q));
        if w < q {
            (0, r * q + w)
        } else {
            (1, r * q + w - q)
        }
    })
}

impl TrainingCheckpoint {
    /// Whether the model's routed experts are gpt-oss's kind (their fc1 has biases).
    fn has_fused_experts(&self) -> bool {
        self.items
            .iter()
            .any(|i| matches!(classify_item(i), Some(ItemKind::Model { name }) if marks_fused_experts(&name)))
    }

    /// Reads the fused expert fc1 of a Megatron-FSDP checkpoint saved at expert-TP size `etp` as
    /// its SwiGLU sections `_w` and `_v` (the parameter and its moments alike), for a dialect that
    /// plans it so (`torch_dist`). Does nothing for a model without such experts; `etp` unknown is
    /// an error for one with them.
    pub fn split_fused(&mut self, etp: Option<u64>) -> Result<(), TrainingError> {
        if !self.has_fused_experts() {
            return Ok(());
        }
        let Some(etp) = etp else {
            return Err(TrainingError::Translate {
                key: "mlp.experts.linear_fc1".into(),
                problem: "gpt-oss's expert fc1 is fused in a layout of the expert-TP size the checkpoint was saved \
                          with, which is unknown (no `args`): pass --from-mesh"
                    .into(),
            });
        };
        let mut items = Vec::with_capacity(self.items.len());
        let mut data = Vec::with_capacity(self.data.len());
        for (item, d) in std::mem::take(&mut self.items).into_iter().zip(std::mem::take(&mut self.data)) {
            let name = match classify_item(&item) {
                Some(ItemKind::Model { name } | ItemKind::OptimizerState { name, .. }) => name,
                _ => String::new(),
            };
            let (ItemData::Tensor(t), Some(meta), true) = (&d, &item.tensor, fused(&name)) else {
                items.push(item);
                data.push(d);
                continue;
            };
            let stored = &self.checkpoint.tensors[*t];
            let rows = meta.shape.first().copied().unwrap_or(0);
            let refuse = |problem: String| TrainingError::Translate { key: item.key.clone(), problem };
            let section = section_of(rows, etp)
                .ok_or_else(|| refuse(format!("{rows} rows do not split over expert-TP size {etp}")))?;
            let q = rows / 2 / etp.max(1);
            let row_elems: u64 = meta.shape[1..].iter().product();
            let elem = meta.dtype.size() as u64;
            let mut halves: [Vec<StoredChunk>; 2] = [Vec::new(), Vec::new()];
            for c in &stored.chunks {
                if c.sizes[1..] != meta.shape[1..] {
                    return Err(refuse("a stored chunk holds part of a row; its rows cannot be moved".into()));
                }
                for mut cut in cut_rows(c, q, row_elems * elem) {
                    let (half, at) = section(cut.offsets[0]);
                    cut.offsets[0] = at;
                    halves[half].push(cut);
                }
            }
            let mut shape = meta.shape.clone();
            shape[0] = rows / 2;
            for (suffix, chunks) in ["_w", "_v"].into_iter().zip(halves) {
                let mut path = item.path.clone();
                // The parameter's name is the model path's last part, a moment's the one before.
                let at = if path.first() == Some(&PathElem::Key("model".into())) { path.len() - 1 } else { 2 };
                if let Some(PathElem::Key(k)) = path.get_mut(at) {
                    k.push_str(suffix);
                }
                let key = flat_key(&path);
                let boxes =
                    chunks.iter().map(|c| ChunkBox { offsets: c.offsets.clone(), sizes: c.sizes.clone() }).collect();
                data.push(ItemData::Tensor(self.checkpoint.tensors.len()));
                self.checkpoint.tensors.push(StoredTensor {
                    key: key.clone(),
                    dtype: meta.dtype,
                    shape: shape.clone(),
                    chunks,
                });
                items.push(SourceItem {
                    key,
                    path,
                    tensor: Some(SourceTensorMeta { dtype: meta.dtype, shape: shape.clone(), chunks: boxes }),
                });
            }
        }
        self.items = items;
        self.data = data;
        Ok(())
    }
}

fn classify_item(item: &SourceItem) -> Option<ItemKind> {
    Some(shardline_layout::reshard::classify(&item.path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(row: u64, rows: u64, cols: u64) -> StoredChunk {
        StoredChunk {
            offsets: vec![row, 0],
            sizes: vec![rows, cols],
            file: "f".into(),
            data_offset: row * cols,
            data_len: rows * cols,
        }
    }

    /// `[gate; up]` rows moved into the fused layout and read back as sections land where they
    /// started: each layout is the other read backwards.
    #[test]
    fn the_fused_layout_and_its_sections_are_inverse() {
        let (rows, cols, etp) = (12u64, 3u64, 3u64);
        // One stored chunk of rows 2..11 of `[gate; up]` (gate 0..6, up 6..12), bytes = row·cols.
        let moved = fused_rows(vec![piece(2, 9, cols)], &[rows, cols], etp, 1).unwrap();
        let section = section_of(rows, etp).unwrap();
        for p in &moved {
            for k in 0..p.sizes[0] {
                let canonical = (p.data_offset - 2 * cols) / cols + 2 + k;
                let (half, row) = section(p.offsets[0] + k);
                assert_eq!(half as u64 * rows / 2 + row, canonical, "{p:?}");
            }
        }
        assert_eq!(moved.iter().map(|p| p.sizes[0]).sum::<u64>(), 9);
        assert!(fused_rows(vec![piece(0, 12, cols)], &[rows, cols], 5, 1).unwrap_err().contains("expert-TP size 5"));
    }
}
