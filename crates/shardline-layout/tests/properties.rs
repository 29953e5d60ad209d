//! Property tests over random architectures' dims and meshes: every plan passes the invariants,
//! and executing it in memory places every source element exactly once, at the offset the mapping
//! says (HF → chunks → reconstructed globals → HF, bit-exact).

use proptest::prelude::*;
use shardline_layout::dialect::Dialect;
use shardline_layout::recipe::{rows_of, segments, Transform};
use shardline_layout::reshard::{
    classify, flat_key, param_layout, plan_reshard, ChunkBox, ItemKind, PathElem, ReshardOptions, RngPolicy,
    SourceItem, SourceTensorMeta,
};
use shardline_layout::{
    build_plan, lower, validate, validate_plan, DType, Mesh, ModelConfig, PlanOptions, PlanTable, Role, SourceTensor,
};

#[derive(Clone, Debug)]
struct Case {
    family: &'static str,
    mesh: Mesh,
    config: String,
    sources: Vec<SourceTensor>,
    experts: u64,
}

fn t(name: String, shape: &[u64]) -> SourceTensor {
    // f32 so each element can carry a unique id; dtype does not change the layout arithmetic.
    SourceTensor { name, dtype: DType::F32, shape: shape.to_vec() }
}

prop_compose! {
    fn case()(
        family in prop::sample::select(vec![
            "llama", "qwen2", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "deepseek_v3", "glm4_moe", "gpt_oss",
            "qwen3_vl_moe", "qwen3_5_moe",
        ]),
        tp in prop::sample::select(vec![1u64, 2, 4]),
        cp in prop::sample::select(vec![1u64, 2]),
        ep in prop::sample::select(vec![1u64, 2]),
        etp_is_tp in any::<bool>(),
        dp_mult in 1u64..4,
        groups_mult in 1u64..3,
        hpg in 1u64..3,
        d in prop::sample::select(vec![2u64, 4]),
        hidden in prop::sample::select(vec![4u64, 6, 8]),
        ffn_mult in 1u64..3,
        experts_mult in 1u64..3,
        layers in 1u64..3,
        vocab in 8u64..40,
        m in 1u64..3,
        q_lora in any::<bool>(),
    ) -> Case {
        let moe = family.contains("moe") || family == "qwen3_next" || family == "deepseek_v3" || family == "gpt_oss";
        // DeepSeek and GLM: dense first layer, then MoE layers, one MTP layer after the decoder
        // (whose eh_proj is column-split: hidden divisible by tp).
        let after_decoder_mtp = family == "deepseek_v3" || family == "glm4_moe";
        let hidden = if after_decoder_mtp { tp * hidden } else { hidden };
        // MLA dims: nope, rope, v head dims and the two latent ranks.
        let (dn, dr, dv_mla, ql, kvl) = (2u64, 2u64, 2u64, 4u64, 4u64);
        let ep = if moe { ep } else { 1 };
        let etp = if etp_is_tp { tp } else { 1 };
        let dp = dp_mult * ep;
        let mesh = Mesh { tp, cp, dp, ep, etp };
        let ng = tp * groups_mult;
        let nh = ng * hpg;
        // gpt-oss splits its experts' columns by etp: an even width each.
        let ffn = tp * etp * ffn_mult * if family == "gpt_oss" { 2 } else { 1 };
        let e = ep * experts_mult * 2;
        // GDN: nk/tp and nv/tp sections must divide by cp.
        let nk = tp * cp;
        let nv = nk * m;
        let (dk, dv, k) = (2u64, 2u64, 4u64);
        let config = format!(
            r#"{{"model_type":"{family}","hidden_size":{hidden},"num_attention_heads":{nh},"num_key_value_heads":{ng},
            "head_dim":{d},"num_hidden_layers":{layers},"vocab_size":{vocab},"intermediate_size":{ffn},
            "moe_intermediate_size":{ffn},"shared_expert_intermediate_size":{ffn},"num_experts":{experts},
            "linear_num_key_heads":{nk},"linear_num_value_heads":{nv},"linear_key_head_dim":{dk},
            "linear_value_head_dim":{dv},"linear_conv_kernel_dim":{k},
            "n_shared_experts":1,"q_lora_rank":{q_lora_rank},"kv_lora_rank":{kvl},"qk_nope_head_dim":{dn},
            "qk_rope_head_dim":{dr},"v_head_dim":{dv_mla},"num_nextn_predict_layers":{mtp}}}"#,
            experts = if moe { e } else { 0 },
            q_lora_rank = if q_lora { ql.to_string() } else { "null".to_string() },
            mtp = u64::from(after_decoder_mtp),
        );
        // Qwen3-VL and Qwen3.5 keep the language model's fields under `text_config`; their
        // tower (a Megatron ViT, TP-split) has vision heads that divide by tp.
        let (vh, vd, vi) = (tp * hpg, d, tp * ffn_mult);
        let hv = vh * vd;
        let config = match family {
            "qwen3_vl_moe" | "qwen3_5_moe" => format!(
                r#"{{"model_type":"{family}","tie_word_embeddings":false,"text_config":{config},
                "vision_config":{{"depth":{layers},"num_heads":{vh},"hidden_size":{hv},"intermediate_size":{vi}}}}}"#
            ),
            _ => config,
        };
        // gpt-oss releases are bf16 (its keys are bf16 and a transpose does not also cast).
        let t = |name: String, shape: &[u64]| {
            let mut s = t(name, shape);
            if family == "gpt_oss" {
                s.dtype = DType::BF16;
            }
            s
        };
        let vl = family == "qwen3_vl_moe";
        let vit = vl || family == "qwen3_5_moe";
        let lm = |name: &str| {
            if vit {
                name.replacen("model.", "model.language_model.", 1)
            } else {
                name.to_string()
            }
        };
        let mut s = vec![
            t(lm("model.embed_tokens.weight"), &[vocab, hidden]),
            t("lm_head.weight".into(), &[vocab, hidden]),
            t(lm("model.norm.weight"), &[hidden]),
        ];
        if vit {
            // A Megatron ViT: fused qkv interleaved per head, fc1 whole (GELU), mergers TP-split.
            let rows = |n: &str, shape: &[u64]| t(format!("model.visual.{n}"), shape);
            s.push(rows("patch_embed.proj.weight", &[hv, 3, 2, 2, 2]));
            s.push(rows("patch_embed.proj.bias", &[hv]));
            s.push(rows("pos_embed.weight", &[4, hv]));
            for j in 0..layers {
                for (n, shape) in [
                    ("norm1.weight", vec![hv]),
                    ("norm1.bias", vec![hv]),
                    ("norm2.weight", vec![hv]),
                    ("norm2.bias", vec![hv]),
                    ("attn.qkv.weight", vec![3 * hv, hv]),
                    ("attn.qkv.bias", vec![3 * hv]),
                    ("attn.proj.weight", vec![hv, hv]),
                    ("attn.proj.bias", vec![hv]),
                    ("mlp.linear_fc1.weight", vec![vi, hv]),
                    ("mlp.linear_fc1.bias", vec![vi]),
                    ("mlp.linear_fc2.weight", vec![hv, vi]),
                    ("mlp.linear_fc2.bias", vec![hv]),
                ] {
                    s.push(rows(&format!("blocks.{j}.{n}"), &shape));
                }
            }
            for (n, shape) in [
                ("norm.weight", vec![hv]),
                ("norm.bias", vec![hv]),
                ("linear_fc1.weight", vec![4 * hv, 4 * hv]),
                ("linear_fc1.bias", vec![4 * hv]),
                ("linear_fc2.weight", vec![hidden, 4 * hv]),
                ("linear_fc2.bias", vec![hidden]),
            ] {
                s.push(rows(&format!("merger.{n}"), &shape));
                // Qwen3-VL's deepstack merger: the final merger's, its norm over the merged width.
                if vl {
                    let shape = if n.starts_with("norm.") { vec![4 * hv] } else { shape };
                    s.push(rows(&format!("deepstack_merger_list.0.{n}"), &shape));
                }
            }
        }
        let gdn = family == "qwen3_next" || family.starts_with("qwen3_5");
        let total_layers = layers + u64::from(after_decoder_mtp);
        for l in 0..total_layers {
            let p = lm(&format!("model.layers.{l}."));
            s.push(t(format!("{p}input_layernorm.weight"), &[hidden]));
            s.push(t(format!("{p}post_attention_layernorm.weight"), &[hidden]));
            if l == layers {
                for name in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"] {
                    s.push(t(format!("{p}{name}"), &[hidden]));
                }
                s.push(t(format!("{p}eh_proj.weight"), &[hidden, 2 * hidden]));
                s.push(t(format!("{p}embed_tokens.weight"), &[vocab, hidden]));
                s.push(t(format!("{p}shared_head.head.weight"), &[vocab, hidden]));
            }
            let linear = gdn && l % 2 == 0;
            if family == "deepseek_v3" {
                let a = format!("{p}self_attn.");
                if q_lora {
                    s.push(t(format!("{a}q_a_proj.weight"), &[ql, hidden]));
                    s.push(t(format!("{a}q_a_layernorm.weight"), &[ql]));
                    s.push(t(format!("{a}q_b_proj.weight"), &[nh * (dn + dr), ql]));
                } else {
                    s.push(t(format!("{a}q_proj.weight"), &[nh * (dn + dr), hidden]));
                }
                s.push(t(format!("{a}kv_a_proj_with_mqa.weight"), &[kvl + dr, hidden]));
                s.push(t(format!("{a}kv_a_layernorm.weight"), &[kvl]));
                s.push(t(format!("{a}kv_b_proj.weight"), &[nh * (dn + dv_mla), kvl]));
                s.push(t(format!("{a}o_proj.weight"), &[hidden, nh * dv_mla]));
            } else if linear {
                let (qk, v) = (nk * dk, nv * dv);
                let a = format!("{p}linear_attn.");
                if family == "qwen3_next" {
                    s.push(t(format!("{a}in_proj_qkvz.weight"), &[nk * (2 * dk + 2 * m * dv), hidden]));
                    s.push(t(format!("{a}in_proj_ba.weight"), &[2 * nv, hidden]));
                } else {
                    s.push(t(format!("{a}in_proj_qkv.weight"), &[2 * qk + v, hidden]));
                    s.push(t(format!("{a}in_proj_z.weight"), &[v, hidden]));
                    s.push(t(format!("{a}in_proj_b.weight"), &[nv, hidden]));
                    s.push(t(format!("{a}in_proj_a.weight"), &[nv, hidden]));
                }
                s.push(t(format!("{a}conv1d.weight"), &[2 * qk + v, 1, k]));
                s.push(t(format!("{a}A_log"), &[nv]));
                s.push(t(format!("{a}dt_bias"), &[nv]));
                s.push(t(format!("{a}norm.weight"), &[dv]));
                s.push(t(format!("{a}out_proj.weight"), &[hidden, v]));
            } else {
                let a = format!("{p}self_attn.");
                let q_rows = if gdn { 2 * nh * d } else { nh * d };
                s.push(t(format!("{a}q_proj.weight"), &[q_rows, hidden]));
                s.push(t(format!("{a}k_proj.weight"), &[ng * d, hidden]));
                s.push(t(format!("{a}v_proj.weight"), &[ng * d, hidden]));
                s.push(t(format!("{a}o_proj.weight"), &[hidden, nh * d]));
                if family == "qwen2" || family == "glm4_moe" || family == "gpt_oss" {
                    s.push(t(format!("{a}q_proj.bias"), &[nh * d]));
                    s.push(t(format!("{a}k_proj.bias"), &[ng * d]));
                    s.push(t(format!("{a}v_proj.bias"), &[ng * d]));
                }
                if family == "gpt_oss" {
                    s.push(t(format!("{a}o_proj.bias"), &[hidden]));
                    s.push(t(format!("{a}sinks"), &[nh]));
                } else if family != "llama" && family != "qwen2" {
                    s.push(t(format!("{a}q_norm.weight"), &[d]));
                    s.push(t(format!("{a}k_norm.weight"), &[d]));
                }
            }
            let dense_first = after_decoder_mtp && l == 0;
            if family == "gpt_oss" {
                // Router with bias; experts [E, in, out] with biases, gate/up interleaved.
                s.push(t(format!("{p}mlp.router.weight"), &[e, hidden]));
                s.push(t(format!("{p}mlp.router.bias"), &[e]));
                s.push(t(format!("{p}mlp.experts.gate_up_proj"), &[e, hidden, 2 * ffn]));
                s.push(t(format!("{p}mlp.experts.gate_up_proj_bias"), &[e, 2 * ffn]));
                s.push(t(format!("{p}mlp.experts.down_proj"), &[e, ffn, hidden]));
                s.push(t(format!("{p}mlp.experts.down_proj_bias"), &[e, hidden]));
            } else if moe && !dense_first {
                s.push(t(format!("{p}mlp.gate.weight"), &[e, hidden]));
                if after_decoder_mtp {
                    s.push(t(format!("{p}mlp.gate.e_score_correction_bias"), &[e]));
                    s.push(t(format!("{p}mlp.shared_experts.gate_proj.weight"), &[ffn, hidden]));
                    s.push(t(format!("{p}mlp.shared_experts.up_proj.weight"), &[ffn, hidden]));
                    s.push(t(format!("{p}mlp.shared_experts.down_proj.weight"), &[hidden, ffn]));
                }
                if family.starts_with("qwen3_5") {
                    s.push(t(format!("{p}mlp.experts.gate_up_proj"), &[e, 2 * ffn, hidden]));
                    s.push(t(format!("{p}mlp.experts.down_proj"), &[e, hidden, ffn]));
                } else if vl {
                    // The release layout [E, in, out].
                    s.push(t(format!("{p}mlp.experts.gate_up_proj"), &[e, hidden, 2 * ffn]));
                    s.push(t(format!("{p}mlp.experts.down_proj"), &[e, ffn, hidden]));
                } else {
                    for x in 0..e {
                        s.push(t(format!("{p}mlp.experts.{x}.gate_proj.weight"), &[ffn, hidden]));
                        s.push(t(format!("{p}mlp.experts.{x}.up_proj.weight"), &[ffn, hidden]));
                        s.push(t(format!("{p}mlp.experts.{x}.down_proj.weight"), &[hidden, ffn]));
                    }
                }
                if gdn {
                    s.push(t(format!("{p}mlp.shared_expert.gate_proj.weight"), &[ffn, hidden]));
                    s.push(t(format!("{p}mlp.shared_expert.up_proj.weight"), &[ffn, hidden]));
                    s.push(t(format!("{p}mlp.shared_expert.down_proj.weight"), &[hidden, ffn]));
                    s.push(t(format!("{p}mlp.shared_expert_gate.weight"), &[1, hidden]));
                }
            } else {
                s.push(t(format!("{p}mlp.gate_proj.weight"), &[ffn, hidden]));
                s.push(t(format!("{p}mlp.up_proj.weight"), &[ffn, hidden]));
                s.push(t(format!("{p}mlp.down_proj.weight"), &[hidden, ffn]));
            }
        }
        Case { family, mesh, config, sources: s, experts: if moe { e } else { 0 } }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn plans_tile_exactly_and_place_every_source_element_once(c in case()) {
        let config = ModelConfig::from_json(&c.config).unwrap();
      for split_fused in [true, false] {
        let options = PlanOptions { optimizer_state: true, split_fused, ..PlanOptions::default() };
        let plan = match build_plan(&config, c.sources.clone(), c.mesh, &options) {
            Ok(p) => p,
            Err(e) => return Err(TestCaseError::fail(format!("{} {}: {e:?}", c.family, c.mesh))),
        };
        let violations = validate(&lower(&plan), c.experts, c.mesh.ep);
        prop_assert!(violations.is_empty(), "{violations:#?}");
        let violations = validate_plan(&plan, c.experts, c.mesh.ep);
        prop_assert!(violations.is_empty(), "key by key: {violations:#?}");
        // A rank's chunks found from the rank alone are the ones found by asking every chunk.
        for t in &plan.tensors {
            for rank in 0..plan.world() {
                let direct: Vec<usize> = t.chunks_of_rank(&plan.mesh, rank).collect();
                let scanned: Vec<usize> =
                    (0..t.chunk_count()).filter(|&i| t.chunk(&plan.mesh, i).rank == rank).collect();
                prop_assert_eq!(direct, scanned, "{} rank {}", t.key, rank);
            }
        }
        // The flat table the writers read holds the same tensors, chunks and per-rank bytes.
        let table = PlanTable::new(&plan);
        prop_assert!(table.tensors().eq(plan.views()));
        prop_assert_eq!(table.bytes_per_rank(), plan.bytes_per_rank());
        for rank in 0..plan.world() {
            prop_assert!(table.rank_chunks(rank).eq(plan.rank_chunks(rank)), "rank {}", rank);
        }
        // Also when listed and derived tilings alternate (hand-edited plans).
        let mut edited = plan.clone();
        for t in edited.tensors.iter_mut().step_by(3) {
            t.listed_chunks(&c.mesh);
        }
        prop_assert!(PlanTable::new(&edited).tensors().eq(edited.views()));

        // Unique ids: element i of source s is base[s] + i.
        let mut base = Vec::new();
        let mut next = 1u32;
        for s in &plan.sources {
            base.push(next);
            next += s.shape.iter().product::<u64>().max(1) as u32;
        }
        // Element ids of `n` output elements read from byte `off` of source `id`: a run of the
        // source, or (transposed) one element every `src_cols`.
        let elements = |id: usize, off: u64, n: u64, transform: Transform| -> Vec<u32> {
            let first = off / plan.sources[id].dtype.size() as u64;
            let step = match transform {
                Transform::Transpose { src_cols, .. } => u64::from(src_cols),
                _ => 1,
            };
            (0..n).map(|i| base[id] + (first + i * step) as u32).collect()
        };
        let mut uses = vec![0u32; next as usize];
        for t in &plan.tensors {
            let numel: u64 = t.shape.iter().product();
            // Reassemble the global tensor from the written chunks; 0 = never written.
            let mut global = vec![u32::MAX; numel as usize];
            for ch in t.chunks(&plan.mesh).filter(|ch| ch.written && ch.numel() > 0) {
                let mut vals = Vec::new();
                // In the tensor's own dtype: a family that casts (bf16 parameters from these f32
                // sources) reads source elements of another size than it writes.
                for seg in segments(&t.shape, t.dtype, &t.recipe, &ch.offsets, &ch.sizes) {
                    let n = seg.len / t.dtype.size() as u64;
                    match seg.source {
                        Some((id, off)) => vals.extend(elements(id, off, n, seg.transform)),
                        None => vals.extend(std::iter::repeat_n(0u32, n as usize)),
                    }
                }
                prop_assert_eq!(vals.len() as u64, ch.numel());
                // Chunk-local C order → global positions.
                for (k, v) in vals.into_iter().enumerate() {
                    let mut rem = k as u64;
                    let mut flat = 0u64;
                    let mut stride = 1u64;
                    let mut coords = vec![0u64; ch.sizes.len()];
                    for dim in (0..ch.sizes.len()).rev() {
                        coords[dim] = ch.offsets[dim] + rem % ch.sizes[dim];
                        rem /= ch.sizes[dim];
                    }
                    for dim in (0..t.shape.len()).rev() {
                        flat += coords[dim] * stride;
                        stride *= t.shape[dim];
                    }
                    prop_assert_eq!(global[flat as usize], u32::MAX, "{} element {} written twice", t.key, flat);
                    global[flat as usize] = v;
                }
            }
            prop_assert!(global.iter().all(|v| *v != u32::MAX), "{}: not fully covered", t.key);
            // The reassembled global equals the recipe's rows of the sources (the reference map).
            let row_len = (numel / rows_of(&t.shape).max(1)) as usize;
            let mut row = 0usize;
            for b in &t.recipe {
                for r in 0..b.rows as usize {
                    let got = &global[(row + r) * row_len..(row + r + 1) * row_len];
                    match b.source {
                        Some((id, first)) => {
                            // Row r of the block: source row first + r·stride, or (transposed) the
                            // column at element first + r·stride.
                            let at = first + r as u64 * u64::from(b.stride);
                            let size = plan.sources[id].dtype.size() as u64;
                            let off = match b.transform {
                                Transform::Transpose { .. } => at * size,
                                _ => at * row_len as u64 * size,
                            };
                            let want = elements(id, off, row_len as u64, b.transform);
                            prop_assert_eq!(got, &want[..], "{} row {}", t.key, row + r);
                        }
                        None => prop_assert!(got.iter().all(|v| *v == 0)),
                    }
                }
                row += b.rows as usize;
            }
            if t.role == Role::Param {
                for v in &global {
                    if *v != 0 {
                        uses[*v as usize] += 1;
                    }
                }
            }
        }
        // Every source element lands exactly once across all parameter keys, but for the tensors
        // knowingly not converted (an MTP layer's copies of the embedding and output layer).
        let mut want_uses = vec![1u32; next as usize];
        for (id, src) in plan.sources.iter().enumerate() {
            if plan.unconverted.contains(&src.name) {
                let n = src.shape.iter().product::<u64>().max(1) as usize;
                want_uses[base[id] as usize..base[id] as usize + n].fill(0);
            }
        }
        let missing: Vec<usize> = (1..next as usize).filter(|i| uses[*i] != want_uses[*i]).take(5).collect();
        prop_assert!(missing.is_empty(), "{} {}: elements used ≠ once: {:?}", c.family, c.mesh, missing);
      }
    }
}

/// The items of a checkpoint written by `plan`: its keys with their saved-state-dict paths and
/// written chunk boxes, as a training checkpoint's `.metadata` lists them.
fn items_of(plan: &shardline_layout::Plan) -> Vec<SourceItem> {
    plan.tensors
        .iter()
        .map(|t| {
            let path = match t.key.strip_prefix("optimizer.state.").and_then(|r| r.rsplit_once('.')) {
                Some((param, state)) => ["optimizer", "state", param, state].map(|s| PathElem::Key(s.into())).to_vec(),
                None => {
                    let (top, rest) = t.key.split_once('.').unwrap();
                    vec![PathElem::Key(top.into()), PathElem::Key(rest.into())]
                }
            };
            let chunks = t
                .chunks(&plan.mesh)
                .filter(|c| c.written && c.numel() > 0)
                .map(|c| ChunkBox { offsets: c.offsets, sizes: c.sizes })
                .collect();
            SourceItem {
                key: t.key.clone(),
                path,
                tensor: Some(SourceTensorMeta { dtype: t.dtype, shape: t.shape.clone(), chunks }),
            }
        })
        .collect()
}

/// The items as the checkpoint reader hands them to a `torch_dist` target: gpt-oss's expert fc1
/// (parameter and moments), fused in Megatron-FSDP's expert-TP layout, as its `[gate; up]`
/// halves, the SwiGLU sections `_w` and `_v` (the reader cuts the stored rows at each rank's
/// section; any tiling of a section will do for the plan, so each is one whole chunk here).
fn fused_as_sections(items: Vec<SourceItem>) -> Vec<SourceItem> {
    let mut out = Vec::new();
    for item in items {
        let name = match classify(&item.path) {
            ItemKind::Model { name } | ItemKind::OptimizerState { name, .. } => name,
            _ => String::new(),
        };
        let fused = param_layout(&name, None).is_some_and(|l| l.tp_dependent);
        let Some(meta) = item.tensor.as_ref().filter(|_| fused) else {
            out.push(item);
            continue;
        };
        let mut shape = meta.shape.clone();
        shape[0] /= 2;
        for suffix in ["_w", "_v"] {
            let mut path = item.path.clone();
            // The parameter's name is the model path's last part, a moment's the one before.
            let at = if path[0] == PathElem::Key("model".into()) { path.len() - 1 } else { 2 };
            if let PathElem::Key(k) = &mut path[at] {
                k.push_str(suffix);
            }
            let whole = ChunkBox { offsets: vec![0; shape.len()], sizes: shape.clone() };
            out.push(SourceItem {
                key: flat_key(&path),
                path,
                tensor: Some(SourceTensorMeta { dtype: meta.dtype, shape: shape.clone(), chunks: vec![whole] }),
            });
        }
    }
    out
}

/// Options of a reshard of case `c`'s plan to `mesh`, written in `dialect`.
fn reshard_options(config: &ModelConfig, c: &Case, mesh: Mesh, dialect: Dialect) -> ReshardOptions {
    ReshardOptions {
        mesh,
        source_mesh: Some(c.mesh),
        vocab_size: Some(config.vocab_size),
        vocab_divisible_by: PlanOptions::default().vocab_divisible_by,
        num_experts: (c.experts > 0).then_some(c.experts),
        num_query_groups: Some(config.num_query_groups),
        rng: RngPolicy::FromRank0,
        dialect,
        model_dtype: None,
    }
}

/// A key's dtype, global shape and sorted written chunk boxes `(offsets, sizes)`.
type KeyLayout = (DType, Vec<u64>, Vec<(Vec<u64>, Vec<u64>)>);

/// Sorted written chunk boxes of every key.
fn boxes_of<'a>(
    mesh: &'a Mesh,
    tensors: impl Iterator<Item = &'a shardline_layout::OutputTensor>,
) -> std::collections::BTreeMap<String, KeyLayout> {
    tensors
        .map(|t| {
            let mut b: Vec<_> =
                t.chunks(mesh).filter(|c| c.written && c.numel() > 0).map(|c| (c.offsets, c.sizes)).collect();
            b.sort();
            (t.key.clone(), (t.dtype, t.shape.clone(), b))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// A checkpoint with optimizer state planned on one mesh and resharded to another holds
    /// exactly the keys, shapes and chunk boxes of the checkpoint planned on the other.
    #[test]
    fn resharding_a_plan_gives_the_plan_of_the_target_mesh(
        c in case(),
        keep_tp in any::<bool>(),
        keep_ep in any::<bool>(),
        dp_mult in 1u64..4,
    ) {
        let config = ModelConfig::from_json(&c.config).unwrap();
        let options = PlanOptions { optimizer_state: true, ..PlanOptions::default() };
        let source = build_plan(&config, c.sources.clone(), c.mesh, &options).unwrap();
        let a = c.mesh;
        let tp = if keep_tp { a.tp } else { 1 };
        let ep = if keep_ep { a.ep } else { 1 };
        // gpt-oss keeps its expert fc1 fused in a layout of the expert-TP size: that stays.
        let etp = if c.family == "gpt_oss" || keep_tp { a.etp } else { 1 };
        let b = Mesh { tp, cp: 1, dp: dp_mult * ep * etp, ep, etp };
        let reshard_options = reshard_options(&config, &c, b, Dialect::FsdpDtensor);
        let resharded = match plan_reshard(&items_of(&source), &reshard_options) {
            Ok(p) => p,
            Err(e) => return Err(TestCaseError::fail(format!("{} {a} → {b}: {e}", c.family))),
        };
        let target = build_plan(&config, c.sources.clone(), b, &options).unwrap();
        let got = boxes_of(&b, resharded.tensors.iter().map(|t| &t.out));
        let want = boxes_of(&b, target.tensors.iter());
        prop_assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (k, v) in &want {
            prop_assert_eq!(&got[k], v, "{} {} → {}: `{}`", c.family, a, b, k);
        }
    }
}

/// A written chunk: `(rank, offsets, sizes)`.
type Written = (u64, Vec<u64>, Vec<u64>);

/// Every written chunk of every key, sorted.
fn written_of<'a>(
    mesh: &'a Mesh,
    tensors: impl Iterator<Item = &'a shardline_layout::OutputTensor>,
) -> std::collections::BTreeMap<String, Vec<Written>> {
    tensors
        .map(|t| {
            let mut b: Vec<_> =
                t.chunks(mesh).filter(|c| c.written && c.numel() > 0).map(|c| (c.rank, c.offsets, c.sizes)).collect();
            b.sort();
            (t.key.clone(), b)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    /// A Megatron-FSDP checkpoint with optimizer state resharded to `torch_dist` on another mesh
    /// holds the model exactly as `convert --target torch_dist` plans it on that mesh — the same
    /// keys, chunks, writing ranks and `_extra_state` objects — and each optimizer state
    /// (`param`, `exp_avg`, `exp_avg_sq`) has its parameter's chunks and writers.
    #[test]
    fn resharding_to_torch_dist_gives_what_convert_writes(
        c in case(),
        keep_tp in any::<bool>(),
        keep_ep in any::<bool>(),
        dp_mult in 1u64..4,
    ) {
        let config = ModelConfig::from_json(&c.config).unwrap();
        let options = PlanOptions { optimizer_state: true, ..PlanOptions::default() };
        let source = build_plan(&config, c.sources.clone(), c.mesh, &options).unwrap();
        let a = c.mesh;
        let (tp, ep) = (if keep_tp { a.tp } else { 1 }, if keep_ep { a.ep } else { 1 });
        let etp = if keep_tp { a.etp } else { 1 };
        let b = Mesh { tp, cp: 1, dp: dp_mult * ep * etp, ep, etp };
        let reshard_options = reshard_options(&config, &c, b, Dialect::TorchDist);
        let resharded = plan_reshard(&fused_as_sections(items_of(&source)), &reshard_options)
            .map_err(|e| TestCaseError::fail(format!("{} {a} → {b}: {e}", c.family)))?;
        let torch_dist = PlanOptions { prefix: String::new(), dialect: Dialect::TorchDist, ..PlanOptions::default() };
        let target = build_plan(&config, c.sources.clone(), b, &torch_dist).unwrap();
        let got = written_of(&b, resharded.tensors.iter().map(|t| &t.out));
        let want = written_of(&b, target.tensors.iter());
        let model: Vec<&String> = got.keys().filter(|k| !k.starts_with("optimizer.")).collect();
        prop_assert_eq!(model, want.keys().collect::<Vec<_>>(), "{} {} → {}", c.family, a, b);
        for (k, v) in &want {
            prop_assert_eq!(&got[k], v, "{} {} → {}: `{}`", c.family, a, b, k);
            for state in ["param", "exp_avg", "exp_avg_sq"] {
                let s = format!("optimizer.state.{state}.{k}");
                prop_assert_eq!(got.get(&s), Some(v), "{} {} → {}: `{}`", c.family, a, b, s);
            }
        }
        let table = PlanTable::new(&target);
        prop_assert_eq!(resharded.disk.objects(), table.disk.objects());
        for t in &target.tensors {
            prop_assert_eq!(resharded.disk.place(&t.key, &t.shape), table.disk.place(&t.key, &t.shape));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// `torch_dist`: every on-disk key is tiled exactly by the placed chunks of the planned
    /// tensors it holds (layers stacked, experts, `[gate; up]`), each chunk within one planned
    /// tensor's region; DP replicas write once, spread over the DP ranks, and a rank's chunks
    /// are found from the rank alone.
    #[test]
    fn torch_dist_placements_tile_every_key_exactly(c in case()) {
        use std::collections::BTreeMap;
        use shardline_layout::invariants::{tiling_violations, Piece};
        use shardline_layout::{Dialect, DiskLayout};
        let config = ModelConfig::from_json(&c.config).unwrap();
        let options = PlanOptions { prefix: String::new(), dialect: Dialect::TorchDist, ..PlanOptions::default() };
        let plan = build_plan(&config, c.sources.clone(), c.mesh, &options)
            .map_err(|e| TestCaseError::fail(format!("{} {}: {e:?}", c.family, c.mesh)))?;
        let table = PlanTable::new(&plan);
        prop_assert!(matches!(table.disk, DiskLayout::TorchDist(_)));
        let mut keys: BTreeMap<String, (Vec<u64>, Vec<Piece>)> = BTreeMap::new();
        let mut placed: BTreeMap<String, Vec<shardline_layout::dialect::Part>> = BTreeMap::new();
        for t in table.tensors() {
            let place = table.disk.place(t.key, t.shape);
            placed.entry(place.key.to_string()).or_default().push(shardline_layout::dialect::Part {
                key: t.key.to_string(),
                origin: place.origin.clone(),
                shape: t.shape.to_vec(),
            });
            prop_assert_eq!(place.origin.len(), place.shape.len());
            let entry = keys.entry(place.key.to_string()).or_insert_with(|| (place.shape.clone(), Vec::new()));
            prop_assert_eq!(&entry.0, &place.shape, "{} in {}", t.key, place.key);
            for ch in t.chunks(&table.mesh) {
                // One writer per chunk, however many DP replicas hold it.
                prop_assert_eq!(ch.fsdp_rank, 0);
                if ch.written && ch.numel() > 0 {
                    let (offsets, sizes) = place.chunk(&ch.offsets, &ch.sizes);
                    entry.1.push(Piece { offsets, sizes, owner: format!("{} rank {}", t.key, ch.rank) });
                }
            }
            for rank in 0..table.world() {
                let direct: Vec<usize> = t.chunks_of_rank(&table.mesh, rank).collect();
                let scanned: Vec<usize> =
                    (0..t.chunk_count()).filter(|&i| t.chunk(&table.mesh, i).rank == rank).collect();
                prop_assert_eq!(direct, scanned, "{} rank {}", t.key, rank);
            }
        }
        // Read backwards, every on-disk key gives back exactly the planned tensors placed in it.
        let planned: std::collections::BTreeSet<&str> = table.tensors().map(|t| t.key).collect();
        for (key, mut want) in placed {
            let shape = &keys[&key].0;
            let mut got = shardline_layout::dialect::unplace(&key, shape, |k| planned.contains(format!("{k}_w").as_str()))
                .map_err(TestCaseError::fail)?;
            want.sort_by(|a, b| a.key.cmp(&b.key));
            got.sort_by(|a, b| a.key.cmp(&b.key));
            prop_assert_eq!(got, want, "{}", key);
        }
        for (key, (shape, pieces)) in keys {
            let v = tiling_violations(&shape, pieces);
            prop_assert!(v.is_empty(), "{} {}: {key}: {v:?}", c.family, c.mesh);
            // SwiGLU keys are whole `[gate; up]`: no `_w`/`_v` key reaches the disk.
            prop_assert!(!key.ends_with("_w") && !key.ends_with("_v"), "{key}");
        }
        // Every TE module of a decoder layer has an `_extra_state` object.
        prop_assert!(table.disk.objects().iter().any(|o| o.key.contains("linear_proj._extra_state/")
            || o.key.contains("out_proj._extra_state/")));
    }
}
