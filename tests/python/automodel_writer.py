"""Writes NeMo Automodel-layout training checkpoints with real torch.distributed, as Automodel
saves them (fsdp2-frameworks.md §1): `epoch_E_step_S/model/` holds the release's tensors under
their HF names as DTensors — FSDP2 `Shard(0)` for dense parameters, per-expert weights `Shard(1)`
as Automodel's expert split leaves them on its `ep_shard` mesh — saved by gloo ranks through
torch's `HuggingFaceStorageWriter(save_distributed=True)` (one `shard-0000r-model-00001-of-00001
.safetensors` per rank, `DCP_SHARDING_INFO` in each header, no `.metadata`), or with the default
DCP writer (`model_save_format: torch_save`). Kept importable: spawned ranks import it by name.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import harness
import reference as ref


def placement(name: str, t: torch.Tensor):
    if ".mlp.experts." in name and t.dim() == 2:
        return Shard(1)
    return Shard(0)


def save_worker(rank: int, world: int, port: int, release: str, model_dir: str, fmt: str, dtype: str) -> None:
    harness.join_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
        tensors = ref.load_hf_tensors(Path(release))
        cast = getattr(torch, dtype) if dtype else None
        state = {}
        for name, t in sorted(tensors.items()):
            t = t.to(cast) if cast is not None else t
            state[name] = distribute_tensor(t, mesh, [placement(name, t)])
        if fmt == "safetensors":
            writer = dcp.HuggingFaceStorageWriter(path=model_dir, save_distributed=True)
            dcp.save(state, storage_writer=writer)
        else:
            dcp.save(state, checkpoint_id=model_dir)
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()
