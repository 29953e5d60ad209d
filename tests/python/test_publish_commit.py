"""The publish commit protocol under faults, checked the way PyTorch sees a destination.

torch's DCP reader takes any directory (or prefix) holding `.metadata` for a checkpoint. So the
invariant after every fault is: a `dcp.load` of the destination loads the complete new
checkpoint, the complete old one, or finds no `.metadata` — never a torn one.

- ENOSPC on a local destination (a tmpfs sized so the disk fills at a chosen page of a chosen
  file), at three points within every file of the publish, then a retry that completes.
- kill -9 of `shardline publish` at every request of a publish to S3 (moto behind a proxy that
  stalls the chosen request), with the prefix listed every few ms throughout; then a retry.
- The same with an older checkpoint at the prefix being overwritten.
- `verify-destination` and `--clean` on what those leave.

Needs root (tmpfs mounts; CI runs as root) and moto from `.venv`; fails, never skips, without.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
import boto3
import pytest
import torch.distributed.checkpoint as dcp
from moto.server import ThreadedMotoServer
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from harness import shardline_bin
from s3_proxy import S3Proxy, free_port

PAGE = 4096
BUCKET = "ckpts"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1"}


def sh(*args, env=None, check=True, timeout=300) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, as torch loads it (raises if it cannot)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731  (NaN-safe, bit for bit)
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("publish")


def convert(work: Path, name: str, arch: str, size: str, seed: int, mesh: list[str]) -> Path:
    rel, out = work / f"{name}-release", work / name
    sh(shardline_bin(), "synth", "--arch", arch, "--size", size, "--seed", seed, rel)
    sh(shardline_bin(), "convert", "--from", rel, "--to", out, *mesh)
    return out


def publish(src: Path, to: str, *extra, env=None, check=True) -> subprocess.CompletedProcess:
    return sh(shardline_bin(), "publish", src, "--to", to, *extra, env=env, check=check)


def verify(to: str, *extra, env=None) -> tuple[int, dict]:
    r = sh(shardline_bin(), "verify-destination", to, "--json", *extra, env=env, check=False)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


# ------------------------------------------------------------------------------------------
# ENOSPC on a local destination


class Tmpfs:
    def __init__(self, base: Path):
        self.dir = base / "tmpfs"
        self.dir.mkdir(exist_ok=True)
        self.mounted = False

    def mount(self, pages: int) -> None:
        self.umount()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(self.dir)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"cannot mount a tmpfs (the test needs root): {r.stderr}"
        self.mounted = True

    def grow(self, pages: int) -> None:
        r = subprocess.run(["mount", "-o", f"remount,size={pages * PAGE}", str(self.dir)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    def umount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.dir)], check=True)
            self.mounted = False


def test_enospc_at_every_file_never_leaves_a_torn_checkpoint(work):
    """The disk fills near the start, the middle and the end of each file in publish order."""
    ckpt = convert(work, "moe", "qwen3_moe", "1MB", 3, ["--tp", "2", "--dp", "2", "--ep", "2"])
    want = load(ckpt)
    # The publish order with one file in flight: the rank files by name, then `.metadata`.
    files = sorted((p.name for p in ckpt.iterdir()), key=lambda n: (n == ".metadata", n))
    sizes = {n: (ckpt / n).stat().st_size for n in files}
    assert len(files) == 5 and all(sizes[n] >= 3 * PAGE for n in files), sizes
    fs = Tmpfs(work)
    torn, cases = [], 0
    try:
        pages_before = 1  # the pending record
        # One file at a time (the disk fills in the file named), and four at once (as publishes
        # run by default: then small `.metadata` is the file most likely to finish first).
        for name, in_flight in [(n, w) for n in files for w in ("1", "4")]:
            pages = -(-sizes[name] // PAGE)
            for at in (1, pages // 2, pages - 1):
                cases += 1
                fs.mount(pages_before + at)
                dest = fs.dir / "ckpt"
                r = publish(ckpt, str(dest), "--files-in-flight", in_flight, check=False)
                assert r.returncode == 2, f"{name}@{at}: the publish did not fail: {r.stdout}"
                assert "No space left on device" in r.stderr, r.stderr
                if (dest / ".metadata").exists():
                    try:
                        if not same(load(dest), want):
                            torn.append(f"{name}@{at}: loads, but not the checkpoint")
                    except BaseException as e:  # noqa: BLE001  (DCP raises CheckpointException)
                        torn.append(f"{name}@{at}: .metadata present, load fails: {e!r:.200}")
                code, report = verify(str(dest))
                assert code == 1 and report["state"] != "complete", report
                if name == files[-1] and at == pages - 1 and in_flight == "4":
                    # The last case: the next publish to the same destination completes.
                    fs.grow(4 * sum(-(-s // PAGE) for s in sizes.values()))
                    publish(ckpt, str(dest))
                    code, report = verify(str(dest))
                    assert code == 0 and report["state"] == "complete", report
                    assert same(load(dest), want)
            if in_flight == "4":
                pages_before += pages
    finally:
        fs.umount()
    assert cases == 30
    assert torn == [], torn


def test_a_full_tmpfs_destination_of_a_pipeline_gets_no_metadata(work):
    """The field case: a 40 MB tmpfs as `store.upload`'s destination, 100 MB converted."""
    rel = work / "moe100-release"
    sh(shardline_bin(), "synth", "--arch", "qwen3_moe", "--size", "100MB", rel)
    spec = work / "full.yaml"
    spec.write_text(f"""apiVersion: shardline/v1
kind: Pipeline
name: full-disk
steps:
  - id: download
    uses: hf.download
    with: {{path: "{rel}"}}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {{tp: 2, dp: 2, ep: 2}}
  - id: upload
    uses: store.upload
    needs: [shard]
    with: {{to: "file://{work}/tmpfs/out"}}
""")
    fs = Tmpfs(work)
    fs.mount((40 << 20) // PAGE)
    try:
        r = subprocess.run([str(shardline_bin()), "run", str(spec), "--state-dir", str(work / "state")],
                           capture_output=True, text=True, timeout=600, cwd=work)
        assert r.returncode != 0, r.stdout
        out = fs.dir / "out"
        assert not (out / ".metadata").exists(), sorted(p.name for p in out.iterdir())
        code, report = verify(str(out))
        assert code == 1 and not report["torch_visible"], report
        assert ".shardline-publish-pending.json" in report["debris"], report
        code, report = verify(str(out), "--clean")
        assert report["debris"] == [] and report["state"] == "empty", report
    finally:
        fs.umount()


# ------------------------------------------------------------------------------------------
# kill -9 during a publish to S3


class S3:
    def __init__(self):
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing-secret")
        self.client.create_bucket(Bucket=BUCKET)
        self.proxy = S3Proxy(self.port)

    def env(self, through_proxy: bool) -> dict:
        port = self.proxy.port if through_proxy else self.port
        return dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ALLOW_HTTP="true", **CREDS)

    def listing(self, prefix: str) -> dict[str, int]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            out.update({o["Key"][len(prefix) + 1:]: o["Size"] for o in page.get("Contents", [])})
        return out

    def download(self, prefix: str, to: Path) -> Path:
        shutil.rmtree(to, ignore_errors=True)
        to.mkdir(parents=True)
        for key in self.listing(prefix):
            self.client.download_file(BUCKET, f"{prefix}/{key}", str(to / key))
        return to

    def close(self):
        self.proxy.close()
        self.server.stop()


@pytest.fixture(scope="module")
def s3():
    s = S3()
    yield s
    s.close()


class Sampler:
    """Lists a prefix every few ms; every listing that shows `.metadata` must show every rank
    file of one of the `complete` checkpoints (name → size) in full."""

    def __init__(self, s3: S3, prefix: str, complete: list[dict[str, int]]):
        self.s3, self.prefix, self.complete = s3, prefix, complete
        self.stop, self.samples, self.bad = threading.Event(), 0, []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            seen = self.s3.listing(self.prefix)
            self.samples += 1
            if ".metadata" in seen and not any(all(seen.get(n) == s for n, s in c.items()) for c in self.complete):
                self.bad.append(seen)
            time.sleep(0.003)

    def finish(self) -> list:
        self.stop.set()
        self.thread.join()
        return self.bad


def files_of(ckpt: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name.endswith(".distcp")}


def killed_at(s3: S3, ckpt: Path, prefix: str, k: int | None, match=None) -> None:
    """Starts a publish through the proxy, waits for its k-th request (or the one `match`
    picks, see `S3Proxy.arm`), kills it (-9) there."""
    s3.proxy.arm(k, match=match)
    p = subprocess.Popen([str(shardline_bin()), "publish", str(ckpt), "--to", f"s3://{BUCKET}/{prefix}",
                          "--part-size", "5MiB"],
                         env=s3.env(True), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not s3.proxy.arrived.wait(0.05):
        assert p.poll() is None, f"the publish ended before its request {k}: {p.stderr.read().decode()}"
    p.send_signal(signal.SIGKILL)
    p.wait()
    s3.proxy.release.set()


def loads_one_of(s3: S3, prefix: str, work: Path, candidates: list[dict[str, torch.Tensor]]) -> str | None:
    """None when torch finds no `.metadata` or loads one of `candidates` whole; else the problem."""
    if ".metadata" not in s3.listing(prefix):
        return None
    local = s3.download(prefix, work / "downloaded")
    try:
        got = load(local)
    except BaseException as e:  # noqa: BLE001
        return f".metadata listed, load fails: {e!r:.200}"
    return None if any(same(got, c) for c in candidates) else "loads a checkpoint that is neither"


@pytest.fixture(scope="module")
def two_checkpoints(work) -> tuple[Path, Path]:
    # Rank files of about 6 MB: multipart uploads of two 5 MiB parts.
    a = convert(work, "a", "llama", "12MB", 0, ["--tp", "2", "--dp", "1"])
    b = convert(work, "b", "llama", "12MB", 1, ["--tp", "2", "--dp", "1"])
    return a, b


def test_kill_9_at_every_request_of_an_s3_publish(s3, two_checkpoints, work):
    a, _ = two_checkpoints
    want = load(a)
    s3.proxy.arm(None)
    publish(a, f"s3://{BUCKET}/count", "--part-size", "5MiB", env=s3.env(True))
    n = s3.proxy.count()
    assert n >= 20, n
    # Killed at or before the manifest's PUT, the location is not complete; after it, it is.
    committed_at = [i + 1 for i, (m, path) in enumerate(s3.proxy.requests)
                    if m == "PUT" and path.endswith("/shardline-manifest.json")]
    assert len(committed_at) == 1, s3.proxy.requests
    problems, samples = [], 0
    for k in range(1, n + 1):
        prefix = f"kill-{k}"
        sampler = Sampler(s3, prefix, [files_of(a)])
        killed_at(s3, a, prefix, k)
        if (p := loads_one_of(s3, prefix, work, [want])) is not None:
            problems.append(f"request {k}: {p}")
        code, report = verify(f"s3://{BUCKET}/{prefix}", env=s3.env(False))
        assert code == (0 if k > committed_at[0] else 1), f"request {k}: {report}"
        publish(a, f"s3://{BUCKET}/{prefix}", "--part-size", "5MiB", env=s3.env(False))
        problems += [f"request {k}: torn listing {b}" for b in sampler.finish()]
        samples += sampler.samples
        code, report = verify(f"s3://{BUCKET}/{prefix}", env=s3.env(False))
        assert code == 0 and report["debris"] == [], f"request {k}: {report}"
    assert problems == [], problems[:5]
    assert samples > n, samples
    assert same(load(s3.download(f"kill-{n}", work / "last")), want)


def test_a_failed_request_is_retried_and_a_denied_one_fails_with_no_metadata(s3, two_checkpoints, work):
    a, _ = two_checkpoints
    want = load(a)
    for k in (4, 8, 12, 20):
        # A 500 is retried by the client: the publish completes.
        s3.proxy.arm(k, "fail")
        publish(a, f"s3://{BUCKET}/fail-{k}", "--part-size", "5MiB", env=s3.env(True))
        assert s3.proxy.arrived.is_set()
        assert same(load(s3.download(f"fail-{k}", work / "failed")), want)
        # A 403 is not: the publish fails and leaves no `.metadata`.
        s3.proxy.arm(k, "deny")
        r = publish(a, f"s3://{BUCKET}/deny-{k}", "--part-size", "5MiB", env=s3.env(True), check=False)
        assert r.returncode == 2 and "403" in r.stderr, r.stderr
        assert ".metadata" not in s3.listing(f"deny-{k}")


def test_an_overwrite_killed_midway_leaves_the_old_or_the_new_or_nothing(s3, two_checkpoints, work):
    a, b = two_checkpoints
    old, new = load(a), load(b)
    assert not same(old, new)
    prefix = "overwrite"
    s3.proxy.arm(None)
    publish(a, f"s3://{BUCKET}/{prefix}", env=s3.env(False))
    publish(b, f"s3://{BUCKET}/{prefix}", "--part-size", "5MiB", env=s3.env(True))
    n = s3.proxy.count()
    problems = []
    for k in range(1, n + 1, 2):
        publish(a, f"s3://{BUCKET}/{prefix}", env=s3.env(False))
        sampler = Sampler(s3, prefix, [files_of(a), files_of(b)])
        killed_at(s3, b, prefix, k)
        if (p := loads_one_of(s3, prefix, work, [old, new])) is not None:
            problems.append(f"request {k}: {p}")
        problems += [f"request {k}: torn listing {b}" for b in sampler.finish()]
    assert problems == [], problems
    publish(b, f"s3://{BUCKET}/{prefix}", env=s3.env(False))
    assert same(load(s3.download(prefix, work / "overwritten")), new)


def test_verify_destination_names_the_manifest_and_clean_removes_debris(s3, two_checkpoints):
    a, b = two_checkpoints
    url = f"s3://{BUCKET}/verify"
    publish(a, url, env=s3.env(False))
    manifest = s3.client.get_object(Bucket=BUCKET, Key="verify/shardline-manifest.json")["Body"].read()
    code, report = verify(url, env=s3.env(False))
    assert code == 0 and report["manifest_sha256"] == hashlib.sha256(manifest).hexdigest(), report
    # Overwritten by another checkpoint and killed at its second rank file's first part: a
    # multipart upload is open and the pending record is there.
    killed_at(s3, b, "verify", None, match=("PUT", "partNumber=1&", 2))
    code, report = verify(url, env=s3.env(False))
    assert code == 1 and any("open upload" in d for d in report["debris"]), report
    code, report = verify(url, "--clean", env=s3.env(False))
    assert code == 1 and report["state"] == "empty" and report["debris"] == [], report
    assert any("open upload" in c for c in report["cleaned"]), report
    publish(a, url, env=s3.env(False))
    assert verify(url, env=s3.env(False))[0] == 0
