//! How an FSDP2 framework places a tensor over its ranks: what a source's chunks show, and what
//! the target takes — the chunks' placement kept, the framework's rule where the chunks cannot
//! show it or it depends on the mesh.

use std::collections::{BTreeMap, BTreeSet};

use super::super::boxes::ChunkBox;
use crate::dialect::Dialect;
use crate::plan::{is_routed_experts, tp_split, uneven_split};

/// How a tensor lies over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Written once, whole (a replicated tensor, or a 0-d one).
    Whole,
    /// `Shard(dim)` over every rank: `torch.chunk` pieces along `dim`, rank `j` holding piece `j`.
    Shard(u8),
    /// Grouped experts `[E, …]` under expert parallelism: dim 0 cut into one slab per EP rank,
    /// each slab cut along `dim` over its expert-FSDP ranks (NeMo Automodel's `[Shard(1),
    /// Shard(0)]` on `(ep_shard, ep)`; torchtitan's `[_StridedShard(0), Shard(0)]` when `dim` is 0).
    Grouped { dim: u8 },
    /// One expert's own tensor (NeMo Automodel's per-expert HF keys): held by the EP rank that
    /// owns expert `expert` of `experts`, `Shard(dim)` over that rank's expert-FSDP group.
    OfExpert { expert: u64, experts: u64, dim: u8 },
    /// On torchtitan's dense mesh `(dp, tp)`: TP rank `r`'s even block of dim `split` (none:
    /// replicated over TP), cut along `dim` of that block over the DP ranks (`plan::torchtitan`'s
    /// `dense_mesh_tiling`).
    DenseMesh { split: Option<u8>, dim: u8 },
}

/// Whether `along` (offset, size) pairs, sorted, are `torch.chunk`'s pieces of `n`.
fn chunk_pieces(along: &[(u64, u64)], n: u64) -> bool {
    let q = along.first().map_or(0, |p| p.1);
    along.iter().enumerate().all(|(k, &(off, size))| {
        let k = k as u64;
        off == k * q && q > 0 && size == q.min(n - k * q)
    })
}

fn dim_u8(d: usize) -> Result<u8, String> {
    u8::try_from(d).map_err(|_| format!("dim {d} is past any tensor's rank"))
}

/// The placement a source tensor's chunks show, or why they are not FSDP2's.
pub fn source_placement(shape: &[u64], chunks: &[ChunkBox]) -> Result<Placement, String> {
    let stored: Vec<&ChunkBox> = chunks.iter().filter(|c| c.numel() > 0 || shape.is_empty()).collect();
    let split: Vec<usize> = (0..shape.len()).filter(|&d| stored.iter().any(|c| c.sizes[d] != shape[d])).collect();
    let pieces_along = |d: usize, of: &[&ChunkBox]| {
        let mut along: Vec<(u64, u64)> = of.iter().map(|c| (c.offsets[d], c.sizes[d])).collect();
        along.sort_unstable();
        along
    };
    match split[..] {
        [] => Ok(Placement::Whole),
        [d] => {
            let along = pieces_along(d, &stored);
            if chunk_pieces(&along, shape[d]) {
                dim_u8(d).map(Placement::Shard)
            } else {
                Err(format!(
                    "its chunks along dim {d} (offset, size) {along:?} are not `torch.chunk` pieces, as FSDP2's \
                     `Shard({d})` makes them"
                ))
            }
        }
        // Expert-parallel slabs of dim 0 of grouped experts `[E, …]`, each cut along `d` by its
        // expert-FSDP group.
        [0, d] if shape.len() == 3 => {
            let slab = stored.first().map_or(0, |c| c.sizes[0]);
            let mut slabs: BTreeMap<u64, Vec<&ChunkBox>> = BTreeMap::new();
            for c in &stored {
                slabs.entry(c.offsets[0]).or_default().push(c);
            }
            let even = slab > 0
                && shape[0].is_multiple_of(slab)
                && stored.iter().all(|c| c.sizes[0] == slab && c.offsets[0].is_multiple_of(slab));
            if even && slabs.values().all(|of| chunk_pieces(&pieces_along(d, of), shape[d])) {
                dim_u8(d).map(|dim| Placement::Grouped { dim })
            } else {
                Err(format!(
                    "it is split along dims [0, {d}] other than as expert-parallel slabs of dim 0, each in \
                     `torch.chunk` pieces along dim {d}"
                ))
            }
        }
        _ => Err(format!(
            "it is split along dims {split:?}: a tensor-parallel placement, which Shardline reads in torchtitan's \
             checkpoints only (by its sharding configs)"
        )),
    }
}

/// `(expert, experts)` of a per-expert key (`….experts.<e>.…`), the experts counted over every key
/// of the same module.
pub struct ExpertKeys<'a> {
    counts: BTreeMap<&'a str, u64>,
}

impl<'a> ExpertKeys<'a> {
    pub fn new(keys: impl Iterator<Item = &'a str>) -> ExpertKeys<'a> {
        let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
        for key in keys {
            if let Some((base, e)) = Self::split(key) {
                let n = counts.entry(base).or_default();
                *n = (*n).max(e + 1);
            }
        }
        ExpertKeys { counts }
    }

    fn split(key: &str) -> Option<(&str, u64)> {
        let at = key.find(".experts.")?;
        let rest = &key[at + ".experts.".len()..];
        let e = rest.split('.').next()?.parse().ok()?;
        Some((&key[..at], e))
    }

    pub fn of(&self, key: &str) -> Option<(u64, u64)> {
        let (base, e) = Self::split(key)?;
        Some((e, *self.counts.get(base)?))
    }
}

/// What the target takes for a tensor of `shape` whose source shows `shown`.
pub struct Target<'a> {
    pub dialect: Dialect,
    /// The target's data-, tensor- and expert-parallel degrees (every rank: `dp·tp`).
    pub dp: u64,
    pub tp: u64,
    pub ep: u64,
    pub source_ranks: u64,
    pub fused_qkv: &'a BTreeSet<&'a str>,
    pub experts: &'a ExpertKeys<'a>,
}

impl Target<'_> {
    /// The target placement of the tensor `key` of `shape`, an optimizer state of the parameter
    /// `param` (else `param` is `key`), whose source chunks show `shown` (or why they show no
    /// FSDP2 placement).
    pub fn placement(
        &self,
        key: &str,
        param: &str,
        shape: &[u64],
        shown: Result<Placement, String>,
    ) -> Result<Placement, String> {
        if shape.is_empty() {
            return Ok(Placement::Whole);
        }
        if let Dialect::Torchtitan(_) = self.dialect {
            if let Some(p) = self.torchtitan(key, param, shape, &shown)? {
                return self.grouped_fits(p, shape);
            }
        }
        let shown = shown?;
        let grouped_key = shape.len() == 3 && (key.contains(".experts.") || key.contains(".moe."));
        let placement = match shown {
            Placement::Grouped { dim } if self.ep > 1 => Placement::Grouped { dim },
            Placement::Grouped { dim } => Placement::Shard(dim),
            Placement::Shard(dim) if self.ep > 1 && grouped_key && dim >= 1 => Placement::Grouped { dim },
            Placement::Shard(dim) | Placement::OfExpert { dim, .. } if self.ep > 1 => match self.experts.of(key) {
                Some((expert, experts)) => Placement::OfExpert { expert, experts, dim },
                None => Placement::Shard(dim),
            },
            Placement::OfExpert { dim, .. } => Placement::Shard(dim),
            Placement::Whole if self.source_ranks <= 1 => Placement::Shard(0),
            p => p,
        };
        self.grouped_fits(placement, shape)
    }

    /// torchtitan's rules (torchtitan/distributed/fsdp.py, models/common/attention.py, its sharding
    /// configs), where they decide; `None` where the source's placement is kept.
    fn torchtitan(
        &self,
        key: &str,
        param: &str,
        shape: &[u64],
        shown: &Result<Placement, String>,
    ) -> Result<Option<Placement>, String> {
        // Persistent buffers are not FSDP2 parameters: replicated, written once.
        if key.ends_with(".expert_bias_E") || key.ends_with(".moe.expert_bias") {
            return Ok(Some(Placement::Whole));
        }
        // The fused-QKV model keys: the save hook splits `wqkv` after redistributing it to Replicate.
        let module = key.strip_suffix(".weight").and_then(|k| k.rsplit_once('.')).map(|(m, _)| m);
        if module.is_some_and(|m| m.ends_with(".qkv_linear") && self.fused_qkv.contains(m)) {
            return Ok(Some(Placement::Whole));
        }
        let split = tp_split(param).filter(|_| self.tp > 1);
        if let Some(why) = uneven_split(shape, split, self.tp) {
            return Err(why);
        }
        let split = split.and_then(|d| u8::try_from(d).ok());
        // Routed experts `[E, …]`: under EP on the sparse mesh over every rank (`[_StridedShard(0),
        // Shard(0)]` within each EP slab), else on the dense mesh, TP-split; FSDP2 cuts dim 1 once
        // its mesh has more ranks than experts.
        if shape.len() == 3 && is_routed_experts(param) {
            return Ok(Some(if self.ep > 1 {
                Placement::Grouped { dim: u8::from(self.dp * self.tp > shape[0]) }
            } else {
                Placement::DenseMesh { split, dim: u8::from(self.dp > shape[0]) }
            }));
        }
        // Under TP, or from a source saved with it (whose chunks show no one-dim placement), every
        // parameter and moment is placed by the sharding configs, FSDP2's `Shard(0)` after.
        if self.tp > 1 || shown.is_err() {
            if *shown == Ok(Placement::Whole) && self.source_ranks > 1 {
                return Ok(Some(Placement::Whole));
            }
            return Ok(Some(Placement::DenseMesh { split, dim: 0 }));
        }
        Ok(None)
    }

    /// Expert parallelism must give each EP rank whole experts.
    fn grouped_fits(&self, p: Placement, shape: &[u64]) -> Result<Placement, String> {
        let experts = match p {
            Placement::Grouped { .. } => shape[0],
            Placement::OfExpert { experts, .. } => experts,
            _ => return Ok(p),
        };
        if experts.is_multiple_of(self.ep) {
            Ok(p)
        } else {
            Err(format!("ep = {} does not divide its {experts} experts", self.ep))
        }
    }
}
