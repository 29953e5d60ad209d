//! The reshard plan's decisions on small hand-made checkpoints: what is carried, what is
//! re-keyed, and what is refused.

use super::*;
use crate::{DType, Mesh};

fn key_path(parts: &[&str]) -> Vec<PathElem> {
    parts.iter().map(|p| PathElem::Key(p.to_string())).collect()
}

fn tensor(parts: &[&str], shape: &[u64], chunks: &[(&[u64], &[u64])]) -> SourceItem {
    let path = key_path(parts);
    SourceItem {
        key: flat_key(&path),
        path,
        tensor: Some(SourceTensorMeta {
            dtype: DType::F32,
            shape: shape.to_vec(),
            chunks: chunks.iter().map(|(o, s)| ChunkBox { offsets: o.to_vec(), sizes: s.to_vec() }).collect(),
        }),
    }
}

fn object(path: Vec<PathElem>) -> SourceItem {
    SourceItem { key: flat_key(&path), path, tensor: None }
}

fn options(mesh: Mesh) -> ReshardOptions {
    ReshardOptions {
        mesh,
        source_mesh: None,
        vocab_size: None,
        vocab_divisible_by: 8,
        num_experts: None,
        num_query_groups: None,
        rng: RngPolicy::FromRank0,
        dialect: crate::dialect::Dialect::FsdpDtensor,
        model_dtype: None,
    }
}

const NORM: &str = "module.decoder.final_layernorm.weight";
const OPT_NORM: &str = "module.module.module.decoder.final_layernorm.weight";

fn rng(tp: u64) -> Vec<SourceItem> {
    let part = rng_rank_part(0, tp);
    vec![
        object(vec![
            PathElem::Key("rng_state".into()),
            PathElem::Key(part.clone()),
            PathElem::Index(0),
            PathElem::Key("random_rng_state".into()),
        ]),
        object(vec![
            PathElem::Key("rng_state".into()),
            PathElem::Key(part),
            PathElem::Index(0),
            PathElem::Key("np_rng_state".into()),
        ]),
    ]
}

#[test]
fn moments_follow_their_parameter_and_bytes_items_are_carried() {
    let mut items = vec![
        tensor(&["model", NORM], &[6], &[(&[0], &[3]), (&[3], &[3])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg"], &[6], &[(&[0], &[3]), (&[3], &[3])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg_sq"], &[6], &[(&[0], &[3]), (&[3], &[3])]),
        object(key_path(&["optimizer", "param_to_group_meta", OPT_NORM, "step"])),
        object(key_path(&["iteration"])),
        object(key_path(&["args"])),
        object(key_path(&["rerun_state_machine", "x"])),
    ];
    items.extend(rng(0));
    let plan = plan_reshard(&items, &options(Mesh::new(1, 1, 4, 1))).unwrap();
    let boxes: Vec<Vec<u64>> = plan.written_chunks(0).map(|c| c.sizes).collect();
    assert_eq!(boxes, vec![vec![2], vec![2], vec![2]], "6 rows over 4 FSDP ranks: 2, 2, 2, empty");
    assert_eq!(plan.written_chunks(1).map(|c| c.sizes).collect::<Vec<_>>(), boxes);
    let keys: Vec<&str> = plan.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys.len(), 6);
    assert!(plan.objects.iter().any(|o| o.is_args && o.key == "args"));
    // Unknown items are carried and reported; a TP grid that does not change is not.
    assert_eq!(plan.notes.len(), 1, "{:?}", plan.notes);
    assert!(plan.notes[0].contains("rerun_state_machine.x"));
}

#[test]
fn rng_states_follow_the_target_tp_grid_by_policy() {
    let mut items = vec![tensor(&["model", NORM], &[4], &[(&[0], &[4])])];
    items.extend(rng(0));
    items.extend(rng(1));
    let plan = plan_reshard(&items, &options(Mesh::new(4, 1, 1, 1))).unwrap();
    let ranks: Vec<(String, usize)> = plan.objects.iter().map(|o| (o.key.clone(), o.source)).collect();
    assert_eq!(ranks.len(), 8);
    // (0, 2) and (0, 3) are copies of (0, 0)'s items; (0, 1) keeps its own.
    assert!(ranks.contains(&("rng_state.(0, 2).0.np_rng_state".into(), 2)));
    assert!(ranks.contains(&("rng_state.(0, 3).0.random_rng_state".into(), 1)));
    assert!(ranks.contains(&("rng_state.(0, 1).0.np_rng_state".into(), 4)));
    assert!(plan.notes.iter().any(|n| n.contains("(0, 2), (0, 3) copied from (0, 0)")), "{:?}", plan.notes);

    let plan = plan_reshard(&items, &options(Mesh::new(1, 1, 1, 1))).unwrap();
    assert_eq!(plan.objects.len(), 2, "(0, 1) dropped");
    assert!(plan.notes.iter().any(|n| n.contains("dropped (0, 1)")), "{:?}", plan.notes);

    let mut drop = options(Mesh::new(2, 1, 1, 1));
    drop.rng = RngPolicy::Drop;
    let plan = plan_reshard(&items, &drop).unwrap();
    assert!(plan.objects.is_empty());
    assert!(plan.notes.iter().any(|n| n.contains("--no-load-rng")), "{:?}", plan.notes);
}

#[test]
fn torch_dist_keeps_each_tp_ranks_rng_states_as_one_object_and_the_model_in_the_jobs_dtype() {
    let mut items = vec![
        tensor(&["model", NORM], &[4], &[(&[0], &[4])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg"], &[4], &[(&[0], &[4])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg_sq"], &[4], &[(&[0], &[4])]),
    ];
    items.extend(rng(0));
    let mut to = options(Mesh::new(2, 1, 1, 1));
    to.dialect = crate::dialect::Dialect::TorchDist;
    to.model_dtype = Some(DType::BF16);
    let plan = plan_reshard(&items, &to).unwrap();
    // (0, 0)'s states for TP rank 0, a copy for TP rank 1: one ShardedObject each, on DP rank 0
    // of its TP rank, its leaves under their list index.
    let rng: Vec<(&str, u64, usize)> =
        plan.rng_objects.iter().map(|o| (o.key.as_str(), o.rank, o.leaves.len())).collect();
    assert_eq!(rng, [("rng_state/shard_0.0_1.2", 0, 2), ("rng_state/shard_0.1_1.2", 1, 2)]);
    let leaf = &plan.rng_objects[1].leaves[0];
    assert_eq!(leaf.0, vec![PathElem::Index(0), PathElem::Key("np_rng_state".into())]);
    assert_eq!(leaf.1, 4, "the copy reads (0, 0)'s item");
    assert!(plan.objects.is_empty() && plan.tensors.iter().all(|t| !t.out.key.starts_with("rng_state")));
    // The model's copy in bf16, its master and moments in fp32.
    let dtype = |k: &str| plan.tensors.iter().find(|t| t.out.key == k).map(|t| t.out.dtype);
    let name = NORM.strip_prefix("module.").unwrap();
    assert_eq!(dtype(name), Some(DType::BF16));
    for state in ["param", "exp_avg", "exp_avg_sq"] {
        assert_eq!(dtype(&format!("optimizer.state.{state}.{name}")), Some(DType::F32), "{state}");
    }
}

#[test]
fn vocab_rows_are_repadded_for_the_target_tp() {
    let emb = "module.embedding.word_embeddings.weight";
    let items = vec![tensor(&["model", emb], &[104, 2], &[(&[0, 0], &[104, 2])])];
    let mut o = options(Mesh::new(2, 1, 1, 1));
    o.vocab_size = Some(100);
    let plan = plan_reshard(&items, &o).unwrap();
    assert_eq!(plan.tensors[0].out.shape, vec![112, 2], "ceil(100 / (8·2))·16");
    assert_eq!(plan.padded_vocab, Some(112));
    assert!(plan.args_updates().contains(&("padded_vocab_size", 112)));
    o.mesh = Mesh::new(1, 1, 1, 1);
    o.vocab_size = None;
    let plan = plan_reshard(&items, &o).unwrap();
    assert_eq!(plan.tensors[0].out.shape, vec![104, 2]);
    assert!(plan.notes.iter().any(|n| n.contains("--vocab-size")), "{:?}", plan.notes);
}

#[test]
fn what_cannot_be_resharded_is_named() {
    let err = |items: &[SourceItem], mesh: Mesh| plan_reshard(items, &options(mesh)).unwrap_err().to_string();
    // A moment chunked unlike its parameter.
    let items = vec![
        tensor(&["model", NORM], &[6], &[(&[0], &[3]), (&[3], &[3])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg"], &[6], &[(&[0], &[2]), (&[2], &[4])]),
    ];
    assert!(err(&items, Mesh::new(1, 1, 2, 1)).contains("its chunks are not its parameter's"));
    let items = vec![
        tensor(&["model", NORM], &[6], &[(&[0], &[6])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg"], &[8], &[(&[0], &[8])]),
    ];
    assert!(err(&items, Mesh::new(1, 1, 2, 1)).contains("global shape [8], its parameter's [6]"));
    // Parameters no table knows, by pattern.
    let items = vec![
        tensor(&["model", "module.decoder.layers.0.mystery.weight"], &[2], &[(&[0], &[2])]),
        tensor(&["model", "module.decoder.layers.1.mystery.weight"], &[2], &[(&[0], &[2])]),
    ];
    assert!(err(&items, Mesh::new(1, 1, 1, 1)).contains("decoder.layers.*.mystery.weight × 2"));
    // One section of a fused parameter without the other.
    let items =
        vec![tensor(&["model", "module.decoder.layers.0.mlp.linear_fc1.weight_w"], &[4, 2], &[(&[0, 0], &[4, 2])])];
    assert!(err(&items, Mesh::new(1, 1, 1, 1)).contains("is split into _w, _v but the checkpoint has only _w"));
    // Rows a TP size does not split.
    let items = vec![tensor(
        &["model", "module.decoder.layers.0.self_attention.linear_proj.weight"],
        &[4, 6],
        &[(&[0, 0], &[4, 6])],
    )];
    assert!(err(&items, Mesh::new(4, 1, 1, 1)).contains("6 columns do not split over tp = 4"));
}

#[test]
fn the_source_mesh_is_read_from_chunk_geometry() {
    // tp 2, dp 2, ep 2, etp 1 (world 4): a row-parallel weight split in column halves by TP rank,
    // and 4 experts whose fc2 is whole (etp 1) on the ranks of their EP rank.
    let proj = "module.decoder.layers.0.self_attention.linear_proj.weight";
    let mut items = vec![tensor(
        &["model", proj],
        &[4, 8],
        &[(&[0, 0], &[2, 4]), (&[0, 4], &[2, 4]), (&[2, 0], &[2, 4]), (&[2, 4], &[2, 4])],
    )];
    let mut ranks = vec![vec![0, 1, 2, 3]];
    for e in 0..4u64 {
        let name = format!("module.decoder.layers.1.mlp.experts.linear_fc2.weight{e}");
        // Expert-DP 2: rows split over the two ranks of the expert's EP rank.
        items.push(tensor(&["model", &name], &[4, 2], &[(&[0, 0], &[2, 2]), (&[2, 0], &[2, 2])]));
        let ep_rank = e / 2;
        ranks.push(vec![ep_rank, ep_rank + 2]);
    }
    let mesh = infer_mesh(&items, |i, c| ranks.get(i).and_then(|r| r.get(c)).copied());
    assert_eq!(mesh, Some(Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 1 }));
    // Without a row-parallel weight TP cannot be told.
    assert_eq!(infer_mesh(&items[1..1], |_, _| Some(0)), None);
}

#[test]
fn each_target_rank_file_costs_the_source_runs_it_reads() {
    // 6 rows of fp32: source rows 0..3 in rank file 0, rows 3..6 in rank file 1; the target cuts
    // them over 4 FSDP ranks as 2, 2, 2 and nothing.
    let items = vec![tensor(&["model", NORM], &[6], &[(&[0], &[3]), (&[3], &[3])])];
    let files = vec![vec![0, 1]];
    let plan = plan_reshard(&items, &options(Mesh::new(1, 1, 4, 1))).unwrap();
    let cost = reshard_cost(&items, &files, &plan);
    let got: Vec<(u64, u64, u64, u64, u64)> =
        cost.ranks.iter().map(|r| (r.chunks, r.bytes_written, r.bytes_read, r.reads, r.source_files)).collect();
    // Rank 1's rows 2 and 3 straddle the two source files: two reads.
    assert_eq!(got, [(1, 8, 8, 1, 1), (1, 8, 8, 2, 2), (1, 8, 8, 1, 1), (0, 0, 0, 0, 0)]);
    assert_eq!((cost.source_bytes, cost.source_chunks), (24, 2));
    assert_eq!((cost.max(|r| r.reads), cost.total(|r| r.bytes_read)), (2, 24));
}

#[test]
fn torch_dist_masters_are_fp32_even_when_the_job_kept_them_in_bf16() {
    let mut items = vec![
        tensor(&["model", NORM], &[4], &[(&[0], &[4])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg"], &[4], &[(&[0], &[4])]),
        tensor(&["optimizer", "state", OPT_NORM, "exp_avg_sq"], &[4], &[(&[0], &[4])]),
    ];
    if let Some(t) = items[0].tensor.as_mut() {
        t.dtype = DType::BF16;
    }
    let mut to = options(Mesh::new(1, 1, 2, 1));
    to.dialect = crate::dialect::Dialect::TorchDist;
    let plan = plan_reshard(&items, &to).unwrap();
    let dtype = |k: &str| plan.tensors.iter().find(|t| t.out.key == k).map(|t| t.out.dtype);
    let name = NORM.strip_prefix("module.").unwrap();
    assert_eq!(dtype(name), Some(DType::BF16));
    assert_eq!(dtype(&format!("optimizer.state.param.{name}")), Some(DType::F32), "widened, exactly");
}
