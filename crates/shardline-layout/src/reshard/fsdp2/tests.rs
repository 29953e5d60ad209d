//! FSDP2 resharding on small hand-made torchtitan checkpoints, and a property test of the
//! re-tiling against `torch.chunk`'s arithmetic written out here.

use proptest::prelude::*;

use super::*;
use crate::reshard::{flat_key, ChunkBox};
use crate::DType;

fn key_path(parts: &[&str]) -> Vec<PathElem> {
    parts.iter().map(|p| PathElem::Key(p.to_string())).collect()
}

/// `torch.chunk(n, d)`'s pieces: ceil-sized, trailing ones short or missing.
fn torch_chunk(n: u64, d: u64) -> Vec<(u64, u64)> {
    let q = n.div_ceil(d);
    (0..d).map(|j| (j * q, n.min((j + 1) * q).saturating_sub(j * q))).filter(|&(_, s)| s > 0).collect()
}

/// A tensor saved by `d` ranks with `Shard(dim)` (or whole when `d` is 0).
fn saved(parts: &[&str], shape: &[u64], dim: usize, d: u64) -> SourceItem {
    let path = key_path(parts);
    let chunks = if d == 0 {
        vec![ChunkBox::whole(shape)]
    } else {
        torch_chunk(shape[dim], d)
            .into_iter()
            .map(|(off, size)| {
                let mut b = ChunkBox::whole(shape);
                b.offsets[dim] = off;
                b.sizes[dim] = size;
                b
            })
            .collect()
    };
    SourceItem {
        key: flat_key(&path),
        path,
        tensor: Some(SourceTensorMeta { dtype: DType::F32, shape: shape.to_vec(), chunks }),
    }
}

fn object(parts: &[&str]) -> SourceItem {
    let path = key_path(parts);
    SourceItem { key: flat_key(&path), path, tensor: None }
}

fn options(dp: u64) -> Fsdp2Options {
    Fsdp2Options { dialect: Dialect::Torchtitan(Default::default()), dp, tp: 1, ep: 1, source_ranks: 4 }
}

/// `(rank, offsets, sizes)` of every written chunk of the target tensor `key`.
fn chunks_of(plan: &ReshardPlan, key: &str) -> Vec<(u64, Vec<u64>, Vec<u64>)> {
    let i = plan.tensors.iter().position(|t| t.out.key == key).unwrap();
    plan.written_chunks(i).map(|c| (c.rank, c.offsets, c.sizes)).collect()
}

#[test]
fn torchtitan_paths_classify() {
    assert_eq!(
        classify_fsdp2(&key_path(&["tok_embeddings.weight"])),
        Fsdp2Item::Param { name: "tok_embeddings.weight".into() }
    );
    assert_eq!(
        classify_fsdp2(&key_path(&["optimizer", "state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"])),
        Fsdp2Item::State { name: "layers.0.attention.qkv_linear.wqkv.weight".into(), state: "exp_avg".into() }
    );
    assert_eq!(
        classify_fsdp2(&key_path(&["optim", "state.model.norm.weight.step"])).clone(),
        Fsdp2Item::State { name: "model.norm.weight".into(), state: "step".into() }
    );
    assert_eq!(classify_fsdp2(&key_path(&["optimizer", "param_groups.norm.weight.lr"])), Fsdp2Item::Other);
    assert_eq!(classify_fsdp2(&key_path(&["dataloader", "dp_rank_3"])), Fsdp2Item::DataloaderRank(3));
    assert_eq!(classify_fsdp2(&key_path(&["dataloader", "world_size"])), Fsdp2Item::Dataloader);
    assert_eq!(classify_fsdp2(&key_path(&["train_state", "step"])), Fsdp2Item::Other);
    assert_eq!(classify_fsdp2(&key_path(&["lr_scheduler", "last_epoch"])), Fsdp2Item::Other);
}

#[test]
fn placements_are_read_off_the_chunks() {
    let whole = |s: &[u64]| vec![ChunkBox::whole(s)];
    assert_eq!(source_placement(&[6, 4], &whole(&[6, 4])), Ok(Placement::Whole));
    assert_eq!(source_placement(&[], &whole(&[])), Ok(Placement::Whole));
    let item = saved(&["w"], &[2, 7, 3], 1, 3);
    assert_eq!(source_placement(&[2, 7, 3], &item.tensor.unwrap().chunks), Ok(Placement::Shard(1)));
    // Even pieces of 2 rows are not torch.chunk's for 7 rows over 4 ranks (2, 2, 2, 1 is): 3, 2, 2 is not.
    let b = |o: u64, s: u64| ChunkBox { offsets: vec![o, 0], sizes: vec![s, 4] };
    let err = source_placement(&[7, 4], &[b(0, 3), b(3, 2), b(5, 2)]).unwrap_err();
    assert!(err.contains("not `torch.chunk` pieces"), "{err}");
    let grid = [(0, 0), (0, 2), (3, 0), (3, 2)].map(|(r, c)| ChunkBox { offsets: vec![r, c], sizes: vec![3, 2] });
    let err = source_placement(&[6, 4], &grid).unwrap_err();
    assert!(err.contains("split along dims [0, 1]"), "{err}");
}

#[test]
fn a_torchtitan_checkpoint_reshards_4_to_3() {
    let items = vec![
        saved(&["tok_embeddings.weight"], &[10, 4], 0, 4),
        saved(&["optimizer", "state.tok_embeddings.weight.exp_avg"], &[10, 4], 0, 4),
        saved(&["optimizer", "state.tok_embeddings.weight.step"], &[], 0, 0),
        saved(&["layers.0.attention.qkv_linear.wq.weight"], &[8, 4], 0, 0),
        saved(&["optimizer", "state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"], &[16, 4], 0, 4),
        saved(&["layers.0.moe.routed_experts.inner_experts.w1_EFD"], &[2, 6, 4], 1, 4),
        saved(&["layers.0.moe.expert_bias_E"], &[2], 0, 0),
        object(&["optimizer", "param_groups.tok_embeddings.weight.lr"]),
        object(&["lr_scheduler", "last_epoch"]),
        object(&["train_state", "step"]),
        object(&["dataloader", "world_size"]),
        object(&["dataloader", "dp_rank_0"]),
        object(&["dataloader", "dp_rank_1"]),
        object(&["dataloader", "dp_rank_2"]),
        object(&["dataloader", "dp_rank_3"]),
    ];
    let plan = plan_fsdp2_reshard(&items, &options(3)).unwrap();
    let rows = |v: &[(u64, u64)], rest: &[u64]| -> Vec<(u64, Vec<u64>, Vec<u64>)> {
        v.iter()
            .enumerate()
            .map(|(j, &(o, s))| {
                let mut off = vec![o];
                off.extend(rest.iter().map(|_| 0));
                let mut sz = vec![s];
                sz.extend(rest);
                (j as u64, off, sz)
            })
            .collect()
    };
    assert_eq!(chunks_of(&plan, "tok_embeddings.weight"), rows(&[(0, 4), (4, 4), (8, 2)], &[4]));
    assert_eq!(
        chunks_of(&plan, "optimizer.state.tok_embeddings.weight.exp_avg"),
        rows(&[(0, 4), (4, 4), (8, 2)], &[4])
    );
    assert_eq!(chunks_of(&plan, "optimizer.state.tok_embeddings.weight.step"), vec![(0, vec![], vec![])]);
    // The fused-QKV model keys stay whole; `wqkv`'s moments are sharded.
    assert_eq!(chunks_of(&plan, "layers.0.attention.qkv_linear.wq.weight"), vec![(0, vec![0, 0], vec![8, 4])]);
    assert_eq!(chunks_of(&plan, "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg").len(), 3);
    // 3 ranks, 2 experts: Shard(1) (the source was Shard(1) at 4 ranks too).
    assert_eq!(
        chunks_of(&plan, "layers.0.moe.routed_experts.inner_experts.w1_EFD"),
        vec![(0, vec![0, 0, 0], vec![2, 2, 4]), (1, vec![0, 2, 0], vec![2, 2, 4]), (2, vec![0, 4, 0], vec![2, 2, 4])]
    );
    assert_eq!(chunks_of(&plan, "layers.0.moe.expert_bias_E"), vec![(0, vec![0], vec![2])]);
    let objects: Vec<&str> = plan.objects.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(
        objects,
        ["lr_scheduler.last_epoch", "optimizer.param_groups.tok_embeddings.weight.lr", "train_state.step"]
    );
    assert!(
        plan.notes.iter().any(|n| n.contains("dataloader state of 4 data-parallel ranks is left out")),
        "{:?}",
        plan.notes
    );

    // At its own degree the dataloader is carried; at 2 ranks the experts are Shard(0).
    let plan = plan_fsdp2_reshard(&items, &options(4)).unwrap();
    assert_eq!(plan.objects.len(), 8);
    let plan = plan_fsdp2_reshard(&items, &options(2)).unwrap();
    assert_eq!(
        chunks_of(&plan, "layers.0.moe.routed_experts.inner_experts.w1_EFD"),
        vec![(0, vec![0, 0, 0], vec![1, 6, 4]), (1, vec![1, 0, 0], vec![1, 6, 4])]
    );
}

#[test]
fn a_one_rank_save_is_sharded_as_fsdp2_shards_parameters() {
    let items = vec![saved(&["norm.weight"], &[5], 0, 0), saved(&["layers.0.moe.expert_bias_E"], &[4], 0, 0)];
    let plan = plan_fsdp2_reshard(&items, &Fsdp2Options { source_ranks: 1, ..options(2) }).unwrap();
    assert_eq!(chunks_of(&plan, "norm.weight"), vec![(0, vec![0], vec![3]), (1, vec![3], vec![2])]);
    assert_eq!(chunks_of(&plan, "layers.0.moe.expert_bias_E"), vec![(0, vec![0], vec![4])]);
}

#[test]
fn what_cannot_be_resharded_is_refused_with_every_reason() {
    let mut bad_state = saved(&["optimizer", "state.norm.weight.exp_avg"], &[6], 0, 2);
    bad_state.tensor.as_mut().unwrap().shape = vec![6];
    let items = vec![
        saved(&["norm.weight"], &[6], 0, 3),
        bad_state,
        SourceItem {
            key: "tp.weight".into(),
            path: key_path(&["tp.weight"]),
            tensor: Some(SourceTensorMeta {
                dtype: DType::F32,
                shape: vec![4, 4],
                chunks: [(0, 0), (0, 2), (2, 0), (2, 2)]
                    .map(|(r, c)| ChunkBox { offsets: vec![r, c], sizes: vec![2, 2] })
                    .to_vec(),
            }),
        },
        {
            let mut gap = saved(&["gap.weight"], &[6], 0, 3);
            gap.tensor.as_mut().unwrap().chunks.pop();
            gap
        },
    ];
    let err = plan_fsdp2_reshard(&items, &options(2)).unwrap_err().to_string();
    assert!(err.contains("`optimizer.state.norm.weight.exp_avg` cannot be resharded like its parameter `norm.weight`: its chunks are not its parameter's"), "{err}");
    assert!(err.contains("`gap.weight`: chunks hold 4 of its 6 elements"), "{err}");
    // A TP split is torchtitan's (its sharding configs place the target), not Automodel's.
    assert!(!err.contains("tp.weight"), "{err}");
    let err = plan_fsdp2_reshard(&items[2..3], &automodel(2, 1)).unwrap_err().to_string();
    assert!(err.contains("`tp.weight`: it is split along dims [0, 1]"), "{err}");
    assert!(plan_fsdp2_reshard(&[], &options(0)).unwrap_err().to_string().contains("at least 1"));
    // An expert degree of 0 is refused before any placement divides by it.
    let grouped = saved(&["layers.0.moe.routed_experts.inner_experts.w1_EFD"], &[4, 2, 2], 0, 2);
    let err = plan_fsdp2_reshard(&[grouped], &Fsdp2Options { ep: 0, ..options(2) }).unwrap_err().to_string();
    assert!(err.contains("`ep` must be at least 1"), "{err}");
}

proptest! {
    /// Any `Shard(dim)` save at any degree re-tiles to `torch.chunk`'s pieces at any other, piece
    /// `j` on rank `j`, and the pieces tile the tensor.
    #[test]
    fn retiling_is_torch_chunk(
        shape in prop::collection::vec(1u64..12, 1..4),
        dim_pick in 0usize..3,
        from in 1u64..9,
        to in 1u64..9,
    ) {
        let dim = dim_pick % shape.len();
        let items = vec![saved(&["w"], &shape, dim, from)];
        let plan = plan_fsdp2_reshard(&items, &Fsdp2Options { source_ranks: from, ..options(to) }).unwrap();
        let got = chunks_of(&plan, "w");
        // A one-rank save shows nothing: FSDP2's default, Shard(0). A tensor saved whole by
        // several ranks was replicated: kept whole.
        let (dim, pieces) = if from == 1 {
            (0, torch_chunk(shape[0], to))
        } else if torch_chunk(shape[dim], from).len() == 1 {
            (dim, vec![(0, shape[dim])])
        } else {
            (dim, torch_chunk(shape[dim], to))
        };
        prop_assert_eq!(got.len(), pieces.len());
        for (j, ((rank, off, size), (o, s))) in got.iter().zip(&pieces).enumerate() {
            prop_assert_eq!(*rank, j as u64);
            for d in 0..shape.len() {
                prop_assert_eq!(off[d], if d == dim { *o } else { 0 });
                prop_assert_eq!(size[d], if d == dim { *s } else { shape[d] });
            }
        }
        let boxes: Vec<ChunkBox> = got.into_iter().map(|(_, offsets, sizes)| ChunkBox { offsets, sizes }).collect();
        prop_assert!(check_tiling(&shape, &boxes).is_ok());
    }
}

/// A tensor saved with explicit boxes `(offsets, sizes)`.
fn boxed(parts: &[&str], shape: &[u64], boxes: &[(Vec<u64>, Vec<u64>)]) -> SourceItem {
    let path = key_path(parts);
    SourceItem {
        key: flat_key(&path),
        path,
        tensor: Some(SourceTensorMeta {
            dtype: DType::F32,
            shape: shape.to_vec(),
            chunks: boxes.iter().map(|(o, s)| ChunkBox { offsets: o.clone(), sizes: s.clone() }).collect(),
        }),
    }
}

fn automodel(dp: u64, ep: u64) -> Fsdp2Options {
    Fsdp2Options { dialect: Dialect::Automodel, dp, tp: 1, ep, source_ranks: 4 }
}

#[test]
fn automodel_experts_move_between_expert_parallel_meshes() {
    // Saved on 4 ranks as (ep_shard 2, ep 2): grouped `[6, 6, 8]` as `[Shard(1), Shard(0)]`, rank
    // (s, p) holding experts [3p, 3p + 3) and rows [3s, 3s + 3) of dim 1.
    let grouped: Vec<(Vec<u64>, Vec<u64>)> =
        (0..4).map(|g| (vec![3 * (g % 2), 3 * (g / 2), 0], vec![3, 3, 8])).collect();
    let mut items =
        vec![boxed(&["optim", "state.model.layers.0.mlp.experts.down_projs.exp_avg"], &[6, 6, 8], &grouped)];
    assert_eq!(
        source_placement(&[6, 6, 8], &items[0].tensor.as_ref().unwrap().chunks),
        Ok(Placement::Grouped { dim: 1 })
    );
    // An expert's own HF key `[4, 6]`, `Shard(1)` over its EP rank's 2 expert-FSDP ranks.
    for e in 0..6 {
        let key = format!("model.layers.0.mlp.experts.{e}.gate_proj.weight");
        items.push(saved(&[key.as_str()], &[4, 6], 1, 2));
    }
    // To 6 ranks as (ep_shard 2, ep 3): slabs of 2 experts, rank g = 3f + p.
    let plan = plan_fsdp2_reshard(&items, &automodel(6, 3)).unwrap();
    let want: Vec<(u64, Vec<u64>, Vec<u64>)> =
        (0..6).map(|g| (g, vec![2 * (g % 3), 3 * (g / 3), 0], vec![2, 3, 8])).collect();
    assert_eq!(chunks_of(&plan, "optim.state.model.layers.0.mlp.experts.down_projs.exp_avg"), want);
    // Expert 3 belongs to EP rank 1: ranks 1 and 4 hold its halves.
    assert_eq!(
        chunks_of(&plan, "model.layers.0.mlp.experts.3.gate_proj.weight"),
        vec![(1, vec![0, 0], vec![4, 3]), (4, vec![0, 3], vec![4, 3])]
    );
    // Without expert parallelism they are FSDP2 `Shard(1)` over every rank.
    let plan = plan_fsdp2_reshard(&items, &automodel(3, 1)).unwrap();
    assert_eq!(
        chunks_of(&plan, "optim.state.model.layers.0.mlp.experts.down_projs.exp_avg"),
        (0..3).map(|g| (g, vec![0, 2 * g, 0], vec![6, 2, 8])).collect::<Vec<_>>()
    );
    // An EP degree that does not divide the experts is refused.
    let err = plan_fsdp2_reshard(&items, &automodel(4, 4)).unwrap_err().to_string();
    assert!(err.contains("ep = 4 does not divide its 6 experts"), "{err}");
}

#[test]
fn torchtitan_routed_experts_are_strided_within_their_expert_parallel_slab() {
    let items = vec![saved(&["layers.0.moe.routed_experts.inner_experts.w1_EFD"], &[8, 4, 6], 0, 4)];
    let plan = plan_fsdp2_reshard(&items, &Fsdp2Options { ep: 2, ..options(4) }).unwrap();
    // Rank g = 2f + p holds block 2p + f of 2 experts: `[_StridedShard(0), Shard(0)]`.
    let want: Vec<(u64, Vec<u64>, Vec<u64>)> =
        (0..4).map(|g| (g, vec![2 * (2 * (g % 2) + g / 2), 0, 0], vec![2, 4, 6])).collect();
    assert_eq!(chunks_of(&plan, "layers.0.moe.routed_experts.inner_experts.w1_EFD"), want);
    // More ranks than experts: `Shard(1)` within each slab.
    let plan = plan_fsdp2_reshard(&items, &Fsdp2Options { ep: 2, ..options(12) }).unwrap();
    let got = chunks_of(&plan, "layers.0.moe.routed_experts.inner_experts.w1_EFD");
    assert_eq!(got.len(), 8, "{got:?}"); // 6 expert-FSDP ranks cut 4 rows: 4 pieces per slab
    assert_eq!(got[0], (0, vec![0, 0, 0], vec![4, 1, 6]));
    assert_eq!(got[1], (1, vec![4, 0, 0], vec![4, 1, 6]));
}

/// A torchtitan save on `(dp 2, tp 2)` — q colwise `[_StridedShard(0), Shard(0)]`, `wo` rowwise
/// `[Shard(0), Shard(1)]`, a norm replicated over TP — resharded to `(dp 3, tp 1)` and to
/// `(dp 1, tp 4)`: every piece where torchtitan's placements put it, moments with their parameter.
#[test]
fn a_torchtitan_save_with_tp_reshards_to_other_tp_and_dp() {
    let boxes = |b: &[([u64; 2], [u64; 2])]| -> Vec<ChunkBox> {
        b.iter().map(|(o, s)| ChunkBox { offsets: o.to_vec(), sizes: s.to_vec() }).collect()
    };
    let item = |parts: &[&str], chunks: Vec<ChunkBox>| {
        let path = key_path(parts);
        SourceItem {
            key: flat_key(&path),
            path,
            tensor: Some(SourceTensorMeta { dtype: DType::F32, shape: vec![8, 8], chunks }),
        }
    };
    // (dp 2, tp 2): q's TP block r of 4 rows, piece j of 2; wo's rows piece j, columns block r.
    let q = boxes(&[([0, 0], [2, 8]), ([4, 0], [2, 8]), ([2, 0], [2, 8]), ([6, 0], [2, 8])]);
    let wo = boxes(&[([0, 0], [4, 4]), ([0, 4], [4, 4]), ([4, 0], [4, 4]), ([4, 4], [4, 4])]);
    let items = vec![
        item(&["layers.0.attention.qkv_linear.wq.weight"], q.clone()),
        item(&["optimizer", "state.layers.0.attention.qkv_linear.wq.weight.exp_avg"], q),
        item(&["layers.0.attention.wo.weight"], wo),
        saved(&["layers.0.attention_norm.weight"], &[8], 0, 2),
    ];
    let plan = plan_fsdp2_reshard(&items, &options(3)).unwrap();
    let rows = |key: &str| chunks_of(&plan, key).into_iter().map(|(r, o, s)| (r, o[0], s[0])).collect::<Vec<_>>();
    assert_eq!(rows("layers.0.attention.qkv_linear.wq.weight"), [(0, 0, 3), (1, 3, 3), (2, 6, 2)]);
    assert_eq!(
        rows("optimizer.state.layers.0.attention.qkv_linear.wq.weight.exp_avg"),
        [(0, 0, 3), (1, 3, 3), (2, 6, 2)]
    );
    assert_eq!(chunks_of(&plan, "layers.0.attention.wo.weight")[2], (2, vec![6, 0], vec![2, 8]));
    let plan = plan_fsdp2_reshard(&items, &Fsdp2Options { tp: 4, ..options(1) }).unwrap();
    assert_eq!(plan.mesh.world(), 4);
    let q = chunks_of(&plan, "layers.0.attention.qkv_linear.wq.weight");
    assert_eq!(q.iter().map(|(r, o, _)| (*r, o[0])).collect::<Vec<_>>(), [(0, 0), (1, 2), (2, 4), (3, 6)]);
    let wo = chunks_of(&plan, "layers.0.attention.wo.weight");
    assert_eq!(
        wo.iter().map(|(r, o, s)| (*r, o[1], s[1])).collect::<Vec<_>>(),
        [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 2)]
    );
    // The norm is replicated over TP: written once, whole, by one of the four.
    assert_eq!(chunks_of(&plan, "layers.0.attention_norm.weight").len(), 1);
    // tp = 3 does not divide q's 8 rows.
    let err = plan_fsdp2_reshard(&items, &Fsdp2Options { tp: 3, ..options(1) }).unwrap_err().to_string();
    assert!(err.contains("tp = 3 does not divide dim 0 of [8, 8]"), "{err}");
}
