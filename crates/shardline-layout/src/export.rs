//! Export: the conversion plan read backwards. The plan of a release says which rows of which
//! release tensor each Megatron row is; inverted, it says where every row of every HF tensor is
//! in a checkpoint — split and interleaved forms undone, vocab padding left out, `weight − 1`
//! undone — so a training checkpoint can be written back as the release's tensors. Pure.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::dtype::DType;
use crate::plan::Plan;
use crate::recipe::{row_elems, rows_of, Transform};

/// Rows `ckpt_row + k` (`k < rows`) of one checkpoint tensor, and where they go in an HF tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportBlock {
    /// The checkpoint tensor's key.
    pub key: String,
    pub ckpt_row: u64,
    pub rows: u64,
    /// Elements of a checkpoint row. `Rows` places count HF rows in this unit too (gpt-oss's
    /// packed biases `[E, X]` give each expert's `[X]` as `X` one-element rows).
    pub width: u64,
    pub place: Place,
    /// The checkpoint holds `weight − 1` (a zero-centred norm): add one back.
    pub add_one: bool,
}

/// Where a block's rows go in the HF tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// HF rows `row + k·stride`.
    Rows { row: u64, stride: u32 },
    /// Columns: element `i` of row `k` goes to HF element `first + i·src_cols + k·col_stride`,
    /// column `k·col_stride` of a row-major matrix of `src_cols` columns whose rows are as long as
    /// a checkpoint row (experts stored `[E, in, out]`).
    Columns { first: u64, src_cols: u64, col_stride: u64 },
}

impl ExportBlock {
    /// The HF row of the block's first row (`Rows`), or its first element (`Columns`): the order
    /// blocks are written in.
    pub fn start(&self) -> u64 {
        match self.place {
            Place::Rows { row, .. } => row,
            Place::Columns { first, .. } => first,
        }
    }
}

/// An HF tensor of the export, in the release's name, dtype and shape, and where its rows are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Sorted by `hf_row`; together they hold every row once.
    pub blocks: Vec<ExportBlock>,
}

/// Why a checkpoint cannot be exported as the release.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ExportError {
    #[error("`{name}` would have to be re-encoded as {how}, which export does not do; export against a bf16 release of the model")]
    Irreversible { name: String, how: &'static str },
    #[error("`{key}` is {actual} in the checkpoint but the release's mapping needs {expected}")]
    Shape { key: String, actual: String, expected: String },
    #[error("the checkpoint has no tensor for {name} (it needs {})", .keys.join(", "))]
    Missing { name: String, keys: Vec<String> },
    #[error("`{0}` is not converted by the mapping, so nothing in the checkpoint holds it")]
    Unconverted(String),
}

/// Plans the export of a checkpoint holding `checkpoint` (key → global shape) as the release
/// `plan` was made from: one [`ExportTensor`] per release tensor, in release order.
pub fn plan_export(
    plan: &Plan,
    checkpoint: &BTreeMap<String, Vec<u64>>,
) -> Result<Vec<ExportTensor>, Vec<ExportError>> {
    let mut errors = Vec::new();
    let mut blocks: Vec<Vec<ExportBlock>> = vec![Vec::new(); plan.sources.len()];
    let mut wanted: Vec<Vec<String>> = vec![Vec::new(); plan.sources.len()];
    for t in &plan.tensors {
        let have = checkpoint.get(&t.key);
        if let Some(shape) = have {
            // Rows beyond the plan's are vocab padding; the row width must agree.
            if row_elems(shape) != row_elems(&t.shape) || shape.len() != t.shape.len() {
                errors.push(ExportError::Shape {
                    key: t.key.clone(),
                    actual: format!("{shape:?}"),
                    expected: format!("{:?}", t.shape),
                });
                continue;
            }
        }
        let mut row = 0u64;
        for b in &t.recipe {
            let at = row;
            row += b.rows;
            let Some((source, first)) = b.source else { continue };
            wanted[source].push(t.key.clone());
            let mut place = Place::Rows { row: first, stride: b.stride.max(1) };
            let add_one = match b.transform {
                Transform::Identity | Transform::Cast(_) => false,
                Transform::SubtractOne => true,
                Transform::Transpose { src_cols, col_stride } => {
                    place = Place::Columns { first, src_cols: src_cols.into(), col_stride: col_stride.into() };
                    false
                }
                Transform::DequantFp8 { .. } => {
                    errors.push(irreversible(plan, source, "block-scaled FP8"));
                    continue;
                }
                Transform::DequantMxfp4 { .. } => {
                    errors.push(irreversible(plan, source, "MXFP4"));
                    continue;
                }
            };
            let Some(shape) = have else { continue };
            if at + b.rows > rows_of(shape) {
                errors.push(ExportError::Shape {
                    key: t.key.clone(),
                    actual: format!("{shape:?}"),
                    expected: format!("at least {} rows", at + b.rows),
                });
                continue;
            }
            let width = row_elems(&t.shape);
            blocks[source].push(ExportBlock { key: t.key.clone(), ckpt_row: at, rows: b.rows, width, place, add_one });
        }
    }
    let covered: Vec<Option<Vec<ExportBlock>>> =
        blocks.into_iter().zip(&plan.sources).map(|(b, s)| covering(b, &s.shape)).collect();
    let by_name: BTreeMap<&str, usize> = plan.sources.iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
    let mut out = Vec::new();
    for (i, s) in plan.sources.iter().enumerate() {
        let unconverted = plan.unconverted.contains(&s.name);
        let mut mine = covered[i].clone();
        if mine.is_none() && unconverted {
            // An MTP layer's copy of the embedding or output layer: Megatron shares the main one.
            mine = shared_copy_of(&s.name)
                .and_then(|main| by_name.get(main.as_str()).copied())
                .filter(|&m| plan.sources[m].shape == s.shape)
                .and_then(|m| covered[m].clone());
        }
        match mine {
            Some(b) => {
                out.push(ExportTensor { name: s.name.clone(), dtype: s.dtype, shape: s.shape.clone(), blocks: b })
            }
            None if unconverted => errors.push(ExportError::Unconverted(s.name.clone())),
            None => {
                let mut keys = std::mem::take(&mut wanted[i]);
                keys.dedup();
                errors.push(ExportError::Missing { name: s.name.clone(), keys });
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        // One line per problem, however many blocks share it.
        let mut unique: Vec<ExportError> = Vec::new();
        for e in errors {
            if !unique.contains(&e) {
                unique.push(e);
            }
        }
        Err(unique)
    }
}

/// Plans the export of a checkpoint that holds the release's tensors under their own names (NeMo
/// Automodel's `model/`, HF-named however it is chunked): every release tensor is the checkpoint
/// tensor of its name, whole, in the release's dtype. `sources` are the release's tensors.
pub fn plan_export_as_named(
    sources: &[crate::plan::SourceTensor],
    checkpoint: &BTreeMap<String, Vec<u64>>,
) -> Result<Vec<ExportTensor>, Vec<ExportError>> {
    let mut errors = Vec::new();
    let mut out = Vec::new();
    for s in sources {
        match checkpoint.get(&s.name) {
            Some(shape) if *shape == s.shape => {
                let block = ExportBlock {
                    key: s.name.clone(),
                    ckpt_row: 0,
                    rows: rows_of(&s.shape),
                    width: row_elems(&s.shape),
                    place: Place::Rows { row: 0, stride: 1 },
                    add_one: false,
                };
                out.push(ExportTensor {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    blocks: vec![block],
                });
            }
            Some(shape) => errors.push(ExportError::Shape {
                key: s.name.clone(),
                actual: format!("{shape:?}"),
                expected: format!("{:?} (the release's)", s.shape),
            }),
            None => errors.push(ExportError::Missing { name: s.name.clone(), keys: vec![s.name.clone()] }),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

fn irreversible(plan: &Plan, source: usize, how: &'static str) -> ExportError {
    ExportError::Irreversible { name: plan.sources[source].name.clone(), how }
}

/// The blocks that hold each element of a tensor of `shape` exactly once, the first producer
/// winning (a tied embedding is both the embedding and the output layer); `None` when an element
/// has none. Coverage is counted in rows, or for transposed blocks in matrix columns.
fn covering(mut blocks: Vec<ExportBlock>, shape: &[u64]) -> Option<Vec<ExportBlock>> {
    let numel: u64 = shape.iter().product();
    // Units: HF rows, or the (matrix, column) pairs of transposed blocks.
    let unit_of = |b: &ExportBlock, k: u64| -> Option<u64> {
        match b.place {
            Place::Rows { row, stride } => Some(row + k * u64::from(stride)),
            Place::Columns { first, src_cols, col_stride } => {
                // A column of a matrix with as many rows as numel / (units) says.
                let matrix_rows = numel.checked_div(units_of_columns(shape, src_cols)?)?;
                let matrix = first / (matrix_rows * src_cols);
                Some(matrix * src_cols + first % (matrix_rows * src_cols) + k * col_stride)
            }
        }
    };
    let columns = blocks.first().is_some_and(|b| matches!(b.place, Place::Columns { .. }));
    if blocks.iter().any(|b| matches!(b.place, Place::Columns { .. }) != columns) {
        return None;
    }
    let units = match blocks.first().map(|b| (b.place, b.width)) {
        Some((Place::Columns { src_cols, .. }, _)) => units_of_columns(shape, src_cols)?,
        Some((Place::Rows { .. }, width)) if width > 0 && numel.is_multiple_of(width) => numel / width,
        _ => rows_of(shape),
    };
    if blocks.iter().any(|b| b.width != blocks[0].width) {
        return None;
    }
    let mut held = vec![false; usize::try_from(units).ok()?];
    blocks.retain(|b| {
        let Some(us) = (0..b.rows).map(|k| unit_of(b, k)).collect::<Option<Vec<u64>>>() else { return false };
        if us.iter().any(|&u| held.get(u as usize).is_none_or(|h| *h)) {
            return false;
        }
        us.iter().for_each(|&u| held[u as usize] = true);
        true
    });
    blocks.sort_by_key(ExportBlock::start);
    held.iter().all(|h| *h).then_some(blocks)
}

/// Matrix columns of a tensor `[E, in, out]` of `src_cols` (= out) columns: `E · out`.
fn units_of_columns(shape: &[u64], src_cols: u64) -> Option<u64> {
    let numel: u64 = shape.iter().product();
    let last = *shape.last()?;
    (last == src_cols && shape.len() >= 2).then(|| numel / shape[shape.len() - 2])
}

/// The main tensor an MTP layer's copy repeats (`model.layers.{N}.embed_tokens.weight` →
/// `model.embed_tokens.weight`).
fn shared_copy_of(name: &str) -> Option<String> {
    let (prefix, rest) = name.split_once("layers.")?;
    let (_, tail) = rest.split_once('.')?;
    match tail {
        "embed_tokens.weight" => Some(format!("{prefix}embed_tokens.weight")),
        "shared_head.head.weight" => Some("lm_head.weight".to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(row: u64, rows: u64, stride: u32) -> ExportBlock {
        ExportBlock { key: "k".into(), ckpt_row: 0, rows, width: 1, place: Place::Rows { row, stride }, add_one: false }
    }

    fn columns(first: u64, rows: u64, col_stride: u64) -> ExportBlock {
        ExportBlock {
            key: "k".into(),
            ckpt_row: 0,
            rows,
            width: 3,
            place: Place::Columns { first, src_cols: 4, col_stride },
            add_one: false,
        }
    }

    #[test]
    fn rows_are_held_once_and_gaps_are_found() {
        let b = covering(vec![block(2, 2, 1), block(0, 2, 1), block(0, 4, 1)], &[4]).unwrap();
        assert_eq!(b.iter().map(ExportBlock::start).collect::<Vec<_>>(), vec![0, 2], "the later full copy is dropped");
        assert!(covering(vec![block(0, 2, 2)], &[4]).is_none(), "odd rows missing");
        assert_eq!(covering(vec![block(0, 2, 2), block(1, 2, 2)], &[4]).map(|b| b.len()), Some(2));
        // Two experts [2, 3, 4]: gate = even columns, up = odd columns of each [3, 4] matrix.
        let shape = [2, 3, 4];
        let all = vec![columns(0, 2, 2), columns(1, 2, 2), columns(12, 2, 2), columns(13, 2, 2)];
        assert_eq!(covering(all.clone(), &shape).map(|b| b.len()), Some(4));
        assert!(covering(all[..3].to_vec(), &shape).is_none(), "expert 1's odd columns missing");
    }

    #[test]
    fn mtp_copies_name_their_main_tensor() {
        assert_eq!(shared_copy_of("model.layers.3.embed_tokens.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(shared_copy_of("model.layers.3.shared_head.head.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(shared_copy_of("model.layers.3.mlp.gate.weight"), None);
    }
}
