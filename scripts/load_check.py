#!/usr/bin/env python3
"""Loads a published checkpoint with PyTorch, as a training job would, and records what it found.

Run as the `command` step of pipelines/load-check.yaml: the published directory comes from
`--checkpoint`, else from `SHARDLINE_STEP_UPLOAD_URL` (the `store.upload` step it needs; a
`file://` URL). Every file is checked against the manifest (size and SHA-256, nothing missing),
then `torch.distributed.checkpoint` loads every tensor into NaN-filled targets of the shapes and
dtypes `.metadata` declares: a target that keeps a NaN was not (fully) written. The summary is
written to `$SHARDLINE_OUTPUT_DIR/result.json` (the step's recorded result) and printed; the
exit code is 1 when anything is wrong.

    python scripts/load_check.py [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MANIFEST = "shardline-manifest.json"


def published_dir(arg: str | None) -> Path:
    where = arg or os.environ.get("SHARDLINE_STEP_UPLOAD_URL")
    if not where:
        sys.exit("no checkpoint: pass --checkpoint DIR or need a store.upload step (SHARDLINE_STEP_UPLOAD_URL)")
    if where.startswith("file://"):
        where = where[len("file://"):]
    elif "://" in where:
        sys.exit(f"{where}: only local (file://) checkpoints are loaded here")
    return Path(where)


def check_manifest(ckpt: Path, problems: list[str]) -> dict:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for f in manifest["files"]:
        path = ckpt / f["path"]
        if not path.is_file():
            problems.append(f"{f['path']}: listed in the manifest but missing")
            continue
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        if path.stat().st_size != f["size"] or digest.hexdigest() != f["sha256"]:
            problems.append(f"{f['path']}: size or SHA-256 differ from the manifest")
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="the published checkpoint directory (default: SHARDLINE_STEP_UPLOAD_URL)")
    a = p.parse_args()
    ckpt = published_dir(a.checkpoint)
    problems: list[str] = []
    manifest = check_manifest(ckpt, problems)

    reader = dcp.FileSystemReader(str(ckpt))
    md = reader.read_metadata()
    specs = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    state = {k: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype) for k, m in specs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=reader)
    unfilled = sorted(k for k, t in state.items() if t.is_floating_point() and bool(t.isnan().any()))
    problems += [f"{k}: not fully loaded (NaN left in the target)" for k in unfilled[:20]]

    dtypes: dict[str, int] = {}
    for t in state.values():
        dtypes[str(t.dtype).removeprefix("torch.")] = dtypes.get(str(t.dtype).removeprefix("torch."), 0) + 1
    result = {
        "ok": not problems,
        "checkpoint": str(ckpt),
        "torch": torch.__version__,
        "files_checked": len(manifest["files"]),
        "tensors": len(state),
        "parameters": sum(t.numel() for t in state.values()),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "dtypes": dtypes,
        "unfilled": len(unfilled),
        "problems": problems[:30],
    }
    text = json.dumps(result, sort_keys=True)
    out = os.environ.get("SHARDLINE_OUTPUT_DIR")
    if out:
        Path(out, "result.json").write_text(text)
    print(text)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
