//! Dialects: how the checkpoint formats of the Megatron world name, stack, split and chunk the
//! same model parameters — the one place that knows it.
//!
//! The planner plans every parameter once, in Megatron's canonical per-module form: one tensor
//! per layer and per expert, fused projections split into their sections (`linear_fc1.weight_w`
//! / `_v`), each with its recipe and its TP pieces. A dialect then says three things:
//!
//! - **chunking**: whether data parallelism shards a parameter (Megatron-FSDP's `fsdp_dtensor`,
//!   uneven row shards) or replicates it (`torch_dist`, where DP replicas write nothing);
//! - **placement**: where each planned tensor lands in the checkpoint — the on-disk key, that
//!   key's global shape, and the planned tensor's origin in it (a layer-stacked key holds every
//!   layer's tensor at its layer index; `[gate; up]` holds the gate section at row 0 and the up
//!   section after it). A planned chunk keeps its bytes and only gains leading axes and an
//!   offset, so the copy is the same for every dialect;
//! - **objects**: the non-tensor items that come with the parameters (`_extra_state`).
//!
//! A new dialect (an FSDP2 framework's naming) is a new variant here and a table of its own,
//! not a branch in the writers.

pub mod torch_dist;

use std::borrow::Cow;

pub use torch_dist::{state_key, unplace, ObjectItem, Part, TorchDistLayout};

/// The checkpoint dialect a plan is written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// Megatron-FSDP's `fsdp_dtensor`: per-layer keys under a module prefix, fused projections
    /// split, every parameter FSDP-sharded over the data-parallel ranks.
    #[default]
    FsdpDtensor,
    /// Megatron-Core's `torch_dist` (Megatron-LM's default `--ckpt-format`): bare keys, uniform
    /// layer stacks under one key with a leading layer axis, experts under
    /// `mlp.experts.experts.` with an expert axis, SwiGLU fc1 whole as `[gate; up]`, DP replicas
    /// written once, and an `_extra_state` object per Transformer Engine module.
    TorchDist,
    /// torchtitan's seed checkpoint (`step-0/`): native names of the torchtitan version given,
    /// q/k/v and the MLP unfused, routed experts stacked, FSDP2 `Shard(0)` over dp; planned from
    /// the release directly (`plan::torchtitan`), not from Megatron's per-module form.
    Torchtitan(crate::plan::TorchtitanTarget),
    /// NeMo Automodel's training checkpoint (`epoch_E_step_S/`): `model/` under the release's HF
    /// names (HF-storage safetensors or DCP), `optim/` (DCP) under its native names, FSDP2
    /// placements as its parallelizer gives them. Automodel reads releases directly, so nothing
    /// converts to it; it is resharded (`reshard::fsdp2`) and exported.
    Automodel,
}

impl Dialect {
    /// The `--target` / `target:` name.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::FsdpDtensor => "fsdp_dtensor",
            Dialect::TorchDist => "torch_dist",
            Dialect::Torchtitan(_) => "torchtitan",
            Dialect::Automodel => "automodel",
        }
    }

    /// Parses a `--target` / `target:` name.
    pub fn parse(name: &str) -> Option<Dialect> {
        match name {
            "fsdp_dtensor" => Some(Dialect::FsdpDtensor),
            "torch_dist" => Some(Dialect::TorchDist),
            "torchtitan" => Some(Dialect::Torchtitan(Default::default())),
            "automodel" => Some(Dialect::Automodel),
            _ => None,
        }
    }

    /// Whether data parallelism shards parameters (else DP ranks hold replicas and only DP rank 0
    /// writes).
    pub fn shards_over_dp(self) -> bool {
        match self {
            Dialect::FsdpDtensor | Dialect::Torchtitan(_) | Dialect::Automodel => true,
            Dialect::TorchDist => false,
        }
    }

    /// Whether the TP replicas of a replicated parameter are balanced over the TP ranks (FSDP's
    /// save plan dedups by load) or written by TP rank 0 (Megatron-Core's main replica, replica
    /// id all zeros).
    pub fn balances_replicas(self) -> bool {
        match self {
            Dialect::FsdpDtensor | Dialect::Torchtitan(_) | Dialect::Automodel => true,
            Dialect::TorchDist => false,
        }
    }

    /// Whether the dialect is an FSDP2 framework's, whose placements may cut any dim of a
    /// tensor (Megatron's dialects cut rows of the TP-local tensor only).
    pub fn is_fsdp2(self) -> bool {
        matches!(self, Dialect::Torchtitan(_) | Dialect::Automodel)
    }

    /// The prefix of model keys in this dialect.
    pub fn default_prefix(self) -> &'static str {
        match self {
            Dialect::FsdpDtensor => "model.module.",
            Dialect::TorchDist | Dialect::Torchtitan(_) | Dialect::Automodel => "",
        }
    }
}

/// Where a planned tensor lands on disk: `key` of global shape `shape`, the planned tensor's
/// element `[i, j, …]` at `origin + [0, …, 0, i, j, …]` (leading axes of size 1 prepended).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement<'a> {
    pub key: Cow<'a, str>,
    pub shape: Vec<u64>,
    pub origin: Vec<u64>,
}

impl Placement<'_> {
    /// The planned tensor itself, where nothing moves.
    pub fn identity<'k>(key: &'k str, shape: &[u64]) -> Placement<'k> {
        Placement { key: Cow::Borrowed(key), shape: shape.to_vec(), origin: vec![0; shape.len()] }
    }

    /// The on-disk `(offsets, sizes)` of a planned chunk.
    pub fn chunk(&self, offsets: &[u64], sizes: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let lead = self.origin.len() - offsets.len();
        let mut off = self.origin.clone();
        let mut sz = vec![1; self.origin.len()];
        for (k, (o, s)) in offsets.iter().zip(sizes).enumerate() {
            off[lead + k] += o;
            sz[lead + k] = *s;
        }
        (off, sz)
    }
}

/// The share of a stored box `offsets`/`sizes` (on-disk coordinates) that the planned tensor at
/// `origin`, of `shape` behind leading axes of size 1, holds: `(offsets, sizes)` in the planned
/// tensor's coordinates, and the first element's coordinates within the box. `None` when they do
/// not meet. A planned tensor covers one index of each leading axis and whole trailing dims, so
/// its share is one contiguous run of the box's bytes, in the same order.
pub fn share_of_box(offsets: &[u64], sizes: &[u64], origin: &[u64], shape: &[u64]) -> Option<BoxShare> {
    let lead = origin.len() - shape.len();
    let mut share = BoxShare { offsets: Vec::new(), sizes: Vec::new(), first_in_box: Vec::new() };
    for d in 0..origin.len() {
        let extent = if d < lead { 1 } else { shape[d - lead] };
        let a = offsets[d].max(origin[d]);
        let b = (offsets[d] + sizes[d]).min(origin[d] + extent);
        if a >= b {
            return None;
        }
        share.first_in_box.push(a - offsets[d]);
        if d >= lead {
            share.offsets.push(a - origin[d]);
            share.sizes.push(b - a);
        }
    }
    Some(share)
}

/// See [`share_of_box`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoxShare {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub first_in_box: Vec<u64>,
}

/// How a frozen plan's tensors are laid out on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DiskLayout {
    /// Every planned tensor is a key of its own (`fsdp_dtensor`, plain DCP).
    #[default]
    AsPlanned,
    TorchDist(TorchDistLayout),
}

impl DiskLayout {
    /// Where the planned tensor `key` of `shape` lands.
    pub fn place<'k>(&self, key: &'k str, shape: &[u64]) -> Placement<'k> {
        match self {
            DiskLayout::AsPlanned => Placement::identity(key, shape),
            DiskLayout::TorchDist(t) => t.place(key, shape),
        }
    }

    /// The non-tensor items written with the tensors.
    pub fn objects(&self) -> &[ObjectItem] {
        match self {
            DiskLayout::AsPlanned => &[],
            DiskLayout::TorchDist(t) => &t.objects,
        }
    }

    /// Whether planned tensors share on-disk keys (the metadata then groups them).
    pub fn regroups(&self) -> bool {
        !matches!(self, DiskLayout::AsPlanned)
    }
}
