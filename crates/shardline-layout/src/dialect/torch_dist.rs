//! Megatron-Core's `torch_dist` placement (torch-dist.md §2): what key, global shape and origin
//! each planned tensor gets, and which `_extra_state` objects come with them.
//!
//! - A decoder block whose layers all hold the same parameters is **stacked**: layer `l` of
//!   `decoder.layers.<l>.<sub>` lands at index `l` of `decoder.layers.<sub>`, of global shape
//!   `(L, …)` (Megatron's homogeneous `TransformerBlock`, prepended axis `(0, l, L)`). A block
//!   whose layers differ (dense and MoE layers mixed, GDN hybrids) keeps per-layer keys, as
//!   Megatron does when `moe_layer_freq`/`linear_attention_freq` make its layers non-homogeneous:
//!   the decision follows the layer kinds the plan holds, which is what those settings encode.
//!   MTP layers are always per-layer.
//! - Routed experts `mlp.experts.<module>.<param><e>` land at expert index `e` of
//!   `mlp.experts.experts.<module>.<param>`, global `(…, E, …)` after the layer axis.
//! - SwiGLU fc1 sections `…_w` (gate) and `…_v` (up) land in one key `[gate; up]`: the gate at
//!   row 0, the up section after it — TP-invariant, as `apply_swiglu_sharded_factory` saves it.
//! - Every Transformer Engine module gets an `_extra_state` object with the module's leading
//!   axes: `<module>._extra_state/shard_<offsets>_<shape>` (`shard_0_1` without axes), payload
//!   `torch.save([None])`, which every TE module and Megatron's own linears accept on load.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use super::Placement;
use crate::mesh::Mesh;
use crate::plan::{Group, TensorView};

/// Modules Megatron builds from Transformer Engine (TE layer spec) and that therefore carry an
/// `_extra_state`; `linear_proj` of an attention also brings its `core_attention`'s.
const TE_MODULES: &[&str] = &[
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "q_layernorm",
    "k_layernorm",
    "in_proj",
    "out_proj",
    "eh_proj",
];

/// Where `fully_reshardable` optimizer state lives: `optimizer.state.<state>.<model key>`, each
/// tensor with its parameter's key suffix, shape and placement (torch-dist.md §3.2).
const OPTIMIZER_STATE: &str = "optimizer.state.";

/// The `fully_reshardable` key of optimizer state `state` (`param` — the fp32 master —,
/// `exp_avg`, `exp_avg_sq`) of the model parameter `name`.
pub fn state_key(state: &str, name: &str) -> String {
    format!("{OPTIMIZER_STATE}{state}.{name}")
}

/// A non-tensor item of the checkpoint: a `ShardedObject` whose payload is `torch.save([None])`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectItem {
    /// The DCP key, `<module>._extra_state/shard_<offsets>_<shape>`.
    pub key: String,
    /// The rank whose file holds it (the module's main replica: TP rank 0, DP rank 0).
    pub rank: u64,
}

/// A decoder block: `<prefix>decoder.layers.` and its layers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Block {
    prefix: String,
    layers: u64,
    stacked: bool,
}

/// The `torch_dist` placement of one plan's tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchDistLayout {
    blocks: Vec<Block>,
    experts: u64,
    /// Sorted by key.
    pub objects: Vec<ObjectItem>,
}

/// A planned key taken apart: block prefix and layer, the sub-key, the expert, the fused section.
#[derive(Debug, PartialEq, Eq)]
struct Parts<'a> {
    /// `(block prefix including "decoder.layers.", layer)` for decoder-layer keys.
    layer: Option<(&'a str, u64)>,
    /// The key with the layer and expert indices and the section suffix removed (per-layer
    /// form when `layer` is `None`).
    sub: Cow<'a, str>,
    expert: Option<u64>,
    /// `Some(false)` for the gate section `_w`, `Some(true)` for the up section `_v`.
    up: Option<bool>,
}

fn parse(key: &str) -> Parts<'_> {
    let (mut sub, mut up) = (Cow::Borrowed(key), None);
    for (suffix, is_up) in [("_w", false), ("_v", true)] {
        if let Some(stem) = key.strip_suffix(suffix) {
            // An expert's index sits between the parameter name and the suffix.
            let name = stem.trim_end_matches(|c: char| c.is_ascii_digit());
            if name.ends_with(".weight") || name.ends_with(".bias") {
                sub = Cow::Borrowed(stem);
                up = Some(is_up);
            }
        }
    }
    let mut expert = None;
    if let Some(at) = sub.find("mlp.experts.") {
        let (head, tail) = sub.split_at(at + "mlp.experts.".len());
        let digits = tail.len() - tail.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let (stem, index) = tail.split_at(tail.len() - digits);
        if digits > 0 && (stem.ends_with(".weight") || stem.ends_with(".bias")) {
            expert = index.parse().ok();
            sub = Cow::Owned(format!("{head}experts.{stem}"));
        }
    }
    let mut layer = None;
    if let Some(at) = sub.find("decoder.layers.").filter(|&at| !sub[..at].contains("mtp.")) {
        let after = at + "decoder.layers.".len();
        let digits = sub[after..].len() - sub[after..].trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 && sub[after + digits..].starts_with('.') {
            let l: u64 = sub[after..after + digits].parse().unwrap_or(0);
            let prefix_end = after;
            let rest = format!("{}{}", &sub[..prefix_end], &sub[after + digits + 1..]);
            // The prefix is a slice of the original key (the layer index never moves it).
            let prefix = &key[..prefix_end];
            layer = Some((prefix, l));
            sub = Cow::Owned(rest);
        }
    }
    Parts { layer, sub, expert, up }
}

/// The module whose weight the on-disk key `key` is: `<module>.weight`, or a named section of
/// it, `<module>.weight.<section>` — GDN's fused input projection is saved in sections
/// (`in_proj.weight.query`, …, Megatron-Core's split factory), its module `in_proj` all the same.
fn weight_module(key: &str) -> Option<&str> {
    key.strip_suffix(".weight")
        .or_else(|| key.rsplit_once(".weight.").filter(|(_, section)| !section.contains('.')).map(|(m, _)| m))
}

impl TorchDistLayout {
    /// The placement of `tensors` (a plan's, in key order) on `mesh`.
    pub fn new(tensors: &[TensorView<'_>], mesh: &Mesh) -> TorchDistLayout {
        // Each block's layers and the parameter set of each layer.
        let mut kinds: BTreeMap<String, BTreeMap<u64, BTreeSet<String>>> = BTreeMap::new();
        let mut experts = 0;
        for t in tensors {
            let p = parse(t.key);
            if let Some(e) = p.expert {
                experts = experts.max(e + 1);
            }
            if let Some((prefix, l)) = p.layer {
                kinds.entry(prefix.to_string()).or_default().entry(l).or_default().insert(p.sub.into_owned());
            }
        }
        let blocks = kinds
            .into_iter()
            .map(|(prefix, layers)| {
                let count = layers.keys().next_back().map_or(0, |l| l + 1);
                let mut sets = layers.values();
                let first = sets.next();
                let stacked = layers.len() as u64 == count && sets.all(|s| Some(s) == first);
                Block { prefix, layers: count, stacked }
            })
            .collect();
        let mut layout = TorchDistLayout { blocks, experts, objects: Vec::new() };
        let mut objects: BTreeMap<String, u64> = BTreeMap::new();
        for t in tensors.iter().filter(|t| !t.key.starts_with(OPTIMIZER_STATE)) {
            let place = layout.place(t.key, t.shape);
            let Some(module) = weight_module(&place.key) else { continue };
            let (parent, name) = module.rsplit_once('.').unwrap_or(("", module));
            if !TE_MODULES.contains(&name) {
                continue;
            }
            let lead = place.origin.len() - t.shape.len();
            let shard = if lead == 0 {
                "shard_0_1".to_string()
            } else {
                let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
                format!("shard_{}_{}", join(&place.origin[..lead]), join(&place.shape[..lead]))
            };
            let rank = match t.group {
                Group::Dense => 0,
                Group::Expert { ep_rank, .. } => mesh.expert_rank(0, ep_rank, 0),
            };
            objects.insert(format!("{module}._extra_state/{shard}"), rank);
            if name == "linear_proj" && parent.ends_with("self_attention") {
                objects.insert(format!("{parent}.core_attention._extra_state/{shard}"), rank);
            }
        }
        layout.objects = objects.into_iter().map(|(key, rank)| ObjectItem { key, rank }).collect();
        layout
    }

    /// Where the planned tensor `key` of `shape` lands.
    pub fn place<'k>(&self, key: &'k str, shape: &[u64]) -> Placement<'k> {
        let p = parse(key);
        if p.layer.is_none() && p.expert.is_none() && p.up.is_none() {
            return Placement::identity(key, shape);
        }
        let mut lead_shape = Vec::new();
        let mut lead_origin = Vec::new();
        let mut disk_key = p.sub.into_owned();
        if let Some((prefix, l)) = p.layer {
            match self.blocks.iter().find(|b| b.prefix == prefix) {
                Some(b) if b.stacked => {
                    lead_shape.push(b.layers);
                    lead_origin.push(l);
                }
                // Per-layer: the layer index goes back into the key.
                _ => disk_key.insert_str(prefix.len(), &format!("{l}.")),
            }
        }
        if let Some(e) = p.expert {
            lead_shape.push(self.experts);
            lead_origin.push(e);
        }
        let mut inner_shape = shape.to_vec();
        let mut inner_origin = vec![0; shape.len()];
        if let (Some(up), Some(rows)) = (p.up, inner_shape.first_mut()) {
            // SwiGLU: `[gate; up]`, gate and up of equal rows.
            if up {
                inner_origin[0] = *rows;
            }
            *rows *= 2;
        }
        lead_shape.extend(inner_shape);
        lead_origin.extend(inner_origin);
        Placement { key: Cow::Owned(disk_key), shape: lead_shape, origin: lead_origin }
    }
}

/// A planned tensor inside an on-disk key: its canonical (per-layer, per-expert, split) key, its
/// origin in the on-disk key and its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub key: String,
    pub origin: Vec<u64>,
    pub shape: Vec<u64>,
}

/// The planned tensors an on-disk `torch_dist` key of `shape` holds: [`TorchDistLayout::place`]
/// read backwards. Stacked keys (`<p>decoder.layers.<sub>`, no layer index) have a leading
/// layer axis; `mlp.experts.experts.` keys an expert axis after it; `gated` says, of a canonical
/// key, whether it is a SwiGLU fc1 stored `[gate; up]`, whose halves become its `_w` and `_v`
/// sections — the model's layer kinds decide, never a flag.
pub fn unplace(key: &str, shape: &[u64], gated: impl Fn(&str) -> bool) -> Result<Vec<Part>, String> {
    let mut lead = 0usize;
    let mut dim = |what: &str| -> Result<u64, String> {
        let d = *shape.get(lead).ok_or_else(|| format!("`{key}` of shape {shape:?} has no {what} axis"))?;
        lead += 1;
        Ok(d)
    };
    let stack = key
        .find("decoder.layers.")
        .filter(|&at| !key[..at].contains("mtp."))
        .map(|at| at + "decoder.layers.".len())
        .filter(|&after| !key[after..].starts_with(|c: char| c.is_ascii_digit()));
    let layers = match stack {
        Some(_) => Some(dim("layer")?),
        None => None,
    };
    let experts = match key.contains("mlp.experts.experts.") {
        true => Some(dim("expert")?),
        false => None,
    };
    let inner = &shape[lead..];
    let mut parts = Vec::new();
    for l in 0..layers.unwrap_or(1) {
        for e in 0..experts.unwrap_or(1) {
            let mut k = key.to_string();
            if experts.is_some() {
                k = k.replacen("mlp.experts.experts.", "mlp.experts.", 1);
                k.push_str(&e.to_string());
            }
            if let Some(after) = stack {
                k.insert_str(after, &format!("{l}."));
            }
            let mut origin: Vec<u64> = Vec::with_capacity(shape.len());
            origin.extend(layers.map(|_| l));
            origin.extend(experts.map(|_| e));
            origin.extend(inner.iter().map(|_| 0));
            if gated(&k) {
                let rows = inner.first().copied().unwrap_or(0);
                if rows % 2 != 0 {
                    return Err(format!("`{key}`: a SwiGLU fc1 of {rows} rows cannot be `[gate; up]`"));
                }
                let mut half = inner.to_vec();
                half[0] = rows / 2;
                let mut up = origin.clone();
                up[lead] = rows / 2;
                parts.push(Part { key: format!("{k}_w"), origin, shape: half.clone() });
                parts.push(Part { key: format!("{k}_v"), origin: up, shape: half });
            } else {
                parts.push(Part { key: k, origin, shape: inner.to_vec() });
            }
        }
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unplace_reads_placements_backwards() {
        let gated = |k: &str| k.ends_with("linear_fc1.weight") || k.contains("experts.linear_fc1.weight");
        let parts = unplace("decoder.layers.mlp.experts.experts.linear_fc1.weight", &[2, 3, 8, 4], gated).unwrap();
        assert_eq!(parts.len(), 2 * 3 * 2);
        assert_eq!(
            parts[3],
            Part {
                key: "decoder.layers.0.mlp.experts.linear_fc1.weight1_v".into(),
                origin: vec![0, 1, 4, 0],
                shape: vec![4, 4]
            }
        );
        let parts = unplace("decoder.layers.3.mlp.linear_fc2.weight", &[16, 6], gated).unwrap();
        assert_eq!(
            parts,
            [Part { key: "decoder.layers.3.mlp.linear_fc2.weight".into(), origin: vec![0, 0], shape: vec![16, 6] }]
        );
        assert!(unplace("decoder.layers.mlp.linear_fc1.weight", &[2, 5, 4], gated).unwrap_err().contains("5 rows"));
        assert!(unplace("decoder.layers.mlp.linear_fc2.weight", &[], gated).unwrap_err().contains("no layer axis"));
    }

    #[test]
    fn keys_come_apart() {
        let p = parse("decoder.layers.12.mlp.experts.linear_fc1.weight37_v");
        assert_eq!(p.layer, Some(("decoder.layers.", 12)));
        assert_eq!(p.sub, "decoder.layers.mlp.experts.experts.linear_fc1.weight");
        assert_eq!((p.expert, p.up), (Some(37), Some(true)));
        let p = parse("language_model.decoder.layers.3.self_attention.linear_qkv.weight");
        assert_eq!(p.layer, Some(("language_model.decoder.layers.", 3)));
        assert_eq!(p.sub, "language_model.decoder.layers.self_attention.linear_qkv.weight");
        let p = parse("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight_w");
        assert_eq!(
            (p.layer, p.sub.as_ref(), p.up),
            (None, "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight", Some(false))
        );
        let p = parse("embedding.word_embeddings.weight");
        assert_eq!((p.layer, p.expert, p.up), (None, None, None));
    }

    #[test]
    fn a_weight_saved_in_sections_belongs_to_its_module() {
        assert_eq!(
            weight_module("decoder.layers.self_attention.linear_qkv.weight"),
            Some("decoder.layers.self_attention.linear_qkv")
        );
        assert_eq!(
            weight_module("decoder.layers.0.self_attention.in_proj.weight.z"),
            Some("decoder.layers.0.self_attention.in_proj")
        );
        assert_eq!(
            weight_module("decoder.layers.0.self_attention.conv1d.weight.query"),
            Some("decoder.layers.0.self_attention.conv1d")
        );
        assert_eq!(weight_module("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"), None);
        assert_eq!(weight_module("decoder.layers.0.mlp.linear_fc1.bias"), None);
    }

    #[test]
    fn chunks_gain_leading_axes_and_the_section_offset() {
        let layout = TorchDistLayout {
            blocks: vec![Block { prefix: "decoder.layers.".into(), layers: 4, stacked: true }],
            experts: 8,
            objects: Vec::new(),
        };
        let place = layout.place("decoder.layers.2.mlp.experts.linear_fc1.weight5_v", &[6, 16]);
        assert_eq!(place.key, "decoder.layers.mlp.experts.experts.linear_fc1.weight");
        assert_eq!(place.shape, vec![4, 8, 12, 16]);
        assert_eq!(place.chunk(&[3, 0], &[3, 16]), (vec![2, 5, 9, 0], vec![1, 1, 3, 16]));
        let per_layer = TorchDistLayout {
            blocks: vec![Block { prefix: "decoder.layers.".into(), layers: 4, stacked: false }],
            ..layout
        };
        let place = per_layer.place("decoder.layers.2.mlp.linear_fc2.weight", &[16, 6]);
        assert_eq!(
            (place.key.as_ref(), place.shape.as_slice()),
            ("decoder.layers.2.mlp.linear_fc2.weight", &[16, 6][..])
        );
    }
}
