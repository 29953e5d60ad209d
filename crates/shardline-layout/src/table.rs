//! A plan frozen for writing: every output tensor's key, recipe and tiling in a few flat arrays.
//! A [`Plan`] holds each tensor's parts in allocations of their own, which is what building,
//! checking and editing a plan want; the copy only reads them, tensor by tensor, for as long as
//! it runs. Flat, they take a fixed number of allocations whatever the tensor count, and a freed
//! plan leaves no heap pages pinned by stray parts while the copy runs.
//!
//! What tensors share is stored once: the experts of every layer, for one, have the same shape,
//! dtype, parallel layout and FSDP numbers. A tensor then costs its key, its recipe and a few
//! positions, so the table grows by little more than the keys as a model gains layers.

use std::collections::HashMap;

use crate::arch::TpMode;
use crate::dialect::{Dialect, DiskLayout, TorchDistLayout};
use crate::dtype::DType;
use crate::mesh::Mesh;
use crate::plan::{self, Chunk, FsdpNumbers, Group, Plan, TensorView, TilingView};
use crate::recipe::RowBlock;

/// A [`Plan`]'s output tensors, read-only and flat; [`PlanTable::tensor`] gives the same views
/// as [`Plan::views`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanTable {
    pub mesh: Mesh,
    /// Where the tensors land on disk (the plan's dialect).
    pub disk: DiskLayout,
    keys: String,
    recipes: Vec<RowBlock>,
    writers: Vec<u32>,
    listed: Vec<Chunk>,
    shapes: Vec<u64>,
    kinds: Vec<Kind>,
    entries: Vec<Entry>,
}

/// What tensors of one shape and layout share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Kind {
    /// `shapes[shape.0..shape.1]`.
    shape: (usize, usize),
    dtype: DType,
    tp_mode: TpMode,
    tp: u64,
    group: Group,
    /// `None` when the chunks are listed.
    fsdp: Option<FsdpNumbers>,
}

/// One tensor: its kind, and where its key, recipe, writers and listed chunks end in the shared
/// arrays (each starts where the previous tensor's ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    kind: usize,
    key_end: usize,
    recipe_end: usize,
    writers_end: usize,
    listed_end: usize,
}

/// What tensors of one kind share: global shape, dtype, TP mode, rows per TP rank, group and
/// FSDP numbers.
type KindKey<'a> = (&'a [u64], DType, TpMode, u64, Group, Option<FsdpNumbers>);

impl PlanTable {
    pub fn new(plan: &Plan) -> PlanTable {
        let total = |part: fn(TensorView<'_>) -> usize| plan.views().map(part).sum::<usize>();
        let mut table = PlanTable {
            mesh: plan.mesh,
            disk: match plan.options.dialect {
                Dialect::FsdpDtensor | Dialect::Torchtitan(_) | Dialect::Automodel => DiskLayout::AsPlanned,
                Dialect::TorchDist => {
                    DiskLayout::TorchDist(TorchDistLayout::new(&plan.views().collect::<Vec<_>>(), &plan.mesh))
                }
            },
            keys: String::with_capacity(total(|t| t.key.len())),
            recipes: Vec::with_capacity(total(|t| t.recipe.len())),
            writers: Vec::with_capacity(total(|t| match t.tiling {
                TilingView::Fsdp(_, writers) => writers.len(),
                TilingView::Listed(_) => 0,
            })),
            listed: Vec::with_capacity(total(|t| match t.tiling {
                TilingView::Fsdp(..) => 0,
                TilingView::Listed(chunks) => chunks.len(),
            })),
            shapes: Vec::new(),
            kinds: Vec::new(),
            entries: Vec::with_capacity(plan.tensors.len()),
        };
        // Kinds by their fields, the shape by value (its place in `shapes` is not known yet).
        let mut kind_of: HashMap<KindKey<'_>, usize> = HashMap::new();
        for t in plan.views() {
            table.keys.push_str(t.key);
            table.recipes.extend_from_slice(t.recipe);
            let fsdp = match t.tiling {
                TilingView::Fsdp(numbers, writers) => {
                    table.writers.extend_from_slice(writers);
                    Some(numbers)
                }
                TilingView::Listed(chunks) => {
                    table.listed.extend_from_slice(chunks);
                    None
                }
            };
            let kind = *kind_of.entry((t.shape, t.dtype, t.tp_mode, t.tp, t.group, fsdp)).or_insert_with(|| {
                let start = table.shapes.len();
                table.shapes.extend_from_slice(t.shape);
                let (dtype, tp_mode, tp, group) = (t.dtype, t.tp_mode, t.tp, t.group);
                table.kinds.push(Kind { shape: (start, table.shapes.len()), dtype, tp_mode, tp, group, fsdp });
                table.kinds.len() - 1
            });
            table.entries.push(Entry {
                kind,
                key_end: table.keys.len(),
                recipe_end: table.recipes.len(),
                writers_end: table.writers.len(),
                listed_end: table.listed.len(),
            });
        }
        table.shapes.shrink_to_fit();
        table.kinds.shrink_to_fit();
        table
    }

    /// Number of output tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Number of rank files of the target job.
    pub fn world(&self) -> u64 {
        self.mesh.world()
    }

    /// Output tensor `i`, in key order.
    pub fn tensor(&self, i: usize) -> TensorView<'_> {
        let e = &self.entries[i];
        let before = i.checked_sub(1).map(|p| &self.entries[p]);
        let start = |end: fn(&Entry) -> usize| before.map_or(0, end);
        let k = &self.kinds[e.kind];
        TensorView {
            key: &self.keys[start(|e| e.key_end)..e.key_end],
            dtype: k.dtype,
            shape: &self.shapes[k.shape.0..k.shape.1],
            recipe: &self.recipes[start(|e| e.recipe_end)..e.recipe_end],
            tp_mode: k.tp_mode,
            tp: k.tp,
            group: k.group,
            tiling: match k.fsdp {
                Some(numbers) => TilingView::Fsdp(numbers, &self.writers[start(|e| e.writers_end)..e.writers_end]),
                None => TilingView::Listed(&self.listed[start(|e| e.listed_end)..e.listed_end]),
            },
        }
    }

    /// Every output tensor, in key order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> + '_ {
        (0..self.len()).map(|i| self.tensor(i))
    }

    /// Bytes each rank writes (tensor data only).
    pub fn bytes_per_rank(&self) -> Vec<u64> {
        plan::bytes_per_rank(&self.mesh, self.tensors())
    }

    /// The non-empty written chunks of `rank`, in key order, as `(tensor index, chunk index,
    /// chunk)`, as [`Plan::rank_chunks`] gives them.
    pub fn rank_chunks(&self, rank: u64) -> impl Iterator<Item = (usize, usize, Chunk)> + '_ {
        plan::rank_chunks(&self.mesh, self.tensors(), rank)
    }
}
