//! A `torch_dist` checkpoint's `_extra_state` objects: a module stacked over layers (or experts)
//! has one `ShardedObject` per index, `<module>._extra_state/shard_<offsets>_<shape>`, and
//! Megatron-Core's load requests every one of them. Which modules have them depends on the layer
//! spec the checkpoint was saved with (Transformer Engine or local), so a module without any is
//! not a finding; a module with some but not all is.

use std::collections::{BTreeMap, BTreeSet};

/// `(offsets, shape)` of a `shard_<o1.o2…>_<s1.s2…>` suffix.
fn grid_point(shard: &str) -> Option<(Vec<u64>, Vec<u64>)> {
    let (offsets, shape) = shard.split_once('_')?;
    let parse = |s: &str| s.split('.').map(|n| n.parse::<u64>().ok()).collect::<Option<Vec<u64>>>();
    let (offsets, shape) = (parse(offsets)?, parse(shape)?);
    (offsets.len() == shape.len()).then_some((offsets, shape))
}

/// The `_extra_state` objects missing from the grids of the modules that have some: `(key,
/// message)`, sorted.
pub fn extra_state_gaps<'k>(keys: impl Iterator<Item = &'k str>) -> Vec<(String, String)> {
    let mut grids: BTreeMap<&str, (Vec<u64>, BTreeSet<Vec<u64>>)> = BTreeMap::new();
    for key in keys {
        let Some((base, shard)) = key.split_once("/shard_") else { continue };
        if !base.ends_with("._extra_state") {
            continue;
        }
        let Some((offsets, shape)) = grid_point(shard) else { continue };
        let grid = grids.entry(base).or_insert_with(|| (shape.clone(), BTreeSet::new()));
        if grid.0 == shape {
            grid.1.insert(offsets);
        }
    }
    let mut gaps = Vec::new();
    for (base, (shape, present)) in grids {
        let total: u64 = shape.iter().product();
        if present.len() as u64 == total || total > 1 << 20 {
            continue;
        }
        let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
        for i in 0..total {
            let mut rest = i;
            let mut at = vec![0; shape.len()];
            for (d, n) in shape.iter().enumerate().rev() {
                at[d] = rest % n;
                rest /= n;
            }
            if !present.contains(&at) {
                gaps.push((
                    format!("{base}/shard_{}_{}", join(&at), join(&shape)),
                    format!(
                        "missing: {} of the {total} `_extra_state` objects of this module are stored, and \
                         Megatron-Core's load requests every one",
                        present.len()
                    ),
                ));
            }
        }
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_missing_one_layers_object_is_named() {
        let keys = [
            "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2",
            "decoder.layers.mlp.linear_fc2._extra_state/shard_0_2",
            "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2",
            "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.1_2.2",
            "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_0.0_2.2",
            "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.0_2.2",
            "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.1_2.2",
            "output_layer._extra_state/shard_0_1",
            "common_state/shard_0_1",
            "decoder.layers.mlp.linear_fc1.weight",
        ];
        let gaps = extra_state_gaps(keys.into_iter());
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert_eq!(gaps[0].0, "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2");
        assert!(gaps[0].1.contains("1 of the 2"), "{}", gaps[0].1);
    }
}
