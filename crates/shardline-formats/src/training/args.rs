//! What a training job's `args` (a pickled `argparse.Namespace`) says about the mesh and the
//! model, read leniently: a field that is absent, `None` or not an int is unknown.

use shardline_layout::{DType, Mesh};

use crate::pickle::Value;

/// The fields of `args` resharding and `inspect` use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainingArgs {
    pub tensor_model_parallel_size: Option<u64>,
    pub pipeline_model_parallel_size: Option<u64>,
    pub context_parallel_size: Option<u64>,
    pub expert_model_parallel_size: Option<u64>,
    pub expert_tensor_parallel_size: Option<u64>,
    pub data_parallel_size: Option<u64>,
    pub world_size: Option<u64>,
    pub vocab_size: Option<u64>,
    pub padded_vocab_size: Option<u64>,
    pub make_vocab_size_divisible_by: Option<u64>,
    pub num_experts: Option<u64>,
    pub num_query_groups: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub iteration: Option<u64>,
    /// The dtype the job keeps its model weights in (`--bf16`, `--fp16`; fp32 otherwise).
    pub params_dtype: Option<DType>,
}

/// The attribute dict of an object (a `Namespace`'s `BUILD` state), or a plain dict.
fn fields(v: &Value) -> Option<&[(Value, Value)]> {
    match v {
        Value::Dict(items) => Some(items),
        Value::Object { state: Some(s), .. } | Value::Reduce { state: Some(s), .. } => fields(s),
        _ => None,
    }
}

impl TrainingArgs {
    /// Reads the unpickled `args`.
    pub fn from_value(v: &Value) -> TrainingArgs {
        let items = fields(v).unwrap_or(&[]);
        let get = |name: &str| {
            items
                .iter()
                .rev()
                .find(|(k, _)| k.as_str() == Some(name))
                .and_then(|(_, v)| v.as_int())
                .and_then(|i| u64::try_from(i).ok())
        };
        TrainingArgs {
            tensor_model_parallel_size: get("tensor_model_parallel_size"),
            pipeline_model_parallel_size: get("pipeline_model_parallel_size"),
            context_parallel_size: get("context_parallel_size"),
            expert_model_parallel_size: get("expert_model_parallel_size"),
            expert_tensor_parallel_size: get("expert_tensor_parallel_size"),
            data_parallel_size: get("data_parallel_size"),
            world_size: get("world_size"),
            vocab_size: get("vocab_size"),
            padded_vocab_size: get("padded_vocab_size"),
            make_vocab_size_divisible_by: get("make_vocab_size_divisible_by"),
            num_experts: get("num_experts"),
            num_query_groups: get("num_query_groups").or(get("num_attention_heads")),
            num_attention_heads: get("num_attention_heads"),
            iteration: get("iteration"),
            params_dtype: {
                let flag = |name: &str| items.iter().rev().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
                match (flag("bf16"), flag("fp16")) {
                    (Some(Value::Bool(true)), _) => Some(DType::BF16),
                    (_, Some(Value::Bool(true))) => Some(DType::F16),
                    (Some(Value::Bool(false)), _) | (_, Some(Value::Bool(false))) => Some(DType::F32),
                    _ => None,
                }
            },
        }
    }

    /// The job's mesh, when `args` gives its TP size and either its DP size or its world size.
    /// Megatron leaves the expert-TP size `None` when it equals TP.
    pub fn mesh(&self) -> Option<Mesh> {
        let tp = self.tensor_model_parallel_size?;
        let cp = self.context_parallel_size.unwrap_or(1);
        let pp = self.pipeline_model_parallel_size.unwrap_or(1);
        let dp = match self.data_parallel_size {
            Some(dp) => dp,
            None => self.world_size? / (tp * cp * pp).max(1),
        };
        let ep = self.expert_model_parallel_size.unwrap_or(1);
        let etp = self.expert_tensor_parallel_size.unwrap_or(tp);
        Some(Mesh { tp, cp, dp, ep, etp })
    }
}
