//! gpt-oss's packed experts (archs-2025.md §3.4, §4.2): MXFP4 weights dequantized to bf16 (or the
//! bf16 layout `[E, in, out]` transposed), fc1's gate and up rows interleaved in the release and
//! kept fused on disk, biases packed per expert.

use super::build::Inventory;
use super::draft::shape_err;
use super::*;
use crate::arch::Kind;
use crate::config::ModelConfig;
use crate::error::LayoutError;
use crate::recipe::{Transform, MXFP4_BLOCK};

/// The sections, TP mode and dtype of expert `e`'s parameter of `kind` from sources `ids`.
pub(super) fn expert_sections(
    config: &ModelConfig,
    inv: &Inventory<'_>,
    kind: Kind,
    ids: &[usize],
    e: u64,
) -> Result<(TpMode, Vec<Section>, DType), LayoutError> {
    let experts = config.num_experts;
    let section =
        |suffix: &str, shape: Vec<u64>, recipe: Vec<RowBlock>| Section { suffix: suffix.into(), shape, recipe };
    match kind {
        Kind::Mxfp4GateUp | Kind::Mxfp4Down => {
            let (rows, cols) = mxfp4_shape(inv, ids, experts)?;
            let dequant = |b: RowBlock| RowBlock { transform: Transform::DequantMxfp4 { scales: ids[1] as u32 }, ..b };
            if kind == Kind::Mxfp4Down {
                let recipe = vec![dequant(RowBlock::copy(ids[0], e * rows, rows))];
                return Ok((TpMode::Row, vec![section("", vec![rows, cols], recipe)], DType::BF16));
            }
            if !rows.is_multiple_of(2) {
                return Err(shape_err(inv, ids[0], format!("[{experts}, 2F, H/32, 16]"), "gate and up rows in pairs"));
            }
            let f = rows / 2;
            let gate = vec![dequant(RowBlock::strided(ids[0], e * rows, f, 2))];
            let up = vec![dequant(RowBlock::strided(ids[0], e * rows + 1, f, 2))];
            Ok((
                TpMode::Column,
                vec![section("_w", vec![f, cols], gate), section("_v", vec![f, cols], up)],
                DType::BF16,
            ))
        }
        Kind::InterleavedGateUpBias => {
            let s = inv.shape(ids[0]);
            if s.len() != 2 || s[0] != experts || !s[1].is_multiple_of(2) {
                return Err(shape_err(inv, ids[0], format!("[{experts}, 2F]"), "packed gate_up_proj_bias"));
            }
            let f = s[1] / 2;
            let gate = vec![RowBlock::strided(ids[0], e * s[1], f, 2)];
            let up = vec![RowBlock::strided(ids[0], e * s[1] + 1, f, 2)];
            let dtype = inv.sources[ids[0]].dtype;
            Ok((TpMode::Column, vec![section("_w", vec![f], gate), section("_v", vec![f], up)], dtype))
        }
        Kind::PackedExpertRow(mode) => {
            let s = inv.shape(ids[0]);
            if s.len() != 2 || s[0] != experts {
                return Err(shape_err(inv, ids[0], format!("[{experts}, X]"), "packed per-expert rows"));
            }
            let recipe = vec![RowBlock::copy(ids[0], e * s[1], s[1])];
            Ok((mode, vec![section("", vec![s[1]], recipe)], inv.sources[ids[0]].dtype))
        }
        Kind::TransposedGateUp | Kind::TransposedDown => {
            // Per expert a row-major [in, out] matrix; Megatron's rows are its columns.
            let s = inv.shape(ids[0]);
            let dtype = inv.sources[ids[0]].dtype;
            if s.len() != 3 || s[0] != experts || u32::try_from(s[2]).is_err() {
                return Err(shape_err(inv, ids[0], format!("[{experts}, in, out]"), "packed bf16 experts"));
            }
            let (rows_in, cols) = (s[1], s[2]);
            let base = e * rows_in * cols;
            if kind == Kind::TransposedDown {
                let recipe = vec![RowBlock::transposed(ids[0], base, cols, cols as u32, 1)];
                return Ok((TpMode::Row, vec![section("", vec![cols, rows_in], recipe)], dtype));
            }
            if !cols.is_multiple_of(2) {
                return Err(shape_err(inv, ids[0], format!("[{experts}, H, 2F]"), "gate and up columns in pairs"));
            }
            let f = cols / 2;
            let gate = vec![RowBlock::transposed(ids[0], base, f, cols as u32, 2)];
            let up = vec![RowBlock::transposed(ids[0], base + 1, f, cols as u32, 2)];
            Ok((
                TpMode::Column,
                vec![section("_w", vec![f, rows_in], gate), section("_v", vec![f, rows_in], up)],
                dtype,
            ))
        }
        _ => Err(shape_err(inv, ids[0], "a gpt-oss expert tensor".into(), "not a gpt-oss expert kind")),
    }
}

/// `(rows, cols)` of one expert's dequantized weight from MXFP4 `blocks [E, rows, cols/32, 16]`
/// (u8) and `scales [E, rows, cols/32]` (u8).
fn mxfp4_shape(inv: &Inventory<'_>, ids: &[usize], experts: u64) -> Result<(u64, u64), LayoutError> {
    let (b, s) = (inv.shape(ids[0]), inv.shape(ids[1]));
    let u8s = inv.sources[ids[0]].dtype == DType::U8 && inv.sources[ids[1]].dtype == DType::U8;
    if !u8s || b.len() != 4 || b[0] != experts || b[3] != MXFP4_BLOCK / 2 {
        return Err(shape_err(inv, ids[0], format!("U8 [{experts}, rows, cols/32, 16]"), "MXFP4 blocks"));
    }
    if s != &b[..3] {
        return Err(shape_err(
            inv,
            ids[1],
            format!("U8 {:?}", &b[..3]),
            "one MXFP4 scale per 32 elements of the blocks",
        ));
    }
    Ok((b[1], b[2] * MXFP4_BLOCK))
}
