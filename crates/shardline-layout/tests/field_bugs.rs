//! The field's bugs (layouts.md §5, T1–T6) as regression tests with the exact numbers given there.
//! Correct variants come out of our planner; the buggy variants are fed to the validator, which
//! must reject them with messages naming key, offsets and shapes.

use shardline_layout::invariants::permuted;
use shardline_layout::plan::{column_section_rows, fsdp_rows};
use shardline_layout::{
    build_plan, lower, validate, validate_plan, DType, Group, Invariant, Mesh, ModelConfig, Plan, PlanOptions,
    RowBlock, SourceTensor, WriteItem,
};

fn src(name: &str, shape: &[u64]) -> SourceTensor {
    SourceTensor { name: name.to_string(), dtype: DType::BF16, shape: shape.to_vec() }
}

fn plan(config: &str, sources: Vec<SourceTensor>, mesh: Mesh, options: PlanOptions) -> Plan {
    let config = ModelConfig::from_json(config).expect("config");
    build_plan(&config, sources, mesh, &options).unwrap_or_else(|e| panic!("plan: {e:?}"))
}

/// `(row offset, rows)` of `key` for TP rank `r`, FSDP ranks 0..D in order.
fn rows_of_key(plan: &Plan, key: &str, r: u64) -> Vec<(u64, u64)> {
    let t = plan.tensors.iter().find(|t| t.key == key).unwrap_or_else(|| panic!("no key {key}"));
    let mut v: Vec<_> =
        t.chunks(&plan.mesh).filter(|c| c.tp_rank == r).map(|c| (c.fsdp_rank, c.offsets[0], c.sizes[0])).collect();
    v.sort();
    v.into_iter().map(|(_, o, s)| (o, s)).collect()
}

fn no_violations(plan: &Plan, experts: u64) {
    let v = validate(&lower(plan), experts, plan.mesh.ep);
    assert!(v.is_empty(), "unexpected violations: {v:#?}");
    let v = validate_plan(plan, experts, plan.mesh.ep);
    assert!(v.is_empty(), "unexpected violations (key by key): {v:#?}");
}

/// The violations of `plan`, asserting that the key-by-key validator finds exactly what the
/// whole-plan one finds (order aside).
fn violations_agree(plan: &Plan, experts: u64) -> Vec<shardline_layout::Violation> {
    let sorted = |mut v: Vec<shardline_layout::Violation>| {
        v.sort_by(|a, b| (a.invariant, &a.key, &a.message).cmp(&(b.invariant, &b.key, &b.message)));
        v
    };
    let whole = sorted(validate(&lower(plan), experts, plan.mesh.ep));
    let by_key = sorted(validate_plan(plan, experts, plan.mesh.ep));
    assert_eq!(by_key, whole);
    whole
}

#[test]
fn the_key_by_key_validator_reports_what_the_whole_plan_validator_reports() {
    let has = |v: &[shardline_layout::Violation], inv: Invariant| v.iter().any(|x| x.invariant == inv);
    // Overlap, a dropped chunk and a swapped key order in a dense plan.
    let mut p = t2_plan();
    let mesh = p.mesh;
    p.tensors[0].listed_chunks(&mesh)[1].offsets[0] = 0;
    assert!(has(&violations_agree(&p, 0), Invariant::ExactTiling));
    let mut p = t2_plan();
    p.tensors[0].listed_chunks(&mesh).pop();
    assert!(has(&violations_agree(&p, 0), Invariant::Determinism));
    let mut p = t2_plan();
    p.tensors.swap(0, 1);
    let v = violations_agree(&p, 0);
    assert!(v.iter().any(|x| x.message.contains("rank-divergent key order")), "{v:#?}");
    // An optimizer state saved as its local shard.
    let mut p = plan(
        NORM_T4,
        vec![src("model.norm.weight", &[256])],
        Mesh::new(1, 1, 4, 1),
        PlanOptions { optimizer_state: true, ..PlanOptions::default() },
    );
    let state = p.tensors.iter_mut().find(|t| t.key.ends_with("final_layernorm.weight.exp_avg")).expect("exp_avg");
    state.shape = vec![64];
    for c in state.listed_chunks(&Mesh::new(1, 1, 4, 1)) {
        c.offsets = vec![0];
    }
    assert!(has(&violations_agree(&p, 0), Invariant::OptimizerParity));
    // A missing expert.
    let moe = r#"{"model_type":"qwen3_moe","hidden_size":4,"num_attention_heads":1,"num_key_value_heads":1,
      "num_hidden_layers":1,"vocab_size":16,"num_experts":2,"moe_intermediate_size":2}"#;
    let mut sources = vec![
        src("model.layers.0.mlp.gate.weight", &[2, 4]),
        src("model.layers.0.post_attention_layernorm.weight", &[4]),
    ];
    for e in 0..2 {
        sources.push(src(&format!("model.layers.0.mlp.experts.{e}.gate_proj.weight"), &[2, 4]));
        sources.push(src(&format!("model.layers.0.mlp.experts.{e}.up_proj.weight"), &[2, 4]));
        sources.push(src(&format!("model.layers.0.mlp.experts.{e}.down_proj.weight"), &[4, 2]));
    }
    let mut p = plan(moe, sources, Mesh::new(1, 1, 2, 2), PlanOptions::default());
    assert!(violations_agree(&p, 2).is_empty());
    let expert_keys = p.tensors.iter().filter(|t| matches!(t.group, Group::Expert { expert: 1, .. })).count();
    assert!(expert_keys > 0);
    p.tensors.retain(|t| !matches!(t.group, Group::Expert { expert: 1, .. }));
    let v = violations_agree(&p, 2);
    assert!(v
        .iter()
        .any(|x| x.invariant == Invariant::ExpertCoverage && x.message.contains("experts [1] are missing")));
}

const GDN_T1: &str = r#"{"model_type":"qwen3_next","hidden_size":8,"num_attention_heads":4,"num_key_value_heads":2,
  "head_dim":2,"num_hidden_layers":1,"vocab_size":16,"num_experts":0,
  "linear_num_key_heads":2,"linear_key_head_dim":2,"linear_num_value_heads":2,"linear_value_head_dim":4,
  "linear_conv_kernel_dim":4}"#;

#[test]
fn t1_gdn_conv1d_split_is_tp_aware() {
    // qk = 4, v = 8, K = 4, t = 2, D = 4: TP-local conv [8,1,4], two rows per FSDP rank.
    let p = plan(
        GDN_T1,
        vec![
            src("model.layers.0.linear_attn.conv1d.weight", &[16, 1, 4]),
            src("model.layers.0.input_layernorm.weight", &[8]),
        ],
        Mesh::new(2, 1, 4, 1),
        PlanOptions::default(),
    );
    let k = |s: &str| format!("model.module.decoder.layers.0.self_attention.conv1d.weight.{s}");
    assert_eq!(rows_of_key(&p, &k("query"), 0), vec![(0, 2), (2, 0), (2, 0), (2, 0)]);
    assert_eq!(rows_of_key(&p, &k("query"), 1), vec![(2, 2), (4, 0), (4, 0), (4, 0)]);
    assert_eq!(rows_of_key(&p, &k("key"), 0), vec![(0, 0), (0, 2), (2, 0), (2, 0)]);
    assert_eq!(rows_of_key(&p, &k("key"), 1), vec![(2, 0), (2, 2), (4, 0), (4, 0)]);
    assert_eq!(rows_of_key(&p, &k("value"), 0), vec![(0, 0), (0, 0), (0, 2), (2, 2)]);
    assert_eq!(rows_of_key(&p, &k("value"), 1), vec![(4, 0), (4, 0), (4, 2), (6, 2)]);
    let q = p.tensors.iter().find(|t| t.key == k("query")).unwrap();
    assert_eq!(q.shape, vec![4, 1, 4]);
    assert_eq!(p.tensors.iter().find(|t| t.key == k("value")).unwrap().shape, vec![8, 1, 4]);
    no_violations(&p, 0);
}

/// The buggy T1 plan: the DTensor's global was TP-local, so `elems_per_unit = R/t` halved every
/// section: query/key/value get rows [1,0,0,0]/[1,0,0,0]/[0,2,0,0] against globals 2/2/4.
fn t1_buggy_items() -> Vec<shardline_layout::RankPlan<'static>> {
    let sections = [("query", 2u64, [1u64, 0, 0, 0]), ("key", 2, [1, 0, 0, 0]), ("value", 4, [0, 2, 0, 0])];
    let mut plans = Vec::new();
    for tp_rank in 0..2u64 {
        for j in 0..4u64 {
            let mut items = Vec::new();
            for (name, global, rows) in &sections {
                let before: u64 = rows[..j as usize].iter().sum();
                items.push(WriteItem {
                    key: format!("decoder.layers.0.self_attention.conv1d.weight.{name}").into(),
                    dtype: DType::BF16,
                    global_shape: vec![*global, 1, 4].into(),
                    offsets: vec![before, 0, 0].into(),
                    sizes: vec![rows[j as usize], 1, 4].into(),
                    local_shape: vec![*global, 1, 4].into(),
                    tp_dim: Some(0),
                    tp: 2,
                    tp_rank,
                    fsdp_rank: j,
                    fsdp_size: 4,
                    group: Group::Dense,
                    content: tp_rank * 1000 + j,
                    expected_global: vec![*global, 1, 4].into(),
                    param_key: None,
                    whole_rows: true,
                });
            }
            items.sort_by(|a, b| a.key.cmp(&b.key));
            plans.push(shardline_layout::RankPlan { rank: tp_rank + 2 * j, items });
        }
    }
    plans
}

#[test]
fn t1_buggy_split_is_rejected_with_key_offsets_and_shapes() {
    let v = validate(&t1_buggy_items(), 0, 1);
    let text: Vec<String> = v.iter().map(ToString::to_string).collect();
    let query_tiling = text
        .iter()
        .find(|m| m.contains("conv1d.weight.query") && m.contains("ExactTiling"))
        .unwrap_or_else(|| panic!("{text:#?}"));
    assert!(query_tiling.contains("offsets (0, 0, 0) sizes (1, 1, 4)"), "{query_tiling}");
    assert!(query_tiling.contains("global shape [2, 1, 4]"), "{query_tiling}");
    assert!(query_tiling.contains("cover 4 of 8 elements"), "{query_tiling}");
    // TP ranks collide on identical (key, offsets) with different bytes, and the global is TP-local.
    assert!(v.iter().any(|x| x.invariant == Invariant::ReplicaConsistency && x.key.ends_with("query")));
    let tp = v.iter().find(|x| x.invariant == Invariant::TpCompleteness).expect("tp completeness");
    assert!(tp.message.contains("global shape [2, 1, 4] is not tp × local shape [2, 1, 4]"), "{}", tp.message);
}

const DENSE_T2: &str = r#"{"model_type":"qwen3_moe","hidden_size":4,"num_attention_heads":1,"num_key_value_heads":1,
  "num_hidden_layers":1,"vocab_size":16,"num_experts":10,"moe_intermediate_size":2}"#;

fn t2_plan() -> Plan {
    plan(
        DENSE_T2,
        vec![
            src("model.layers.0.mlp.gate.weight", &[10, 4]),
            src("model.layers.0.post_attention_layernorm.weight", &[4]),
        ],
        Mesh::new(1, 1, 8, 1),
        PlanOptions::default(),
    )
}

#[test]
fn t2_uneven_and_empty_shards_are_computed_without_collectives() {
    let p = t2_plan();
    let key = "model.module.decoder.layers.0.mlp.router.weight";
    // Flat chunks r0..r4 = 8 elements (2 rows) each, r5..r7 empty, offsets cumulative.
    assert_eq!(rows_of_key(&p, key, 0), vec![(0, 2), (2, 2), (4, 2), (6, 2), (8, 2), (10, 0), (10, 0), (10, 0)]);
    assert_eq!((0..8).map(|j| fsdp_rows(10, 8, j)).collect::<Vec<_>>()[5], (10, 10));
    // Every rank lists the key (empty ones too), in the same sorted order.
    let lowered = lower(&p);
    for rp in &lowered {
        let keys: Vec<&str> = rp.items.iter().map(|i| i.key.as_ref()).collect();
        assert_eq!(keys, vec![key, "model.module.decoder.layers.0.pre_mlp_layernorm.weight"], "rank {}", rp.rank);
    }
    no_violations(&p, 0);
}

#[test]
fn t2_rank_divergent_key_sets_and_orders_are_reported_not_blocked_on() {
    let key = "model.module.decoder.layers.0.mlp.router.weight";
    let plan = t2_plan();
    let mut omitted = lower(&plan);
    for rp in omitted.iter_mut().filter(|rp| rp.rank >= 5) {
        rp.items.retain(|i| i.key != key);
    }
    let v = validate(&omitted, 0, 1);
    let m = v.iter().find(|x| x.invariant == Invariant::Determinism).expect("determinism");
    assert!(m.message.contains("rank-divergent key set"), "{}", m.message);
    assert!(m.message.contains("listed by ranks [0, 1, 2, 3, 4]") && m.message.contains("tp0/fsdp5"), "{}", m.message);

    let mut reordered = lower(&plan);
    reordered[6].items.reverse();
    let v = validate(&reordered, 0, 1);
    let m = v.iter().find(|x| x.invariant == Invariant::Determinism).expect("order");
    assert!(m.message.contains("rank-divergent key order: rank 6"), "{}", m.message);
}

fn t3_items(global: Vec<u64>, place_dim: usize) -> Vec<shardline_layout::RankPlan<'static>> {
    // Native down_projs [E=4, I=6, H=8] sharded (Shard(0) on ep=2, Shard(1) on ep_shard=2), local
    // [2,3,8]; transposed 1↔2 to HF [4,8,6] the local is [2,8,3] and the FSDP shard dim must move to 2.
    let local = vec![2u64, 8, 3];
    let mut plans = Vec::new();
    for ep in 0..2u64 {
        for s in 0..2u64 {
            let mut offsets = vec![ep * 2, 0, 0];
            offsets[place_dim] = s * local[place_dim];
            plans.push(shardline_layout::RankPlan {
                rank: ep * 2 + s,
                items: vec![WriteItem {
                    key: "model.layers.0.mlp.experts.down_proj".into(),
                    dtype: DType::BF16,
                    global_shape: global.clone().into(),
                    offsets: offsets.into(),
                    sizes: local.clone().into(),
                    local_shape: local.clone().into(),
                    tp_dim: None,
                    tp: 1,
                    tp_rank: 0,
                    fsdp_rank: ep * 2 + s,
                    fsdp_size: 4,
                    group: Group::Dense,
                    content: ep * 2 + s,
                    expected_global: permuted(&[4, 6, 8], &[0, 2, 1]).into(),
                    param_key: None,
                    whole_rows: true,
                }],
            });
        }
    }
    plans
}

#[test]
fn t3_transpose_must_permute_shard_placements() {
    // Correct: (Shard(0), Shard(2)) gives global [4, 8, 6].
    assert!(validate(&t3_items(vec![4, 8, 6], 2), 0, 1).is_empty());
    // Buggy: the old (Shard(0), Shard(1)) infers [4, 16, 3]; it even tiles, but is the wrong tensor.
    let v = validate(&t3_items(vec![4, 16, 3], 1), 0, 1);
    assert_eq!(v.len(), 1, "{v:#?}");
    assert_eq!(v[0].invariant, Invariant::PermutationConsistency);
    assert!(v[0].message.contains("global shape [4, 16, 3] differs from [4, 8, 6]"), "{}", v[0].message);
    assert!(v[0].message.contains("local [2, 8, 3]"), "{}", v[0].message);
    // gate of gate_and_up [4,8,12] split on its last dim then transposed: [4,6,8], buggy [4,12,4].
    assert_eq!(permuted(&[4, 8, 6], &[0, 2, 1]), vec![4, 6, 8]);
}

const NORM_T4: &str =
    r#"{"model_type":"llama","hidden_size":256,"num_attention_heads":1,"num_hidden_layers":1,"vocab_size":16}"#;

#[test]
fn t4_optimizer_state_is_sharded_like_its_parameter() {
    let p = plan(
        NORM_T4,
        vec![src("model.norm.weight", &[256])],
        Mesh::new(1, 1, 4, 1),
        PlanOptions { optimizer_state: true, ..PlanOptions::default() },
    );
    let key = "optimizer.state.module.module.module.decoder.final_layernorm.weight.exp_avg";
    let t = p.tensors.iter().find(|t| t.key == key).expect("exp_avg");
    assert_eq!(t.shape, vec![256]);
    assert_eq!(t.dtype, DType::F32);
    let chunks: Vec<_> = t.chunks(&p.mesh).map(|c| (c.offsets, c.sizes)).collect();
    assert_eq!(chunks, vec![(vec![0], vec![64]), (vec![64], vec![64]), (vec![128], vec![64]), (vec![192], vec![64])]);
    assert_eq!(t.recipe, vec![RowBlock::zeros(256)]);
    no_violations(&p, 0);
}

#[test]
fn t4_plain_local_optimizer_state_is_rejected() {
    let p = plan(
        NORM_T4,
        vec![src("model.norm.weight", &[256])],
        Mesh::new(1, 1, 4, 1),
        PlanOptions { optimizer_state: true, ..PlanOptions::default() },
    );
    let key = "optimizer.state.module.module.module.decoder.final_layernorm.weight.exp_avg";
    let mut buggy = lower(&p);
    for rp in &mut buggy {
        for it in rp.items.iter_mut().filter(|i| i.key == key) {
            // FusedAdam stored the local tensor as if it were full: size [64], one chunk at 0 per rank.
            it.global_shape = vec![64].into();
            it.expected_global = vec![64].into();
            it.local_shape = vec![64].into();
            it.offsets = vec![0].into();
            it.content = rp.rank;
        }
    }
    let v = validate(&buggy, 0, 1);
    let parity = v.iter().find(|x| x.invariant == Invariant::OptimizerParity).expect("parity");
    assert!(parity.key.ends_with("exp_avg"));
    assert!(parity.message.contains("global shape [64] but its parameter"), "{}", parity.message);
    assert!(
        parity.message.contains("[256]") && parity.message.contains("offsets (0) sizes (64)"),
        "{}",
        parity.message
    );
    assert!(v.iter().any(|x| x.invariant == Invariant::ReplicaConsistency && x.message.contains("offsets (0)")));
}

const SWIGLU_T5: &str = r#"{"model_type":"llama","hidden_size":4,"num_attention_heads":2,"num_key_value_heads":2,
  "num_hidden_layers":1,"vocab_size":16,"intermediate_size":6}"#;

#[test]
fn t5_swiglu_section_straddles_an_fsdp_boundary() {
    let p = plan(
        SWIGLU_T5,
        vec![
            src("model.layers.0.mlp.gate_proj.weight", &[6, 4]),
            src("model.layers.0.mlp.up_proj.weight", &[6, 4]),
            src("model.layers.0.post_attention_layernorm.weight", &[4]),
        ],
        Mesh::new(2, 1, 4, 1),
        PlanOptions::default(),
    );
    let w = "model.module.decoder.layers.0.mlp.linear_fc1.weight_w";
    let v = "model.module.decoder.layers.0.mlp.linear_fc1.weight_v";
    assert_eq!(rows_of_key(&p, w, 0), vec![(0, 2), (2, 1), (3, 0), (3, 0)]);
    assert_eq!(rows_of_key(&p, w, 1), vec![(3, 2), (5, 1), (6, 0), (6, 0)]);
    assert_eq!(rows_of_key(&p, v, 0), vec![(0, 0), (0, 1), (1, 2), (3, 0)]);
    assert_eq!(rows_of_key(&p, v, 1), vec![(3, 0), (3, 1), (4, 2), (6, 0)]);
    // _w ≡ gate_proj and _v ≡ up_proj, whole.
    let tw = p.tensors.iter().find(|t| t.key == w).unwrap();
    assert_eq!(tw.shape, vec![6, 4]);
    assert_eq!(tw.recipe, vec![RowBlock::copy(0, 0, 6)]);
    assert_eq!(p.tensors.iter().find(|t| t.key == v).unwrap().recipe, vec![RowBlock::copy(1, 0, 6)]);
    assert_eq!(column_section_rows(6, 3, 3, 0, 4, 1), (0, 1));
    no_violations(&p, 0);
}

/// Expands a recipe to `(source id, source row)` per output row.
fn expand(recipe: &[RowBlock]) -> Vec<(usize, u64)> {
    recipe
        .iter()
        .flat_map(|b| {
            let (id, first) = b.source.expect("no zero rows here");
            (0..b.rows).map(move |i| (id, first + i))
        })
        .collect()
}

#[test]
fn t6_qkv_interleave_golden() {
    let config = r#"{"model_type":"llama","hidden_size":4,"num_attention_heads":4,"num_key_value_heads":2,
      "head_dim":2,"num_hidden_layers":1,"vocab_size":16}"#;
    let p = plan(
        config,
        vec![
            src("model.layers.0.self_attn.q_proj.weight", &[8, 4]),
            src("model.layers.0.self_attn.k_proj.weight", &[4, 4]),
            src("model.layers.0.self_attn.v_proj.weight", &[4, 4]),
            src("model.layers.0.input_layernorm.weight", &[4]),
        ],
        Mesh::new(2, 1, 1, 1),
        PlanOptions::default(),
    );
    let t = p.tensors.iter().find(|t| t.key.ends_with("linear_qkv.weight")).unwrap();
    let (q, k, v) = (0usize, 1usize, 2usize);
    // g0 = q0[0:2] q1[2:4] k0[4:6] v0[6:8]; g1 = q2[8:10] q3[10:12] k1[12:14] v1[14:16].
    let want: Vec<(usize, u64)> = vec![
        (q, 0),
        (q, 1),
        (q, 2),
        (q, 3),
        (k, 0),
        (k, 1),
        (v, 0),
        (v, 1),
        (q, 4),
        (q, 5),
        (q, 6),
        (q, 7),
        (k, 2),
        (k, 3),
        (v, 2),
        (v, 3),
    ];
    assert_eq!(expand(&t.recipe), want);
    assert_eq!(rows_of_key(&p, &t.key, 0), vec![(0, 8)]);
    assert_eq!(rows_of_key(&p, &t.key, 1), vec![(8, 8)]);
}

#[test]
fn t6_qkv_interleave_golden_with_output_gate() {
    let config = r#"{"model_type":"qwen3_next","hidden_size":4,"num_attention_heads":4,"num_key_value_heads":2,
      "head_dim":2,"num_hidden_layers":1,"vocab_size":16,"linear_num_key_heads":2,"linear_key_head_dim":2,
      "linear_num_value_heads":2,"linear_value_head_dim":2,"linear_conv_kernel_dim":4}"#;
    let p = plan(
        config,
        vec![
            src("model.layers.0.self_attn.q_proj.weight", &[16, 4]),
            src("model.layers.0.self_attn.k_proj.weight", &[4, 4]),
            src("model.layers.0.self_attn.v_proj.weight", &[4, 4]),
            src("model.layers.0.input_layernorm.weight", &[4]),
        ],
        Mesh::new(1, 1, 1, 1),
        PlanOptions::default(),
    );
    let t = p.tensors.iter().find(|t| t.key.ends_with("linear_qkv.weight")).unwrap();
    assert_eq!(t.shape, vec![24, 4]);
    let rows = expand(&t.recipe);
    // HF gated q_proj per head [q_h (d); gate_h (d)]: q0 = rows 0..2, gate0 = 2..4, q1 = 4..6, gate1 = 6..8.
    assert_eq!(&rows[0..4], &[(0, 0), (0, 1), (0, 4), (0, 5)], "q0, q1");
    assert_eq!(&rows[4..8], &[(0, 2), (0, 3), (0, 6), (0, 7)], "gate0, gate1");
    assert_eq!(&rows[8..12], &[(1, 0), (1, 1), (2, 0), (2, 1)], "k0, v0");
    assert_eq!(&rows[12..16], &[(0, 8), (0, 9), (0, 12), (0, 13)], "g1 starts at +12: q2, q3");
}

#[test]
fn unsplit_swiglu_keeps_the_tp_dependent_fused_layout() {
    // Without the split, fc1 is one key whose global rows are [g0; u0; g1; u1] (layouts.md §2.2).
    let p = plan(
        SWIGLU_T5,
        vec![
            src("model.layers.0.mlp.gate_proj.weight", &[6, 4]),
            src("model.layers.0.mlp.up_proj.weight", &[6, 4]),
            src("model.layers.0.post_attention_layernorm.weight", &[4]),
        ],
        Mesh::new(2, 1, 4, 1),
        PlanOptions { split_fused: false, ..PlanOptions::default() },
    );
    let key = "model.module.decoder.layers.0.mlp.linear_fc1.weight";
    let t = p.tensors.iter().find(|t| t.key == key).expect("fused key");
    assert_eq!(t.shape, vec![12, 4]);
    assert_eq!(
        t.recipe,
        vec![RowBlock::copy(0, 0, 3), RowBlock::copy(1, 0, 3), RowBlock::copy(0, 3, 3), RowBlock::copy(1, 3, 3)]
    );
    // TP rank 1's local rows start at 6; FSDP rows as in T5: 2, 2, 2, 0.
    assert_eq!(rows_of_key(&p, key, 1), vec![(6, 2), (8, 2), (10, 2), (12, 0)]);
    assert!(!p.tensors.iter().any(|t| t.key.ends_with("_w")));
    no_violations(&p, 0);
}
