//! Checks of a resolved pipeline that follow from a shard step's `target` (the checkpoint
//! dialect): what a `torch_dist` or `torchtitan` shard cannot be combined with.

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
    let keeps_whole = |id: &str| matches!(resolved.get(id).map(|r| &r.config), Some(StepConfig::MegatronShard { target, .. }) if target == "torch_dist" || target == "torchtitan");
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
            Some(StepConfig::MegatronShard { target, format, optimizer_state, tp, cp, ep, etp, prefix, .. })
                if target == "torchtitan" =>
            {
                if *format == OutputFormatName::DcpSafetensors {
                    push(
                        "with.format",
                        "target",
                        format!("step `{}`: `target: torchtitan` is a DCP checkpoint; `format: dcp-safetensors` does not apply", spec.id),
                        "remove `format`",
                    );
                }
                if *optimizer_state {
                    push(
                        "with.optimizer_state",
                        "target",
                        format!("step `{}`: torchtitan loads its seed `step-0` model-only", spec.id),
                        "remove `optimizer_state`: torchtitan builds its optimizer fresh",
                    );
                }
                if *cp != 1 || (*etp != 1 && etp != tp) {
                    push(
                        "with",
                        "target",
                        format!(
                            "step `{}`: `target: torchtitan` shards over data, tensor and expert parallelism (FSDP2 over dp, TP over tp, routed experts over ep); got cp {cp}, etp {etp}: torchtitan has no expert tensor parallelism, and context parallelism keeps no parameter shard of its own",
                            spec.id
                        ),
                        "set cp to 1 and leave etp out: DCP reshards the seed onto a CP mesh on load",
                    );
                }
                if !prefix.is_empty() {
                    push(
                        "with.prefix",
                        "target",
                        format!("step `{}`: torchtitan's model keys sit at the top level; `prefix` does not apply", spec.id),
                        "remove `prefix`",
                    );
                }
            }
            Some(StepConfig::MegatronShard { target, torchtitan_version, .. })
                if target != "torchtitan" && !torchtitan_version.is_empty() =>
            {
                push(
                    "with.torchtitan_version",
                    "target",
                    format!("step `{}`: `torchtitan_version` applies only to `target: torchtitan`", spec.id),
                    "remove it, or set `target: torchtitan`",
                );
            }
            _ if spec.kind == StepKind::MegatronSplitFused && spec.needs.iter().any(|n| keeps_whole(n)) => push(
                "needs",
                "target",
                format!("step `{}`: `megatron.split_fused` follows a `target: torch_dist` or `target: torchtitan` shard, which has no fused parameters to split (torch_dist keeps SwiGLU fc1 whole as `[gate; up]`, torchtitan never fuses)", spec.id),
                "remove this step: the shard step's output is final",
            ),
            _ => {}
        }
    }
}
