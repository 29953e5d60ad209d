//! Checks of a resolved pipeline that follow from a shard step's `target` (the checkpoint
//! dialect): what a `torch_dist` shard cannot be combined with.

use std::collections::BTreeMap;

use crate::diagnostic::Diagnostic;
use crate::lint::join;
use crate::model::{Locations, OutputFormatName, ResolvedStep, StepConfig, StepKind, StepSpec};

/// What a `torch_dist` shard step cannot combine with: the DCP-safetensors format, optimizer
/// state (not written for torch_dist yet), a `megatron.split_fused` after it (torch_dist keeps
/// SwiGLU fc1 whole as `[gate; up]`).
pub(crate) fn check_targets(
    steps: &[(usize, &StepSpec)],
    resolved: &BTreeMap<String, ResolvedStep>,
    loc: &Locations,
    file: &str,
    diags: &mut Vec<Diagnostic>,
) {
    let torch_dist = |id: &str| matches!(resolved.get(id).map(|r| &r.config), Some(StepConfig::MegatronShard { target, .. }) if target == "torch_dist");
    for (index, spec) in steps {
        let base = format!("steps[{index}]");
        let mut push = |field: &str, code: &str, message: String, hint: &str| {
            let path = join(&base, field);
            diags.push(Diagnostic::at(file, loc.span(&path), &path, code, message).with_hint(hint));
        };
        match resolved.get(&spec.id).map(|r| &r.config) {
            Some(StepConfig::MegatronShard { target, format, optimizer_state, .. }) if target == "torch_dist" => {
                if *format == OutputFormatName::DcpSafetensors {
                    push(
                        "with.format",
                        "target",
                        format!("step `{}`: `target: torch_dist` is a DCP checkpoint; `format: dcp-safetensors` does not apply", spec.id),
                        "remove `format`, or use `target: fsdp_dtensor`",
                    );
                }
                if *optimizer_state {
                    push(
                        "with.optimizer_state",
                        "target",
                        format!(
                            "step `{}`: a `target: torch_dist` seed is a release checkpoint, and Megatron-LM never reads \
                             optimizer state from one",
                            spec.id
                        ),
                        "remove `optimizer_state`: the fresh optimizer Megatron-LM builds on load holds the same zero \
                         moments and fp32 masters",
                    );
                }
            }
            _ if spec.kind == StepKind::MegatronSplitFused && spec.needs.iter().any(|n| torch_dist(n)) => push(
                "needs",
                "target",
                format!("step `{}`: `megatron.split_fused` follows a `target: torch_dist` shard, which keeps SwiGLU fc1 whole as `[gate; up]` by definition", spec.id),
                "remove this step: torch_dist has nothing to split",
            ),
            _ => {}
        }
    }
}
