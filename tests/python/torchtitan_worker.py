"""Spawned gloo ranks that load a torchtitan seed as torchtitan's FSDP2 places it (`Shard(0)` over
the data-parallel mesh) and compare every local shard with `torch.chunk` of the reference.
Kept importable: mp.start_processes pickles by name."""

from __future__ import annotations

from pathlib import Path
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import harness
from torchtitan_ref import torchtitan_seed


def load_worker(rank: int, world: int, port: int, jobs: list[tuple[str, str]]) -> None:
    """jobs: (release dir, seed `step-0` dir)."""
    harness.join_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        problems: list[str] = []
        for release, seed in jobs:
            want = torchtitan_seed(Path(release))
            state = {k: distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), mesh, [Shard(0)], src_data_rank=None)
                     for k, t in want.items()}
            dcp.load(state, checkpoint_id=seed)
            for key, t in sorted(want.items()):
                pieces = torch.chunk(t, world, 0)
                expect = pieces[rank] if rank < len(pieces) else t.narrow(0, t.shape[0], 0)
                local = state[key].to_local()
                if local.shape != expect.shape or not torch.equal(local, expect):
                    problems.append(f"{seed} rank {rank}: " + harness.describe_mismatch(key, local, expect))
        if problems:
            raise AssertionError("\n".join(problems[:20]))
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()


def _routed(key: str, shape) -> bool:
    return len(shape) == 3 and (".routed_experts." in key or ".moe.experts." in key)


def load_ep_worker(rank: int, world: int, port: int, release: str, seed: str, ep: int) -> None:
    """Loads a seed written with `--ep` as torchtitan places it: routed experts on the sparse
    mesh `(efsdp, ep)` (ep the inner, contiguous-rank axis) as `[_StridedShard(0, split_factor=ep),
    Shard(0)]` — `[Shard(1), Shard(0)]` once the mesh has more ranks than experts — and the rest
    `Shard(0)` over every rank. Each local shard must be the expected slice (block `efsdp·p + f` of
    the experts, fsdp2-frameworks.md §2.3), torch's placement must say the same, and `.metadata`
    must store that very box in this rank's file."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    harness.join_gloo(rank, world, port)
    try:
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        md = dcp.FileSystemReader(seed).read_metadata()
        want = torchtitan_seed(Path(release))
        f, p = divmod(rank, ep)
        efsdp = world // ep
        state, boxes = {}, {}
        for key, t in want.items():
            if _routed(key, t.shape):
                strided = world <= t.shape[0]
                placements = [_StridedShard(0, split_factor=ep) if strided else Shard(1), Shard(0)]
                local_shape, offset = compute_local_shape_and_global_offset(t.shape, sparse, placements)
                slab = t.shape[0] // ep
                if strided:
                    # Evenly divided (torchtitan's adapter requires it): block `efsdp·p + f`.
                    block = slab // efsdp
                    expect = ((efsdp * p + f) * block, 0, 0), (block, t.shape[1], t.shape[2])
                else:
                    q = -(-t.shape[1] // efsdp)
                    rows = max(0, min(q, t.shape[1] - f * q))
                    expect = (p * slab, min(f * q, t.shape[1]), 0), (slab, rows, t.shape[2])
                if (tuple(offset), tuple(local_shape)) != expect:
                    raise AssertionError(f"{key}: torch places rank {rank} at {tuple(offset)} {tuple(local_shape)}, "
                                         f"torchtitan's blocks say {expect}")
                local = harness.nan_like_spec(local_shape, t.dtype)
                state[key] = DTensor.from_local(local, sparse, placements, shape=t.shape, stride=t.stride())
                boxes[key] = (tuple(offset), tuple(local_shape))
            else:
                state[key] = distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), dense, [Shard(0)],
                                               src_data_rank=None)
        dcp.load(state, checkpoint_id=seed)
        problems = []
        for key, (offset, size) in boxes.items():
            expect = want[key][tuple(slice(o, o + s) for o, s in zip(offset, size))]
            local = state[key].to_local()
            if not torch.equal(local, expect):
                problems.append(f"rank {rank}: " + harness.describe_mismatch(key, local, expect))
            chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks}
            from torch.distributed.checkpoint.metadata import MetadataIndex
            if size and all(size) and (offset, size) not in chunks:
                problems.append(f"{key}: no chunk at {offset} {size} for rank {rank}")
            elif size and all(size):
                stored = md.storage_data[MetadataIndex(key, torch.Size(offset))].relative_path
                if stored != f"__{rank}_0.distcp":
                    problems.append(f"{key}: rank {rank}'s block is stored in {stored}")
        for key, t in want.items():
            if key not in boxes:
                pieces = torch.chunk(t, world, 0)
                expect = pieces[rank] if rank < len(pieces) else t.narrow(0, t.shape[0], 0)
                if not torch.equal(state[key].to_local(), expect):
                    problems.append(f"rank {rank}: " + harness.describe_mismatch(key, state[key].to_local(), expect))
        if problems:
            raise AssertionError("\n".join(problems[:20]))
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()


# The dim torchtitan's tensor parallelism splits each parameter along, from its sharding configs
# (torchtitan main, models/common/decoder_sharding.py: colwise `S(0)`, rowwise `S(1)`;
# models/common/moe_sharding.py: routed experts without EP `S(1)` colwise, `S(2)` rowwise, the
# router and expert bias replicated; deepseek_v3/sharding.py: MLA's up-projections colwise, its
# low-rank projections and norms replicated, MTP's `eh_proj` replicated).
_TP_COLWISE = ("tok_embeddings.weight", "lm_head.weight", ".wq.weight", ".wk.weight", ".wv.weight", ".wqkv.weight",
               ".wq.bias", ".wk.bias", ".wv.bias", "attention.sinks", ".wq_b.weight",
               ".wkv_b.weight", "feed_forward.w1.weight", "feed_forward.w3.weight", "shared_experts.w1.weight",
               "shared_experts.w3.weight")
_TP_ROWWISE = (".wo.weight", "feed_forward.w2.weight", "shared_experts.w2.weight")


def _tp_placement(key: str, ep: int):
    from torch.distributed.tensor import Replicate

    if ".routed_experts." in key or ".moe.experts." in key:
        if ep > 1:
            return None  # on the sparse mesh, out of TP
        # gpt_oss/sharding.py: mlp1 and its bias colwise, mlp2 rowwise, its bias replicated.
        if key.endswith("mlp2_bias_ED"):
            return Replicate()
        return Shard(2) if key.endswith(("w2_EDF", ".w2", "mlp2_weight_EDF")) else Shard(1)
    if key.endswith(_TP_COLWISE):
        return Shard(0)
    if key.endswith(_TP_ROWWISE):
        return Shard(1)
    return Replicate()


def load_tp_worker(rank: int, world: int, port: int, jobs: list[tuple[str, str]], tp: int, ep: int) -> None:
    """jobs: (release dir, seed `step-0` dir), each written with `--tp tp --ep ep`. Loads each seed
    into parameters placed by torch itself as torchtitan parallelizes: each distributed over TP by
    torchtitan's sharding configs, then `fully_shard` over the data-parallel mesh (routed experts
    under EP: `Shard(0)` over `ep`, then `fully_shard` over `efsdp` of the sparse mesh that spans
    every rank). Each rank's loaded shard must be the slice of the reference torch's placement
    gives it, stored in this rank's file (a TP replica in the file of a rank of its FSDP row), and
    the whole tensors must equal the reference."""
    harness.join_gloo(rank, world, port)
    try:
        dense = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("fsdp", "tp"))
        sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep")) if ep > 1 else None
        problems = []
        for release, seed in jobs:
            problems += [f"{Path(release).name}: {p}" for p in _load_tp(rank, tp, ep, dense, sparse, release, seed)]
        if problems:
            raise AssertionError("\n".join(problems[:20]))
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()


def _load_tp(rank: int, tp: int, ep: int, dense, sparse, release: str, seed: str) -> list[str]:
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    want = torchtitan_seed(Path(release))
    md = dcp.FileSystemReader(seed).read_metadata()
    dense_root, sparse_root = nn.Module(), nn.Module()
    names = {}
    for i, (key, t) in enumerate(sorted(want.items())):
        placement = _tp_placement(key, ep)
        if placement is None:
            param = distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), sparse["ep"], [Shard(0)],
                                      src_data_rank=None)
            sparse_root.register_parameter(f"p{i}", nn.Parameter(param, requires_grad=False))
        else:
            param = distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), dense["tp"], [placement],
                                      src_data_rank=None)
            dense_root.register_parameter(f"p{i}", nn.Parameter(param, requires_grad=False))
        names[f"p{i}"] = key
    fully_shard(dense_root, mesh=dense["fsdp"])
    if sparse is not None:
        fully_shard(sparse_root, mesh=sparse["efsdp"])
    params = dict(dense_root.named_parameters())
    params.update(sparse_root.named_parameters())
    state = {names[n]: p for n, p in params.items()}
    dcp.load(state, checkpoint_id=seed)
    problems = []
    for key, t in sorted(want.items()):
        param = state[key]
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, param.device_mesh, param.placements)
        expect = t[tuple(slice(o, o + s) for o, s in zip(offset, local_shape))]
        if not torch.equal(param.to_local(), expect):
            problems.append(f"rank {rank} {param.placements}: "
                            + harness.describe_mismatch(key, param.to_local(), expect))
        if problem := stored_where_placed(md, key, param, rank, tp):
            problems.append(problem)
        full = param.full_tensor()
        if rank == 0 and not torch.equal(full, t):
            problems.append("whole: " + harness.describe_mismatch(key, full, t))
    return problems


def stored_where_placed(md, key: str, param, rank: int, tp: int) -> str | None:
    """Why the DTensor `param`'s local box on `rank` is not a chunk stored in that rank's file —
    or, replicated over TP, in the file of a rank of its FSDP row — if it is not: each rank of a
    job on torchtitan's placements reads only its own part."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if not all(shape) or all(p.is_replicate() for p in param.placements):
        return None  # empty, or whole on every rank and written once (fused-QKV model keys)
    chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[key].chunks}
    if (tuple(offset), tuple(shape)) not in chunks:
        return f"{key}: no chunk at {tuple(offset)} {tuple(shape)} for rank {rank} ({param.placements})"
    stored = int(md.storage_data[MetadataIndex(key, torch.Size(offset))].relative_path.split("_")[2])
    replicated = param.placements[-1].is_replicate()
    if stored != rank and not (replicated and stored // tp == rank // tp):
        return f"{key}: rank {rank}'s block {param.placements} is stored in rank {stored}'s file"
    return None
