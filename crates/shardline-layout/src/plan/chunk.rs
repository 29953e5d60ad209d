//! Chunking a draft for the mesh: TP split, vocab padding, FSDP row shards (uneven at the end)
//! and the split of fused sections, as Megatron-FSDP would save them.

use super::*;
use crate::recipe::slice_recipe;

/// FSDP rows `[lo, hi)` of rank `j` of `d` over `rows` TP-local rows.
pub fn fsdp_rows(rows: u64, d: u64, j: u64) -> (u64, u64) {
    let q = rows.div_ceil(d);
    ((j * q).min(rows), ((j + 1) * q).min(rows))
}

/// Chunks of a column-parallel section `c` (TP-local rows `[a_c, a_c+n_c)` of a fused TP-local
/// tensor of `local_rows` rows) for TP rank `r` and FSDP rank `j` of `d`: `(row offset, rows)`
/// in global coordinates (layouts.md §3).
pub fn column_section_rows(local_rows: u64, a_c: u64, n_c: u64, r: u64, d: u64, j: u64) -> (u64, u64) {
    let (lo_j, hi_j) = fsdp_rows(local_rows, d, j);
    let lo = lo_j.max(a_c);
    let hi = hi_j.min(a_c + n_c);
    let rows = hi.saturating_sub(lo);
    let row_in_section = lo_j.saturating_sub(a_c).min(n_c);
    (r * n_c + row_in_section, rows)
}

pub(crate) fn chunk_draft(
    d: Draft,
    mesh: &Mesh,
    num_experts: u64,
    options: &PlanOptions,
    rank_bytes: &mut [u64],
) -> Vec<OutputTensor> {
    let (t, dsize, group) = match d.expert {
        None => (mesh.tp, mesh.fsdp_size(), Group::Dense),
        Some(e) => {
            (mesh.etp, mesh.expert_dp_size(), Group::Expert { expert: e, ep_rank: e / (num_experts / mesh.ep).max(1) })
        }
    };
    let rank_of = |r: u64, j: u64| match group {
        Group::Dense => mesh.dense_rank(r, j),
        Group::Expert { ep_rank, .. } => mesh.expert_rank(r, ep_rank, j),
    };
    // Replicated over DP (torch_dist): one DP replica writes the tensor, the one whose ranks
    // have the fewest bytes planned so far (lowest on ties), as a fully parallel save spreads
    // the writing over the replicas.
    let (dsize, dp_writer) = if options.dialect.shards_over_dp() {
        (dsize, 0)
    } else {
        let load = |j: u64| (0..t).map(|r| rank_bytes[rank_of(r, j) as usize]).sum::<u64>();
        (1, (0..dsize).min_by_key(|&j| (load(j), j)).unwrap_or(0))
    };
    let mut sections: Vec<(String, Vec<u64>, Vec<RowBlock>)> =
        d.sections.into_iter().map(|s| (s.suffix, s.shape, s.recipe)).collect();
    // Vocab padding happens here because it depends on tp.
    if d.pad_vocab {
        let (_, shape, recipe) = &mut sections[0];
        let multiple = options.vocab_divisible_by.max(1) * t;
        let padded = shape[0].div_ceil(multiple) * multiple;
        if padded > shape[0] {
            recipe.push(RowBlock::zeros(padded - shape[0]));
            shape[0] = padded;
        }
    }
    // torch_dist keeps even these as `[gate; up]` (its placement joins the sections).
    let fused_on_disk = d.fused_on_disk && options.dialect == crate::dialect::Dialect::FsdpDtensor;
    if (!options.split_fused || fused_on_disk) && sections.len() > 1 && d.tp_mode == TpMode::Column {
        // The TP-dependent fused layout: TP rank r's slice of every section, in section order.
        let mut rows = 0;
        let mut recipe = Vec::new();
        for r in 0..t {
            for (_, shape, rc) in &sections {
                let n = rows_of(shape) / t;
                recipe.extend(slice_recipe(rc, r * n, n));
                rows += n;
            }
        }
        let mut shape = sections[0].1.clone();
        shape[0] = rows;
        sections = vec![(String::new(), shape, recipe)];
    }
    let n_sections = sections.len();
    // FSDP shards the fused TP-local tensor: all its sections.
    let local_rows: u64 = match d.tp_mode {
        TpMode::Column => sections.iter().map(|(_, s, _)| rows_of(s) / t).sum(),
        _ => sections.iter().map(|(_, s, _)| rows_of(s)).sum(),
    };
    let item = d.dtype.size() as u64;
    let mut out = Vec::new();
    let mut a_c = 0u64;
    for (ci, (suffix, shape, recipe)) in sections.into_iter().enumerate() {
        let n_c = match d.tp_mode {
            TpMode::Column => rows_of(&shape) / t,
            TpMode::Row | TpMode::Replicated => rows_of(&shape),
        };
        // For replicated pieces, the TP replica with the fewest planned bytes writes (like
        // torch's save-plan dedup), lowest rank on ties. Each FSDP piece's replicas sit on ranks
        // of their own, so the choice for one piece does not depend on the others.
        let writers: Box<[u32]> = if d.tp_mode == TpMode::Replicated && !options.dialect.balances_replicas() {
            // Megatron-Core's main replica: TP rank 0.
            vec![0; dsize as usize].into_boxed_slice()
        } else if d.tp_mode == TpMode::Replicated {
            (0..dsize)
                .map(|j| {
                    let w = (0..t).min_by_key(|r| (rank_bytes[rank_of(*r, j) as usize], rank_of(*r, j))).unwrap_or(0);
                    u32::try_from(w).unwrap_or(u32::MAX)
                })
                .collect()
        } else {
            Box::default()
        };
        let numbers = FsdpNumbers {
            fsdp_size: dsize,
            local_rows,
            section_start: a_c,
            section_rows: n_c,
            dp_writer,
            dim: 0,
            slabs: 1,
        };
        let tiling = FsdpTiling { numbers, writers };
        // Sized exactly: a plan keeps every key for the whole conversion.
        let mut key = String::with_capacity(options.prefix.len() + d.name.len() + suffix.len());
        key.extend([options.prefix.as_str(), &d.name, &suffix]);
        let split = (n_sections > 1).then(|| {
            let start = options.prefix.len();
            let at = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            SplitFrom {
                name: (at(start), at(start + d.name.len())),
                index: u16::try_from(ci).unwrap_or(u16::MAX),
                sections: u16::try_from(n_sections).unwrap_or(u16::MAX),
            }
        });
        let tensor = OutputTensor {
            key,
            dtype: d.dtype,
            shape,
            recipe,
            tp_mode: d.tp_mode,
            tp: t,
            group,
            split,
            role: Role::Param,
            tiling: Tiling::Fsdp(tiling),
        };
        for c in tensor.chunks(mesh).filter(|c| c.written) {
            rank_bytes[c.rank as usize] += c.numel() * item;
        }
        out.push(tensor);
        a_c += n_c;
    }
    out
}

pub(super) fn with_rest(first: u64, rest: &[u64], zeros: bool) -> Vec<u64> {
    let mut v = Vec::with_capacity(1 + rest.len());
    v.push(first);
    v.extend(rest.iter().map(|r| if zeros { 0 } else { *r }));
    v
}
