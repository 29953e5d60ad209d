//! Whole-plan validation against the invariants of layouts.md §4, run before a byte is written.
//!
//! The validator works on per-rank write plans ([`RankPlan`]), the form every writer of a DCP
//! checkpoint produces, so it can judge plans that did not come from our planner — the field's
//! buggy ones included (see the T1–T6 tests). [`lower`] turns our [`Plan`] into that form.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::dtype::DType;
use crate::plan::{Group, OutputTensor, Plan, Role};

/// One item a rank would write (possibly empty: ranks list every key of their group). Names and
/// shapes borrow from the plan they were lowered from, so validating a plan with many chunks
/// does not copy its metadata; hand-written plans (the field's buggy ones) own theirs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteItem<'a> {
    pub key: Cow<'a, str>,
    pub dtype: DType,
    pub global_shape: Cow<'a, [u64]>,
    pub offsets: Cow<'a, [u64]>,
    pub sizes: Cow<'a, [u64]>,
    /// The TP-local shape the writer holds.
    pub local_shape: Cow<'a, [u64]>,
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
    pub expected_global: Cow<'a, [u64]>,
    /// For optimizer states, the parameter key they belong to.
    pub param_key: Option<Cow<'a, str>>,
    /// Whether chunks must be whole rows of the local tensor: Megatron's flat buffers shard by
    /// rows, while FSDP2 cuts any dim (`Shard(1)` experts, EP slabs, TP splits of dims 1 and 2).
    pub whole_rows: bool,
}

/// Everything one rank would write, in its order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlan<'a> {
    pub rank: u64,
    pub items: Vec<WriteItem<'a>>,
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

/// The items of one tensor, one per chunk, with the rank that lists each.
fn lower_tensor<'a>(plan: &'a Plan, t: &'a OutputTensor) -> impl Iterator<Item = (u64, WriteItem<'a>)> {
    let tp_dim = match t.tp_mode {
        crate::arch::TpMode::Column => Some(0),
        crate::arch::TpMode::Row => Some(1),
        crate::arch::TpMode::Replicated => None,
    };
    let fsdp_size = match (&t.tiling, t.group) {
        (crate::plan::Tiling::Fsdp(f), _) => f.numbers.fsdp_size,
        (_, Group::Dense) => plan.mesh.fsdp_size(),
        (_, Group::Expert { .. }) => plan.mesh.expert_dp_size(),
    };
    t.chunks(&plan.mesh).map(move |c| {
        let mut h = DefaultHasher::new();
        t.recipe.hash(&mut h);
        t.shape.hash(&mut h);
        c.offsets.hash(&mut h);
        c.sizes.hash(&mut h);
        let item = WriteItem {
            key: Cow::Borrowed(&t.key),
            dtype: t.dtype,
            global_shape: Cow::Borrowed(&t.shape),
            offsets: Cow::Owned(c.offsets),
            sizes: Cow::Owned(c.sizes),
            local_shape: Cow::Owned(t.local_shape()),
            tp_dim,
            tp: t.tp,
            tp_rank: c.tp_rank,
            fsdp_rank: c.fsdp_rank,
            fsdp_size,
            group: t.group,
            content: h.finish(),
            expected_global: Cow::Borrowed(&t.shape),
            param_key: match &t.role {
                Role::Param => None,
                Role::OptimizerState { param_key, .. } => Some(Cow::Borrowed(param_key)),
            },
            whole_rows: !plan.options.dialect.is_fsdp2(),
        };
        (c.rank, item)
    })
}

/// Lowers a plan to per-rank write plans (every rank lists every key of its group, empty pieces
/// and deduplicated replicas included, in key order).
pub fn lower(plan: &Plan) -> Vec<RankPlan<'_>> {
    let mut counts = vec![0usize; plan.world() as usize];
    for c in plan.tensors.iter().flat_map(|t| t.chunks(&plan.mesh)) {
        counts[c.rank as usize] += 1;
    }
    let mut plans: Vec<RankPlan> =
        counts.into_iter().zip(0..).map(|(n, rank)| RankPlan { rank, items: Vec::with_capacity(n) }).collect();
    for t in &plan.tensors {
        for (rank, item) in lower_tensor(plan, t) {
            plans[rank as usize].items.push(item);
        }
    }
    plans
}

/// Checks every invariant of our own plan, one key at a time: the same checks, with the same
/// messages, as `validate(&lower(plan), …)`, but holding one key's items at a time instead of
/// every chunk of the plan, so memory does not grow with the model's chunk count.
pub fn validate_plan(plan: &Plan, num_experts: u64, ep: u64) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut last_key: Vec<Option<&str>> = vec![None; plan.world() as usize];
    let mut order_broken = vec![false; plan.world() as usize];
    let mut experts = ExpertCoverage::new(num_experts, ep);
    let mut states_of: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let lowered = |t| lower_tensor(plan, t).collect::<Vec<_>>();
    for t in &plan.tensors {
        let items = lowered(t);
        let refs: Vec<(u64, &WriteItem)> = items.iter().map(|(r, it)| (*r, it)).collect();
        for (rank, it) in &refs {
            let r = *rank as usize;
            if let Some(prev) = last_key[r].replace(&t.key) {
                if !order_broken[r] && prev >= t.key.as_str() {
                    order_broken[r] = true;
                    push_order_violation(&mut v, *rank, prev, &it.key);
                }
            }
        }
        check_key_set(&t.key, &refs, &mut v);
        check_key(&t.key, &refs, &mut v);
        experts.observe(&t.key, &refs, &mut v);
        if let Role::OptimizerState { param_key, .. } = &t.role {
            states_of.entry(param_key).or_default().push(&t.key);
        }
    }
    for (param, states) in &states_of {
        let param_items =
            plan.tensors.binary_search_by(|t| t.key.as_str().cmp(param)).ok().map(|i| lowered(&plan.tensors[i]));
        let param_refs: Option<Vec<(u64, &WriteItem)>> =
            param_items.as_ref().map(|items| items.iter().map(|(r, it)| (*r, it)).collect());
        check_parameter_states(param, param_refs.as_deref(), states, &mut v, |state| {
            let i = plan.tensors.binary_search_by(|t| t.key.as_str().cmp(state)).ok()?;
            Some(lowered(&plan.tensors[i]))
        });
    }
    experts.finish(&mut v);
    v
}

/// Checks every invariant over the union of the rank plans. `num_experts`/`ep` enable the
/// expert-coverage check (pass 0 for dense models).
pub fn validate(plans: &[RankPlan], num_experts: u64, ep: u64) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut by_key: BTreeMap<&str, Vec<(u64, &WriteItem)>> = BTreeMap::new();
    for p in plans {
        for it in &p.items {
            by_key.entry(it.key.as_ref()).or_default().push((p.rank, it));
        }
    }
    for p in plans {
        if let Some(pair) = p.items.windows(2).find(|pair| pair[0].key >= pair[1].key) {
            push_order_violation(&mut v, p.rank, &pair[0].key, &pair[1].key);
        }
    }
    let mut experts = ExpertCoverage::new(num_experts, ep);
    let mut states_of: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, items) in &by_key {
        check_key_set(key, items, &mut v);
        check_key(key, items, &mut v);
        experts.observe(key, items, &mut v);
        if let Some(param) = &items[0].1.param_key {
            states_of.entry(param.as_ref()).or_default().push(key);
        }
    }
    for (param, states) in &states_of {
        check_parameter_states(param, by_key.get(param).map(Vec::as_slice), states, &mut v, |state| {
            Some(by_key.get(state)?.iter().map(|(r, it)| (*r, (*it).clone())).collect())
        });
    }
    experts.finish(&mut v);
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
    let mut boxes: BTreeMap<&[u64], (u64, &WriteItem)> = BTreeMap::new();
    for (rank, it) in items {
        // 1. bounds
        let in_bounds = it.offsets.len() == global.len()
            && it.sizes.len() == global.len()
            && it
                .offsets
                .iter()
                .zip(it.sizes.iter())
                .zip(global.iter())
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
        if it.whole_rows && !it.sizes.is_empty() && it.sizes.iter().product::<u64>() > 0 {
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
        match boxes.get(it.offsets.as_ref()) {
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
                boxes.insert(it.offsets.as_ref(), (*rank, it));
            }
        }
    }
    // 3. exact tiling: unique boxes pairwise disjoint and covering the volume exactly
    let unique: Vec<Piece> = boxes
        .iter()
        .map(|(off, (r, it))| Piece { offsets: off.to_vec(), sizes: it.sizes.to_vec(), owner: format!("rank {r}") })
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

fn push_order_violation(v: &mut Vec<Violation>, rank: u64, before: &str, after: &str) {
    push(
        v,
        Invariant::Determinism,
        after,
        format!(
            "rank-divergent key order: rank {rank} lists `{after}` after `{before}`; every rank must list keys in the same sorted order"
        ),
    );
}

/// Every (tp rank, fsdp rank) of the key's group must list the key, possibly empty.
fn check_key_set(key: &str, items: &[(u64, &WriteItem)], v: &mut Vec<Violation>) {
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

/// The non-empty chunks of a key, as a set.
fn chunk_set(items: &[(u64, &WriteItem)]) -> BTreeSet<(Vec<u64>, Vec<u64>)> {
    items
        .iter()
        .filter(|(_, it)| it.sizes.iter().product::<u64>() > 0)
        .map(|(_, it)| (it.offsets.to_vec(), it.sizes.to_vec()))
        .collect()
}

/// Invariant 9: the optimizer states of `param` (`param_items`: its items, `None` if it does not
/// exist) have both Adam moments and the parameter's global shape and chunk list. `state_items`
/// gives a state's items.
fn check_parameter_states<'s>(
    param: &str,
    param_items: Option<&[(u64, &WriteItem)]>,
    states: &[&'s str],
    v: &mut Vec<Violation>,
    state_items: impl Fn(&'s str) -> Option<Vec<(u64, WriteItem<'s>)>>,
) {
    let Some(param_items) = param_items else {
        push(
            v,
            Invariant::OptimizerParity,
            param,
            format!("optimizer states {states:?} exist but the parameter does not"),
        );
        return;
    };
    let p_global = &param_items[0].1.global_shape;
    let p_chunks = chunk_set(param_items);
    for suffix in ["exp_avg", "exp_avg_sq"] {
        // `fsdp_dtensor` names a moment `<param>.<state>`, `torch_dist` `optimizer.state.<state>.<param>`.
        let named =
            |s: &str| s.ends_with(&format!(".{suffix}")) || s.starts_with(&format!("optimizer.state.{suffix}."));
        if !states.iter().any(|s| named(s)) {
            push(v, Invariant::OptimizerParity, param, format!("has optimizer state but no `{suffix}`"));
        }
    }
    for s in states {
        let Some(owned) = state_items(s) else { continue };
        let items: Vec<(u64, &WriteItem)> = owned.iter().map(|(r, it)| (*r, it)).collect();
        let s_global = &items[0].1.global_shape;
        if s_global != p_global {
            let chunks = chunk_set(&items)
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
        } else if chunk_set(&items) != p_chunks {
            push(v, Invariant::OptimizerParity, s, format!("chunk list differs from its parameter `{param}`"));
        }
    }
}

/// Index in `…weight{g}…` (or `…bias{g}…`, gpt-oss's expert biases) of an expert key.
fn expert_index(key: &str) -> Option<(String, u64)> {
    let (at, name) = [".weight", ".bias"].iter().filter_map(|n| key.rfind(n).map(|at| (at, n))).max()?;
    let pos = at + name.len();
    let digits: String = key[pos..].chars().take_while(char::is_ascii_digit).collect();
    let g = digits.parse().ok()?;
    Some((format!("{}{{E}}{}", &key[..pos], &key[pos + digits.len()..]), g))
}

/// Invariant 11: every expert of every expert parameter is present under its global index, owned
/// by the EP rank that holds it; fed one key at a time.
struct ExpertCoverage {
    num_experts: u64,
    ep: u64,
    stems: BTreeMap<String, BTreeSet<u64>>,
}

impl ExpertCoverage {
    fn new(num_experts: u64, ep: u64) -> Self {
        ExpertCoverage { num_experts, ep, stems: BTreeMap::new() }
    }

    fn enabled(&self) -> bool {
        self.num_experts > 0 && self.ep > 0
    }

    fn observe(&mut self, key: &str, items: &[(u64, &WriteItem)], v: &mut Vec<Violation>) {
        if !self.enabled() {
            return;
        }
        let Group::Expert { expert, ep_rank } = items[0].1.group else {
            return;
        };
        match expert_index(key) {
            Some((stem, g)) if g == expert => {
                self.stems.entry(stem).or_default().insert(g);
            }
            _ => push(
                v,
                Invariant::ExpertCoverage,
                key,
                format!("key does not carry the global expert index {expert} (a local index leaked to disk?)"),
            ),
        }
        let per_rank = self.num_experts / self.ep;
        if per_rank > 0 && ep_rank != expert / per_rank {
            push(
                v,
                Invariant::ExpertCoverage,
                key,
                format!(
                    "expert {expert} is owned by EP rank {ep_rank}, expected {} (= {expert} / ({}/{}))",
                    expert / per_rank,
                    self.num_experts,
                    self.ep
                ),
            );
        }
    }

    fn finish(self, v: &mut Vec<Violation>) {
        for (stem, seen) in self.stems {
            let missing: Vec<u64> = (0..self.num_experts).filter(|g| !seen.contains(g)).collect();
            if !missing.is_empty() {
                push(v, Invariant::ExpertCoverage, &stem, format!("experts {} are missing", list(&missing)));
            }
        }
    }
}

/// `shape` permuted by `perm` (`perm[i]` = source dim of output dim `i`).
pub fn permuted(shape: &[u64], perm: &[usize]) -> Vec<u64> {
    perm.iter().map(|p| shape.get(*p).copied().unwrap_or(0)).collect()
}
