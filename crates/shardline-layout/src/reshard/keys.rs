//! What an item of a training checkpoint is, read from its `planner_data` path (the nested
//! state-dict keys DCP flattened), never from splitting its flat key on dots: parameter names
//! hold dots themselves.

use std::fmt;

/// One component of a `planner_data` path: a dict key or a list index.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathElem {
    Key(String),
    Index(u64),
}

impl fmt::Display for PathElem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathElem::Key(k) => f.write_str(k),
            PathElem::Index(i) => write!(f, "{i}"),
        }
    }
}

/// The flat key DCP gives a path: its parts joined with dots.
pub fn flat_key(path: &[PathElem]) -> String {
    path.iter().map(ToString::to_string).collect::<Vec<_>>().join(".")
}

/// What an item of a Megatron `fsdp_dtensor` training checkpoint holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ItemKind {
    /// `model` → `module.<name>`: a parameter, a section of one, or a buffer.
    Model { name: String },
    /// `optimizer` → `state` → `module.module.module.<name>` → `<state>` (`exp_avg`, `exp_avg_sq`,
    /// `step`).
    OptimizerState { name: String, state: String },
    /// `optimizer` → `param_to_group_meta` → … : a parameter group's settings, Adam's `step`
    /// among them, under the live (unsplit) parameter name.
    GroupMeta,
    /// `rng_state` → `(pp, tp)` → …: one pipeline and tensor-parallel rank's random state.
    Rng { pp: u64, tp: u64 },
    /// `args`: the training job's pickled arguments.
    Args,
    /// Items the same on every rank and mesh (`iteration`, `checkpoint_version`,
    /// `opt_param_scheduler.*`, `num_floating_point_operations_so_far`): carried as they are.
    Carried,
    /// Anything else: carried as it is, and reported.
    Unknown,
}

/// Top-level items carried unchanged.
const CARRIED: &[&str] =
    &["iteration", "checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far"];

fn key(e: &PathElem) -> Option<&str> {
    match e {
        PathElem::Key(k) => Some(k),
        PathElem::Index(_) => None,
    }
}

/// `name` without the `module.` prefixes of its wrappers (MegatronFSDP, Float16Module, DDP).
pub fn strip_modules(mut name: &str) -> &str {
    while let Some(rest) = name.strip_prefix("module.") {
        name = rest;
    }
    name
}

/// The joined keys of `parts` (a name nested deeper than Megatron nests it).
fn joined(parts: &[PathElem]) -> Option<String> {
    let keys: Option<Vec<&str>> = parts.iter().map(key).collect();
    keys.filter(|k| !k.is_empty()).map(|k| k.join("."))
}

/// Parses `(pp, tp)` as Megatron keys its RNG states.
pub fn parse_rng_rank(part: &str) -> Option<(u64, u64)> {
    let inner = part.strip_prefix('(')?.strip_suffix(')')?;
    let (pp, tp) = inner.split_once(',')?;
    Some((pp.trim().parse().ok()?, tp.trim().parse().ok()?))
}

/// The `(pp, tp)` key part of an RNG state, as Megatron writes it.
pub fn rng_rank_part(pp: u64, tp: u64) -> String {
    format!("({pp}, {tp})")
}

/// What the item at `path` is.
pub fn classify(path: &[PathElem]) -> ItemKind {
    let Some(top) = path.first().and_then(key) else { return ItemKind::Unknown };
    match top {
        "model" => match joined(&path[1..]) {
            Some(name) => ItemKind::Model { name: strip_modules(&name).to_string() },
            None => ItemKind::Unknown,
        },
        "optimizer" => match path.get(1).and_then(key) {
            Some("state") if path.len() >= 4 => match (joined(&path[2..path.len() - 1]), key(&path[path.len() - 1])) {
                (Some(name), Some(state)) => {
                    ItemKind::OptimizerState { name: strip_modules(&name).to_string(), state: state.to_string() }
                }
                _ => ItemKind::Unknown,
            },
            Some("param_to_group_meta") => ItemKind::GroupMeta,
            _ => ItemKind::Unknown,
        },
        "rng_state" => match path.get(1).and_then(key).and_then(parse_rng_rank) {
            Some((pp, tp)) => ItemKind::Rng { pp, tp },
            None => ItemKind::Unknown,
        },
        "args" if path.len() == 1 => ItemKind::Args,
        t if CARRIED.contains(&t) => ItemKind::Carried,
        _ => ItemKind::Unknown,
    }
}

/// What the item keyed `key` is in Megatron-Core's `torch_dist` dialect, where the key is the
/// `ShardedTensor`'s own (model parameters bare, `decoder.layers.…`; fully reshardable optimizer
/// states `optimizer.state.<state>.<parameter>`) or a `ShardedObject`'s
/// `<key>/shard_<offsets>_<shape>` (RNG `rng_state/shard_<pp>.<tp>_<PP>.<TP>`, modules'
/// `_extra_state`, the common and rerun states).
pub fn classify_torch_dist(key: &str) -> ItemKind {
    if let Some((state, name)) = key.strip_prefix("optimizer.state.").and_then(|r| r.split_once('.')) {
        return ItemKind::OptimizerState { name: name.to_string(), state: state.to_string() };
    }
    if let Some(shard) = key.strip_prefix("rng_state/shard_") {
        let offsets = shard.split('_').next().unwrap_or_default();
        let mut at = offsets.split('.').map(|n| n.parse::<u64>().ok());
        return match (at.next().flatten(), at.next().flatten()) {
            (Some(pp), Some(tp)) => ItemKind::Rng { pp, tp },
            _ => ItemKind::Unknown,
        };
    }
    let object = key.split_once("/shard_").map(|(k, _)| k);
    match object {
        Some(k) if k.ends_with("._extra_state") || k == "common_state" || k == "rerun_state_machine_state" => {
            ItemKind::Carried
        }
        Some(_) => ItemKind::Unknown,
        // Distributed-optimizer buckets (`optimizer.distributed.…`) have no parameter to follow.
        None if key.starts_with("optimizer.") => ItemKind::Unknown,
        None => ItemKind::Model { name: key.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_dist_keys_as_megatron_core_names_them() {
        let model = |n: &str| ItemKind::Model { name: n.to_string() };
        assert_eq!(
            classify_torch_dist("decoder.layers.mlp.linear_fc1.weight"),
            model("decoder.layers.mlp.linear_fc1.weight")
        );
        assert_eq!(
            classify_torch_dist("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"),
            ItemKind::OptimizerState { name: "decoder.layers.mlp.linear_fc1.weight".into(), state: "exp_avg".into() }
        );
        assert_eq!(classify_torch_dist("rng_state/shard_0.1_1.2"), ItemKind::Rng { pp: 0, tp: 1 });
        assert_eq!(classify_torch_dist("decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"), ItemKind::Carried);
        assert_eq!(classify_torch_dist("common_state/shard_0_1"), ItemKind::Carried);
        assert_eq!(
            classify_torch_dist("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg"),
            ItemKind::Unknown
        );
        assert_eq!(classify_torch_dist("something/shard_0_1"), ItemKind::Unknown);
    }

    fn p(parts: &[&str]) -> Vec<PathElem> {
        parts
            .iter()
            .map(|s| match s.parse::<u64>() {
                Ok(i) => PathElem::Index(i),
                Err(_) => PathElem::Key(s.to_string()),
            })
            .collect()
    }

    #[test]
    fn megatron_paths_classify() {
        assert_eq!(
            classify(&p(&["model", "module.decoder.layers.0.mlp.linear_fc1.weight_w"])),
            ItemKind::Model { name: "decoder.layers.0.mlp.linear_fc1.weight_w".into() }
        );
        assert_eq!(
            classify(&p(&["optimizer", "state", "module.module.module.output_layer.weight", "exp_avg_sq"])),
            ItemKind::OptimizerState { name: "output_layer.weight".into(), state: "exp_avg_sq".into() }
        );
        assert_eq!(
            classify(&p(&["optimizer", "param_to_group_meta", "module.module.module.output_layer.weight", "step"])),
            ItemKind::GroupMeta
        );
        assert_eq!(classify(&p(&["rng_state", "(0, 3)", "0", "random_rng_state"])), ItemKind::Rng { pp: 0, tp: 3 });
        assert_eq!(classify(&p(&["args"])), ItemKind::Args);
        assert_eq!(classify(&p(&["opt_param_scheduler", "max_lr"])), ItemKind::Carried);
        assert_eq!(classify(&p(&["rerun_state_machine", "x"])), ItemKind::Unknown);
    }

    #[test]
    fn flat_keys_join_with_dots() {
        assert_eq!(flat_key(&p(&["rng_state", "(0, 1)", "0", "np_rng_state"])), "rng_state.(0, 1).0.np_rng_state");
    }
}
