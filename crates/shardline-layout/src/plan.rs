//! The plan: every output tensor's key, global shape, dtype and recipe, and every rank's chunks
//! of it, derived arithmetically from the config, the release inventory and the mesh.
//!
//! FSDP sharding follows Megatron-FSDP with one parameter per bucket: the TP-local tensor is
//! padded to a multiple of `D·R` elements (`R` = elements per row), so FSDP rank `j` of `D` owns
//! TP-local rows `[j·q, (j+1)·q)` clipped to the tensor, `q = ceil(rows/D)`. Shards are uneven or
//! empty at the end. A fused parameter (SwiGLU fc1, GDN in_proj/conv1d) is sharded as one TP-local
//! tensor and then split into its sections, so a section can straddle an FSDP boundary (layouts.md
//! §3). Any exact tiling loads in DCP; this one is what a Megatron-FSDP job would save.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::arch::{self, Kind, Rule, TpMode};
use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::LayoutError;
use crate::mesh::Mesh;
use crate::recipe::{rows_of, slice_recipe, RowBlock, Transform};

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
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            prefix: "model.module.".to_string(),
            vocab_divisible_by: 128,
            optimizer_state: false,
            optimizer_prefix: "optimizer.state.module.module.module.".to_string(),
            split_fused: true,
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
            TilingView::Fsdp(..) => {
                let (j, r) = (i as u64 / self.tp, i as u64 % self.tp);
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
            TilingView::Fsdp(..) => {
                // Invert dense_rank / expert_rank: chunk i is TP rank i mod tp of FSDP rank i div tp.
                let index = match self.group {
                    Group::Dense => Some(rank),
                    Group::Expert { ep_rank, .. } => {
                        let (etp_rank, rest) = (rank % mesh.etp, rank / mesh.etp);
                        (rest % mesh.ep == ep_rank).then(|| (rest / mesh.ep) * self.tp + etp_rank)
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
        TpMode::Replicated => {
            let (lo, hi) = fsdp_rows(f.section_rows, f.fsdp_size, j);
            (with_rest(lo, rest, true), with_rest(hi - lo, rest, false))
        }
    };
    let numel: u64 = sizes.iter().product();
    // A 0-d tensor is one element: FSDP rank 0 holds it.
    let zero_d_extra = t.shape.is_empty() && j > 0;
    let writer = writers.get(j as usize).is_none_or(|&w| u64::from(w) == r);
    let rank = t.chunk_rank(mesh, i as usize);
    Chunk { rank, tp_rank: r, fsdp_rank: j, offsets, sizes, written: numel > 0 && !zero_d_extra && writer }
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
struct Section {
    suffix: String,
    shape: Vec<u64>,
    recipe: Vec<RowBlock>,
}

/// A Megatron parameter before chunking.
struct Draft {
    name: String,
    /// The first release tensor it is made from (to name it in errors).
    first_source: usize,
    dtype: DType,
    tp_mode: TpMode,
    expert: Option<u64>,
    /// Vocab tensors get zero rows up to a multiple of `vocab_divisible_by · tp`.
    pad_vocab: bool,
    sections: Vec<Section>,
}

fn fill(template: &str, layer: Option<u64>, expert: Option<u64>) -> String {
    let mut s = template.to_string();
    if let Some(l) = layer {
        s = s.replace("{L}", &l.to_string());
    }
    if let Some(e) = expert {
        s = s.replace("{E}", &e.to_string());
    }
    s
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Release inventory, indexed by normalised name (multimodal `model.language_model.` → `model.`).
struct Inventory<'a> {
    sources: &'a [SourceTensor],
    by_name: HashMap<Cow<'a, str>, usize>,
}

impl<'a> Inventory<'a> {
    fn new(sources: &'a [SourceTensor], language_model_prefix: bool) -> Inventory<'a> {
        let mut by_name = HashMap::with_capacity(sources.len());
        for (i, s) in sources.iter().enumerate() {
            by_name.insert(normalise(&s.name, language_model_prefix), i);
        }
        Inventory { sources, by_name }
    }
    fn get(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }
    fn shape(&self, id: usize) -> &[u64] {
        &self.sources[id].shape
    }
}

fn normalise(name: &str, language_model_prefix: bool) -> Cow<'_, str> {
    if language_model_prefix {
        if let Some(rest) = name.strip_prefix("model.language_model.") {
            return Cow::Owned(format!("model.{rest}"));
        }
    }
    Cow::Borrowed(name)
}

/// Model-level divisibility checks Megatron would make for this mesh; every violation names the
/// numbers. Usable without a release (e.g. to lint a pipeline spec).
pub fn check_mesh_for_model(config: &ModelConfig, mesh: &Mesh) -> Vec<LayoutError> {
    let mut errors = mesh.check();
    if !errors.is_empty() {
        return errors;
    }
    let mut err = |msg: String| errors.push(LayoutError::Mesh(msg));
    let (t, ng, nh) = (mesh.tp, config.num_query_groups, config.num_attention_heads);
    if nh % ng != 0 {
        err(format!("num_attention_heads ({nh}) is not divisible by num_query_groups ({ng})"));
    }
    if ng < t {
        err(format!(
            "num_query_groups ({ng}) < tp ({t}): Megatron's replicated-KV path is not supported; use tp ≤ {ng}"
        ));
    } else if ng % t != 0 {
        err(format!("num_query_groups ({ng}) is not divisible by tp ({t})"));
    }
    if let Some(f) = config.ffn_hidden_size {
        if config.num_experts == 0 && f % t != 0 {
            err(format!("intermediate_size ({f}) is not divisible by tp ({t})"));
        }
    }
    if let Some(f) = config.shared_expert_ffn_hidden_size {
        if f % t != 0 {
            err(format!("shared_expert_intermediate_size ({f}) is not divisible by tp ({t})"));
        }
    }
    if config.num_experts == 0 {
        if mesh.ep > 1 {
            err(format!("ep ({}) > 1 but `{}` has no experts", mesh.ep, config.model_type));
        }
    } else {
        let e = config.num_experts;
        if !e.is_multiple_of(mesh.ep) {
            err(format!("num_experts ({e}) is not divisible by ep ({})", mesh.ep));
        }
        if let Some(f) = config.moe_ffn_hidden_size {
            if f % mesh.etp != 0 {
                err(format!("moe_intermediate_size ({f}) is not divisible by etp ({})", mesh.etp));
            }
        }
    }
    if let Some(g) = &config.gdn {
        let (nk, nv) = (g.num_key_heads, g.num_value_heads);
        if nk % t != 0 {
            err(format!("linear_num_key_heads ({nk}) is not divisible by tp ({t})"));
        }
        if nv % t != 0 {
            err(format!("linear_num_value_heads ({nv}) is not divisible by tp ({t})"));
        }
        if nk == 0 || nv % nk != 0 {
            err(format!("linear_num_value_heads ({nv}) is not divisible by linear_num_key_heads ({nk})"));
        }
        if nk % t == 0 && nv % t == 0 {
            for (what, size) in [("qk", g.qk() / t), ("v", g.v() / t), ("nv", nv / t)] {
                if size % mesh.cp != 0 {
                    err(format!(
                        "GDN in_proj section {what}/tp = {size} is not divisible by cp ({}); Megatron splits each section across CP ranks",
                        mesh.cp
                    ));
                }
            }
        }
    }
    errors
}

/// Builds the plan. Returns every error found, not just the first.
pub fn build_plan(
    config: &ModelConfig,
    sources: Vec<SourceTensor>,
    mesh: Mesh,
    options: &PlanOptions,
) -> Result<Plan, Vec<LayoutError>> {
    let mut errors = check_mesh_for_model(config, &mesh);
    if !mesh.check().is_empty() {
        return Err(errors);
    }
    let inv = Inventory::new(&sources, config.language_model_prefix);
    let mut consumed = vec![false; sources.len()];
    let mut drafts: Vec<Draft> = Vec::new();

    let (tables, with_mtp) = arch::tables(config.family);
    let mut rules: Vec<(Rule, Option<(&str, &str)>)> = Vec::new();
    for table in tables {
        for r in *table {
            rules.push((*r, None));
            if with_mtp && r.megatron.starts_with("decoder.layers.{L}.") {
                rules.push((*r, Some(arch::MTP_PREFIX)));
            }
        }
    }
    let retarget = |s: &str, mtp: Option<(&str, &str)>| -> String {
        match mtp {
            None => s.to_string(),
            Some((meg, hf)) => s.replacen("decoder.layers.{L}.", meg, 1).replacen("model.layers.{L}.", hf, 1),
        }
    };

    let layers: Vec<u64> = (0..config.num_layers).collect();
    let experts: Vec<u64> = (0..config.num_experts).collect();
    for (rule, mtp) in &rules {
        let megatron_t = retarget(rule.megatron, *mtp);
        let hf_t: Vec<String> = rule.hf.iter().map(|h| retarget(h, *mtp)).collect();
        let guard_t = retarget(rule.guard.unwrap_or(rule.hf[0]), *mtp);
        let layer_iter: Vec<Option<u64>> =
            if megatron_t.contains("{L}") { layers.iter().map(|l| Some(*l)).collect() } else { vec![None] };
        let expert_iter: Vec<Option<u64>> =
            if rule.expert { experts.iter().map(|e| Some(*e)).collect() } else { vec![None] };
        for layer in &layer_iter {
            for expert in &expert_iter {
                let guard = fill(&guard_t, *layer, *expert);
                if inv.get(&guard).is_none() {
                    continue;
                }
                let target = fill(&megatron_t, *layer, *expert);
                let mut ids = Vec::new();
                for h in &hf_t {
                    let name = fill(h, *layer, *expert);
                    match inv.get(&name) {
                        Some(id) => ids.push(id),
                        None => errors.push(LayoutError::MissingTensor {
                            missing: name,
                            present: guard.clone(),
                            target: target.clone(),
                        }),
                    }
                }
                if ids.len() != hf_t.len() {
                    continue;
                }
                for id in &ids {
                    consumed[*id] = true;
                }
                match draft(config, &inv, rule.kind, &target, &ids, *expert) {
                    Ok(d) => drafts.push(d),
                    Err(e) => errors.push(e),
                }
            }
        }
    }

    let mut unmapped = Vec::new();
    let mut unconverted = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        if consumed[i] {
            continue;
        }
        let norm = normalise(&s.name, config.language_model_prefix);
        if arch::UNCONVERTED_PREFIXES.iter().any(|p| norm.starts_with(p) || s.name.starts_with(p)) {
            unconverted.push(s.name.clone());
        } else {
            unmapped.push(s.name.clone());
        }
    }
    if !unmapped.is_empty() {
        unmapped.sort();
        errors.push(LayoutError::Unmapped { model_type: config.model_type.clone(), names: unmapped });
    }
    // Backstop checks on the tensors themselves (the config may understate what the release holds).
    for d in &drafts {
        let t = tp_of(&mesh, d.expert.is_some());
        for s in &d.sections {
            let bad = match d.tp_mode {
                // Vocab rows are padded to a multiple of tp when chunked.
                TpMode::Column => !d.pad_vocab && !rows_of(&s.shape).is_multiple_of(t),
                TpMode::Row => s.shape.len() != 2 || s.shape[1] % t != 0,
                TpMode::Replicated => false,
            };
            if bad {
                let dim = if d.tp_mode == TpMode::Row { 1 } else { 0 };
                errors.push(LayoutError::Mesh(format!(
                    "`{}{}` shape {:?}: dim {dim} is not divisible by {} ({t})",
                    d.name,
                    s.suffix,
                    s.shape,
                    if d.expert.is_some() { "etp" } else { "tp" }
                )));
            }
        }
    }
    drafts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    for pair in drafts.windows(2).filter(|pair| pair[0].name == pair[1].name) {
        // Two rules for one target (e.g. per-expert and packed forms both present).
        let id = pair[1].first_source;
        errors.push(LayoutError::Shape {
            tensor: sources[id].name.clone(),
            actual: sources[id].shape.clone(),
            expected: format!("a single source for `{}`", pair[1].name),
            why: "the release holds the same parameter twice".to_string(),
        });
    }
    if !errors.is_empty() {
        let mut seen = BTreeSet::new();
        errors.retain(|e| seen.insert(e.to_string()));
        return Err(errors);
    }

    // A plan lives for the whole conversion: sized exactly, and sorted in place.
    let params: usize = drafts.iter().map(|d| d.sections.len()).sum();
    let mut tensors = Vec::with_capacity(if options.optimizer_state { 3 * params } else { params });
    let mut rank_bytes = vec![0u64; mesh.world() as usize];
    for d in drafts {
        tensors.extend(chunk_draft(d, &mesh, config, options, &mut rank_bytes));
    }
    tensors.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    if options.optimizer_state {
        let mut states = Vec::new();
        for t in &tensors {
            let name = t.key.strip_prefix(&options.prefix).unwrap_or(&t.key);
            for state in ["exp_avg", "exp_avg_sq"] {
                let mut s = t.clone();
                s.key = format!("{}{name}.{state}", options.optimizer_prefix);
                if let Some(split) = &mut s.split {
                    // The fused name sits after the optimizer prefix instead of the model one.
                    let shift = |at: u32| at as usize - (t.key.len() - name.len()) + options.optimizer_prefix.len();
                    split.name = (shift(split.name.0) as u32, shift(split.name.1) as u32);
                }
                s.dtype = DType::F32;
                s.recipe = vec![RowBlock::zeros(rows_of(&t.shape))];
                s.role = Role::OptimizerState { param_key: t.key.clone(), state };
                states.push(s);
            }
        }
        tensors.extend(states);
        tensors.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    }
    unconverted.sort();
    Ok(Plan { mesh, options: options.clone(), model_type: config.model_type.clone(), sources, tensors, unconverted })
}

fn tp_of(mesh: &Mesh, expert: bool) -> u64 {
    if expert {
        mesh.etp
    } else {
        mesh.tp
    }
}

fn shape_err(inv: &Inventory, id: usize, expected: String, why: &str) -> LayoutError {
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
fn draft(
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
        Kind::GdnInProjQkvz | Kind::GdnInProjSplit | Kind::GdnConv1d => (TpMode::Column, gdn(config, inv, kind, ids)?),
    };
    Ok(Draft {
        name: target.to_string(),
        first_source: ids[0],
        dtype,
        tp_mode,
        expert,
        pad_vocab: kind == Kind::Vocab,
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

/// FSDP rows `[lo, hi)` of rank `j` of `d` over `rows` TP-local rows.
pub fn fsdp_rows(rows: u64, d: u64, j: u64) -> (u64, u64) {
    let q = div_ceil(rows, d);
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

fn chunk_draft(
    d: Draft,
    mesh: &Mesh,
    config: &ModelConfig,
    options: &PlanOptions,
    rank_bytes: &mut [u64],
) -> Vec<OutputTensor> {
    let (t, dsize, group) = match d.expert {
        None => (mesh.tp, mesh.fsdp_size(), Group::Dense),
        Some(e) => {
            (mesh.etp, mesh.expert_dp_size(), Group::Expert { expert: e, ep_rank: e / (config.num_experts / mesh.ep) })
        }
    };
    let rank_of = |r: u64, j: u64| match group {
        Group::Dense => mesh.dense_rank(r, j),
        Group::Expert { ep_rank, .. } => mesh.expert_rank(r, ep_rank, j),
    };
    let mut sections: Vec<(String, Vec<u64>, Vec<RowBlock>)> =
        d.sections.into_iter().map(|s| (s.suffix, s.shape, s.recipe)).collect();
    // Vocab padding happens here because it depends on tp.
    if d.pad_vocab {
        let (_, shape, recipe) = &mut sections[0];
        let multiple = options.vocab_divisible_by.max(1) * t;
        let padded = div_ceil(shape[0], multiple) * multiple;
        if padded > shape[0] {
            recipe.push(RowBlock::zeros(padded - shape[0]));
            shape[0] = padded;
        }
    }
    if !options.split_fused && sections.len() > 1 && d.tp_mode == TpMode::Column {
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
    let local_rows: u64 = match d.tp_mode {
        TpMode::Column => sections.iter().map(|(_, s, _)| rows_of(s) / t).sum(),
        _ => rows_of(&sections[0].1),
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
        let writers: Box<[u32]> = if d.tp_mode == TpMode::Replicated {
            (0..dsize)
                .map(|j| {
                    let w = (0..t).min_by_key(|r| (rank_bytes[rank_of(*r, j) as usize], rank_of(*r, j))).unwrap_or(0);
                    u32::try_from(w).unwrap_or(u32::MAX)
                })
                .collect()
        } else {
            Box::default()
        };
        let numbers = FsdpNumbers { fsdp_size: dsize, local_rows, section_start: a_c, section_rows: n_c };
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

fn with_rest(first: u64, rest: &[u64], zeros: bool) -> Vec<u64> {
    let mut v = Vec::with_capacity(1 + rest.len());
    v.push(first);
    v.extend(rest.iter().map(|r| if zeros { 0 } else { *r }));
    v
}

/// Per-key summary for `--dry-run`: `(key, dtype, global shape, split_from)`.
pub fn summary(plan: &Plan) -> BTreeMap<String, (DType, Vec<u64>, Option<String>)> {
    plan.tensors
        .iter()
        .map(|t| (t.key.clone(), (t.dtype, t.shape.clone(), t.split_from().map(|s| s.0.to_string()))))
        .collect()
}
