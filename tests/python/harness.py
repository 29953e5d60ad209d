"""Shared constants and helpers of the interop suite (no pytest fixtures here; see conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from functools import lru_cache
from pathlib import Path

import torch

import reference as ref
# Re-exported: the suite's tests take them from here.
from mesh import Mesh, free_port, leave_gloo  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf-tiny"
FIXTURE_NAMES = ["llama", "qwen3_moe", "qwen3_next", "deepseek_v3", "deepseek_v3_no_q_lora",
                 "deepseek_v3_fp8", "glm4_moe", "gpt_oss",
                 "gpt_oss_bf16", "qwen3_vl_moe", "qwen3_5_moe_vl"]
OLD_TORCH_PYTHON = ROOT / ".venv-torch25" / "bin" / "python"
CONVERT_TIMEOUT_S = 120

# Non-tensor (bytes) items a Megatron fsdp_dtensor checkpoint may carry next to the weights.
TRAINER_STATE_ROOTS = {"args", "iteration", "checkpoint_version", "opt_param_scheduler", "rng_state",
                       "rerun_state_machine", "num_floating_point_operations_so_far", "content_metadata"}


# tp1·dp1, tp2·dp4, tp2·cp2·dp2·ep2, tp1·dp8·ep4 (EP only applies to models with experts).
MESHES = [Mesh(1, 1, 1, 1), Mesh(2, 1, 4, 1), Mesh(2, 2, 2, 2), Mesh(1, 1, 8, 4)]
MESH_IDS = ["tp1dp1", "tp2dp4", "tp2cp2dp2ep2", "tp1dp8ep4"]
# Extra meshes for models with experts: expert TP different from TP, both ways.
EXPERT_MESHES = [Mesh(2, 1, 4, 2, etp=1), Mesh(1, 1, 4, 2, etp=2)]
EXPERT_MESH_IDS = ["tp2dp4ep2etp1", "tp1dp4ep2etp2"]
# Megatron fsdp_dtensor optimizer-state key prefix (layouts.md §1.5).
OPTIMIZER_PREFIX = "optimizer.state.module.module.module."


def mesh_for(model: str, mesh: Mesh) -> Mesh:
    return mesh if has_experts(model) else Mesh(mesh.tp, mesh.cp, mesh.dp, 1)


# Fixtures derived at test time (see derive_fixture), by name.
DERIVED: dict[str, Path] = {}


def fixture_dir(model: str) -> Path:
    return DERIVED.get(model) or FIXTURES / model


def derive_fixture(name: str, parent: Path, base: str, *, vocab: int | None = None, tied: bool = False,
                   model_type: str | None = None) -> Path:
    """Fixture `name` under `parent`: a copy of fixture `base` with the vocab cut to `vocab` rows,
    tied embeddings (lm_head dropped) and/or another `model_type` of the same architecture."""
    from safetensors.torch import save_file

    cfg = json.loads((FIXTURES / base / "config.json").read_text())
    tensors = ref.load_hf_tensors(FIXTURES / base)
    if vocab is not None:
        cfg["vocab_size"] = vocab
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[k] = tensors[k][:vocab].contiguous()
    if tied:
        cfg["tie_word_embeddings"] = True
        tensors.pop("lm_head.weight")
    if model_type is not None:
        cfg["model_type"] = model_type
    out = parent / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    DERIVED[name] = out
    return out


def has_experts(model: str) -> bool:
    return ref.has_experts(fixture_dir(model))


@lru_cache(maxsize=None)
def reference(model: str, tp: int, prefix: str = ref.DEFAULT_PREFIX, etp: int | None = None) -> dict[str, torch.Tensor]:
    """The reference at `tp`; `etp` (default tp) matters only where the global layout depends
    on it (gpt-oss's fused expert fc1)."""
    return ref.reference_state_dict(fixture_dir(model), tp=tp, prefix=prefix, etp=etp or tp)


def shardline_bin() -> Path:
    """The converter binary: $SHARDLINE_BIN, else target/debug/shardline under the repo root."""
    env = os.environ.get("SHARDLINE_BIN")
    path = Path(env) if env else ROOT / "target" / "debug" / "shardline"
    if not path.is_absolute():
        path = ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(
            f"shardline binary not found at {path} "
            f"({'from $SHARDLINE_BIN' if env else 'default; build it with `cargo build` or set SHARDLINE_BIN'})")
    return path


def run_cli(args: list[str], timeout: float = CONVERT_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([str(shardline_bin()), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def run_old_torch(args: list, what: str, timeout: float = 300) -> str:
    """Run .venv-torch25's interpreter with `args` (a script that prints torch.__version__ last);
    assert it exits 0 on torch 2.5 and return its stdout."""
    py = OLD_TORCH_PYTHON
    assert py.is_file(), f"{py} missing: run scripts/setup-python (it creates .venv-torch25 with torch 2.5.1)"
    proc = subprocess.run([str(py), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{what} on torch 2.5 exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("2.5."), f"{what} ran on torch {lines[-1:]}, not 2.5"
    return proc.stdout


class Conversions:
    """Session cache of converter outputs, keyed by (model, mesh, format, prefix)."""

    def __init__(self, base: Path):
        self.base = base
        self.done: dict[tuple, Path] = {}
        self.lock = threading.Lock()

    def get(self, model: str, mesh: Mesh, fmt: str = "dcp", prefix: str | None = None,
            extra: tuple[str, ...] = ()) -> Path:
        key = (model, mesh, fmt, prefix, extra)
        with self.lock:
            if key in self.done:
                return self.done[key]
            out = self.base / f"{model}-{mesh.id}-{fmt}-{len(self.done)}"
            args = ["convert", "--from", str(fixture_dir(model)), "--to", str(out), *mesh.cli_args(),
                    "--format", fmt, *extra]
            if prefix is not None:
                args += ["--prefix", prefix]
            proc = run_cli(args)
            if proc.returncode != 0:
                raise AssertionError(
                    f"shardline {' '.join(args)} exited {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
            self.done[key] = out
            return out


def nan_like_spec(shape, dtype) -> torch.Tensor:
    """A target tensor that cannot be mistaken for loaded data: regions left unwritten stay NaN."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


def describe_mismatch(key: str, got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{key}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    diff = ~((got == want) | (got.isnan() & want.isnan()))
    idx = diff.nonzero()
    nan_count = int(got.isnan().sum())
    first = tuple(idx[0].tolist()) if len(idx) else None
    detail = f"{int(diff.sum())}/{got.numel()} elements differ, first at {first}"
    if first is not None:
        detail += f" (got {got[first].item()!r}, want {want[first].item()!r})"
    if nan_count:
        detail += f"; {nan_count} elements never written (NaN sentinel)"
    # Row-permutation hint: are the rows of `got` a permutation of the rows of `want`? (Rows of
    # a 1-D tensor are scalars, which cannot be viewed as bytes: no hint there.)
    if got.dim() >= 2 and got.shape[0] > 1 and not nan_count:
        g_rows = [bytes(r.contiguous().view(torch.uint8).flatten().tolist()) for r in got]
        w_rows = [bytes(r.contiguous().view(torch.uint8).flatten().tolist()) for r in want]
        if sorted(g_rows) == sorted(w_rows):
            pos = {r: i for i, r in enumerate(w_rows)}
            perm = [pos.get(r, -1) for r in g_rows]
            detail += f"; rows are a permutation of the reference rows: got row i = want row {perm[:24]}"
    return f"{key}: {detail}"


def compare_state_dicts(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for key in sorted(want):
        if key not in got:
            problems.append(f"{key}: missing")
        elif not (got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])):
            msg = describe_mismatch(key, got[key], want[key])
            twin = next((k for k, t in want.items() if k != key and t.shape == got[key].shape
                         and t.dtype == got[key].dtype and torch.equal(t, got[key])), None)
            if twin:
                msg += f"; it holds the reference value of {twin}"
            problems.append(msg)
    return problems


def join_gloo(rank: int, world: int, port: int) -> None:
    """Joins this spawned rank to a gloo process group of `world` CPU ranks on loopback."""
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn_ranks(fn, world: int, args: tuple, what: str, timeout_s: float = 150.0) -> None:
    """Runs `fn(rank, world, port, *args)` on `world` spawned ranks; fails (stopping them) when they
    do not finish within `timeout_s`, so a hung collective fails the test instead of the suite."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
            raise AssertionError(f"{world}-rank {what} did not finish in {timeout_s:.0f}s")
