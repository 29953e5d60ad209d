"""Mutation test of `shardline validate` against real torch (issue 11).

A converted checkpoint is mutated one byte at a time (XOR with a random non-zero value), the offsets
weighted towards structure: ~40 % in the `.metadata` pickle (opcodes, GLOBAL names, lengths,
strings, ints), ~50 % in the zip and pickle structure of the rank files (headers, names, extra
fields, central directory, end records, data.pkl, byteorder, version, ...), ~10 % anywhere in the
rank files. Every mutant goes to `shardline validate --against` and to a real `dcp.load` (in a
separate worker process: a torch crash or hang is a "torch failed", not a dead pytest).

validate claims torch-compatible structure plus bit-exact data, so it must never accept a mutant
that torch fails to load or loads into different values. Rejecting a mutant torch loads fine is
allowed (validate is stricter, e.g. it compares CRC-less data with the source) and counted.

Env: SHARDLINE_MUTANTS (default 1500, ~45 s), SHARDLINE_MUTATION_SEED (default 11).
Report: <tmp>/mutations.json and target/mutations/report.json.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pickle
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import harness
from dcp_structure import METADATA, Region, RegionIndex, checkpoint_regions
from harness import Mesh

MODEL = "qwen3_moe"
MESH = Mesh(tp=2, cp=1, dp=2, ep=2)  # 4 rank files
MUTANTS = int(os.environ.get("SHARDLINE_MUTANTS", "1500"))
SEED = int(os.environ.get("SHARDLINE_MUTATION_SEED", "11"))
SHARE_METADATA, SHARE_STRUCTURE = 0.40, 0.50  # the rest: anywhere in the rank files
# Rank-file bytes that are not structure: drawn only by the "anywhere" share.
NON_STRUCTURE_KINDS = {"tensor-data", "unreferenced"}
VALIDATE_TIMEOUT_S = 60
TORCH_TIMEOUT_S = 60
REPORT = harness.ROOT / "target" / "mutations" / "report.json"
WORKER = Path(__file__).with_name("mutation_worker.py")


@dataclass
class Mutant:
    index: int
    file: str
    offset: int
    xor: int
    old: int
    new: int
    kind: str
    field: str
    where: str
    share: str  # which weighting share drew it: metadata / structure / anywhere


# ---------------------------------------------------------------------------------------------
# Drawing mutants
# ---------------------------------------------------------------------------------------------

class BytePool:
    """A uniform draw over the bytes of a set of regions (possibly in several files)."""

    def __init__(self, regions: list[Region]):
        self.regions = regions
        self.ends = []
        total = 0
        for r in regions:
            total += r.end - r.start
            self.ends.append(total)
        self.size = total

    def draw(self, rng: random.Random) -> tuple[str, int]:
        n = rng.randrange(self.size)
        i = bisect_right(self.ends, n)
        r = self.regions[i]
        return r.file, r.end - (self.ends[i] - n)


def _kind_pools(regions: list[Region]) -> dict[str, BytePool]:
    by_kind: dict[str, list[Region]] = collections.defaultdict(list)
    for r in regions:
        by_kind[r.kind].append(r)
    return {k: BytePool(v) for k, v in sorted(by_kind.items())}


def draw_offsets(regions: dict[str, list[Region]], n: int, rng: random.Random) -> list[tuple[str, int, str]]:
    """(file, offset, share) for n distinct bytes. Within the metadata and structure shares a kind is
    picked uniformly first, so small records (EOCD, byteorder) get as many mutants as big ones."""
    rank_regions = [r for f, rs in regions.items() if f != METADATA for r in rs]
    shares = [
        ("metadata", round(n * SHARE_METADATA), list(_kind_pools(regions[METADATA]).values())),
        ("structure", round(n * SHARE_STRUCTURE),
         list(_kind_pools([r for r in rank_regions if r.kind not in NON_STRUCTURE_KINDS]).values())),
    ]
    shares.append(("anywhere", n - shares[0][1] - shares[1][1], [BytePool(rank_regions)]))
    seen: set[tuple[str, int]] = set()
    out = []
    for share, count, pools in shares:
        drawn = attempts = 0
        while drawn < count and attempts < count * 50:  # tiny pools run dry; the others fill in
            attempts += 1
            file, offset = rng.choice(pools).draw(rng)
            if (file, offset) not in seen:
                seen.add((file, offset))
                out.append((file, offset, share))
                drawn += 1
    return out


def generate_mutants(ckpt: Path, n: int, seed: int) -> list[Mutant]:
    regions = checkpoint_regions(ckpt)
    index = {f: RegionIndex(rs) for f, rs in regions.items()}
    contents = {f: (ckpt / f).read_bytes() for f in regions}
    rng = random.Random(seed)
    mutants = []
    for i, (file, offset, share) in enumerate(draw_offsets(regions, n, rng)):
        region = index[file].at(offset)
        xor = rng.randrange(1, 256)
        old = contents[file][offset]
        mutants.append(Mutant(i, file, offset, xor, old, old ^ xor, region.kind, region.field, region.where, share))
    return mutants


def materialize(ckpt: Path, mutant: Mutant, dest: Path) -> Path:
    """A copy of the checkpoint with the mutant's byte flipped; unchanged files are hard links."""
    dest.mkdir(parents=True)
    for src in ckpt.iterdir():
        if src.name == mutant.file:
            data = bytearray(src.read_bytes())
            data[mutant.offset] ^= mutant.xor
            (dest / src.name).write_bytes(data)
        else:
            os.link(src, dest / src.name)
    return dest


# ---------------------------------------------------------------------------------------------
# The two judges
# ---------------------------------------------------------------------------------------------

def run_validate(ckpt: Path) -> tuple[str, str]:
    """("accepted" | "rejected" | "crashed", first finding or error line). Exit 0 accepts, 1 (findings)
    and 2 (error) reject; anything else (a panic's 101, a signal, a hang) is a crash."""
    args = ["validate", str(ckpt), "--against", str(harness.fixture_dir(MODEL)), "--json"]
    try:
        proc = harness.run_cli(args, timeout=VALIDATE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "crashed", f"no exit within {VALIDATE_TIMEOUT_S}s"
    if proc.returncode == 0:
        return "accepted", ""
    if proc.returncode in (1, 2):
        return "rejected", _first_reason(proc).replace(str(ckpt), "MUTANT")
    return "crashed", f"exit {proc.returncode}: {(proc.stderr.strip() or proc.stdout.strip())[-800:]}"


def _first_reason(proc: subprocess.CompletedProcess) -> str:
    try:
        findings = json.loads(proc.stdout).get("findings") or []
        if findings:
            return f"`{findings[0]['key']}`: {findings[0]['message']}"[:400]
    except (json.JSONDecodeError, AttributeError, TypeError, KeyError):
        pass
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error")]
    return ((errors or lines or ["(no message)"])[0])[:400]


class TorchWorker:
    """mutation_worker.py, restarted when it dies or exceeds the per-mutant timeout."""

    def __init__(self, spec_path: Path, log_path: Path):
        self.spec_path, self.log_path = spec_path, log_path
        self.proc: subprocess.Popen | None = None
        self.replies: queue.Queue = queue.Queue()
        self.restarts = 0

    def _start(self) -> None:
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(self.spec_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=harness.ROOT)
        self.replies = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.replies), daemon=True).start()
        hello = self.replies.get(timeout=120)
        assert hello and hello.get("ready"), f"torch worker did not start; see {self.log_path}"

    @staticmethod
    def _pump(proc: subprocess.Popen, replies: queue.Queue) -> None:
        for line in proc.stdout:
            replies.put(json.loads(line))
        replies.put(None)  # EOF: the worker died

    def submit(self, ckpt: Path) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps({"ckpt": str(ckpt)}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        try:
            reply = self.replies.get(timeout=TORCH_TIMEOUT_S)
        except queue.Empty:
            self._kill()
            return {"ok": False, "error_type": "Timeout", "error": f"dcp.load did not finish in {TORCH_TIMEOUT_S}s"}
        if reply is None:
            code = self.proc.wait()
            self._kill()
            return {"ok": False, "error_type": "WorkerCrash", "error": f"torch worker died with exit code {code}"}
        return reply

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            self.proc = None
            self.restarts += 1

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.log.close()
            self.proc = None


def torch_verdict(reply: dict, baseline: dict[str, str], ckpt: Path) -> tuple[str, str]:
    """("identical" | "different" | "failed", detail) relative to the unmutated load."""
    if not reply["ok"]:
        error = reply["error"].replace(str(ckpt), "MUTANT")
        return "failed", error if error.startswith(reply["error_type"]) else f"{reply['error_type']}: {error}"
    differ = sorted(k for k in baseline if reply["digests"].get(k) != baseline[k])
    if differ:
        return "different", f"{len(differ)} item(s) load different values, e.g. {differ[0]}"
    return "identical", ""


def load_spec(ckpt: Path) -> dict:
    """What every load requests: the unmutated checkpoint's keys, global shapes and dtypes."""
    md = pickle.loads((ckpt / METADATA).read_bytes())
    tensors, other = {}, []
    for key, m in sorted(md.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            tensors[key] = [list(m.size), str(m.properties.dtype).removeprefix("torch.")]
        else:
            other.append(key)
    return {"tensors": tensors, "bytes": other}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def classify(v: str, t: str) -> str:
    if v == "crashed":
        return "validate_crashed"
    if v == "rejected":
        return "rejected_by_both" if t != "identical" else "rejected_only_by_validate"
    return "accepted_by_both" if t == "identical" else "accepted_only_by_validate"


def describe(rec: dict) -> str:
    # Trimmed for reading: miniz appends the same "likely corrupted" advice to every error, and DCP
    # appends its failed fallback to a rank-local metadata file that a checkpoint never has.
    torch_detail = rec["torch_detail"].split(" This is an internal miniz error")[0]
    torch_detail = torch_detail.split("; rank local metadata read failed")[0]
    return (f"  {rec['file']} @{rec['offset']} [{rec['field']}] {rec['old']:#04x}->{rec['new']:#04x} "
            f"({rec['where'][:140]}): torch {rec['torch']}" + (f": {torch_detail[:240]}" if torch_detail else "")
            + (f"; validate: {rec['validate_detail'][:240]}" if rec["validate_detail"] else ""))


def grouped(records: list[dict], limit_per_group: int) -> list[str]:
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in records:
        groups[rec["field"]].append(rec)
    lines = []
    for field, recs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{field}: {len(recs)}")
        lines += [describe(r) for r in recs[:limit_per_group]]
    return lines


def summary_line(counts: collections.Counter, records: list[dict], seconds: float) -> str:
    torch_failed = sum(1 for r in records if r["outcome"] == "accepted_only_by_validate" and r["torch"] == "failed")
    return (f"mutation test: {len(records)} mutants (seed {SEED}) in {seconds:.0f}s: "
            f"rejected by both {counts['rejected_by_both']}, accepted by both {counts['accepted_by_both']}, "
            f"rejected only by validate {counts['rejected_only_by_validate']}, "
            f"accepted only by validate {counts['accepted_only_by_validate']} "
            f"(torch failed {torch_failed}, torch loaded different values "
            f"{counts['accepted_only_by_validate'] - torch_failed}), "
            f"validate crashed {counts['validate_crashed']}")


def write_report(paths: list[Path], summary: str, counts, records: list[dict], restarts: int) -> None:
    body = {
        "summary": summary,
        "model": MODEL, "mesh": MESH.id, "seed": SEED, "mutants": len(records),
        "counts": dict(counts), "torch_worker_restarts": restarts,
        "validate_verdicts": dict(collections.Counter(r["validate"] for r in records)),
        "torch_verdicts": dict(collections.Counter(r["torch"] for r in records)),
        "outcomes_by_kind": {k: dict(collections.Counter(r["outcome"] for r in records if r["kind"] == k))
                             for k in sorted({r["kind"] for r in records})},
        "definitions": {
            "validate": "accepted = exit 0; rejected = exit 1 or 2; crashed = any other exit or a hang",
            "torch": "identical = dcp.load succeeded with the unmutated values; different = succeeded with "
                     "other values; failed = raised, crashed or timed out",
        },
        "disagreements_by_field": {f: len(rs) for f, rs in _by_field(records, "accepted_only_by_validate").items()},
        "stricter_by_field": {f: len(rs) for f, rs in _by_field(records, "rejected_only_by_validate").items()},
        "results": records,
    }
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=1))


def _by_field(records: list[dict], outcome: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        if r["outcome"] == outcome:
            out[r["field"]].append(r)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------

def _digest_files(ckpt: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


def test_validate_never_accepts_what_torch_rejects(conversions, tmp_path, capsys):
    started = time.monotonic()
    ckpt = conversions.get(MODEL, MESH)
    verdict, detail = run_validate(ckpt)
    assert verdict == "accepted", f"validate rejects the unmutated checkpoint {ckpt}: {verdict}: {detail}"
    before = _digest_files(ckpt)

    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(load_spec(ckpt)))
    worker = TorchWorker(spec_path, tmp_path / "torch-worker.log")
    try:
        worker.submit(ckpt)
        baseline = worker.result()
        assert baseline["ok"], f"torch cannot load the unmutated checkpoint: {baseline}"
        baseline = baseline["digests"]

        mutants = generate_mutants(ckpt, MUTANTS, SEED)
        assert len(mutants) >= MUTANTS * 0.95, f"only {len(mutants)} distinct offsets drawn of {MUTANTS}"
        records = []
        for m in mutants:
            work = materialize(ckpt, m, tmp_path / "mutants" / f"{m.index:04d}")
            worker.submit(work)  # torch loads while validate runs: the two use a core each
            v, v_detail = run_validate(work)
            t, t_detail = torch_verdict(worker.result(), baseline, work)
            shutil.rmtree(work)
            records.append(asdict(m) | {"validate": v, "validate_detail": v_detail, "torch": t,
                                        "torch_detail": t_detail, "outcome": classify(v, t)})
    finally:
        worker.close()
    assert _digest_files(ckpt) == before, "a mutant run changed the unmutated checkpoint (hard link written?)"

    counts = collections.Counter(r["outcome"] for r in records)
    summary = summary_line(counts, records, time.monotonic() - started)
    write_report([tmp_path / "mutations.json", REPORT], summary, counts, records, worker.restarts)
    with capsys.disabled():
        print(f"\n{summary}\nreport: {REPORT}")

    crashed = [r for r in records if r["outcome"] == "validate_crashed"]
    accepted_bad = [r for r in records if r["outcome"] == "accepted_only_by_validate"]
    stricter = [r for r in records if r["outcome"] == "rejected_only_by_validate"]
    problems = []
    if crashed:
        problems += [f"validate crashed (panic, signal or hang) on {len(crashed)} mutant(s):"]
        problems += [describe(r) + f"\n    validate: {r['validate_detail'][:600]}" for r in crashed[:20]]
    if accepted_bad:
        problems += [f"validate accepted {len(accepted_bad)} mutant(s) that torch fails to load or loads "
                     f"into different values, by region field (file @offset [field] old->new):"]
        problems += grouped(accepted_bad, limit_per_group=3)
    if stricter:  # context only: rejecting what torch loads is allowed
        problems += [f"(allowed) rejected only by validate: {len(stricter)}, e.g.:"]
        problems += [describe(r) for r in stricter[:5]]
    if crashed or accepted_bad:
        pytest.fail(f"{summary}\nreport: {REPORT}\n" + "\n".join(problems), pytrace=False)
