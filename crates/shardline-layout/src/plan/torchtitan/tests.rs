//! The torchtitan seed planner's names, permutation and placements, by hand-worked examples.

use super::*;

fn llama(tied: bool) -> (ModelConfig, Vec<SourceTensor>) {
    let config = ModelConfig::from_json(&format!(
        r#"{{"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 12, "vocab_size": 10,
            "tie_word_embeddings": {tied}}}"#
    ))
    .expect("config");
    let t = |name: &str, shape: &[u64]| SourceTensor { name: name.into(), dtype: DType::BF16, shape: shape.to_vec() };
    let mut sources = vec![
        t("model.embed_tokens.weight", &[10, 8]),
        t("model.norm.weight", &[8]),
        t("model.layers.0.self_attn.q_proj.weight", &[8, 8]),
        t("model.layers.0.self_attn.k_proj.weight", &[4, 8]),
        t("model.layers.0.self_attn.v_proj.weight", &[4, 8]),
        t("model.layers.0.self_attn.o_proj.weight", &[8, 8]),
        t("model.layers.0.mlp.gate_proj.weight", &[12, 8]),
        t("model.layers.0.mlp.up_proj.weight", &[12, 8]),
        t("model.layers.0.mlp.down_proj.weight", &[8, 12]),
        t("model.layers.0.input_layernorm.weight", &[8]),
        t("model.layers.0.post_attention_layernorm.weight", &[8]),
    ];
    if !tied {
        sources.push(t("lm_head.weight", &[10, 8]));
    }
    (config, sources)
}

fn plan(config: &ModelConfig, sources: Vec<SourceTensor>, dp: u64, version: TorchtitanVersion) -> Plan {
    let target = TorchtitanTarget { version, dtype: DType::F32 };
    let options = PlanOptions { prefix: String::new(), dialect: Dialect::Torchtitan(target), ..Default::default() };
    build_plan(config, sources, Mesh { tp: 1, cp: 1, dp, ep: 1, etp: 1 }, &options).expect("plan")
}

#[test]
fn llama_keys_are_torchtitan_s_and_q_k_rows_are_rope_permuted() {
    let (config, sources) = llama(false);
    let p = plan(&config, sources, 3, TorchtitanVersion::Main);
    let keys: Vec<&str> = p.tensors.iter().map(|t| t.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "layers.0.attention.qkv_linear.wk.weight",
            "layers.0.attention.qkv_linear.wq.weight",
            "layers.0.attention.qkv_linear.wv.weight",
            "layers.0.attention.wo.weight",
            "layers.0.attention_norm.weight",
            "layers.0.feed_forward.w1.weight",
            "layers.0.feed_forward.w2.weight",
            "layers.0.feed_forward.w3.weight",
            "layers.0.ffn_norm.weight",
            "lm_head.weight",
            "norm.weight",
            "tok_embeddings.weight",
        ]
    );
    assert!(p.tensors.iter().all(|t| t.dtype == DType::F32));
    // q: 2 heads of 4 rows, half 2: torchtitan rows (0,1,2,3) are HF rows (0,2,1,3) per head.
    let q = p.tensors.iter().find(|t| t.key.ends_with("wq.weight")).expect("wq");
    let rows: Vec<u64> = q.recipe.iter().map(|b| b.source.expect("source").1).collect();
    assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
    assert!(q.recipe.iter().all(|b| b.transform == Transform::Cast(DType::BF16) && b.rows == 1));
    // FSDP2 Shard(0) over 3 ranks: torch.chunk's ceil-sized pieces, the last short.
    let w1 = p.tensors.iter().find(|t| t.key.ends_with("w1.weight")).expect("w1");
    let pieces: Vec<(u64, u64, Vec<u64>)> =
        w1.chunks(&p.mesh).map(|c| (c.rank, c.offsets[0], c.sizes.clone())).collect();
    assert_eq!(pieces, [(0, 0, vec![4, 8]), (1, 4, vec![4, 8]), (2, 8, vec![4, 8])]);
    let norm = p.tensors.iter().find(|t| t.key == "norm.weight").expect("norm");
    let sizes: Vec<u64> = norm.chunks(&p.mesh).map(|c| c.sizes[0]).collect();
    assert_eq!(sizes, [3, 3, 2]);
}

#[test]
fn tied_embeddings_give_the_output_projection_the_embedding_and_old_names_are_kept() {
    let (config, sources) = llama(true);
    let p = plan(&config, sources, 1, TorchtitanVersion::V2025_12);
    let output = p.tensors.iter().find(|t| t.key == "output.weight").expect("output");
    let embed = p.tensors.iter().find(|t| t.key == "tok_embeddings.weight").expect("embed");
    assert_eq!(output.recipe, embed.recipe);
    assert!(p.tensors.iter().any(|t| t.key == "layers.0.attention.wq.weight"));
}

#[test]
fn what_torchtitan_cannot_take_is_refused_with_the_reason() {
    let (config, mut sources) = llama(false);
    sources.push(SourceTensor {
        name: "model.layers.0.self_attn.q_proj.bias".into(),
        dtype: DType::BF16,
        shape: vec![8],
    });
    let target = Dialect::Torchtitan(TorchtitanTarget::default());
    let options = PlanOptions { dialect: target, ..Default::default() };
    let errors = build_plan(&config, sources.clone(), Mesh { tp: 1, cp: 1, dp: 2, ep: 1, etp: 1 }, &options)
        .expect_err("a bias torchtitan's llama3 has no place for");
    assert!(errors.iter().any(|e| e.to_string().contains("q_proj.bias")), "{errors:?}");
    sources.pop();
    let errors =
        build_plan(&config, sources.clone(), Mesh { tp: 1, cp: 2, dp: 1, ep: 1, etp: 1 }, &options).expect_err("cp");
    assert!(
        errors.iter().any(|e| e.to_string().contains("context parallelism keeps no parameter shard")),
        "{errors:?}"
    );
    // 3 does not divide the vocabulary (10 rows) TP splits.
    let errors = build_plan(&config, sources, Mesh { tp: 3, cp: 1, dp: 1, ep: 1, etp: 3 }, &options).expect_err("tp");
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("`tok_embeddings.weight`: tp = 3 does not divide dim 0 of [10, 8]")),
        "{errors:?}"
    );
}

/// `(rank, offsets, sizes)` of `key`'s written chunks, by rank.
fn placed(p: &Plan, key: &str) -> Vec<(u64, Vec<u64>, Vec<u64>)> {
    let t = p.tensors.iter().find(|t| t.key == key).expect(key);
    let mut out: Vec<_> = t.chunks(&p.mesh).filter(|c| c.written).map(|c| (c.rank, c.offsets, c.sizes)).collect();
    out.sort();
    out
}

#[test]
fn under_tp_colwise_keys_are_strided_rowwise_keys_split_columns_and_replicas_are_written_once() {
    let (config, sources) = llama(false);
    let target = Dialect::Torchtitan(TorchtitanTarget::default());
    let options = PlanOptions { prefix: String::new(), dialect: target, ..Default::default() };
    // The CLI's default etp is tp; torchtitan has none, so it is taken as 1.
    let p = build_plan(&config, sources, Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 2 }, &options).expect("plan");
    assert_eq!(p.world(), 4);
    // Colwise `Shard(0)` then FSDP2: `[_StridedShard(0, sf=2), Shard(0)]`: rank `2j + r` holds
    // piece j of TP rank r's 4 rows.
    let v = |o: [u64; 2], s: [u64; 2]| (o.to_vec(), s.to_vec());
    let wq: Vec<_> = placed(&p, "layers.0.attention.qkv_linear.wq.weight");
    let expect = [(0, v([0, 0], [2, 8])), (1, v([4, 0], [2, 8])), (2, v([2, 0], [2, 8])), (3, v([6, 0], [2, 8]))];
    assert_eq!(wq, expect.map(|(r, (o, s))| (r, o, s)));
    // Rowwise `Shard(1)`: `[Shard(0), Shard(1)]`.
    let wo = placed(&p, "layers.0.attention.wo.weight");
    let expect = [(0, v([0, 0], [4, 4])), (1, v([0, 4], [4, 4])), (2, v([4, 0], [4, 4])), (3, v([4, 4], [4, 4]))];
    assert_eq!(wo, expect.map(|(r, (o, s))| (r, o, s)));
    // The vocabulary is colwise too: 10 rows, 5 per TP rank, pieces of 3 and 2.
    let embed = placed(&p, "tok_embeddings.weight");
    let expect = [(0, v([0, 0], [3, 8])), (1, v([5, 0], [3, 8])), (2, v([3, 0], [2, 8])), (3, v([8, 0], [2, 8]))];
    assert_eq!(embed, expect.map(|(r, (o, s))| (r, o, s)));
    // A norm is replicated over TP: each FSDP piece written by one rank of its TP pair.
    let norm = placed(&p, "norm.weight");
    assert_eq!(norm.len(), 2, "{norm:?}");
    assert_eq!(norm.iter().map(|(_, o, s)| (o[0], s[0])).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
    assert!(norm[0].0 < 2 && norm[1].0 >= 2, "{norm:?}");
    // Every byte exactly once.
    let total: u64 = p.bytes_per_rank().iter().sum();
    assert_eq!(total, p.tensors.iter().map(OutputTensor::nbytes).sum::<u64>());
}

fn qwen3_moe(experts: u64) -> (ModelConfig, Vec<SourceTensor>) {
    let config = ModelConfig::from_json(&format!(
        r#"{{"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 12, "moe_intermediate_size": 6,
            "num_experts": {experts}, "num_experts_per_tok": 2, "vocab_size": 16, "tie_word_embeddings": false}}"#
    ))
    .expect("config");
    let t = |name: String, shape: &[u64]| SourceTensor { name, dtype: DType::BF16, shape: shape.to_vec() };
    let mut sources: Vec<SourceTensor> = [
        ("model.embed_tokens.weight", vec![16, 8]),
        ("lm_head.weight", vec![16, 8]),
        ("model.norm.weight", vec![8]),
        ("model.layers.0.self_attn.q_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.k_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.v_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.o_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.q_norm.weight", vec![4]),
        ("model.layers.0.self_attn.k_norm.weight", vec![4]),
        ("model.layers.0.input_layernorm.weight", vec![8]),
        ("model.layers.0.post_attention_layernorm.weight", vec![8]),
        ("model.layers.0.mlp.gate.weight", vec![experts, 8]),
    ]
    .into_iter()
    .map(|(n, s)| t(n.to_string(), &s))
    .collect();
    for e in 0..experts {
        for (proj, shape) in [("gate_proj", [6, 8]), ("up_proj", [6, 8]), ("down_proj", [8, 6])] {
            sources.push(t(format!("model.layers.0.mlp.experts.{e}.{proj}.weight"), &shape));
        }
    }
    (config, sources)
}

#[test]
fn routed_experts_are_tp_split_on_dims_1_and_2_without_ep_and_leave_tp_under_ep() {
    let target = Dialect::Torchtitan(TorchtitanTarget::default());
    let options = PlanOptions { prefix: String::new(), dialect: target, ..Default::default() };
    let (config, sources) = qwen3_moe(4);
    let p = build_plan(&config, sources, Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 1 }, &options).expect("plan");
    // w1_EFD [4, 6, 8]: TP `Shard(1)`, FSDP2 `Shard(0)` of the experts.
    let w1 = placed(&p, "layers.0.moe.routed_experts.inner_experts.w1_EFD");
    let expect =
        [(0, [0, 0, 0], [2, 3, 8]), (1, [0, 3, 0], [2, 3, 8]), (2, [2, 0, 0], [2, 3, 8]), (3, [2, 3, 0], [2, 3, 8])];
    assert_eq!(w1, expect.map(|(r, o, s)| (r, o.to_vec(), s.to_vec())));
    // w2_EDF [4, 8, 6]: TP `Shard(2)`.
    let w2 = placed(&p, "layers.0.moe.routed_experts.inner_experts.w2_EDF");
    let expect =
        [(0, [0, 0, 0], [2, 8, 3]), (1, [0, 0, 3], [2, 8, 3]), (2, [2, 0, 0], [2, 8, 3]), (3, [2, 0, 3], [2, 8, 3])];
    assert_eq!(w2, expect.map(|(r, o, s)| (r, o.to_vec(), s.to_vec())));
    // With more FSDP ranks than experts FSDP2 cuts dim 1: within the TP block for w1.
    let (config, sources) = qwen3_moe(2);
    let p = build_plan(&config, sources, Mesh { tp: 2, cp: 1, dp: 3, ep: 1, etp: 1 }, &options).expect("plan");
    let w1 = placed(&p, "layers.0.moe.routed_experts.inner_experts.w1_EFD");
    let expect = [
        (0, [0, 0, 0], [2, 1, 8]),
        (1, [0, 3, 0], [2, 1, 8]),
        (2, [0, 1, 0], [2, 1, 8]),
        (3, [0, 4, 0], [2, 1, 8]),
        (4, [0, 2, 0], [2, 1, 8]),
        (5, [0, 5, 0], [2, 1, 8]),
    ];
    assert_eq!(w1, expect.map(|(r, o, s)| (r, o.to_vec(), s.to_vec())));
    // Under EP the experts span all 4 ranks as (efsdp 2, ep 2), out of TP: rank i holds
    // slab i mod 2, its efsdp piece i div 2 along dim 0.
    let (config, sources) = qwen3_moe(4);
    let p = build_plan(&config, sources, Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 }, &options).expect("plan");
    let w2 = placed(&p, "layers.0.moe.routed_experts.inner_experts.w2_EDF");
    let expect =
        [(0, [0, 0, 0], [1, 8, 6]), (1, [2, 0, 0], [1, 8, 6]), (2, [1, 0, 0], [1, 8, 6]), (3, [3, 0, 0], [1, 8, 6])];
    assert_eq!(w2, expect.map(|(r, o, s)| (r, o.to_vec(), s.to_vec())));
    let total: u64 = p.bytes_per_rank().iter().sum();
    assert_eq!(total, p.tensors.iter().map(OutputTensor::nbytes).sum::<u64>());
}

#[test]
fn tp_splits_follow_torchtitan_s_sharding_configs_under_every_version_s_names() {
    use super::tp::tp_split;
    for (key, split) in [
        ("tok_embeddings.weight", Some(0)),
        ("output.weight", Some(0)),
        ("layers.3.attention.wq.weight", Some(0)),
        ("layers.3.attention.qkv_linear.wk.weight", Some(0)),
        ("layers.3.attention.qkv_linear.wqkv.weight", Some(0)),
        ("layers.3.attention.wq_a.weight", None),
        ("layers.3.attention.wkv_b.weight", Some(0)),
        ("layers.3.attention.wo.weight", Some(1)),
        ("layers.3.attention.wo.bias", None),
        ("layers.3.attention.qkv_linear.wv.bias", Some(0)),
        ("layers.3.attention.sinks", Some(0)),
        ("layers.3.attention_norm.weight", None),
        ("layers.3.feed_forward.w2.weight", Some(1)),
        ("layers.3.moe.router.gate.weight", None),
        ("layers.3.moe.experts.w1", Some(1)),
        ("layers.3.moe.experts.w2_EDF", Some(2)),
        ("layers.3.moe.routed_experts.inner_experts.w3_EFD", Some(1)),
        ("layers.3.moe.routed_experts.inner_experts.mlp1_bias_EG", Some(1)),
        ("layers.3.moe.routed_experts.inner_experts.mlp2_weight_EDF", Some(2)),
        ("layers.3.moe.routed_experts.inner_experts.mlp2_bias_ED", None),
        ("layers.3.moe.shared_experts.w2.weight", Some(1)),
        ("layers.3.moe.expert_bias_E", None),
    ] {
        assert_eq!(tp_split(key), split, "{key}");
    }
}
