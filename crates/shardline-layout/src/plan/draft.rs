//! Drafts: one mapped parameter's sections and row recipes, from its release tensors, with
//! their shapes checked against the config (QKV interleave, gated MLP, packed experts, GDN).

use super::build::Inventory;
use super::gpt_oss;
use super::*;
use crate::arch::{self, Kind};
use crate::config::ModelConfig;
use crate::error::LayoutError;
use crate::recipe::{can_cast, Transform};

pub(super) fn shape_err(inv: &Inventory, id: usize, expected: String, why: &str) -> LayoutError {
    LayoutError::Shape {
        tensor: inv.sources[id].name.clone(),
        actual: inv.shape(id).to_vec(),
        expected,
        why: why.to_string(),
    }
}

fn same_dtype(inv: &Inventory, target: &str, ids: &[usize]) -> Result<DType, LayoutError> {
    let d = inv.sources[ids[0]].dtype;
    if ids.iter().any(|i| inv.sources[*i].dtype != d) {
        let detail = ids
            .iter()
            .map(|i| format!("`{}` {}", inv.sources[*i].name, inv.sources[*i].dtype))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(LayoutError::DtypeMismatch { target: target.to_string(), detail });
    }
    Ok(d)
}

/// Builds the sections and recipes of one mapped parameter, checking source shapes.
pub(super) fn draft(
    config: &ModelConfig,
    inv: &Inventory,
    kind: Kind,
    target: &str,
    ids: &[usize],
    expert: Option<u64>,
    out_dtype: Option<DType>,
) -> Result<Draft, LayoutError> {
    let mut d = draft_as_released(config, inv, kind, target, ids, expert)?;
    let Some(to) = out_dtype.filter(|to| *to != d.dtype) else { return Ok(d) };
    let from = d.dtype;
    if !can_cast(from, to) {
        return Err(shape_err(inv, ids[0], format!("a float tensor castable to {to}"), &format!("`{target}` is {to}")));
    }
    for block in d.sections.iter_mut().flat_map(|s| s.recipe.iter_mut()).filter(|b| b.source.is_some()) {
        if block.transform != Transform::Identity {
            return Err(shape_err(inv, ids[0], format!("{to}"), "a converted value cannot also be cast"));
        }
        block.transform = Transform::Cast(from);
    }
    d.dtype = to;
    Ok(d)
}

/// [`draft`] in the release's dtype.
fn draft_as_released(
    config: &ModelConfig,
    inv: &Inventory,
    kind: Kind,
    target: &str,
    ids: &[usize],
    expert: Option<u64>,
) -> Result<Draft, LayoutError> {
    let dtype = same_dtype(inv, target, ids)?;
    let shape = |i: usize| inv.shape(ids[i]).to_vec();
    let whole = |i: usize| vec![RowBlock::copy(ids[i], 0, rows_of(inv.shape(ids[i])))];
    let one = |shape: Vec<u64>, recipe: Vec<RowBlock>| vec![Section { suffix: String::new(), shape, recipe }];
    let (tp_mode, sections) = match kind {
        Kind::Copy(mode) => (mode, one(shape(0), whole(0))),
        Kind::ZeroCentered(mode) => {
            if !dtype.is_float() || matches!(dtype, DType::F8E4M3 | DType::F8E5M2) {
                return Err(shape_err(inv, ids[0], "a 16/32/64-bit float tensor".into(), "zero-centred norm"));
            }
            let mut recipe = whole(0);
            recipe[0].transform = Transform::SubtractOne;
            (mode, one(shape(0), recipe))
        }
        Kind::Vocab => {
            // Padded below, once the mesh is known; here the unpadded rows.
            let s = shape(0);
            if s.len() != 2 || s[0] != config.vocab_size {
                return Err(shape_err(inv, ids[0], format!("[{}, H]", config.vocab_size), "vocab_size × hidden"));
            }
            (TpMode::Column, one(s, whole(0)))
        }
        Kind::Qkv => (TpMode::Column, one_qkv(config, inv, ids)?),
        Kind::VisionQkv => (TpMode::Column, vision_qkv(config, inv, ids[0])?),
        Kind::GatedMlp => {
            let (g, u) = (shape(0), shape(1));
            if g != u || g.len() != 2 {
                return Err(shape_err(inv, ids[1], format!("{g:?} like the gate projection"), "gate/up must match"));
            }
            (
                TpMode::Column,
                vec![
                    Section { suffix: "_w".into(), shape: g.clone(), recipe: whole(0) },
                    Section { suffix: "_v".into(), shape: u, recipe: whole(1) },
                ],
            )
        }
        Kind::PackedGatedExperts => {
            let s = shape(0);
            let e = expert.unwrap_or(0);
            if s.len() != 3 || s[0] != config.num_experts || s[1] % 2 != 0 {
                return Err(shape_err(inv, ids[0], format!("[{}, 2F, H]", config.num_experts), "packed gate_up_proj"));
            }
            let f = s[1] / 2;
            let sec = |suffix: &str, first: u64| Section {
                suffix: suffix.into(),
                shape: vec![f, s[2]],
                recipe: vec![RowBlock::copy(ids[0], first, f)],
            };
            (TpMode::Column, vec![sec("_w", e * 2 * f), sec("_v", e * 2 * f + f)])
        }
        Kind::PackedExpertsDown => {
            let s = shape(0);
            let e = expert.unwrap_or(0);
            if s.len() != 3 || s[0] != config.num_experts {
                return Err(shape_err(inv, ids[0], format!("[{}, H, F]", config.num_experts), "packed down_proj"));
            }
            (TpMode::Row, one(vec![s[1], s[2]], vec![RowBlock::copy(ids[0], e * s[1], s[1])]))
        }
        Kind::TransposedGatedExperts => {
            let s = shape(0);
            let e = expert.unwrap_or(0);
            if s.len() != 3 || s[0] != config.num_experts || !s[2].is_multiple_of(2) || u32::try_from(s[2]).is_err() {
                return Err(shape_err(inv, ids[0], format!("[{}, H, 2F]", config.num_experts), "packed gate_up_proj"));
            }
            let (h, f) = (s[1], s[2] / 2);
            let sec = |suffix: &str, first: u64| Section {
                suffix: suffix.into(),
                shape: vec![f, h],
                recipe: vec![RowBlock::transposed(ids[0], first, f, s[2] as u32, 1)],
            };
            (TpMode::Column, vec![sec("_w", e * h * s[2]), sec("_v", e * h * s[2] + f)])
        }
        Kind::GdnInProjQkvz | Kind::GdnInProjSplit | Kind::GdnConv1d => (TpMode::Column, gdn(config, inv, kind, ids)?),
        Kind::Mxfp4GateUp
        | Kind::Mxfp4Down
        | Kind::InterleavedGateUpBias
        | Kind::PackedExpertRow(_)
        | Kind::TransposedGateUp
        | Kind::TransposedDown => {
            let (mode, sections, dtype) = gpt_oss::expert_sections(config, inv, kind, ids, expert.unwrap_or(0))?;
            return Ok(Draft {
                name: target.to_string(),
                first_source: ids[0],
                dtype,
                tp_mode: mode,
                expert,
                pad_vocab: false,
                // Not SwiGLU: Megatron keeps fc1 and its bias whole, in the ETP-dependent layout.
                fused_on_disk: true,
                sections,
            });
        }
        // Consumed by the planner before drafting.
        Kind::NotConverted => {
            return Err(shape_err(inv, ids[0], "a mapped tensor".into(), "not converted by design"));
        }
    };
    Ok(Draft {
        name: target.to_string(),
        first_source: ids[0],
        dtype,
        tp_mode,
        expert,
        pad_vocab: kind == Kind::Vocab,
        fused_on_disk: false,
        sections,
    })
}

/// QKV interleave per query group (layouts.md §2.1), with output-gate heads when present.
fn one_qkv(config: &ModelConfig, inv: &Inventory, ids: &[usize]) -> Result<Vec<Section>, LayoutError> {
    let (nh, ng, d) = (config.num_attention_heads, config.num_query_groups, config.head_dim);
    let hpg = config
        .heads_per_group()
        .ok_or_else(|| shape_err(inv, ids[0], format!("nh ({nh}) divisible by ng ({ng})"), "heads per group"))?;
    let (q, k, v) = (inv.shape(ids[0]), inv.shape(ids[1]), inv.shape(ids[2]));
    let rest = &q[1..];
    let gated = if q[0] == nh * d {
        false
    } else if q[0] == 2 * nh * d && arch::has_gated_attention(config.family) {
        true
    } else {
        return Err(shape_err(inv, ids[0], format!("[{}, …] (nh·head_dim)", nh * d), "query projection"));
    };
    for (i, s) in [(1, k), (2, v)] {
        if s[0] != ng * d || &s[1..] != rest {
            return Err(shape_err(
                inv,
                ids[i],
                format!("[{}, {rest:?}…] (ng·head_dim)", ng * d),
                "key/value projection",
            ));
        }
    }
    let mut recipe = Vec::new();
    for g in 0..ng {
        if gated {
            // HF gated q_proj holds per head [q_h (d); gate_h (d)].
            for h in g * hpg..(g + 1) * hpg {
                recipe.push(RowBlock::copy(ids[0], h * 2 * d, d));
            }
            for h in g * hpg..(g + 1) * hpg {
                recipe.push(RowBlock::copy(ids[0], h * 2 * d + d, d));
            }
        } else {
            recipe.push(RowBlock::copy(ids[0], g * hpg * d, hpg * d));
        }
        recipe.push(RowBlock::copy(ids[1], g * d, d));
        recipe.push(RowBlock::copy(ids[2], g * d, d));
    }
    let rows = ng * (if gated { 2 * hpg } else { hpg } + 2) * d;
    let mut shape = vec![rows];
    shape.extend_from_slice(rest);
    Ok(vec![Section { suffix: String::new(), shape, recipe }])
}

/// A vision tower's fused `[q; k; v]` (`3·Hv` rows, as many key/value heads as query heads) →
/// per head `[q_h; k_h; v_h]`: `merge_qkv_weights` / `merge_qkv_biases` with one head per group.
fn vision_qkv(config: &ModelConfig, inv: &Inventory, id: usize) -> Result<Vec<Section>, LayoutError> {
    let Some(v) = config.vision.as_ref().filter(|v| v.num_heads > 0 && v.hidden_size.is_multiple_of(v.num_heads))
    else {
        return Err(shape_err(inv, id, "a tower of `vision_config.num_heads` heads".into(), "vision qkv"));
    };
    let (nh, hv) = (v.num_heads, v.hidden_size);
    let d = hv / nh;
    let s = inv.shape(id).to_vec();
    if s.is_empty() || s[0] != 3 * hv || s.len() > 2 || s.get(1).is_some_and(|c| *c != hv) {
        let expected = if s.len() == 1 { format!("[{}]", 3 * hv) } else { format!("[{}, {hv}]", 3 * hv) };
        return Err(shape_err(inv, id, expected, "vision qkv: 3 · vision_config.hidden_size rows"));
    }
    let recipe = (0..nh).flat_map(|h| [0, hv, 2 * hv].map(|at| RowBlock::copy(id, at + h * d, d))).collect();
    Ok(vec![Section { suffix: String::new(), shape: s, recipe }])
}

/// GDN in_proj / conv1d sections in natural head order (layouts.md §2.3–2.4).
fn gdn(config: &ModelConfig, inv: &Inventory, kind: Kind, ids: &[usize]) -> Result<Vec<Section>, LayoutError> {
    let Some(g) = &config.gdn else {
        return Err(shape_err(inv, ids[0], "a GDN model".into(), "config has no linear_* fields"));
    };
    let (nk, nv, dk, dv) = (g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim);
    if nk == 0 || nv % nk != 0 {
        return Err(shape_err(inv, ids[0], format!("nv ({nv}) divisible by nk ({nk})"), "GDN heads"));
    }
    let m = nv / nk;
    let (qk, v) = (g.qk(), g.v());
    let names = ["query", "key", "value", "z", "beta", "alpha"];
    let sec = |i: usize, rows: u64, cols: &[u64], recipe: Vec<RowBlock>| {
        let mut shape = vec![rows];
        shape.extend_from_slice(cols);
        Section { suffix: format!(".{}", names[i]), shape, recipe }
    };
    match kind {
        Kind::GdnInProjQkvz => {
            let (qkvz, ba) = (inv.shape(ids[0]), inv.shape(ids[1]));
            let gs = 2 * dk + 2 * m * dv;
            if qkvz.len() != 2 || qkvz[0] != nk * gs {
                return Err(shape_err(
                    inv,
                    ids[0],
                    format!("[{}, H] (nk·(2dk+2·(nv/nk)·dv))", nk * gs),
                    "in_proj_qkvz",
                ));
            }
            if ba.len() != 2 || ba[0] != 2 * nv || ba[1] != qkvz[1] {
                return Err(shape_err(inv, ids[1], format!("[{}, {}]", 2 * nv, qkvz[1]), "in_proj_ba"));
            }
            let cols = &qkvz[1..];
            let per_head = |src: usize, start: u64, stride: u64, len: u64| -> Vec<RowBlock> {
                (0..nk).map(|h| RowBlock::copy(ids[src], h * stride + start, len)).collect()
            };
            Ok(vec![
                sec(0, qk, cols, per_head(0, 0, gs, dk)),
                sec(1, qk, cols, per_head(0, dk, gs, dk)),
                sec(2, v, cols, per_head(0, 2 * dk, gs, m * dv)),
                sec(3, v, cols, per_head(0, 2 * dk + m * dv, gs, m * dv)),
                sec(4, nv, cols, per_head(1, 0, 2 * m, m)),
                sec(5, nv, cols, per_head(1, m, 2 * m, m)),
            ])
        }
        Kind::GdnInProjSplit => {
            let qkv = inv.shape(ids[0]);
            if qkv.len() != 2 || qkv[0] != 2 * qk + v {
                return Err(shape_err(inv, ids[0], format!("[{}, H] (2·qk+v)", 2 * qk + v), "in_proj_qkv"));
            }
            let cols = qkv[1..].to_vec();
            for (i, rows) in [(1usize, v), (2, nv), (3, nv)] {
                if inv.shape(ids[i]) != [rows, cols[0]] {
                    return Err(shape_err(inv, ids[i], format!("[{rows}, {}]", cols[0]), "GDN projection"));
                }
            }
            Ok(vec![
                sec(0, qk, &cols, vec![RowBlock::copy(ids[0], 0, qk)]),
                sec(1, qk, &cols, vec![RowBlock::copy(ids[0], qk, qk)]),
                sec(2, v, &cols, vec![RowBlock::copy(ids[0], 2 * qk, v)]),
                sec(3, v, &cols, vec![RowBlock::copy(ids[1], 0, v)]),
                sec(4, nv, &cols, vec![RowBlock::copy(ids[2], 0, nv)]),
                sec(5, nv, &cols, vec![RowBlock::copy(ids[3], 0, nv)]),
            ])
        }
        _ => {
            let conv = inv.shape(ids[0]);
            if conv.is_empty() || conv[0] != 2 * qk + v {
                return Err(shape_err(inv, ids[0], format!("[{}, 1, K] (2·qk+v)", 2 * qk + v), "conv1d"));
            }
            let cols = conv[1..].to_vec();
            Ok(vec![
                sec(0, qk, &cols, vec![RowBlock::copy(ids[0], 0, qk)]),
                sec(1, qk, &cols, vec![RowBlock::copy(ids[0], qk, qk)]),
                sec(2, v, &cols, vec![RowBlock::copy(ids[0], 2 * qk, v)]),
            ])
        }
    }
}
