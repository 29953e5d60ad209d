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
        dist.destroy_process_group()
