"""Code that runs in spawned gloo ranks (reshard N->M). Kept importable: mp.spawn pickles by name."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import harness


def placement_for(world: int, index: int, t: torch.Tensor):
    """A sharding different from the one written (which is FSDP dim-0 rows on a world of 1..8 ranks).

    world 2: Shard(0) everywhere (even splits).
    world 3: rotate Shard(0) / Shard(last dim) / Replicate, giving uneven and empty local shards.
    """
    if world == 2:
        return Shard(0)
    kind = index % 3
    if kind == 0:
        return Shard(0)
    if kind == 1:
        return Shard(t.dim() - 1)
    return Replicate()


def expected_local(t: torch.Tensor, placement, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of the global tensor under `placement` (torch.chunk semantics for Shard)."""
    if isinstance(placement, Replicate):
        return t
    dim = placement.dim
    chunks = torch.chunk(t, world, dim)
    if rank < len(chunks):
        return chunks[rank]
    return t.narrow(dim, t.shape[dim], 0)


def _reader(kind: str, path: str):
    if kind == "dcp":
        return dcp.FileSystemReader(path)
    if kind == "dcp-safetensors":
        return dcp.HuggingFaceStorageReader(path)
    raise ValueError(kind)


def reshard_worker(rank: int, world: int, port: int, jobs: list[tuple[str, str, str, int]]) -> None:
    """Load every job's checkpoint into DTensors on a CPU mesh of `world` ranks; compare local shards.

    jobs: (label, storage kind "dcp" | "dcp-safetensors", checkpoint dir, model fixture, tp, etp).
    """
    harness.join_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        problems: list[str] = []
        for label, kind, path, model, tp, etp in jobs:
            want = harness.reference(model, tp, etp=etp)
            state: dict[str, torch.Tensor] = {}
            expect: dict[str, torch.Tensor] = {}
            for i, (key, t) in enumerate(sorted(want.items())):
                p = placement_for(world, i, t)
                state[key] = distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), mesh, [p],
                                               src_data_rank=None)
                expect[key] = expected_local(t, p, rank, world)
            try:
                dcp.load(state, storage_reader=_reader(kind, path))
            except BaseException as e:  # CheckpointException is a BaseException
                problems.append(f"[{label}] rank {rank}: dcp.load raised {type(e).__name__}: {e}")
                continue
            for key in sorted(want):
                local = state[key].to_local()
                if local.shape != expect[key].shape:
                    problems.append(f"[{label}] rank {rank}: {key}: local shard {tuple(local.shape)}, "
                                    f"expected {tuple(expect[key].shape)} under {state[key].placements}")
                elif not torch.equal(local, expect[key]):
                    problems.append(f"[{label}] rank {rank} {state[key].placements}: "
                                    + harness.describe_mismatch(key, local, expect[key]))
        if problems:
            raise AssertionError(f"{len(problems)} problem(s) on rank {rank}/{world}:\n" + "\n".join(problems[:40]))
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()
