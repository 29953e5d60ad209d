//! A `torch_dist` optimizer's `param_groups` (settings without their parameters) given back to
//! each parameter, as Megatron-FSDP's `param_to_group_meta` keeps them.
//!
//! `torch_dist` saves the groups only; which parameter was in which group follows from the rule
//! Megatron-Core built them by (`_get_param_groups`, torch-dist.md §3.2): a bias or a 1-D
//! parameter has no weight decay (`wd_mult` 0), every other one `wd_mult` 1, and routed experts'
//! parameters are in the expert-parallel groups. A parameter is given the one saved group with
//! its `(wd_mult, is_expert_parallel)`; when the groups cannot be told apart that way (per-name
//! learning-rate scales, a decoupled embedding rate), the translation is refused, not guessed.

use crate::pickle::Value;

/// The saved groups: `common["optimizer"]` of a `fully_reshardable` save, one optimizer's dict
/// or a `ChainedOptimizer`'s `{0: …, 1: …}`.
pub(super) fn saved_groups(optimizer: &Value) -> Result<Vec<&[(Value, Value)]>, String> {
    let entries = optimizer.as_dict().ok_or("the common state's `optimizer` is not a dict")?;
    let mut all = Vec::new();
    if entries.iter().all(|(k, _)| matches!(k, Value::Int(_))) {
        for (_, sub) in entries {
            groups_of(sub, &mut all)?;
        }
    } else {
        groups_of(optimizer, &mut all)?;
    }
    Ok(all)
}

/// The groups of one (sub-)optimizer's saved dict, appended to `out`.
fn groups_of<'v>(sub: &'v Value, out: &mut Vec<&'v [(Value, Value)]>) -> Result<(), String> {
    let kind = sub.dict_get("param_state_sharding_type").and_then(Value::as_str);
    if kind != Some("fully_reshardable") {
        return Err(format!(
            "the optimizer was saved as {}, not `fully_reshardable`: its state is not per parameter",
            kind.map_or("(no param_state_sharding_type)".to_string(), |k| format!("`{k}`"))
        ));
    }
    let groups = sub
        .dict_get("optimizer")
        .and_then(|o| o.dict_get("param_groups"))
        .and_then(Value::as_seq)
        .ok_or("the optimizer has no `optimizer.param_groups` list")?;
    for g in groups {
        out.push(g.as_dict().ok_or("a param group is not a dict")?);
    }
    Ok(())
}

fn field<'g>(group: &'g [(Value, Value)], name: &str) -> Option<&'g Value> {
    group.iter().rev().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}

fn number(v: Option<&Value>) -> Option<f64> {
    match v? {
        Value::Float(f) => Some(*f),
        Value::Int(i) => Some(*i as f64),
        _ => None,
    }
}

/// The saved group of the parameter `live` (its live, unsplit name) of `ndim` dimensions.
pub(super) fn group_of<'g>(
    groups: &[&'g [(Value, Value)]],
    live: &str,
    ndim: usize,
    expert: bool,
) -> Result<&'g [(Value, Value)], String> {
    let wd_mult = if live.ends_with(".bias") || ndim == 1 { 0.0 } else { 1.0 };
    // Saved at EP 1, experts were not expert-parallel: their groups are the dense ones.
    let expert = expert && groups.iter().any(|g| field(g, "is_expert_parallel") == Some(&Value::Bool(true)));
    let matching: Vec<&&[(Value, Value)]> = groups
        .iter()
        .filter(|g| {
            number(field(g, "wd_mult")) == Some(wd_mult)
                && field(g, "is_expert_parallel").is_none_or(|v| *v == Value::Bool(expert))
        })
        .collect();
    match matching.as_slice() {
        [one] => Ok(one),
        [] => Err(format!(
            "no saved param group has wd_mult {wd_mult} and is_expert_parallel {expert}, the group Megatron-Core puts `{live}` in"
        )),
        many => Err(format!(
            "{} saved param groups have wd_mult {wd_mult} and is_expert_parallel {expert} (per-parameter learning-rate \
             overrides?), so which one holds `{live}` is not known; not guessed",
            many.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(wd: f64, expert: bool, lr: f64) -> Value {
        let s = |k: &str| Value::Str(k.to_string());
        Value::Dict(vec![
            (s("wd_mult"), Value::Float(wd)),
            (s("is_expert_parallel"), Value::Bool(expert)),
            (s("lr"), Value::Float(lr)),
        ])
    }

    fn sub(groups: Vec<Value>) -> Value {
        let s = |k: &str| Value::Str(k.to_string());
        Value::Dict(vec![
            (s("optimizer"), Value::Dict(vec![(s("param_groups"), Value::List(groups))])),
            (s("param_state_sharding_type"), s("fully_reshardable")),
        ])
    }

    #[test]
    fn parameters_find_their_group_by_megatron_cores_rule() {
        let chained = Value::Dict(vec![
            (Value::Int(0), sub(vec![group(0.0, false, 1.0), group(1.0, false, 2.0)])),
            (Value::Int(1), sub(vec![group(1.0, true, 3.0)])),
        ]);
        let groups = saved_groups(&chained).unwrap();
        let lr = |g: &[(Value, Value)]| number(field(g, "lr")).unwrap();
        assert_eq!(lr(group_of(&groups, "decoder.final_layernorm.weight", 1, false).unwrap()), 1.0);
        assert_eq!(lr(group_of(&groups, "decoder.layers.0.self_attention.linear_qkv.bias", 1, false).unwrap()), 1.0);
        assert_eq!(lr(group_of(&groups, "output_layer.weight", 2, false).unwrap()), 2.0);
        assert_eq!(lr(group_of(&groups, "decoder.layers.1.mlp.experts.linear_fc2.weight3", 2, true).unwrap()), 3.0);
        assert!(group_of(&groups, "decoder.layers.1.mlp.router.expert_bias", 1, true)
            .unwrap_err()
            .contains("no saved"));
        let two = sub(vec![group(1.0, false, 1.0), group(1.0, false, 9.0)]);
        let groups = saved_groups(&two).unwrap();
        assert!(group_of(&groups, "output_layer.weight", 2, false).unwrap_err().contains("not guessed"));
        let dp =
            Value::Dict(vec![(Value::Str("param_state_sharding_type".into()), Value::Str("dp_reshardable".into()))]);
        assert!(saved_groups(&dp).unwrap_err().contains("`dp_reshardable`"));
    }
}
