"""Reading a training checkpoint back in one process, without a planner: its `.metadata`, any
item's bytes as `torch.load` reads them, every bytes item, full tensors through `dcp.load`, and a
comparable form of a bytes item (used by training_ckpt.py and test_reshard.py)."""

from __future__ import annotations

import argparse
import io
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata



def read_metadata(path):
    return dcp.FileSystemReader(str(path)).read_metadata()


def read_item(path, md, fqn: str, offsets=None):
    index = MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))
    info = md.storage_data.get(index)
    if info is None:
        raise ValueError(f"{path}: {fqn} (offset {offsets}) has no storage_data entry in .metadata; "
                         f"dcp.load would fail with KeyError {index}")
    with open(Path(path) / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"{fqn}: transforms {info.transform_descriptors} not handled here")
    return torch.load(io.BytesIO(data), weights_only=False)


def read_bytes_items(path) -> dict:
    """Every BytesStorageMetadata item, unpickled (the way DefaultLoadPlanner.load_bytes does)."""
    md = read_metadata(path)
    return {k: read_item(path, md, k) for k, m in md.state_dict_metadata.items()
            if isinstance(m, BytesStorageMetadata)}


def tensor_keys(md) -> dict[str, TensorStorageMetadata]:
    return {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def load_full(path, keys: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """dcp.load in this process into full plain tensors (every tensor of the checkpoint by default)."""
    if keys is None:
        keys = {k: (tuple(m.size), m.properties.dtype) for k, m in tensor_keys(read_metadata(path)).items()}
    state = {k: (torch.full(s, float("nan"), dtype=d) if d.is_floating_point else torch.full(s, 77, dtype=d))
             for k, (s, d) in keys.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    return state


def canon(obj):
    """A comparable form of a bytes item (numpy arrays and tensors inside tuples/dicts/Namespaces)."""
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, obj.tobytes())
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.reshape(-1).view(torch.uint8).numpy().tobytes()
                if obj.numel() else b"")
    if isinstance(obj, argparse.Namespace):
        return ("Namespace", canon(vars(obj)))
    if isinstance(obj, dict):
        return {k: canon(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(canon(v) for v in obj))
    return obj
