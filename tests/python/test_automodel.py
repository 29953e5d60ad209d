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
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def _automodel_checkpoint(root: Path, release: Path, fmt: str, dtype: str = "") -> Path:
    """`root/epoch_0_step_10/` as Automodel lays one out (the parts the export reads, and the
    files beside them)."""
    step = root / "epoch_0_step_10"
    model = step / "model"
    model.mkdir(parents=True)
    harness.spawn_ranks(automodel_writer.save_worker, WORLD, (str(release), str(model), fmt, dtype), "Automodel save")
    # What Automodel's ConsolidatedHFAddon keeps of the release (fsdp2-frameworks.md §1): its
    # config, each tensor's 1-based file number from the release's index, and its original dtype
    # as safetensors spells it.
    meta = model / ".hf_metadata"
    meta.mkdir()
    (meta / "config.json").write_text((release / "config.json").read_text())
    weight_map = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    numbers = {k: int(f.split("-")[1]) for k, f in weight_map.items()}
    (meta / "fqn_to_file_index_mapping.json").write_text(json.dumps(numbers, indent=2, sort_keys=True))
    dtypes = {k: SAFETENSORS_DTYPES[t.dtype] for k, t in ref.load_hf_tensors(release).items()}
    (meta / "fqn_to_dtype_mapping.json").write_text(json.dumps(dtypes, indent=2, sort_keys=True))
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


def test_a_save_exports_as_the_release_its_hf_metadata_describes(tmp_path):
    # No --like: the names and global shapes are the checkpoint's, each tensor's dtype and file
    # Automodel's records; the release's files come back file for file.
    release = FIXTURES / "qwen3_moe"
    step = _automodel_checkpoint(tmp_path / "ckpt", release, "safetensors", "float32")
    proc = run_cli(["export", str(step), "--to", str(tmp_path / "hf")])
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in release.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    got, want = ref.load_hf_tensors(out), ref.load_hf_tensors(release)
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key].view(torch.uint8), t.view(torch.uint8)), key
    # Without those records and without --like, nothing says what the release was.
    (step / "model" / ".hf_metadata" / "fqn_to_file_index_mapping.json").unlink()
    proc = run_cli(["export", str(step), "--to", str(tmp_path / "none")])
    assert proc.returncode == 2 and "pass --like" in proc.stderr, proc.stderr
    assert not (tmp_path / "none").exists()


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
