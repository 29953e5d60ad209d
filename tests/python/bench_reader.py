"""Benchmark of `shardline.open`'s slice reads (run by hand; never a timed test):

    python tests/python/bench_reader.py WORK_DIR [--size 6GB] [--ranks 256]

with a Python that has the wheel installed (or `shardline` importable) and torch. It writes a
synthetic llama release of `--size` and converts it for FSDP over `--ranks` ranks (kept in
WORK_DIR for the next run), takes the largest tensor, and reads an eighth of its rows, the page
cache warm, in a fresh process each:

- through `shardline.open(...).get_slice(key)[rows]`, as a numpy array;
- with plain `os.preadv`s of exactly the bytes those rows are stored in, one file after the
  other: into a buffer allocated beforehand (the copy alone), and into one allocated in the timed
  region (what any reader returning a new array also pays: faulting its pages in).

It prints both times, their ratio, the bytes each read, and the slice process's peak RSS above
its baseline (the interpreter, torch and shardline imported) as a multiple of the slice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SLICE = r"""
import json, resource, sys, time
import torch, shardline
ckpt, key, lo, hi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
f = shardline.open(ckpt)
f.metadata(key)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
got = f.get_slice(key)[lo:hi]
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "bytes": got.numel() * got.element_size(), "read": f.last_read, "rss_above_base": peak - base}))
"""

PREAD = r"""
import json, os, sys, time
ranges, allocate = json.loads(sys.argv[1]), sys.argv[2] == "allocate"
size = sum(n for _, _, n in ranges)
out = None if allocate else bytearray(size)
t = time.perf_counter()
if allocate:
    out = bytearray(size)
view, at = memoryview(out), 0
for path, offset, n in ranges:
    fd = os.open(path, os.O_RDONLY)
    got = os.preadv(fd, [view[at:at + n]], offset)
    assert got == n
    os.close(fd)
    at += n
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": len(out)}))
"""


def shardline_cli() -> str:
    return os.environ.get("SHARDLINE_BIN", "shardline")


def prepare(work: Path, size: str, ranks: int) -> Path:
    release, ckpt = work / f"release-{size}", work / f"ckpt-{size}-dp{ranks}"
    if not (release / "config.json").exists():
        subprocess.run([shardline_cli(), "synth", "--arch", "llama", "--size", size, release], check=True)
    if not (ckpt / ".metadata").exists():
        subprocess.run([shardline_cli(), "convert", "--from", release, "--to", ckpt, "--dp", str(ranks), "--overwrite"],
                       check=True)
    return ckpt


def run(code: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def main() -> None:
    import shardline

    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("--size", default="6GB")
    p.add_argument("--ranks", type=int, default=256)
    a = p.parse_args()
    ckpt = prepare(a.work, a.size, a.ranks)
    f = shardline.open(ckpt)
    key = max((k for k in f.keys() if len(f.metadata(k).shape) == 2),
              key=lambda k: f.metadata(k).shape[0] * f.metadata(k).shape[1])
    md = f.metadata(key)
    rows, cols = md.shape
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}[md.dtype]
    lo, hi = rows // 3, rows // 3 + rows // 8
    ranges = []
    for c in sorted(md.chunks, key=lambda c: c.offsets[0]):
        a0, a1 = max(lo, c.offsets[0]), min(hi, c.offsets[0] + c.sizes[0])
        if a0 < a1 and c.sizes[1] == cols:
            ranges.append([str(Path(f.path) / c.file), c.offset + (a0 - c.offsets[0]) * cols * elem, (a1 - a0) * cols * elem])
    for path, offset, n in ranges:  # warm the page cache for both
        with open(path, "rb") as fh:
            fh.seek(offset)
            fh.read(n)
    best = lambda code, *args: min((run(code, *args) for _ in range(3)), key=lambda r: r["seconds"])  # noqa: E731
    sliced = best(SLICE, ckpt, key, lo, hi)
    copy, fresh = best(PREAD, json.dumps(ranges), "reuse"), best(PREAD, json.dumps(ranges), "allocate")
    total = md.shape[0] * md.shape[1] * elem
    print(f"tensor {key}: {list(md.shape)} {md.dtype}, {total / 2**30:.2f} GiB in {len(md.chunks)} chunks")
    print(f"slice rows {lo}:{hi}: {sliced['bytes'] / 2**20:.1f} MiB from {sliced['read']['chunks']} chunks, "
          f"{sliced['read']['reads']} reads, {sliced['read']['bytes_read'] / 2**20:.1f} MiB read")
    print(f"shardline.open: {sliced['seconds'] * 1e3:.1f} ms")
    print(f"preadv of the same bytes into a buffer allocated first: {copy['seconds'] * 1e3:.1f} ms "
          f"(ratio {sliced['seconds'] / copy['seconds']:.2f}); into a new buffer: {fresh['seconds'] * 1e3:.1f} ms "
          f"(ratio {sliced['seconds'] / fresh['seconds']:.2f})")
    print(f"peak RSS above the baseline: {sliced['rss_above_base'] / 2**20:.1f} MiB "
          f"= {sliced['rss_above_base'] / sliced['bytes']:.2f} x the slice")


if __name__ == "__main__":
    main()
