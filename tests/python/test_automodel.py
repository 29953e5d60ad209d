"""NeMo Automodel training checkpoints exported back to the release: `model/` written by torch
itself (automodel_writer.py) in both of Automodel's formats, consolidated by `shardline export`
byte for byte, each tensor in the release's dtype; an unfinished save refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import automodel_writer
import harness
import reference as ref
from harness import FIXTURES, run_cli

WORLD = 3


def _automodel_checkpoint(root: Path, release: Path, fmt: str, dtype: str = "") -> Path:
    """`root/epoch_0_step_10/` as Automodel lays one out (the parts the export reads, and the
    files beside them)."""
    step = root / "epoch_0_step_10"
    model = step / "model"
    model.mkdir(parents=True)
    harness.spawn_ranks(automodel_writer.save_worker, WORLD, (str(release), str(model), fmt, dtype), "Automodel save")
    meta = model / ".hf_metadata"
    meta.mkdir()
    (meta / "config.json").write_text((release / "config.json").read_text())
    (step / "config.yaml").write_text("step_scheduler: {global_batch_size: 8}\n")
    (step / "losses.json").write_text(json.dumps({"train_loss": 1.0}))
    return step


def _export(step: Path, release: Path, out: Path):
    return run_cli(["export", str(step), "--to", str(out), "--like", str(release)])


@pytest.mark.parametrize("model,fmt,dtype", [
    ("qwen3_moe", "safetensors", ""),
    ("llama", "safetensors", "float32"),
    ("qwen3_moe", "torch_save", ""),
])
def test_export_consolidates_the_release_byte_for_byte(tmp_path, model, fmt, dtype):
    release = FIXTURES / model
    step = _automodel_checkpoint(tmp_path / "ckpt", release, fmt, dtype)
    files = sorted(p.name for p in (step / "model").iterdir() if p.is_file())
    if fmt == "safetensors":
        assert files == [f"shard-{r:05}-model-00001-of-00001.safetensors" for r in range(1, WORLD + 1)], files
    else:
        assert ".metadata" in files, files
    proc = _export(step, release, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    got, want = ref.load_hf_tensors(tmp_path / "hf"), ref.load_hf_tensors(release)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(got[key].view(torch.uint8), t.view(torch.uint8)), harness.describe_mismatch(key, got[key], t)


def test_an_unfinished_save_is_refused_and_nothing_is_written(tmp_path):
    release = FIXTURES / "llama"
    step = _automodel_checkpoint(tmp_path / "ckpt", release, "safetensors")
    (step / ".incomplete").write_text("")
    out = tmp_path / "hf"
    proc = _export(step, release, out)
    assert proc.returncode != 0
    assert "still being written" in proc.stderr, proc.stderr
    assert not out.exists()
    # A missing shard file: a tensor without all of its chunks.
    (step / ".incomplete").unlink()
    (step / "model" / "shard-00002-model-00001-of-00001.safetensors").unlink()
    proc = _export(step, release, out)
    assert proc.returncode != 0 and "cannot be read whole" in proc.stderr and "a chunk is missing" in proc.stderr, proc.stderr
    assert not out.exists() or not any(out.iterdir())
