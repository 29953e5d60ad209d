//! torchtitan's dense mesh `(dp, tp)`: which dim its tensor parallelism splits each parameter
//! along, and the chunks FSDP2 then makes of the TP-local tensor. Shared by the seed planner and
//! the reshard of torchtitan's training checkpoints, which name tensors alike.

use super::super::{fsdp_rows, Chunk, FsdpNumbers, FsdpTiling, Tiling};
use crate::arch::TpMode;
use crate::mesh::Mesh;

/// Whether `key` (a model key, or the parameter an optimizer state follows) is a routed-experts
/// tensor `[E, …]` of any torchtitan version.
pub(crate) fn is_routed_experts(key: &str) -> bool {
    key.contains(".routed_experts.") || key.contains(".moe.experts.")
}

/// The dim torchtitan's tensor parallelism splits the parameter `key` along, from its sharding
/// configs (models/common/decoder_sharding.py, moe_sharding.py, deepseek_v3/sharding.py):
/// colwise `Shard(0)` (embedding, output projection, q/k/v and fused `wqkv`, `w1`/`w3`, MLA's
/// up-projections; gpt-oss's q/k/v biases and attention sinks), rowwise `Shard(1)` (`wo`, `w2`),
/// routed experts without EP `Shard(1)` (`w1`, `w3`; gpt-oss's `mlp1` and its bias) and
/// `Shard(2)` (`w2`, gpt-oss's `mlp2`); `None` where TP replicates it (norms, router, biases of
/// rowwise layers, expert bias, MLA's low-rank projections, MTP's `eh_proj`). Names of every
/// torchtitan version match (gpt_oss/sharding.py for gpt-oss).
pub(crate) fn tp_split(key: &str) -> Option<usize> {
    const COLWISE: &[&str] = &[
        "tok_embeddings.weight",
        "lm_head.weight",
        "output.weight",
        ".wq.weight",
        ".wk.weight",
        ".wv.weight",
        ".wqkv.weight",
        ".wq.bias",
        ".wk.bias",
        ".wv.bias",
        "attention.sinks",
        ".wq_b.weight",
        ".wkv_b.weight",
        "feed_forward.w1.weight",
        "feed_forward.w3.weight",
        "shared_experts.w1.weight",
        "shared_experts.w3.weight",
    ];
    const ROWWISE: &[&str] = &[".wo.weight", "feed_forward.w2.weight", "shared_experts.w2.weight"];
    if is_routed_experts(key) {
        return match key.rsplit('.').next() {
            Some("w1_EFD" | "w3_EFD" | "w1" | "w3" | "mlp1_weight_EGD" | "mlp1_bias_EG") => Some(1),
            Some("w2_EDF" | "w2" | "mlp2_weight_EDF") => Some(2),
            _ => None,
        };
    }
    if COLWISE.iter().any(|s| key.ends_with(s)) {
        Some(0)
    } else if ROWWISE.iter().any(|s| key.ends_with(s)) {
        Some(1)
    } else {
        None
    }
}

/// Why `mesh.tp` cannot split dim `split` of `shape`, if it cannot (Shardline writes even TP
/// shards, as torchtitan's models have them).
pub(crate) fn uneven_split(shape: &[u64], split: Option<usize>, tp: u64) -> Option<String> {
    let d = split?;
    match shape.get(d) {
        Some(n) if n.is_multiple_of(tp) => None,
        _ => Some(format!(
            "tp = {tp} does not divide dim {d} of {shape:?}, which torchtitan's tensor parallelism splits"
        )),
    }
}

/// The tiling of a tensor of `shape` on the dense mesh of `mesh`: TP rank `r`'s even block of dim
/// `split` (none: TP replicates it, and TP rank `writer(j)` writes FSDP piece `j`), cut by FSDP2
/// into `torch.chunk` pieces along `fsdp_dim` of the TP-local tensor over `mesh.dp`; rank `j·tp + r`
/// holds piece `j` of block `r`. A colwise split is Megatron's column tiling
/// (`[_StridedShard(0), Shard(0)]`), a rowwise one its row tiling (`[Shard(0), Shard(1)]`); the
/// rest (dims 1 and 2 of stacked experts) is listed.
pub(crate) fn dense_mesh_tiling(
    shape: &[u64],
    split: Option<usize>,
    fsdp_dim: usize,
    mesh: &Mesh,
    writer: impl Fn(u64) -> u32,
) -> (TpMode, Tiling) {
    let (tp, dp) = (mesh.tp, mesh.dp);
    let rows = shape.first().copied().unwrap_or(1);
    let numbers = |local_rows: u64, dim: u8| FsdpNumbers {
        fsdp_size: dp,
        local_rows,
        section_start: 0,
        section_rows: local_rows,
        dp_writer: 0,
        dim,
        slabs: 1,
    };
    let fsdp = |n: FsdpNumbers, writers: Box<[u32]>| Tiling::Fsdp(FsdpTiling { numbers: n, writers });
    let split = split.filter(|_| tp > 1);
    match (split, fsdp_dim) {
        (Some(0), 0) => (TpMode::Column, fsdp(numbers(rows / tp, 0), Box::default())),
        (Some(1), 0) if shape.len() == 2 => (TpMode::Row, fsdp(numbers(rows, 0), Box::default())),
        (None, _) => {
            let writers = if tp > 1 { (0..dp).map(writer).collect() } else { Box::default() };
            let n = shape.get(fsdp_dim).copied().unwrap_or(1);
            (TpMode::Replicated, fsdp(numbers(n, u8::try_from(fsdp_dim).unwrap_or(0)), writers))
        }
        (Some(d), _) => {
            let chunks = (0..dp)
                .flat_map(|j| (0..tp).map(move |r| (j, r)))
                .map(|(j, r)| {
                    let (offsets, sizes) = tp_fsdp_box(shape, Some((d, tp, r)), fsdp_dim, dp, j);
                    let written = sizes.iter().all(|&n| n > 0);
                    Chunk { rank: mesh.dense_rank(r, j), tp_rank: r, fsdp_rank: j, offsets, sizes, written }
                })
                .collect();
            (TpMode::Replicated, Tiling::Listed(chunks))
        }
    }
}

/// The tiling of routed experts `[E, …]` under expert parallelism: torchtitan's sparse mesh
/// `(efsdp, ep)` spans every rank and takes them out of TP, one slab of `E / ep` experts per EP
/// rank cut along `dim` over its `efsdp` ranks; chunk `i = j·tp + r` is on rank `i`.
pub(crate) fn sparse_mesh_tiling(shape: &[u64], dim: u8, mesh: &Mesh) -> Tiling {
    let n = shape.get(usize::from(dim)).copied().unwrap_or(1);
    let numbers = FsdpNumbers {
        fsdp_size: mesh.dp,
        local_rows: n,
        section_start: 0,
        section_rows: n,
        dp_writer: 0,
        dim,
        slabs: mesh.ep,
    };
    Tiling::Fsdp(FsdpTiling { numbers, writers: Box::default() })
}

/// The box of dense-mesh rank `(j, r)`: TP rank `r`'s even block of dim `d` when `tp` is
/// `Some((d, tp, r))`, then `torch.chunk` piece `j` of `dp` of the TP-local tensor along
/// `fsdp_dim` (strided within the TP block when the dims agree, as FSDP2 places it).
fn tp_fsdp_box(shape: &[u64], tp: Option<(usize, u64, u64)>, fsdp_dim: usize, dp: u64, j: u64) -> (Vec<u64>, Vec<u64>) {
    let mut offsets = vec![0; shape.len()];
    let mut sizes = shape.to_vec();
    if let Some((d, tp, r)) = tp {
        if let (Some(o), Some(s)) = (offsets.get_mut(d), sizes.get_mut(d)) {
            *s /= tp;
            *o = r * *s;
        }
    }
    if let (Some(o), Some(s)) = (offsets.get_mut(fsdp_dim), sizes.get_mut(fsdp_dim)) {
        let (lo, hi) = fsdp_rows(*s, dp, j);
        (*o, *s) = (*o + lo, hi - lo);
    }
    (offsets, sizes)
}
