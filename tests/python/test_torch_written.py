"""Checkpoints that torch itself saved (torch 2.15 here, torch 2.5 in its own venv) are read by the
same strict readers as ours: `validate` proves them bit-exact against the release, `inspect` lists
them, bytes items included, and a corruption of torch's own archive layout is caught."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import harness

MODEL = "qwen3_moe"
# What a training job keeps next to its weights: plain Python objects, saved as bytes items.
BYTES_ITEMS = {"iteration": 7, "checkpoint_version": 3.0,
               "args": argparse.Namespace(tensor_model_parallel_size=1, lr=1e-4)}

SAVE_ON_TORCH_2_5 = """
import sys, torch, torch.distributed.checkpoint as dcp
state = torch.load(sys.argv[1], weights_only=False)
dcp.save(state, checkpoint_id=sys.argv[2])
print(torch.__version__)
"""


def save_with(version: str, state: dict, ckpt: Path, tmp_path: Path) -> None:
    if version == "2.15":
        assert torch.__version__.startswith("2.15"), torch.__version__
        dcp.save(state, checkpoint_id=str(ckpt))
        return
    torch.save(state, tmp_path / "state.pt")
    harness.run_old_torch(["-c", SAVE_ON_TORCH_2_5, tmp_path / "state.pt", ckpt], "dcp.save")


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("version", ["2.15", "2.5"])
def test_torch_saved_checkpoints_validate_and_inspect(shardline, tmp_path, version):
    want = harness.reference(MODEL, tp=1)
    ckpt = tmp_path / "ckpt"
    save_with(version, {**want, **BYTES_ITEMS}, ckpt, tmp_path)

    v = run(shardline, "validate", ckpt, "--against", harness.fixture_dir(MODEL), "--json")
    assert v.returncode == 0, f"validate refused torch {version}'s checkpoint:\n{v.stdout[-3000:]}\n{v.stderr[-3000:]}"
    report = json.loads(v.stdout)
    assert report["ok"] is True and report["tensors"] == len(want), report

    i = run(shardline, "inspect", ckpt, "--json")
    assert i.returncode == 0, i.stderr[-3000:]
    listing = json.loads(i.stdout)
    assert {t["key"] for t in listing["tensors"]} == set(want)
    assert set(listing["bytes_items"]) == set(BYTES_ITEMS)
    for t in listing["tensors"]:
        assert t["shape"] == list(want[t["key"]].shape), t["key"]

    # torch writes its local headers with a data descriptor: a wrong descriptor crc is caught.
    rank_file = next(ckpt.glob("*.distcp"))
    data = bytearray(rank_file.read_bytes())
    descriptor = data.find(b"PK\x07\x08")
    assert descriptor > 0, "torch's archives carry data descriptors"
    data[descriptor + 4] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    v = run(shardline, "validate", ckpt, "--against", harness.fixture_dir(MODEL))
    assert v.returncode != 0 and "data descriptor" in (v.stdout + v.stderr), v.stdout + v.stderr


def torch_listing(ckpt: Path) -> dict:
    """Keys, dtypes, global shapes and sorted chunk boxes as torch's own reader sees them."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    out = {}
    for key, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            chunks = sorted((list(c.offsets), list(c.sizes)) for c in m.chunks)
            out[key] = (str(m.properties.dtype).removeprefix("torch."), list(m.size), chunks)
    return out


def shardline_listing(shardline, ckpt: Path) -> dict:
    i = run(shardline, "inspect", ckpt, "--json")
    assert i.returncode == 0, i.stderr[-3000:]
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
             "I32": "int32", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    out = {}
    for t in json.loads(i.stdout)["tensors"]:
        chunks = sorted((c["offsets"], c["sizes"]) for c in t["chunks"])
        out[t["key"]] = (names.get(t["dtype"], t["dtype"]), t["shape"], chunks)
    return out


@pytest.mark.parametrize("model", harness.FIXTURE_NAMES)
def test_streamed_inspect_agrees_with_torchs_reader(shardline, conversions, tmp_path, model):
    """`inspect` streams `.metadata` entry by entry; torch reads it whole: on every fixture at a
    mesh with uneven and empty shards, and on a checkpoint torch saved, they must list the same."""
    mesh = harness.mesh_for(model, harness.Mesh(2, 2, 2, 2))
    ckpt = conversions.get(model, mesh)
    assert shardline_listing(shardline, ckpt) == torch_listing(ckpt)
    saved = tmp_path / "saved"
    dcp.save(harness.reference(model, tp=1), checkpoint_id=str(saved))
    assert shardline_listing(shardline, saved) == torch_listing(saved)
