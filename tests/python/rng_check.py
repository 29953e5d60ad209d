"""RNG states compared and restored: what the reshard tests check of Megatron's `rng_state_list`.

- `assert_same_rng`: two lists of RNG states equal leaf by leaf (tensors by value and dtype,
  numpy arrays by value, dict keys in any order).
- `megatron_rng`: what Megatron-Core itself loads and restores from a `torch_dist` checkpoint, per
  TP rank (megatron_rng.py, run in a process of its own).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def assert_same_rng(got, want) -> None:
    """Two RNG state lists equal leaf by leaf (tensors by value and dtype, numpy arrays by value)."""
    import numpy as np

    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (list(got), list(want))
        for k in want:
            assert_same_rng(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (type(got), type(want))
        for a, b in zip(got, want):
            assert_same_rng(a, b)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    else:
        assert got == want, (got, want)


def megatron_rng(ckpt: Path, tp: int, tmp_path: Path) -> list:
    """What megatron_rng.py loads and restores from `ckpt` with Megatron-Core, per TP rank."""
    out = tmp_path / f"rng-{ckpt.parent.name}.pt"
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_rng.py"), str(ckpt), str(tp), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out, weights_only=False)
