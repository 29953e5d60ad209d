//! The reshard plan: every item of the target checkpoint, where it comes from, and — for
//! parameters and their optimizer moments — the chunks Megatron-FSDP saves on the target mesh,
//! computed by the same chunk arithmetic `convert` uses.

use std::collections::{BTreeMap, BTreeSet};

use super::boxes::{check_tiling, ChunkBox};
use super::keys::{classify, flat_key, rng_rank_part, ItemKind, PathElem};
use super::params::{is_buffer, param_layout, vision_table, ParamLayout};
use super::target::RngObject;
use super::ReshardError;
use crate::arch::TpMode;
use crate::dialect::{Dialect, DiskLayout, TorchDistLayout};
use crate::dtype::DType;
use crate::mesh::Mesh;
use crate::plan::{chunk_draft, Chunk, Draft, OutputTensor, Plan, PlanOptions, Role, Section, Tiling};
use crate::recipe::RowBlock;

/// An item of the source checkpoint, as its `.metadata` declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceItem {
    pub key: String,
    pub path: Vec<PathElem>,
    /// `None` for a bytes item.
    pub tensor: Option<SourceTensorMeta>,
}

/// A tensor item: dtype, global shape and its saved chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTensorMeta {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub chunks: Vec<ChunkBox>,
}

/// What to do with the per-(pp, tp) RNG states when the TP grid changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RngPolicy {
    /// Keep the states of the (pp, tp) ranks both grids have, give each new rank a copy of
    /// `(0, 0)`'s, drop the ranks the target does not have.
    FromRank0,
    /// Drop every RNG state (the job then loads with `--no-load-rng`).
    Drop,
}

/// What the reshard needs besides the items: the target mesh and the model facts that decide
/// shapes (from the job's `args` when it has them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReshardOptions {
    pub mesh: Mesh,
    /// The source job's mesh, when known (`args`, or the user).
    pub source_mesh: Option<Mesh>,
    /// The tokenizer's vocabulary size, unpadded.
    pub vocab_size: Option<u64>,
    /// Megatron's `--make-vocab-size-divisible-by`.
    pub vocab_divisible_by: u64,
    pub num_experts: Option<u64>,
    pub num_query_groups: Option<u64>,
    pub rng: RngPolicy,
    /// The dialect to write (the source is read as `fsdp_dtensor`).
    pub dialect: Dialect,
    /// `torch_dist`: the dtype the job keeps its model weights in (`args`' `--bf16`), which
    /// Megatron-Core saves them in beside their fp32 masters; `None` keeps the masters' dtype.
    pub model_dtype: Option<DType>,
}

/// A tensor of the target checkpoint: its key, chunks and role as a plan tensor, its path, and
/// the source item its data comes from (rows past the source's are zeros: added vocab padding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetTensor {
    pub out: OutputTensor,
    pub path: Vec<PathElem>,
    pub source: usize,
}

/// A bytes item of the target checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetObject {
    pub key: String,
    pub path: Vec<PathElem>,
    pub source: usize,
    /// `args`: rewritten with the target mesh ([`ReshardPlan::args_updates`]).
    pub is_args: bool,
}

/// The whole target checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct ReshardPlan {
    pub mesh: Mesh,
    /// Sorted by key.
    pub tensors: Vec<TargetTensor>,
    /// Sorted by key.
    pub objects: Vec<TargetObject>,
    /// The padded vocabulary on the target mesh, when the model has a vocab tensor.
    pub padded_vocab: Option<u64>,
    /// What the user should know: RNG states copied or dropped, items carried without being
    /// understood, a vocabulary size guessed.
    pub notes: Vec<String>,
    pub dialect: Dialect,
    /// Where the tensors land on disk.
    pub disk: DiskLayout,
    /// `torch_dist`: the source items of the parameter groups' settings, which become the
    /// optimizer's `param_groups` in the common state (in `fsdp_dtensor` they are `objects`).
    pub group_meta: Vec<usize>,
    /// `torch_dist`: the RNG states, one `ShardedObject` per (pp, tp) rank of the target (in
    /// `fsdp_dtensor` they are `tensors` and `objects` under `rng_state.(pp, tp).…`).
    pub rng_objects: Vec<RngObject>,
}

impl ReshardPlan {
    /// The `args` fields that describe the mesh, with their values on the target.
    pub fn args_updates(&self) -> Vec<(&'static str, i128)> {
        let m = &self.mesh;
        let mut v = vec![
            ("tensor_model_parallel_size", m.tp),
            ("context_parallel_size", m.cp),
            ("data_parallel_size", m.dp),
            ("expert_model_parallel_size", m.ep),
            ("expert_tensor_parallel_size", m.etp),
            ("pipeline_model_parallel_size", 1),
            ("world_size", m.world()),
        ];
        v.extend(self.padded_vocab.map(|p| ("padded_vocab_size", p)));
        v.into_iter().map(|(k, x)| (k, i128::from(x))).collect()
    }

    /// Every target tensor's chunks that are written, with the rank file holding each.
    pub fn written_chunks(&self, tensor: usize) -> impl Iterator<Item = Chunk> + '_ {
        self.tensors[tensor].out.chunks(&self.mesh).filter(|c| c.written && c.numel() > 0)
    }
}

/// A parameter or moment to re-tile: the source item and how its parameter is laid out.
struct Tiled<'a> {
    item: usize,
    meta: &'a SourceTensorMeta,
    /// The parameter's name (without prefix).
    name: String,
    layout: ParamLayout,
    /// `None` for the parameter, `Some(state)` for a moment.
    state: Option<String>,
}

/// Plans the target checkpoint of `items` on `options.mesh`.
pub fn plan_reshard(items: &[SourceItem], options: &ReshardOptions) -> Result<ReshardPlan, ReshardError> {
    let mesh = options.mesh;
    if let Dialect::Torchtitan(_) | Dialect::Automodel = options.dialect {
        return Err(ReshardError::Mesh(format!(
            "a Megatron training checkpoint is not translated to {} yet",
            options.dialect.name()
        )));
    }
    let mut errors: Vec<ReshardError> = mesh.check().into_iter().map(|e| ReshardError::Mesh(e.to_string())).collect();
    let mut notes = Vec::new();
    let kinds: Vec<ItemKind> = items.iter().map(|i| classify(&i.path)).collect();
    let vision = vision_table(kinds.iter().filter_map(|k| match k {
        ItemKind::Model { name } | ItemKind::OptimizerState { name, .. } => Some(name.as_str()),
        _ => None,
    }));

    // Every tensor must tile its global shape before anything is read from it.
    for item in items {
        if let Some(t) = &item.tensor {
            if let Err(problem) = check_tiling(&t.shape, &t.chunks) {
                errors.push(ReshardError::Tiling { key: item.key.clone(), problem: problem.to_string() });
            }
        }
    }
    let params: BTreeMap<&str, usize> = kinds
        .iter()
        .enumerate()
        .filter_map(|(i, k)| match k {
            ItemKind::Model { name } if items[i].tensor.is_some() => Some((name.as_str(), i)),
            _ => None,
        })
        .collect();

    // Buffers have no optimizer state in Megatron; one that has some was written as a parameter
    // (`convert --optimizer-state` does so) and is re-tiled like one.
    let with_states: BTreeSet<&str> = kinds
        .iter()
        .filter_map(|k| match k {
            ItemKind::OptimizerState { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    let mut tiled: Vec<Tiled> = Vec::new();
    let mut plain: Vec<(usize, &SourceTensorMeta)> = Vec::new();
    let mut unknown_params: BTreeMap<String, usize> = BTreeMap::new();
    let mut rng: BTreeMap<(u64, u64), Vec<usize>> = BTreeMap::new();
    let mut objects = Vec::new();
    for (i, (item, kind)) in items.iter().zip(&kinds).enumerate() {
        let Some(t) = &item.tensor else {
            match kind {
                ItemKind::Rng { pp, tp } => rng.entry((*pp, *tp)).or_default().push(i),
                _ => {
                    if *kind == ItemKind::Unknown {
                        notes.push(format!("`{}` is not an item Shardline knows; carried unchanged", item.key));
                    }
                    objects.push(TargetObject {
                        key: item.key.clone(),
                        path: item.path.clone(),
                        source: i,
                        is_args: *kind == ItemKind::Args,
                    });
                }
            }
            continue;
        };
        match kind {
            // torch_dist writes a buffer whole, by the replica a fully parallel save picks, as
            // `convert` plans it.
            ItemKind::Model { name }
                if is_buffer(name)
                    && !with_states.contains(name.as_str())
                    && (options.dialect == Dialect::FsdpDtensor || param_layout(name, vision).is_none()) =>
            {
                plain.push((i, t))
            }
            ItemKind::Model { name } => match param_layout(name, vision) {
                Some(layout) if layout.tp_dependent && options.dialect == Dialect::TorchDist => {
                    errors.push(ReshardError::Dialect {
                        key: item.key.clone(),
                        problem: "kept fused in a layout of the expert-TP size (gpt-oss's expert fc1); torch_dist \
                                  takes its `_w`/`_v` sections, which the reader gives once it knows the \
                                  expert-TP size the checkpoint was saved with (`split_fused`)"
                            .into(),
                    })
                }
                Some(layout) => tiled.push(Tiled { item: i, meta: t, name: name.clone(), layout, state: None }),
                None => *unknown_params.entry(pattern_of(name)).or_default() += 1,
            },
            ItemKind::OptimizerState { name, state } if !t.shape.is_empty() => {
                if let Some(&p) = params.get(name.as_str()) {
                    if let Some(problem) = state_mismatch(items[p].tensor.as_ref(), t) {
                        errors.push(ReshardError::StateMismatch {
                            key: item.key.clone(),
                            param: items[p].key.clone(),
                            problem,
                        });
                        continue;
                    }
                }
                match param_layout(name, vision) {
                    Some(layout) => {
                        tiled.push(Tiled { item: i, meta: t, name: name.clone(), layout, state: Some(state.clone()) })
                    }
                    None => *unknown_params.entry(pattern_of(name)).or_default() += 1,
                }
            }
            ItemKind::Rng { pp, tp } => rng.entry((*pp, *tp)).or_default().push(i),
            ItemKind::Unknown => {
                notes.push(format!("tensor `{}` is not an item Shardline knows; carried unchanged", item.key));
                plain.push((i, t));
            }
            _ => plain.push((i, t)),
        }
    }
    if !unknown_params.is_empty() {
        errors
            .push(ReshardError::UnknownParams(unknown_params.into_iter().map(|(p, n)| format!("{p} × {n}")).collect()));
    }

    let mut tensors = Vec::new();
    let padded_vocab = retile(items, &params, &tiled, options, &mut tensors, &mut errors, &mut notes);
    for (i, t) in plain {
        tensors.push(carried_tensor(t, i, items[i].key.clone(), items[i].path.clone()));
    }
    let mut group_meta = Vec::new();
    let mut rng_objects = Vec::new();
    rng_items(items, &rng, options, &mut tensors, &mut objects, &mut notes);
    if options.dialect == Dialect::TorchDist {
        rng_objects = super::target::rng_objects(&kinds, &mesh, &mut tensors, &mut objects);
        group_meta = super::target::to_torch_dist(
            &kinds,
            options.model_dtype,
            &mut tensors,
            &mut objects,
            &mut notes,
            &mut errors,
        );
    }
    if !errors.is_empty() {
        return Err(ReshardError::Many(errors));
    }
    tensors.sort_by(|a, b| a.out.key.cmp(&b.out.key));
    objects.sort_by(|a, b| a.key.cmp(&b.key));
    check_unique(&tensors, &objects)?;
    let disk = match options.dialect {
        Dialect::FsdpDtensor | Dialect::Torchtitan(_) | Dialect::Automodel => DiskLayout::AsPlanned,
        Dialect::TorchDist => {
            let views: Vec<_> = tensors.iter().map(|t| t.out.view()).collect();
            DiskLayout::TorchDist(TorchDistLayout::new(&views, &mesh))
        }
    };
    let plan = ReshardPlan {
        mesh,
        tensors,
        objects,
        padded_vocab,
        notes,
        dialect: options.dialect,
        disk,
        group_meta,
        rng_objects,
    };
    validate(&plan, options)?;
    Ok(plan)
}

/// `name` with its layer and expert numbers as `*`, to list unknown names by pattern.
fn pattern_of(name: &str) -> String {
    name.split('.')
        .map(|part| {
            let digits = part.bytes().rev().take_while(u8::is_ascii_digit).count();
            if digits == part.len() {
                "*".to_string()
            } else if digits > 0 {
                format!("{}*", &part[..part.len() - digits])
            } else {
                part.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// Why a moment cannot be re-tiled like its parameter: another global shape, or other chunks.
fn state_mismatch(param: Option<&SourceTensorMeta>, state: &SourceTensorMeta) -> Option<String> {
    let param = param?;
    if param.shape != state.shape {
        return Some(format!("global shape {:?}, its parameter's {:?}", state.shape, param.shape));
    }
    let boxes = |t: &SourceTensorMeta| t.chunks.iter().filter(|c| c.numel() > 0).cloned().collect::<BTreeSet<_>>();
    if boxes(param) != boxes(state) {
        return Some("its chunks are not its parameter's (Megatron shards a moment exactly like its parameter)".into());
    }
    None
}

/// A tensor written whole, as it is, to rank 0's file (buffers, RNG tensors, per-parameter
/// `step`, tensors Shardline does not know — these keep their chunks).
fn carried_tensor(t: &SourceTensorMeta, i: usize, key: String, path: Vec<PathElem>) -> TargetTensor {
    let chunks: Vec<Chunk> = t
        .chunks
        .iter()
        .filter(|c| c.numel() > 0 || t.shape.is_empty())
        .map(|c| Chunk {
            rank: 0,
            tp_rank: 0,
            fsdp_rank: 0,
            offsets: c.offsets.clone(),
            sizes: c.sizes.clone(),
            written: true,
        })
        .collect();
    let rows = t.shape.first().copied().unwrap_or(1);
    TargetTensor {
        out: OutputTensor {
            key,
            dtype: t.dtype,
            shape: t.shape.clone(),
            recipe: vec![RowBlock::copy(i, 0, rows)],
            tp_mode: TpMode::Replicated,
            tp: 1,
            group: crate::plan::Group::Dense,
            split: None,
            role: Role::Param,
            tiling: Tiling::Listed(chunks),
        },
        path,
        source: i,
    }
}

/// Re-tiles parameters and moments for the target mesh; returns the padded vocabulary.
fn retile(
    items: &[SourceItem],
    params: &BTreeMap<&str, usize>,
    tiled: &[Tiled],
    options: &ReshardOptions,
    out: &mut Vec<TargetTensor>,
    errors: &mut Vec<ReshardError>,
    notes: &mut Vec<String>,
) -> Option<u64> {
    let mesh = options.mesh;
    let num_experts =
        options.num_experts.unwrap_or_else(|| tiled.iter().filter_map(|t| t.layout.expert).max().map_or(0, |e| e + 1));
    if num_experts > 0 && !num_experts.is_multiple_of(mesh.ep) {
        errors.push(ReshardError::Mesh(format!("ep = {} does not divide the model's {num_experts} experts", mesh.ep)));
        return None;
    }
    // Sections of one fused parameter (and state) are tiled together, parameters in the order
    // `convert` plans them (by name), then their states.
    let mut groups: BTreeMap<(Option<String>, String), Vec<&Tiled>> = BTreeMap::new();
    for t in tiled {
        // The fused name as the checkpoint spells it (the table's may lack a tower's prefix).
        let name = match &t.layout.section {
            Some((fused, index, suffixes)) => t.name.strip_suffix(suffixes[*index]).unwrap_or(fused).to_string(),
            None => t.name.clone(),
        };
        groups.entry((t.state.clone(), name)).or_default().push(t);
    }
    let mut rank_bytes = vec![0u64; mesh.world() as usize];
    let mut padded_vocab = None;
    let plan_options = PlanOptions {
        vocab_divisible_by: options.vocab_divisible_by,
        dialect: options.dialect,
        ..PlanOptions::default()
    };
    for ((state, name), mut members) in groups {
        members.sort_by_key(|t| t.layout.section.as_ref().map_or(0, |s| s.1));
        let first = members[0];
        let layout = &first.layout;
        if let Some((_, _, suffixes)) = &layout.section {
            let have: Vec<usize> = members.iter().filter_map(|t| t.layout.section.as_ref().map(|s| s.1)).collect();
            if have != (0..suffixes.len()).collect::<Vec<_>>() {
                errors.push(ReshardError::Sections {
                    fused: name.clone(),
                    have: have.iter().map(|i| suffixes[*i]).collect::<Vec<_>>().join(", "),
                    want: suffixes.join(", "),
                });
                continue;
            }
        }
        let t = if first.layout.expert.is_some() { mesh.etp } else { mesh.tp };
        if let Err(e) = check_divisible(items, &members, layout, t, options) {
            errors.push(e);
            continue;
        }
        let mut sections = Vec::new();
        for m in &members {
            let src = m.meta;
            let mut shape = src.shape.clone();
            if layout.vocab {
                let rows = options.vocab_size.unwrap_or(shape[0]);
                if options.vocab_size.is_none() && padded_vocab.is_none() {
                    notes.push(format!(
                        "the vocabulary size is unknown (no `args`, or `args` without it): `{}` keeps its {} rows, \
                         padded up to a multiple of {}·tp; pass --vocab-size to re-pad from the tokenizer's",
                        items[m.item].key, rows, options.vocab_divisible_by
                    ));
                }
                shape[0] = rows;
            }
            let rows = shape.first().copied().unwrap_or(1);
            sections.push(Section { suffix: String::new(), shape, recipe: vec![RowBlock::copy(m.item, 0, rows)] });
        }
        let draft = Draft {
            name: name.clone(),
            first_source: first.item,
            dtype: first.meta.dtype,
            tp_mode: layout.tp_mode,
            expert: layout.expert,
            pad_vocab: layout.vocab,
            fused_on_disk: false,
            sections,
        };
        let chunked = chunk_draft(draft, &mesh, num_experts, &plan_options, &mut rank_bytes);
        for (m, mut tensor) in members.iter().zip(chunked) {
            let item = &items[m.item];
            if layout.vocab {
                padded_vocab = tensor.shape.first().copied();
            }
            tensor.key = item.key.clone();
            tensor.split = None;
            if let Some(state) = &state {
                let param_key = params.get(m.name.as_str()).map(|&p| items[p].key.clone()).unwrap_or_default();
                tensor.role = Role::OptimizerState { param_key, state: leak_state(state) };
            }
            out.push(TargetTensor { out: tensor, path: item.path.clone(), source: m.item });
        }
    }
    // A state is written where its parameter is: the same chunks, and the same ranks writing
    // the replicas (Megatron saves a moment with its parameter's replica ids).
    let tiling_of: BTreeMap<usize, Tiling> =
        out.iter().filter(|t| t.out.role == Role::Param).map(|t| (t.source, t.out.tiling.clone())).collect();
    let param_of: BTreeMap<usize, usize> = tiled
        .iter()
        .filter(|m| m.state.is_some())
        .filter_map(|m| Some((m.item, *params.get(m.name.as_str())?)))
        .collect();
    for t in out.iter_mut() {
        if let Some(tiling) = param_of.get(&t.source).and_then(|p| tiling_of.get(p)) {
            t.out.tiling = tiling.clone();
        }
    }
    padded_vocab
}

/// The state names the invariants know, as the `'static` strings `Role` holds.
fn leak_state(state: &str) -> &'static str {
    match state {
        "exp_avg" => "exp_avg",
        "exp_avg_sq" => "exp_avg_sq",
        "param" => "param",
        _ => "state",
    }
}

/// Whether the target (expert-)TP size `t` splits this parameter as Megatron would.
fn check_divisible(
    items: &[SourceItem],
    members: &[&Tiled],
    layout: &ParamLayout,
    t: u64,
    options: &ReshardOptions,
) -> Result<(), ReshardError> {
    let key = &items[members[0].item].key;
    let cannot = |why: String| Err(ReshardError::Mesh(format!("`{key}`: {why}")));
    if layout.tp_dependent {
        let source_t = options.source_mesh.map(|m| if layout.expert.is_some() { m.etp } else { m.tp });
        return match source_t {
            Some(s) if s == t => Ok(()),
            Some(s) => cannot(format!(
                "kept fused in a layout that depends on the expert-TP size ({s} in the source); resharding it to {t} is not supported"
            )),
            None => cannot("its layout depends on the source's expert-TP size, which is unknown: pass --from-mesh".into()),
        };
    }
    for m in members {
        let shape = &m.meta.shape;
        match layout.tp_mode {
            TpMode::Column if !layout.vocab && !shape.first().is_some_and(|r| r.is_multiple_of(t)) => {
                return cannot(format!("{} rows do not split over tp = {t}", shape.first().copied().unwrap_or(0)));
            }
            TpMode::Row if !shape.get(1).is_some_and(|c| c.is_multiple_of(t)) => {
                return cannot(format!("{} columns do not split over tp = {t}", shape.get(1).copied().unwrap_or(0)));
            }
            _ => {}
        }
    }
    if key.ends_with(".linear_qkv.weight") || key.ends_with(".linear_qkv.bias") || key.contains(".linear_qkv.weight.") {
        if let Some(ng) = options.num_query_groups {
            if !ng.is_multiple_of(t) {
                return cannot(format!("tp = {t} does not divide the {ng} query groups"));
            }
        }
    }
    Ok(())
}

/// RNG states for the target grid, by `options.rng`.
fn rng_items(
    items: &[SourceItem],
    rng: &BTreeMap<(u64, u64), Vec<usize>>,
    options: &ReshardOptions,
    tensors: &mut Vec<TargetTensor>,
    objects: &mut Vec<TargetObject>,
    notes: &mut Vec<String>,
) {
    if rng.is_empty() {
        return;
    }
    let target: Vec<(u64, u64)> = (0..options.mesh.tp).map(|t| (0, t)).collect();
    let source: Vec<(u64, u64)> = rng.keys().copied().collect();
    let changed = source != target;
    let list = |v: &[(u64, u64)]| v.iter().map(|(p, t)| rng_rank_part(*p, *t)).collect::<Vec<_>>().join(", ");
    if options.rng == RngPolicy::Drop {
        notes.push(format!("warning: RNG states of {} dropped (--rng drop); load with --no-load-rng", list(&source)));
        return;
    }
    let Some(origin) = rng.get(&(0, 0)).or_else(|| rng.values().next()) else { return };
    let origin_rank = rng.iter().find(|(_, v)| *v == origin).map(|(k, _)| *k).unwrap_or((0, 0));
    let mut copied = Vec::new();
    for &(pp, tp) in &target {
        let (members, renamed) = match rng.get(&(pp, tp)) {
            Some(m) => (m, false),
            None => {
                copied.push((pp, tp));
                (origin, true)
            }
        };
        for &i in members {
            let item = &items[i];
            let (key, path) = if renamed {
                let mut path = item.path.clone();
                path[1] = PathElem::Key(rng_rank_part(pp, tp));
                (flat_key(&path), path)
            } else {
                (item.key.clone(), item.path.clone())
            };
            if let Some(t) = &item.tensor {
                tensors.push(carried_tensor(t, i, key, path));
            } else {
                objects.push(TargetObject { key, path, source: i, is_args: false });
            }
        }
    }
    if changed {
        let dropped: Vec<(u64, u64)> = source.iter().filter(|k| !target.contains(k)).copied().collect();
        let kept: Vec<(u64, u64)> = source.iter().filter(|k| target.contains(k)).copied().collect();
        notes.push(format!(
            "warning: RNG states re-keyed for the target TP grid (--rng from-rank0): kept {}; {} copied from {}; dropped {}",
            if kept.is_empty() { "none".into() } else { list(&kept) },
            if copied.is_empty() { "none".into() } else { list(&copied) },
            rng_rank_part(origin_rank.0, origin_rank.1),
            if dropped.is_empty() { "none".into() } else { list(&dropped) },
        ));
    }
}

fn check_unique(tensors: &[TargetTensor], objects: &[TargetObject]) -> Result<(), ReshardError> {
    let mut keys: Vec<&str> =
        tensors.iter().map(|t| t.out.key.as_str()).chain(objects.iter().map(|o| o.key.as_str())).collect();
    keys.sort_unstable();
    match keys.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(ReshardError::Duplicate(w[0].to_string())),
        None => Ok(()),
    }
}

/// The target's parameters and moments pass the layout invariants `convert`'s plans pass.
fn validate(plan: &ReshardPlan, options: &ReshardOptions) -> Result<(), ReshardError> {
    let tiled: Vec<OutputTensor> =
        plan.tensors.iter().filter(|t| matches!(t.out.tiling, Tiling::Fsdp(_))).map(|t| t.out.clone()).collect();
    let num_experts = options.num_experts.unwrap_or_else(|| {
        tiled
            .iter()
            .filter_map(|t| match t.group {
                crate::plan::Group::Expert { expert, .. } => Some(expert + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    });
    let as_plan = Plan {
        mesh: plan.mesh,
        options: PlanOptions::default(),
        model_type: String::new(),
        sources: Vec::new(),
        tensors: tiled,
        unconverted: Vec::new(),
    };
    let violations = crate::invariants::validate_plan(&as_plan, num_experts, plan.mesh.ep);
    if violations.is_empty() {
        Ok(())
    } else {
        Err(ReshardError::Invalid(violations.iter().take(20).map(|v| v.to_string()).collect()))
    }
}
