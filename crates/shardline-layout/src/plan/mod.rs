//! The plan: every output tensor's key, global shape, dtype and recipe, and every rank's chunks
//! of it, derived arithmetically from the config, the release inventory and the mesh.
//!
//! FSDP sharding follows Megatron-FSDP with one parameter per bucket: the TP-local tensor is
//! padded to a multiple of `D·R` elements (`R` = elements per row), so FSDP rank `j` of `D` owns
//! TP-local rows `[j·q, (j+1)·q)` clipped to the tensor, `q = ceil(rows/D)`. Shards are uneven or
//! empty at the end. A fused parameter (SwiGLU fc1, GDN in_proj/conv1d) is sharded as one TP-local
//! tensor and then split into its sections, so a section can straddle an FSDP boundary (layouts.md
//! §3). Any exact tiling loads in DCP; this one is what a Megatron-FSDP job would save.

mod build;
mod chunk;
mod draft;
mod gpt_oss;
mod quant;
mod torchtitan;

use std::collections::BTreeMap;

use crate::arch::TpMode;
use crate::dialect::Dialect;
use crate::dtype::DType;
use crate::mesh::Mesh;
use crate::recipe::{rows_of, RowBlock};

pub use build::{build_plan, check_mesh_for_model};
pub(crate) use chunk::chunk_draft;
use chunk::with_rest;
pub use chunk::{column_section_rows, fsdp_rows};
pub(crate) use torchtitan::{dense_mesh_tiling, is_routed_experts, sparse_mesh_tiling, tp_split, uneven_split};
pub use torchtitan::{TorchtitanTarget, TorchtitanVersion};

/// A tensor of the release, as its header declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// Options that change the output but not the mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Prefix of every model key (`model.module.` for Megatron `fsdp_dtensor`).
    pub prefix: String,
    /// The vocab dim is padded to a multiple of `vocab_divisible_by · tp` (Megatron's
    /// `--make-vocab-size-divisible-by`, default 128).
    pub vocab_divisible_by: u64,
    /// Also emit zero-filled fp32 Adam states (`exp_avg`, `exp_avg_sq`) sharded exactly like their
    /// parameters, so the checkpoint can be resumed and resharded by an optimizer.
    pub optimizer_state: bool,
    /// Prefix of optimizer-state keys; the parameter name and `.exp_avg` follow.
    pub optimizer_prefix: String,
    /// Write fused projections split (`linear_fc1.weight_w/_v`, GDN `.query…`), as Megatron's
    /// `fsdp_dtensor` stores them. When false they stay fused in the TP-dependent layout
    /// (`[gate_r; up_r]` per TP rank), as a TP-local Megatron module holds them.
    pub split_fused: bool,
    /// The checkpoint dialect: how DP chunks parameters and where they land on disk
    /// (see [`crate::dialect`]).
    pub dialect: Dialect,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            prefix: "model.module.".to_string(),
            vocab_divisible_by: 128,
            optimizer_state: false,
            optimizer_prefix: "optimizer.state.module.module.module.".to_string(),
            split_fused: true,
            dialect: Dialect::FsdpDtensor,
        }
    }
}

/// Which mesh a parameter lives on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Group {
    /// `(dp·cp) × tp`.
    Dense,
    /// `expert_dp × ep × etp`, owned by EP rank `ep_rank`.
    Expert { expert: u64, ep_rank: u64 },
}

/// What a key holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// A model parameter (or one split section of a fused one).
    Param,
    /// An optimizer state of the parameter key named.
    OptimizerState { param_key: String, state: &'static str },
}

/// One `(TP rank, FSDP rank)` piece of a tensor. Pieces with no rows, and replicas of a
/// TP-replicated piece other than the one chosen to write it, have `written = false` so the
/// per-rank plans stay complete for validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub rank: u64,
    pub tp_rank: u64,
    pub fsdp_rank: u64,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub written: bool,
}

impl Chunk {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.sizes.iter().product()
    }
}

/// How a tensor is cut into chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tiling {
    /// Megatron-FSDP's arithmetic, as the planner produces it: chunks are computed when asked
    /// for, so a plan holds a few numbers per tensor however many ranks it spans.
    Fsdp(FsdpTiling),
    /// Chunks listed one by one (hand-written plans, including the field's buggy ones).
    Listed(Vec<Chunk>),
}

/// How a tensor's Megatron-FSDP chunks are derived: chunk `i` is TP rank `i mod tp` of FSDP
/// rank `i div tp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsdpTiling {
    pub numbers: FsdpNumbers,
    /// TP-replicated tensors: the TP rank that writes each FSDP piece (the others are replicas
    /// and are not written); empty for TP-split tensors.
    pub writers: Box<[u32]>,
}

/// The numbers a tensor's Megatron-FSDP chunks are derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FsdpNumbers {
    /// Size of the FSDP shard group.
    pub fsdp_size: u64,
    /// Rows of the TP-local tensor that is FSDP-sharded (the whole fused tensor for a section).
    pub local_rows: u64,
    /// Column-parallel sections: first TP-local row of this section within `local_rows`.
    pub section_start: u64,
    /// TP-local rows of this key.
    pub section_rows: u64,
    /// The data-parallel rank whose ranks write the chunks, when DP replicates instead of
    /// sharding (`fsdp_size` 1): `torch_dist` spreads whole tensors over the DP replicas, as
    /// Megatron-Core's fully parallel save does. 0 under FSDP.
    pub dp_writer: u64,
    /// The dim FSDP shards (TP-replicated tensors only): 0 under Megatron-FSDP and FSDP2's
    /// default; FSDP2's `shard_placement_fn` may pick another (`Shard(1)` for grouped experts
    /// when there are more ranks than experts). `section_rows` is that dim's size.
    pub dim: u8,
    /// Grouped experts `[E, …]` under expert parallelism (FSDP2 frameworks): dim 0 is cut into
    /// this many slabs of `E / slabs` experts, chunk `i` (on rank `i`, expert-parallel rank fastest)
    /// holding slab `i mod slabs` cut along `dim` over the `fsdp_size · tp / slabs` ranks — within
    /// the slab when `dim` is 0, as torchtitan's `_StridedShard(0)` does. 1 otherwise.
    pub slabs: u64,
}

/// Where a split section comes from: the fused parameter's name (a byte range of the key, so a
/// plan holds no second copy of it) and the section's place among its siblings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitFrom {
    pub name: (u32, u32),
    pub index: u16,
    pub sections: u16,
}

/// An output tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputTensor {
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub recipe: Vec<RowBlock>,
    pub tp_mode: TpMode,
    /// TP (or ETP for experts) degree the parameter is split over.
    pub tp: u64,
    pub group: Group,
    /// When this key is a section of a fused parameter.
    pub split: Option<SplitFrom>,
    pub role: Role,
    pub tiling: Tiling,
}

impl OutputTensor {
    /// What the writers and the chunk arithmetic read of this tensor.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            key: &self.key,
            dtype: self.dtype,
            shape: &self.shape,
            recipe: &self.recipe,
            tp_mode: self.tp_mode,
            tp: self.tp,
            group: self.group,
            tiling: match &self.tiling {
                Tiling::Fsdp(f) => TilingView::Fsdp(f.numbers, &f.writers),
                Tiling::Listed(chunks) => TilingView::Listed(chunks),
            },
        }
    }

    /// Bytes of the whole tensor.
    pub fn nbytes(&self) -> u64 {
        self.view().nbytes()
    }

    /// The TP-local shape of this key (a section of the fused TP-local tensor when split): the
    /// global shape with its TP-split dim divided by `tp`.
    pub fn local_shape(&self) -> Vec<u64> {
        self.view().local_shape()
    }

    /// `(fused parameter name, section index, sections)` when this key is a split section.
    pub fn split_from(&self) -> Option<(&str, usize, usize)> {
        let s = self.split?;
        let name = self.key.get(s.name.0 as usize..s.name.1 as usize)?;
        Some((name, usize::from(s.index), usize::from(s.sections)))
    }

    /// Number of chunks, written or not.
    pub fn chunk_count(&self) -> usize {
        self.view().chunk_count()
    }

    /// Chunk `i` (`i < chunk_count()`) on `mesh`, the mesh of the plan holding this tensor.
    pub fn chunk(&self, mesh: &Mesh, i: usize) -> Chunk {
        self.view().chunk(mesh, i)
    }

    /// The rank that lists chunk `i`, without computing the chunk's geometry.
    pub fn chunk_rank(&self, mesh: &Mesh, i: usize) -> u64 {
        self.view().chunk_rank(mesh, i)
    }

    /// The indices of the chunks `rank` lists, in order (see [`TensorView::chunks_of_rank`]).
    pub fn chunks_of_rank<'a>(&'a self, mesh: &'a Mesh, rank: u64) -> impl Iterator<Item = usize> + 'a {
        self.view().chunks_of_rank(mesh, rank)
    }

    /// Every chunk, in order.
    pub fn chunks<'a>(&'a self, mesh: &'a Mesh) -> impl Iterator<Item = Chunk> + 'a {
        self.view().chunks(mesh)
    }

    /// The chunks as a list that can be edited (to build a plan by hand from a planned one).
    pub fn listed_chunks(&mut self, mesh: &Mesh) -> &mut Vec<Chunk> {
        if let Tiling::Fsdp(_) = self.tiling {
            self.tiling = Tiling::Listed(self.chunks(mesh).collect());
        }
        match &mut self.tiling {
            Tiling::Listed(chunks) => chunks,
            Tiling::Fsdp(_) => unreachable!("just listed"),
        }
    }
}

/// A [`Tiling`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TilingView<'a> {
    /// The FSDP numbers and the writers of TP-replicated pieces (empty for TP-split tensors).
    Fsdp(FsdpNumbers, &'a [u32]),
    Listed(&'a [Chunk]),
}

/// An output tensor as the writers read it, borrowed from an [`OutputTensor`] or a
/// [`PlanTable`]: the chunk arithmetic lives here, so both give the same chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorView<'a> {
    pub key: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub recipe: &'a [RowBlock],
    pub tp_mode: TpMode,
    pub tp: u64,
    pub group: Group,
    pub tiling: TilingView<'a>,
}

impl<'a> TensorView<'a> {
    /// Bytes of the whole tensor.
    pub fn nbytes(self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
    }

    /// The TP-local shape (see [`OutputTensor::local_shape`]).
    pub fn local_shape(self) -> Vec<u64> {
        let mut local = self.shape.to_vec();
        let dim = match self.tp_mode {
            TpMode::Column => 0,
            TpMode::Row => 1,
            TpMode::Replicated => return local,
        };
        if let Some(d) = local.get_mut(dim) {
            *d /= self.tp.max(1);
        }
        local
    }

    /// Number of chunks, written or not.
    pub fn chunk_count(self) -> usize {
        match self.tiling {
            TilingView::Fsdp(f, _) => (f.fsdp_size * self.tp) as usize,
            TilingView::Listed(chunks) => chunks.len(),
        }
    }

    /// Chunk `i` (`i < chunk_count()`) on `mesh`, the mesh of the plan holding this tensor.
    pub fn chunk(self, mesh: &Mesh, i: usize) -> Chunk {
        match self.tiling {
            TilingView::Fsdp(f, writers) => fsdp_chunk(self, f, writers, mesh, i as u64),
            TilingView::Listed(chunks) => chunks[i].clone(),
        }
    }

    /// The rank that lists chunk `i`, without computing the chunk's geometry.
    pub fn chunk_rank(self, mesh: &Mesh, i: usize) -> u64 {
        match self.tiling {
            TilingView::Fsdp(f, _) => {
                let (j, r) = (i as u64 / self.tp + f.dp_writer, i as u64 % self.tp);
                match self.group {
                    Group::Dense => mesh.dense_rank(r, j),
                    Group::Expert { ep_rank, .. } => mesh.expert_rank(r, ep_rank, j),
                }
            }
            TilingView::Listed(chunks) => chunks[i].rank,
        }
    }

    /// The indices of the chunks `rank` lists, in order. Under Megatron-FSDP a rank holds at
    /// most one chunk of a tensor and its index follows from the rank, so a rank's chunks are
    /// found without looking at the other ranks'.
    pub fn chunks_of_rank(self, mesh: &'a Mesh, rank: u64) -> impl Iterator<Item = usize> + 'a {
        let (direct, listed) = match self.tiling {
            TilingView::Fsdp(f, _) => {
                // Invert dense_rank / expert_rank: chunk i is TP rank i mod tp of FSDP rank
                // i div tp (shifted to the DP rank that writes it).
                let index = match self.group {
                    Group::Dense => rank.checked_sub(self.tp * f.dp_writer),
                    Group::Expert { ep_rank, .. } => {
                        let (etp_rank, rest) = (rank % mesh.etp, rank / mesh.etp);
                        (rest % mesh.ep == ep_rank)
                            .then(|| (rest / mesh.ep).checked_sub(f.dp_writer))
                            .flatten()
                            .map(|dp| dp * self.tp + etp_rank)
                    }
                };
                let index = index.and_then(|i| usize::try_from(i).ok()).filter(|&i| i < self.chunk_count());
                (index, 0..0)
            }
            TilingView::Listed(chunks) => (None, 0..chunks.len()),
        };
        direct.into_iter().chain(listed.filter(move |&i| self.chunk_rank(mesh, i) == rank))
    }

    /// Every chunk, in order.
    pub fn chunks(self, mesh: &'a Mesh) -> impl Iterator<Item = Chunk> + 'a {
        (0..self.chunk_count()).map(move |i| self.chunk(mesh, i))
    }
}

/// Chunk `i` of `t` under Megatron-FSDP (layouts.md §3): TP rank `r`, FSDP rank `j`.
fn fsdp_chunk(t: TensorView<'_>, f: FsdpNumbers, writers: &[u32], mesh: &Mesh, i: u64) -> Chunk {
    let (j, r) = (i / t.tp, i % t.tp);
    let rest = t.shape.get(1..).unwrap_or(&[]);
    let (offsets, sizes) = match t.tp_mode {
        TpMode::Column => {
            let (row, rows) = column_section_rows(f.local_rows, f.section_start, f.section_rows, r, f.fsdp_size, j);
            (with_rest(row, rest, true), with_rest(rows, rest, false))
        }
        TpMode::Row => {
            let (lo, hi) = fsdp_rows(f.section_rows, f.fsdp_size, j);
            let cols = t.shape.get(1).map_or(0, |c| c / t.tp);
            let mut off = vec![lo, r * cols];
            off.extend(rest.iter().skip(1).map(|_| 0));
            let mut sz = vec![hi - lo, cols];
            sz.extend(rest.iter().skip(1).copied());
            (off, sz)
        }
        TpMode::Replicated if t.shape.is_empty() => (vec![], vec![]),
        TpMode::Replicated if f.slabs > 1 => grouped_box(t.shape, f, t.tp, i),
        TpMode::Replicated if f.dim == 0 => {
            let (lo, hi) = fsdp_rows(f.section_rows, f.fsdp_size, j);
            (with_rest(lo, rest, true), with_rest(hi - lo, rest, false))
        }
        TpMode::Replicated => {
            let (lo, hi) = fsdp_rows(f.section_rows, f.fsdp_size, j);
            let dim = usize::from(f.dim);
            let offsets = (0..t.shape.len()).map(|d| if d == dim { lo } else { 0 }).collect();
            let sizes = t.shape.iter().enumerate().map(|(d, &n)| if d == dim { hi - lo } else { n }).collect();
            (offsets, sizes)
        }
    };
    let numel: u64 = sizes.iter().product();
    // A 0-d tensor is one element: FSDP rank 0 holds it.
    let zero_d_extra = t.shape.is_empty() && j > 0;
    let writer = writers.get(j as usize).is_none_or(|&w| u64::from(w) == r);
    let rank = t.chunk_rank(mesh, i as usize);
    Chunk { rank, tp_rank: r, fsdp_rank: j, offsets, sizes, written: numel > 0 && !zero_d_extra && writer }
}

/// Chunk `i` of grouped experts cut into expert-parallel slabs (see [`FsdpNumbers::slabs`]) over
/// the `fsdp_size · tp` ranks of the mesh (torchtitan's sparse mesh takes the TP ranks too).
fn grouped_box(shape: &[u64], f: FsdpNumbers, tp: u64, i: u64) -> (Vec<u64>, Vec<u64>) {
    let (slab, j) = (i % f.slabs, i / f.slabs);
    let per_slab = shape.first().copied().unwrap_or(0) / f.slabs;
    let dim = usize::from(f.dim);
    let mut offsets = vec![0; shape.len()];
    let mut sizes = shape.to_vec();
    if let (Some(o), Some(s)) = (offsets.first_mut(), sizes.first_mut()) {
        (*o, *s) = (slab * per_slab, per_slab);
    }
    if let (Some(o), Some(s)) = (offsets.get_mut(dim), sizes.get_mut(dim)) {
        let (lo, hi) = fsdp_rows(*s, f.fsdp_size * tp / f.slabs, j);
        (*o, *s) = (*o + lo, hi - lo);
    }
    (offsets, sizes)
}

/// A conversion plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub mesh: Mesh,
    pub options: PlanOptions,
    pub model_type: String,
    pub sources: Vec<SourceTensor>,
    /// Sorted by key.
    pub tensors: Vec<OutputTensor>,
    /// Release tensors knowingly not converted (vision towers), by name.
    pub unconverted: Vec<String>,
}

impl Plan {
    /// Number of rank files of the target job.
    pub fn world(&self) -> u64 {
        self.mesh.world()
    }

    /// The output tensors as the writers read them, in key order.
    pub fn views(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        self.tensors.iter().map(OutputTensor::view)
    }

    /// Bytes each rank writes (tensor data only).
    pub fn bytes_per_rank(&self) -> Vec<u64> {
        bytes_per_rank(&self.mesh, self.views())
    }

    /// The non-empty written chunks of `rank`, in key order, as `(tensor index, chunk index,
    /// chunk)`: what the rank's file holds, computed as it is read.
    pub fn rank_chunks(&self, rank: u64) -> impl Iterator<Item = (usize, usize, Chunk)> + '_ {
        rank_chunks(&self.mesh, self.views(), rank)
    }
}

/// Bytes each rank of `mesh` writes of `tensors` (tensor data only).
pub(crate) fn bytes_per_rank<'a>(mesh: &Mesh, tensors: impl Iterator<Item = TensorView<'a>>) -> Vec<u64> {
    let mut bytes = vec![0u64; mesh.world() as usize];
    for t in tensors {
        for c in t.chunks(mesh).filter(|c| c.written) {
            bytes[c.rank as usize] += c.numel() * t.dtype.size() as u64;
        }
    }
    bytes
}

/// The non-empty written chunks of `rank` among `tensors`, as `(tensor index, chunk index, chunk)`.
pub(crate) fn rank_chunks<'a>(
    mesh: &'a Mesh,
    tensors: impl Iterator<Item = TensorView<'a>> + 'a,
    rank: u64,
) -> impl Iterator<Item = (usize, usize, Chunk)> + 'a {
    tensors.enumerate().flat_map(move |(ti, t)| {
        t.chunks_of_rank(mesh, rank)
            .map(move |ci| (ti, ci, t.chunk(mesh, ci)))
            .filter(|(_, _, c)| c.written && c.numel() > 0)
    })
}

/// A fused parameter's section before chunking.
pub(crate) struct Section {
    pub(crate) suffix: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) recipe: Vec<RowBlock>,
}

/// A Megatron parameter before chunking.
pub(crate) struct Draft {
    pub(crate) name: String,
    /// The first release tensor it is made from (to name it in errors).
    pub(crate) first_source: usize,
    pub(crate) dtype: DType,
    pub(crate) tp_mode: TpMode,
    pub(crate) expert: Option<u64>,
    /// Vocab tensors get zero rows up to a multiple of `vocab_divisible_by · tp`.
    pub(crate) pad_vocab: bool,
    /// Sections kept fused on disk whatever the options (gpt-oss fc1: `[gate_r; up_r]` per TP rank).
    pub(crate) fused_on_disk: bool,
    pub(crate) sections: Vec<Section>,
}
/// Per-key summary for `--dry-run`: `(key, dtype, global shape, split_from)`.
pub fn summary(plan: &Plan) -> BTreeMap<String, (DType, Vec<u64>, Option<String>)> {
    plan.tensors
        .iter()
        .map(|t| (t.key.clone(), (t.dtype, t.shape.clone(), t.split_from().map(|s| s.0.to_string()))))
        .collect()
}
