"""Reads a checkpoint published to an S3-compatible store back and loads it with real PyTorch.

Used by the end-to-end test of `hf.download` → … → `store.upload` (tests/integration/hub_s3.rs):
every object under the prefix is downloaded with boto3, checked against the manifest (size and
SHA-256 of every listed file, nothing missing), then `torch.distributed.checkpoint` loads the
directory into full tensors that are compared, bit for bit, with the independent reference
mapping of the source release (reference.py). Prints a JSON summary; exits 1 on any difference.

    python load_published.py --endpoint URL --bucket B --prefix P --source HF_DIR --tp N --out DIR

torch and boto3 are imported first: without them this fails, it never skips.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch  # noqa: F401  (first: a missing torch must be the error reported)
import boto3
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference as ref  # noqa: E402
from harness import compare_state_dicts, nan_like_spec  # noqa: E402

MANIFEST = "shardline-manifest.json"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--source", required=True, help="the HF release the checkpoint was converted from")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    s3 = boto3.client("s3", endpoint_url=a.endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing-secret")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = a.prefix.rstrip("/") + "/"
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=a.bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    if not keys:
        print(f"nothing under s3://{a.bucket}/{prefix}", file=sys.stderr)
        return 1
    for key in keys:
        dest = out / key[len(prefix):]
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(a.bucket, key, str(dest))

    problems = []
    manifest = json.loads((out / MANIFEST).read_text())
    listed = {f["path"] for f in manifest["files"]}
    for f in manifest["files"]:
        data = (out / f["path"]).read_bytes()
        if len(data) != f["size"] or hashlib.sha256(data).hexdigest() != f["sha256"]:
            problems.append(f"{f['path']}: size/sha256 differ from the manifest")
    stray = sorted({k[len(prefix):] for k in keys} - listed - {MANIFEST})
    if stray:
        problems.append(f"objects not in the manifest: {stray}")

    want = ref.reference_state_dict(a.source, tp=a.tp)
    md = dcp.FileSystemReader(str(out)).read_metadata()
    saved = {k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if saved != set(want):
        problems.append(f"tensor keys differ from the reference: missing {sorted(set(want) - saved)[:10]}, "
                        f"unexpected {sorted(saved - set(want))[:10]}")
    state = {k: nan_like_spec(t.shape, t.dtype) for k, t in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(out)))
    problems += compare_state_dicts(state, want)

    print(json.dumps({
        "objects": len(keys),
        "tensors": len(want),
        "bytes": sum(t.numel() * t.element_size() for t in want.values()),
        "source": manifest["source"],
        "problems": problems[:30],
    }))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
