//! Whole-plan validation against the invariants of layouts.md §4, run before a byte is written.
//!
//! The validator works on per-rank write plans ([`RankPlan`]), the form every writer of a DCP
//! checkpoint produces, so it can judge plans that did not come from our planner — the field's
//! buggy ones included (see the T1–T6 tests). [`lower`] turns our [`Plan`] into that form.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::dtype::DType;
use crate::plan::{Group, Plan, Role};

/// One item a rank would write (possibly empty: ranks list every key of their group).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteItem {
    pub key: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    /// The TP-local shape the writer holds.
    pub local_shape: Vec<u64>,
    /// Dim split across TP ranks (`None` when replicated on TP).
    pub tp_dim: Option<usize>,
    pub tp: u64,
    pub tp_rank: u64,
    pub fsdp_rank: u64,
    /// Size of the FSDP shard group of this key.
    pub fsdp_size: u64,
    pub group: Group,
    /// Identity of the bytes: equal for identical content (replica consistency).
    pub content: u64,
    /// The global shape implied by the sources (after any declared permutation).
    pub expected_global: Vec<u64>,
    /// For optimizer states, the parameter key they belong to.
    pub param_key: Option<String>,
}

/// Everything one rank would write, in its order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlan {
    pub rank: u64,
    pub items: Vec<WriteItem>,
}

/// The invariants of layouts.md §4 (numbering as there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Invariant {
    Bounds = 1,
    ExactTiling = 3,
    Contract = 4,
    ReplicaConsistency = 5,
    TpCompleteness = 6,
    RowAlignment = 7,
    OptimizerParity = 9,
    Determinism = 10,
    ExpertCoverage = 11,
    PermutationConsistency = 12,
}

/// A broken invariant, naming the key, offsets and shapes involved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub invariant: Invariant,
    pub key: String,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant {} ({:?}): `{}`: {}", self.invariant as u8, self.invariant, self.key, self.message)
    }
}

fn tuple(v: &[u64]) -> String {
    format!("({})", v.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))
}

fn list(v: &[u64]) -> String {
    format!("[{}]", v.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))
}

/// Lowers a plan to per-rank write plans (every rank lists every key of its group, empty pieces
/// and deduplicated replicas included, in key order).
pub fn lower(plan: &Plan) -> Vec<RankPlan> {
    let mut plans: Vec<RankPlan> = (0..plan.world()).map(|rank| RankPlan { rank, items: Vec::new() }).collect();
    for t in &plan.tensors {
        let tp_dim = match t.tp_mode {
            crate::arch::TpMode::Column => Some(0),
            crate::arch::TpMode::Row => Some(1),
            crate::arch::TpMode::Replicated => None,
        };
        let fsdp_size = match t.group {
            Group::Dense => plan.mesh.fsdp_size(),
            Group::Expert { .. } => plan.mesh.expert_dp_size(),
        };
        for c in &t.chunks {
            let mut h = DefaultHasher::new();
            t.recipe.hash(&mut h);
            t.shape.hash(&mut h);
            c.offsets.hash(&mut h);
            c.sizes.hash(&mut h);
            plans[c.rank as usize].items.push(WriteItem {
                key: t.key.clone(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                offsets: c.offsets.clone(),
                sizes: c.sizes.clone(),
                local_shape: t.local_shape.clone(),
                tp_dim,
                tp: t.tp,
                tp_rank: c.tp_rank,
                fsdp_rank: c.fsdp_rank,
                fsdp_size,
                group: t.group,
                content: h.finish(),
                expected_global: t.shape.clone(),
                param_key: match &t.role {
                    Role::Param => None,
                    Role::OptimizerState { param_key, .. } => Some(param_key.clone()),
                },
            });
        }
    }
    plans
}

/// Checks every invariant over the union of the rank plans. `num_experts`/`ep` enable the
/// expert-coverage check (pass 0 for dense models).
pub fn validate(plans: &[RankPlan], num_experts: u64, ep: u64) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut by_key: BTreeMap<&str, Vec<(u64, &WriteItem)>> = BTreeMap::new();
    for p in plans {
        for it in &p.items {
            by_key.entry(it.key.as_str()).or_default().push((p.rank, it));
        }
    }
    check_determinism(plans, &by_key, &mut v);
    for (key, items) in &by_key {
        check_key(key, items, &mut v);
    }
    check_optimizer_parity(&by_key, &mut v);
    if num_experts > 0 && ep > 0 {
        check_expert_coverage(&by_key, num_experts, ep, &mut v);
    }
    v
}

fn push(v: &mut Vec<Violation>, invariant: Invariant, key: &str, message: String) {
    v.push(Violation { invariant, key: key.to_string(), message });
}

fn check_key(key: &str, items: &[(u64, &WriteItem)], v: &mut Vec<Violation>) {
    let (_, first) = items[0];
    // 4. contract
    for (rank, it) in items {
        if it.global_shape != first.global_shape || it.dtype != first.dtype {
            push(
                v,
                Invariant::Contract,
                key,
                format!(
                    "rank {rank} declares global shape {} {} but rank {} declares {} {}",
                    list(&it.global_shape),
                    it.dtype,
                    items[0].0,
                    list(&first.global_shape),
                    first.dtype
                ),
            );
            return;
        }
    }
    let global = &first.global_shape;
    // 12. the declared global shape is the one the sources imply
    if first.expected_global != *global {
        push(
            v,
            Invariant::PermutationConsistency,
            key,
            format!(
                "global shape {} differs from {} implied by the source data; a dim permutation was applied without permuting the shard placements (local {}, offsets {})",
                list(global),
                list(&first.expected_global),
                list(&first.local_shape),
                tuple(&first.offsets)
            ),
        );
    }
    let mut boxes: BTreeMap<Vec<u64>, (u64, &WriteItem)> = BTreeMap::new();
    for (rank, it) in items {
        // 1. bounds
        let in_bounds = it.offsets.len() == global.len()
            && it.sizes.len() == global.len()
            && it
                .offsets
                .iter()
                .zip(&it.sizes)
                .zip(global)
                .all(|((o, s), g)| o.checked_add(*s).is_some_and(|e| e <= *g));
        if !in_bounds {
            push(
                v,
                Invariant::Bounds,
                key,
                format!(
                    "rank {rank}: offsets {} sizes {} exceed global shape {}",
                    tuple(&it.offsets),
                    tuple(&it.sizes),
                    list(global)
                ),
            );
            continue;
        }
        // 7. row alignment: whole rows of the local tensor (a stripe for row-parallel)
        if !it.sizes.is_empty() && it.sizes.iter().product::<u64>() > 0 {
            let aligned = it.sizes.iter().enumerate().skip(1).all(|(d, s)| it.local_shape.get(d) == Some(s));
            if !aligned {
                push(
                    v,
                    Invariant::RowAlignment,
                    key,
                    format!(
                        "rank {rank}: chunk sizes {} are not whole rows of the local shape {}",
                        tuple(&it.sizes),
                        list(&it.local_shape)
                    ),
                );
            }
        }
        // 6. TP completeness
        if let Some(d) = it.tp_dim {
            if it.tp > 1 && global.get(d) != it.local_shape.get(d).map(|l| l * it.tp).as_ref() {
                push(
                    v,
                    Invariant::TpCompleteness,
                    key,
                    format!(
                        "rank {rank}: TP-split on dim {d} over tp={} but global shape {} is not tp × local shape {}",
                        it.tp,
                        list(global),
                        list(&it.local_shape)
                    ),
                );
            }
        }
        // 5. replicas: the same (key, offsets) must carry the same sizes and bytes
        if it.sizes.iter().product::<u64>() == 0 {
            continue;
        }
        match boxes.get(&it.offsets) {
            Some((other_rank, other)) => {
                if other.sizes != it.sizes || other.content != it.content {
                    push(
                        v,
                        Invariant::ReplicaConsistency,
                        key,
                        format!(
                            "ranks {other_rank} and {rank} both write offsets {} (sizes {} and {}) with different data; DCP keeps one and silently drops the other",
                            tuple(&it.offsets),
                            tuple(&other.sizes),
                            tuple(&it.sizes)
                        ),
                    );
                }
            }
            None => {
                boxes.insert(it.offsets.clone(), (*rank, it));
            }
        }
    }
    // 3. exact tiling: unique boxes pairwise disjoint and covering the volume exactly
    let unique: Vec<Piece> = boxes
        .iter()
        .map(|(off, (r, it))| Piece { offsets: off.clone(), sizes: it.sizes.clone(), owner: format!("rank {r}") })
        .collect();
    for message in tiling_violations(global, unique) {
        push(v, Invariant::ExactTiling, key, message);
    }
}

/// A box of a tensor and who holds it (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub owner: String,
}

/// Exact tiling of `global` by `pieces` (assumed in bounds): pairwise disjoint and covering every
/// element. Empty pieces are ignored. Returns one message per problem.
pub fn tiling_violations(global: &[u64], mut pieces: Vec<Piece>) -> Vec<String> {
    pieces.retain(|p| p.sizes.iter().product::<u64>() > 0);
    pieces.sort_by(|a, b| a.offsets.cmp(&b.offsets));
    let mut out = Vec::new();
    let total: u64 = global.iter().product();
    let covered: u64 = pieces.iter().map(|p| p.sizes.iter().product::<u64>()).sum();
    for (i, a) in pieces.iter().enumerate() {
        for b in pieces.iter().skip(i + 1) {
            // Sorted by offsets: once dim 0 starts past a's end, no later piece overlaps a.
            if !a.offsets.is_empty() && b.offsets[0] >= a.offsets[0] + a.sizes[0] {
                break;
            }
            let overlaps = a
                .offsets
                .iter()
                .zip(&a.sizes)
                .zip(b.offsets.iter().zip(&b.sizes))
                .all(|((oa, sa), (ob, sb))| *oa < ob + sb && *ob < oa + sa);
            if overlaps {
                out.push(format!(
                    "chunks overlap: {} offsets {} sizes {} and {} offsets {} sizes {}",
                    a.owner,
                    tuple(&a.offsets),
                    tuple(&a.sizes),
                    b.owner,
                    tuple(&b.offsets),
                    tuple(&b.sizes)
                ));
            }
        }
    }
    if out.is_empty() && covered != total {
        let detail = pieces
            .iter()
            .take(6)
            .map(|p| format!("{}: offsets {} sizes {}", p.owner, tuple(&p.offsets), tuple(&p.sizes)))
            .collect::<Vec<_>>()
            .join("; ");
        out.push(format!(
            "chunks cover {covered} of {total} elements of global shape {} (boundary check failed: {detail})",
            list(global)
        ));
    }
    out
}

fn check_determinism(plans: &[RankPlan], by_key: &BTreeMap<&str, Vec<(u64, &WriteItem)>>, v: &mut Vec<Violation>) {
    for p in plans {
        for pair in p.items.windows(2) {
            if pair[0].key >= pair[1].key {
                push(
                    v,
                    Invariant::Determinism,
                    &pair[1].key,
                    format!(
                        "rank-divergent key order: rank {} lists `{}` after `{}`; every rank must list keys in the same sorted order",
                        p.rank, pair[1].key, pair[0].key
                    ),
                );
                break;
            }
        }
    }
    // Every (tp rank, fsdp rank) of the key's group must list the key, possibly empty.
    for (key, items) in by_key {
        let (_, first) = items[0];
        let present: BTreeSet<(u64, u64)> = items.iter().map(|(_, it)| (it.tp_rank, it.fsdp_rank)).collect();
        let listing: BTreeSet<u64> = items.iter().map(|(r, _)| *r).collect();
        let missing: Vec<String> = (0..first.tp)
            .flat_map(|r| (0..first.fsdp_size).map(move |j| (r, j)))
            .filter(|rj| !present.contains(rj))
            .map(|(r, j)| format!("tp{r}/fsdp{j}"))
            .collect();
        if !missing.is_empty() {
            push(
                v,
                Invariant::Determinism,
                key,
                format!(
                    "rank-divergent key set: listed by ranks {} but not by {}; ranks that hold no rows must still list the key with an empty chunk",
                    list(&listing.into_iter().collect::<Vec<_>>()),
                    missing.join(", ")
                ),
            );
        }
    }
}

fn check_optimizer_parity(by_key: &BTreeMap<&str, Vec<(u64, &WriteItem)>>, v: &mut Vec<Violation>) {
    let chunk_list = |items: &[(u64, &WriteItem)]| -> BTreeSet<(Vec<u64>, Vec<u64>)> {
        items
            .iter()
            .filter(|(_, it)| it.sizes.iter().product::<u64>() > 0)
            .map(|(_, it)| (it.offsets.clone(), it.sizes.clone()))
            .collect()
    };
    let mut states_of: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, items) in by_key {
        if let Some(param) = &items[0].1.param_key {
            states_of.entry(param.as_str()).or_default().push(key);
        }
    }
    for (param, states) in &states_of {
        let Some(param_items) = by_key.get(param) else {
            push(
                v,
                Invariant::OptimizerParity,
                param,
                format!("optimizer states {states:?} exist but the parameter does not"),
            );
            continue;
        };
        let p_global = &param_items[0].1.global_shape;
        let p_chunks = chunk_list(param_items);
        for suffix in ["exp_avg", "exp_avg_sq"] {
            if !states.iter().any(|s| s.ends_with(&format!(".{suffix}"))) {
                push(v, Invariant::OptimizerParity, param, format!("has optimizer state but no `{suffix}`"));
            }
        }
        for s in states {
            let items = &by_key[s];
            let s_global = &items[0].1.global_shape;
            if s_global != p_global {
                let chunks = chunk_list(items)
                    .iter()
                    .map(|(o, z)| format!("offsets {} sizes {}", tuple(o), tuple(z)))
                    .collect::<Vec<_>>()
                    .join("; ");
                push(
                    v,
                    Invariant::OptimizerParity,
                    s,
                    format!(
                        "global shape {} but its parameter `{param}` has {}; a state saved as a plain local tensor cannot be resharded (chunks: {chunks})",
                        list(s_global),
                        list(p_global)
                    ),
                );
            } else if chunk_list(items) != p_chunks {
                push(v, Invariant::OptimizerParity, s, format!("chunk list differs from its parameter `{param}`"));
            }
        }
    }
}

/// Index in `…weight{g}…` of an expert key.
fn expert_index(key: &str) -> Option<(String, u64)> {
    let pos = key.rfind(".weight")? + ".weight".len();
    let digits: String = key[pos..].chars().take_while(char::is_ascii_digit).collect();
    let g = digits.parse().ok()?;
    Some((format!("{}{{E}}{}", &key[..pos], &key[pos + digits.len()..]), g))
}

fn check_expert_coverage(
    by_key: &BTreeMap<&str, Vec<(u64, &WriteItem)>>,
    num_experts: u64,
    ep: u64,
    v: &mut Vec<Violation>,
) {
    let per_rank = num_experts / ep;
    let mut stems: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for (key, items) in by_key {
        let Group::Expert { expert, ep_rank } = items[0].1.group else {
            continue;
        };
        match expert_index(key) {
            Some((stem, g)) if g == expert => {
                stems.entry(stem).or_default().insert(g);
            }
            _ => push(
                v,
                Invariant::ExpertCoverage,
                key,
                format!("key does not carry the global expert index {expert} (a local index leaked to disk?)"),
            ),
        }
        if per_rank > 0 && ep_rank != expert / per_rank {
            push(
                v,
                Invariant::ExpertCoverage,
                key,
                format!(
                    "expert {expert} is owned by EP rank {ep_rank}, expected {} (= {expert} / ({num_experts}/{ep}))",
                    expert / per_rank
                ),
            );
        }
    }
    for (stem, seen) in stems {
        let missing: Vec<u64> = (0..num_experts).filter(|g| !seen.contains(g)).collect();
        if !missing.is_empty() {
            push(v, Invariant::ExpertCoverage, &stem, format!("experts {} are missing", list(&missing)));
        }
    }
}

/// `shape` permuted by `perm` (`perm[i]` = source dim of output dim `i`).
pub fn permuted(shape: &[u64], perm: &[usize]) -> Vec<u64> {
    perm.iter().map(|p| shape.get(*p).copied().unwrap_or(0)).collect()
}
