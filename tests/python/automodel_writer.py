"""Writes NeMo Automodel-layout training checkpoints with real torch.distributed, as Automodel
saves them (fsdp2-frameworks.md §1): `epoch_E_step_S/model/` holds the release's tensors under
their HF names as DTensors — FSDP2 `Shard(0)` for dense parameters, per-expert weights `Shard(1)`
as Automodel's expert split leaves them on its `ep_shard` mesh — saved by gloo ranks through
torch's `HuggingFaceStorageWriter(save_distributed=True)` (one `shard-0000r-model-00001-of-00001
.safetensors` per rank, `DCP_SHARDING_INFO` in each header, no `.metadata`), or with the default
DCP writer (`model_save_format: torch_save`). Kept importable: spawned ranks import it by name.
"""

from __future__ import annotations

import re
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
        harness.leave_gloo()


# ---------------------------------------------------------------------------------------------
# Training saves: native parameters stepped by AdamW, `optim/` as Automodel's OptimizerState saves
# it, `model/` from the trained parameters through the adapter's split, per-rank files
# ---------------------------------------------------------------------------------------------

STEPS = 2
EXPERTS = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def native_from_hf(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Automodel's native parameters of a release: HF names (its dense adapters pass them
    through), routed experts grouped as `MoESplitExpertsStateDictMixin` merges them —
    `gate_and_up_projs [E, H, 2I]` = `cat([gate.T, up.T], -1)` per expert, `down_projs [E, I, H]` =
    `down.T` (fsdp2-frameworks.md §1.3)."""
    native, experts = {}, {}
    for key, t in hf.items():
        m = EXPERTS.match(key)
        if m:
            experts.setdefault(m["base"], {}).setdefault(int(m["e"]), {})[m["proj"]] = t
        else:
            native[key] = t
    for base, by_expert in experts.items():
        ids = sorted(by_expert)
        native[f"{base}.gate_and_up_projs"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"].T, by_expert[e]["up_proj"].T], -1) for e in ids])
        native[f"{base}.down_projs"] = torch.stack([by_expert[e]["down_proj"].T for e in ids])
    return native


def hf_from_native(native: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's `to_hf`: grouped experts split back per expert and transposed."""
    hf = {}
    for key, t in native.items():
        if key.endswith(".gate_and_up_projs"):
            base, inter = key[: -len(".gate_and_up_projs")], t.shape[-1] // 2
            for e in range(t.shape[0]):
                hf[f"{base}.{e}.gate_proj.weight"] = t[e][:, :inter].T.contiguous()
                hf[f"{base}.{e}.up_proj.weight"] = t[e][:, inter:].T.contiguous()
        elif key.endswith(".down_projs"):
            base = key[: -len(".down_projs")]
            for e in range(t.shape[0]):
                hf[f"{base}.{e}.down_proj.weight"] = t[e].T.contiguous()
        else:
            hf[key] = t
    return hf


def hf_grouped_from_native(native: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step3p5's adapter `to_hf` (fsdp2-frameworks.md §1.3): grouped experts stay grouped on
    disk, `moe.{gate,up}_proj.weight [E, I, H]` and `moe.down_proj.weight [E, H, I]`, each a
    `transpose(1, 2)` of the native tensor."""
    hf = {}
    for key, t in native.items():
        if key.endswith(".mlp.experts.gate_and_up_projs"):
            base, inter = key[: -len(".mlp.experts.gate_and_up_projs")], t.shape[-1] // 2
            hf[f"{base}.moe.gate_proj.weight"] = t[..., :inter].transpose(1, 2).contiguous()
            hf[f"{base}.moe.up_proj.weight"] = t[..., inter:].transpose(1, 2).contiguous()
        elif key.endswith(".mlp.experts.down_projs"):
            hf[f"{key[: -len('.mlp.experts.down_projs')]}.moe.down_proj.weight"] = t.transpose(1, 2).contiguous()
        else:
            hf[key] = t
    return hf


def grouped_placement(key: str, t: torch.Tensor):
    """The placement of a Step3p5 HF tensor: the native `Shard(1)` of grouped experts moved to
    dim 2 by the transpose — the swap PR #1691 added (field report 004) — else `Shard(0)`."""
    return Shard(2) if ".moe." in key and t.dim() == 3 else Shard(0)


def native_placement(key: str, t: torch.Tensor):
    """FSDP2's placement of a native parameter: grouped experts `Shard(1)` on the `ep_shard`
    mesh (`_moe_shard_placement`), the rest `Shard(0)`."""
    return Shard(1) if key.endswith(("gate_and_up_projs", "down_projs")) and t.dim() == 3 else Shard(0)


def module_of(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module tree whose `named_parameters()` are `params`, so torch's state-dict helpers name
    the optimizer state by them."""
    root = torch.nn.Module()
    for key, p in params.items():
        *path, leaf = key.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, p)
    return root


def _grad(key: str, step: int, shape) -> torch.Tensor:
    import zlib
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(f"{key}@{step}".encode())))


class Meshes:
    """Automodel's meshes on `world` ranks (fsdp2-frameworks.md §1.5): the dense FSDP mesh of every
    rank and, under expert parallelism, the MoE mesh `(ep_shard, ep)`, `ep` the inner,
    contiguous-rank axis, on which grouped experts are `[Shard(1), Shard(0)]` and an expert's
    own HF tensor is `Shard(1)` over its EP rank's `ep_shard` group."""

    def __init__(self, world: int, ep: int):
        self.world, self.ep = world, ep
        self.dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
        self.moe = (init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("ep_shard", "ep"))
                    if ep > 1 else None)

    def native(self, key: str, value: torch.Tensor):
        if self.moe is not None and key.endswith(("gate_and_up_projs", "down_projs")):
            return distribute_tensor(value, self.moe, [Shard(1), Shard(0)], src_data_rank=None)
        return distribute_tensor(value, self.dense, [native_placement(key, value)], src_data_rank=None)

    def hf(self, key: str, value: torch.Tensor, place, experts: int):
        """The HF tensor as this rank saves it, or None when another EP rank owns it."""
        m = EXPERTS.match(key)
        if self.moe is None or not m:
            return distribute_tensor(value, self.dense, [place(key, value)], src_data_rank=None)
        if int(m["e"]) // (experts // self.ep) != dist.get_rank() % self.ep:
            return None
        return distribute_tensor(value, self.moe["ep_shard"], [Shard(1)], src_data_rank=None)


def trained(release: Path, meshes: Meshes, fill: str, dtype):
    """The native parameters on `meshes` (the release's, cast to `dtype`; NaN for a load
    template) in a module, and its AdamW."""
    native = native_from_hf(ref.load_hf_tensors(release))
    params = {}
    for key, t in sorted(native.items()):
        t = t.to(dtype)
        value = t if fill == "release" else torch.full(t.shape, float("nan"), dtype=t.dtype)
        params[key] = torch.nn.Parameter(meshes.native(key, value))
    model = module_of(params)
    # One tensor at a time: the parameters live on two meshes.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    return model, params, opt


def _hf_state(meshes: Meshes, hf_full: dict[str, torch.Tensor], place, fill) -> dict:
    experts = max((int(m["e"]) + 1 for k in hf_full if (m := EXPERTS.match(k))), default=0)
    out = {}
    for key, t in hf_full.items():
        d = meshes.hf(key, t if fill is None else torch.full(t.shape, fill, dtype=t.dtype), place, experts)
        if d is not None:
            out[key] = d
    return out


def sched_state(step: int) -> dict:
    """What Automodel's `OptimizerParamScheduler.state_dict()` holds (scheduler.py)."""
    return {"max_lr": 0.01, "lr_warmup_steps": 0, "num_steps": step, "lr_decay_style": "cosine",
            "lr_decay_steps": 100, "min_lr": 0.0, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
            "wd_incr_steps": 100}


def save_training_worker(rank: int, world: int, port: int, release: str, step_dir: str, fmt: str, dtype: str,
                         grouped: bool = False, ep: int = 1) -> None:
    """Two AdamW steps on `world` ranks, then the save's tensor parts and per-rank files;
    `grouped`: `model/` as Step3p5's adapter writes it (grouped experts, transposed)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    harness.join_gloo(rank, world, port)
    try:
        step = Path(step_dir)
        meshes = Meshes(world, ep)
        model, params, opt = trained(Path(release), meshes, "release", getattr(torch, dtype))
        for s in range(1, STEPS + 1):
            for key, p in params.items():
                p.grad = distribute_tensor(_grad(key, s, p.shape).to(p.dtype), p.device_mesh, p.placements,
                                           src_data_rank=None)
            opt.step()
        flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"optim": flat, "sched": sched_state(STEPS)}, checkpoint_id=str(step / "optim"))
        full = {k: p.detach().full_tensor() for k, p in params.items()}
        to_hf, place = (hf_grouped_from_native, grouped_placement) if grouped else (hf_from_native, placement)
        hf = _hf_state(meshes, to_hf(full), place, None)
        if fmt == "safetensors":
            dcp.save(hf, storage_writer=dcp.HuggingFaceStorageWriter(path=str(step / "model"), save_distributed=True))
        else:
            dcp.save(hf, checkpoint_id=str(step / "model"))
        # Per-rank states, as `save_on_global_ranks` / `save_on_dp_ranks` write them.
        for name, infix, state in (("rng", "global_rank", {"torch": torch.get_rng_state(), "rank": rank}),
                                    ("dataloader", "dp_rank", {"sampler": {"yielded": 8 * STEPS}, "rank": rank})):
            (step / name).mkdir(parents=True, exist_ok=True)
            torch.save(state, step / name / f"{name}_{infix}_{rank}.pt")
        if rank == 0:
            torch.save({"step": STEPS, "epoch": 0}, step / "step_scheduler.pt")
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()


def load_training_worker(rank: int, world: int, port: int, release: str, source: str, ours: str, fmt: str,
                         dtype: str, grouped: bool = False, ep: int = 1) -> None:
    """Loads `source` (torch's own load-time resharding) and `ours` on `world` ranks with
    Automodel's placements — `model/` through torch's HF storage reader (or DCP), `optim/` as
    `{"optim", "sched"}` — compares every local shard and value, and hands our optimizer state to
    `set_optimizer_state_dict`."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    harness.join_gloo(rank, world, port)
    try:
        meshes = Meshes(world, ep)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        loaded = []
        for step in (Path(source), Path(ours)):
            model, params, opt = trained(Path(release), meshes, "nan", getattr(torch, dtype))
            for p in params.values():  # creates AdamW's state for the template
                p.grad = torch.zeros_like(p)
            opt.step()
            state = {"optim": get_optimizer_state_dict(model, opt, options=options), "sched": sched_state(0)}
            dcp.load(state, checkpoint_id=str(step / "optim"))
            to_hf, place = (hf_grouped_from_native, grouped_placement) if grouped else (hf_from_native, placement)
            hf_full = to_hf({k: torch.zeros(p.shape, dtype=p.dtype) for k, p in params.items()})
            hf = _hf_state(meshes, hf_full, place, float("nan"))
            if fmt == "safetensors":
                dcp.load(hf, storage_reader=dcp.HuggingFaceStorageReader(path=str(step / "model")))
            else:
                dcp.load(hf, checkpoint_id=str(step / "model"))
            loaded.append((state, hf, model, opt))
        (want, want_hf, _, _), (got, got_hf, model, opt) = loaded
        problems = []

        def same(key, g, w):
            if isinstance(w, torch.distributed.tensor.DTensor):
                if g.placements != w.placements:
                    problems.append(f"{key}: placements {g.placements}, want {w.placements}")
                g, w = g.to_local(), w.to_local()
            if isinstance(w, torch.Tensor):
                if w.is_floating_point() and bool(w.isnan().any()):
                    problems.append(f"{key}: the template was not filled from the source")
                if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(
                        g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                    problems.append(harness.describe_mismatch(key, g, w))
            elif g != w:
                problems.append(f"{key}: {g!r}, want {w!r}")

        for part in ("optim", "sched"):
            for key in sorted(want[part]):
                same(f"{part}.{key}", got[part][key], want[part][key])
        for key in sorted(want_hf):
            same(f"model/{key}", got_hf[key], want_hf[key])
        if problems:
            raise AssertionError(f"rank {rank}:\n" + "\n".join(problems[:20]))
        set_optimizer_state_dict(model, opt, optim_state_dict=got["optim"], options=options)
    except AssertionError:
        raise
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        harness.leave_gloo()
