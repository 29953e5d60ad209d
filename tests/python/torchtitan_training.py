"""torchtitan training checkpoints written and read by real torch.distributed (gloo ranks), with
torchtitan 0.3.0's own code where it has some: a model on FSDP2's placements (`Shard(0)`, grouped
experts `Shard(1)` once there are more ranks than experts, buffers replicated), its attention's
q/k/v fused into `qkv_linear.wqkv` and split again on save by torchtitan's `FusedQKVLinear`
hooks, `AdamW` built on `(name, param)` pairs and stepped, its state flattened by torchtitan's
`get_flat_optim_state_dict`, and the other states as torchtitan's checkpointer saves them
(`lr_scheduler`, `dataloader` keyed by DP rank, `train_state`) — fsdp2-frameworks.md §2.
Kept importable: spawned ranks import it by name.
"""

from __future__ import annotations

import json
import pickle
import traceback
import zlib
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import harness
from torchtitan_ref import torchtitan_seed

STEPS = 2


def _torchtitan():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                           load_flat_optim_state_dict)
        from torchtitan.models.common.attention import FusedQKVLinear
    return SimpleNamespace(flat=get_flat_optim_state_dict, init=init_optim_state, load=load_flat_optim_state_dict,
                           fused=FusedQKVLinear)


def is_buffer(key: str) -> bool:
    return key.endswith(".expert_bias_E")


def placement(key: str, shape: torch.Size, world: int):
    """FSDP2's placement of a parameter in torchtitan: grouped experts `Shard(1)` when the
    expert-FSDP mesh has more ranks than experts (torchtitan/distributed/fsdp.py), else `Shard(0)`."""
    if ".routed_experts." in key and len(shape) == 3 and world > shape[0]:
        return Shard(1)
    return Shard(0)


def _attention(release: Path) -> SimpleNamespace:
    cfg = json.loads((release / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # What FusedQKVLinear's hooks read off the module.
    return SimpleNamespace(head_dim=hd, heads_per_kv=heads // kv, r_dim=heads // kv + 2)


def native_params(release: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's parameters as torchtitan holds them in training (q/k/v fused into `wqkv` by
    `FusedQKVLinear`'s load hook), and its buffers."""
    tt, attention = _torchtitan(), _attention(release)
    seed = torchtitan_seed(release)
    prefixes = sorted({k[: -len("wq.weight")] for k in seed if k.endswith(".qkv_linear.wq.weight")})
    for prefix in prefixes:
        tt.fused._merge_qkv_on_load(attention, seed, prefix)
    buffers = {k: v for k, v in seed.items() if is_buffer(k)}
    return {k: v for k, v in seed.items() if not is_buffer(k)}, buffers


def _grad(key: str, step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}@{step}".encode()))
    return torch.randn(shape, generator=gen)


def build(release: Path, world: int, mesh, fill: str):
    """Parameters on `mesh` (the release's values, or NaN when `fill` is "nan") and an AdamW over
    them (its state created for a load, by torchtitan's `init_optim_state`)."""
    tt = _torchtitan()
    params, buffers = native_params(release)
    dist_params = {}
    for key, t in params.items():
        value = t if fill == "release" else harness.nan_like_spec(t.shape, t.dtype)
        dist_params[key] = torch.nn.Parameter(distribute_tensor(value, mesh, [placement(key, t.shape, world)],
                                                                src_data_rank=None))
    opt = torch.optim.AdamW(list(dist_params.items()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    if fill == "nan":
        tt.init(opt)
    return dist_params, buffers, opt


def build_tp(release: Path, dp: int, tp: int):
    """Parameters (NaN) placed by torch itself as torchtitan parallelizes them on `(dp, tp)`:
    distributed over TP by its sharding configs (the fused `wqkv` colwise), then `fully_shard`
    over the data-parallel mesh; and an AdamW over them with its state created for a load."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from torchtitan_worker import _tp_placement

    tt = _torchtitan()
    params, buffers = native_params(release)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("fsdp", "tp"))
    root, names = nn.Module(), {}
    for i, (key, t) in enumerate(sorted(params.items())):
        value = distribute_tensor(harness.nan_like_spec(t.shape, t.dtype), mesh["tp"], [_tp_placement(key, 1)],
                                  src_data_rank=None)
        root.register_parameter(f"p{i}", torch.nn.Parameter(value))
        names[f"p{i}"] = key
    by_param = {p: names[n] for n, p in root.named_parameters()}
    fully_shard(root, mesh=mesh["fsdp"],
                shard_placement_fn=lambda p: placement(by_param[p], p.shape, dp))
    dist_params = {names[n]: p for n, p in root.named_parameters()}
    opt = torch.optim.AdamW(list(dist_params.items()), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    tt.init(opt)
    return dist_params, buffers, opt


def state_dict(release: Path, params, buffers, opt, rank: int, world: int) -> dict:
    """What torchtitan's checkpointer saves: model keys at the top (the fused q/k/v split again by
    `FusedQKVLinear`'s save hook), then `optimizer`, `lr_scheduler`, `dataloader`, `train_state`."""
    tt, attention = _torchtitan(), _attention(release)
    model = {k: p.detach() for k, p in params.items()}
    for key in [k for k in model if k.endswith(".qkv_linear.wqkv.weight")]:
        tt.fused._split_qkv_on_save(attention, model, key[: -len("wqkv.weight")], None)
    model.update(buffers)
    return {
        **model,
        "optimizer": tt.flat(opt),
        "lr_scheduler": {"last_epoch": STEPS},
        "dataloader": {f"dp_rank_{rank}": pickle.dumps({"sample_idx": 100 * rank + STEPS}), "world_size": world},
        "train_state": {"step": STEPS, "ntokens_seen": 4096 * STEPS},
    }


def save_worker(rank: int, world: int, port: int, release: str, step_dir: str) -> None:
    """Trains `STEPS` AdamW steps with fixed gradients on `world` ranks and saves `step_dir`."""
    harness.join_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        params, buffers, opt = build(Path(release), world, mesh, "release")
        for step in range(1, STEPS + 1):
            for key, p in params.items():
                p.grad = distribute_tensor(_grad(key, step, p.shape), mesh, p.placements)
            opt.step()
        dcp.save(state_dict(Path(release), params, buffers, opt, rank, world), checkpoint_id=step_dir)
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()


def _describe(key: str, got, want) -> str | None:
    if isinstance(want, DTensor):
        if not isinstance(got, DTensor) or got.placements != want.placements:
            return f"{key}: placements {getattr(got, 'placements', None)}, want {want.placements}"
        got, want = got.to_local(), want.to_local()
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
            got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        return None if same else harness.describe_mismatch(key, got, want)
    return None if got == want else f"{key}: {got!r}, want {want!r}"


def load_worker(rank: int, world: int, port: int, release: str, source: str, ours: str,
                keep_dataloader: bool, tp: int = 1) -> None:
    """Loads `source` (torch's own load-time resharding) and `ours` (Shardline's reshard) into the
    same state on `world` ranks (`world / tp` data-parallel ranks of `tp` tensor-parallel ones), as
    torchtitan resumes — the dataloader excluded when the degree changed — and compares every
    local shard and value; then hands our optimizer state to torchtitan's
    `load_flat_optim_state_dict`."""
    harness.join_gloo(rank, world, port)
    try:
        tt = _torchtitan()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)) if tp == 1 else None
        loaded = []
        for ckpt in (source, ours):
            if tp == 1:
                params, buffers, opt = build(Path(release), world, mesh, "nan")
            else:
                params, buffers, opt = build_tp(Path(release), world // tp, tp)
            state = state_dict(Path(release), params, buffers, opt, rank // tp, world // tp)
            if not keep_dataloader:
                state.pop("dataloader")  # torchtitan: --checkpoint.exclude_from_loading dataloader
            dcp.load(state, checkpoint_id=ckpt)
            loaded.append((state, params, opt))
        (want, _, _), (got, params, opt) = loaded
        flat = lambda s: {**{k: v for k, v in s.items() if not isinstance(v, dict)},
                          **{f"{k}.{i}": x for k, v in s.items() if isinstance(v, dict) for i, x in v.items()}}
        want, got = flat(want), flat(got)
        problems = [f"rank {rank}: keys differ {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
        problems += [f"rank {rank}: {p}" for k in sorted(want) if (p := _describe(k, got[k], want[k]))]
        if problems:
            raise AssertionError("\n".join(problems[:20]))
        if tp > 1:
            # Each rank's parameters and moments are chunks of its own file.
            from torchtitan_worker import stored_where_placed

            md = dcp.FileSystemReader(ours).read_metadata()
            problems = [p for k, v in got.items() if isinstance(v, DTensor)
                        and (p := stored_where_placed(md, k, v, rank, tp))]
            if problems:
                raise AssertionError("\n".join(problems[:20]))
        tt.load(opt, {k[len("optimizer."):]: v for k, v in got.items() if k.startswith("optimizer.")})
        for key, p in params.items():
            for s in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(opt.state[p][s].to_local(), got[f"optimizer.state.{key}.{s}"].to_local()):
                    raise AssertionError(f"rank {rank}: the optimizer's {s} of {key} is not what was loaded")
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()
