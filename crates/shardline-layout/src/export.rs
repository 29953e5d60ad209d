//! Export: the conversion plan read backwards. The plan of a release says which rows of which
//! release tensor each Megatron row is; inverted, it says where every row of every HF tensor is
//! in a checkpoint — split and interleaved forms undone, vocab padding left out, `weight − 1`
//! undone — so a training checkpoint can be written back as the release's tensors. Pure.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::dtype::DType;
use crate::plan::Plan;
use crate::recipe::{row_elems, rows_of, Transform};

/// Rows of one HF tensor held by one checkpoint tensor: HF rows `hf_row + k·stride` are the
/// checkpoint tensor's global rows `ckpt_row + k`, `k < rows`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportBlock {
    /// The checkpoint tensor's key.
    pub key: String,
    pub ckpt_row: u64,
    pub hf_row: u64,
    pub rows: u64,
    pub stride: u32,
    /// The checkpoint holds `weight − 1` (a zero-centred norm): add one back.
    pub add_one: bool,
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
            let add_one = match b.transform {
                Transform::Identity | Transform::Cast(_) => false,
                Transform::SubtractOne => true,
                Transform::DequantFp8 { .. } => {
                    errors.push(irreversible(plan, source, "block-scaled FP8"));
                    continue;
                }
                Transform::DequantMxfp4 { .. } => {
                    errors.push(irreversible(plan, source, "MXFP4"));
                    continue;
                }
                Transform::Transpose { .. } => {
                    errors.push(irreversible(plan, source, "the transposed `[E, in, out]` layout"));
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
            blocks[source].push(ExportBlock {
                key: t.key.clone(),
                ckpt_row: at,
                hf_row: first,
                rows: b.rows,
                stride: b.stride.max(1),
                add_one,
            });
        }
    }
    let covered: Vec<Option<Vec<ExportBlock>>> =
        blocks.into_iter().zip(&plan.sources).map(|(b, s)| covering(b, rows_of(&s.shape))).collect();
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

fn irreversible(plan: &Plan, source: usize, how: &'static str) -> ExportError {
    ExportError::Irreversible { name: plan.sources[source].name.clone(), how }
}

/// The blocks that hold each of `rows` rows exactly once, the first producer winning (a tied
/// embedding is both the embedding and the output layer); `None` when a row has none.
fn covering(mut blocks: Vec<ExportBlock>, rows: u64) -> Option<Vec<ExportBlock>> {
    let mut held = vec![false; usize::try_from(rows).ok()?];
    blocks.retain(|b| {
        let hf_rows = (0..b.rows).map(|k| (b.hf_row + k * u64::from(b.stride)) as usize);
        if hf_rows.clone().any(|r| held.get(r).is_none_or(|h| *h)) {
            return false;
        }
        hf_rows.for_each(|r| held[r] = true);
        true
    });
    blocks.sort_by_key(|b| b.hf_row);
    held.iter().all(|h| *h).then_some(blocks)
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

    fn block(hf_row: u64, rows: u64, stride: u32) -> ExportBlock {
        ExportBlock { key: "k".into(), ckpt_row: 0, hf_row, rows, stride, add_one: false }
    }

    #[test]
    fn rows_are_held_once_and_gaps_are_found() {
        let b = covering(vec![block(2, 2, 1), block(0, 2, 1), block(0, 4, 1)], 4).unwrap();
        assert_eq!(b.iter().map(|b| b.hf_row).collect::<Vec<_>>(), vec![0, 2], "the later full copy is dropped");
        assert!(covering(vec![block(0, 2, 2)], 4).is_none(), "odd rows missing");
        assert_eq!(covering(vec![block(0, 2, 2), block(1, 2, 2)], 4).map(|b| b.len()), Some(2));
    }

    #[test]
    fn mtp_copies_name_their_main_tensor() {
        assert_eq!(shared_copy_of("model.layers.3.embed_tokens.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(shared_copy_of("model.layers.3.shared_head.head.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(shared_copy_of("model.layers.3.mlp.gate.weight"), None);
    }
}
