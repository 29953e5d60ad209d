"""`shardline reshard`: a Megatron-FSDP training checkpoint saved on mesh A, re-tiled for mesh B.

The inputs are real training checkpoints written with torch.distributed (gloo ranks, dcp.save of
DTensors with Megatron-FSDP's uneven boxes, optimizer moments, bytes items and RNG states; see
training_ckpt.py). Sources: S1 tp1·dp4·ep2·etp1 (TE FusedAdam: `step` in param_to_group_meta),
S2 tp2·dp4·ep4·etp1 (torch-AdamW fallback: a 0-d `step` per parameter state) and S3, S1 written by
torch 2.5 itself (training_ckpt.py run by .venv-torch25's interpreter). For each mesh change:
  (a) the output `.metadata` lists exactly the reference boxes of every tensor on the target mesh,
      global shapes (vocab re-padded) and dtypes, and Megatron's planner_data nesting;
  (b) loaded on the target mesh in real gloo ranks, every rank's boxes of parameters, moments and
      steps equal what torch's own load-time resharding reads from the ORIGINAL checkpoint (vocab
      tensors whose padded size changed: the reference, real rows equal and padding zero);
  (c) bytes items: iteration, checkpoint_version, param_to_group_meta, scheduler unchanged; args
      with the target mesh fields; rng_state re-keyed for the target TP grid (and a warning);
  (d) no metadata.json / common.pt, a `.metadata`, storage entries inside the rank files.
Also: --rng drop, round trips A→B→A byte-identical, rejected inputs (nothing left behind), and
a self-test of the harness that needs no shardline.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import shutil
import subprocess
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)

import harness
import rng_check
import training_ckpt as tc
from harness import Mesh


@dataclass(frozen=True)
class Source:
    mesh: Mesh
    variant: str
    torch: str = "2.15"   # the torch whose dcp.save writes it


SOURCES = {
    "S1": Source(Mesh(1, 1, 4, 2, etp=1), "fused_adam"),
    "S2": Source(Mesh(2, 1, 4, 4, etp=1), "adamw"),
    "S3": Source(Mesh(1, 1, 4, 2, etp=1), "fused_adam", torch="2.5"),
}

# case -> (source, target mesh)
CASES = {
    "dp4to3": ("S1", Mesh(1, 1, 3, 1, etp=1)),   # world 3 cannot take ep 2: EP 2 -> 1 as well
    "dp4to8": ("S1", Mesh(1, 1, 8, 2, etp=1)),   # empty FSDP pieces (7 rows over 8 ranks)
    "tp1to2": ("S1", Mesh(2, 1, 2, 2, etp=2)),   # vocab 40 -> 48; expert TP follows
    "ep2to4": ("S1", Mesh(1, 1, 4, 4, etp=1)),
    "tp2to1": ("S2", Mesh(1, 1, 8, 4, etp=1)),   # vocab 48 -> 40
    "ep4to1": ("S2", Mesh(2, 1, 4, 1, etp=1)),
    "cp2": ("S2", Mesh(1, 2, 4, 2, etp=1)),      # FSDP group dp·cp = 8; TP 2 -> 1, EP 4 -> 2
    "t25-dp4to3": ("S3", Mesh(1, 1, 3, 1, etp=1)),
    "t25-tp1to2": ("S3", Mesh(2, 1, 2, 2, etp=2)),
}
CASE_IDS = list(CASES)
ROUND_TRIPS = [("S1", "tp1to2"), ("S2", "tp2to1"), ("S2", "ep4to1")]
MESH_FIELDS = ("tensor_model_parallel_size", "context_parallel_size", "data_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "world_size", "padded_vocab_size")
RESHARD_TIMEOUT_S = 120


def mesh_args(mesh: Mesh) -> dict[str, int]:
    return {"tensor_model_parallel_size": mesh.tp, "context_parallel_size": mesh.cp, "data_parallel_size": mesh.dp,
            "expert_model_parallel_size": mesh.ep, "expert_tensor_parallel_size": tc.etp_of(mesh),
            "world_size": mesh.world, "padded_vocab_size": tc.padded_vocab(mesh.tp)}


# ---------------------------------------------------------------------------------------------
# Fixtures: the sources (saved by gloo ranks), the reshards (shardline), the target-mesh loads
# ---------------------------------------------------------------------------------------------

class Sources(dict):
    """Source checkpoints by name. One that could not be written raises its error where a test
    uses it, so that only the tests of that source fail."""

    def __init__(self):
        super().__init__()
        self.errors: dict[str, str] = {}

    def __missing__(self, name):
        raise AssertionError(self.errors[name])


def save_with_torch25(src: Source, out: Path, results: Path) -> None:
    m = src.mesh
    harness.run_old_torch([tc.__file__, "save", out, "--mesh", f"{m.tp},{m.cp},{m.dp},{m.ep},{tc.etp_of(m)}",
                           "--variant", src.variant, "--results", results], f"training_ckpt.py save {out.name}")


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> Sources:
    base = tmp_path_factory.mktemp("training-sources")
    out = Sources()
    for name, src in SOURCES.items():
        path, results = base / name, base / f"{name}-results"
        if src.torch == "2.15":
            tc.run_ranks(src.mesh.world, [tc.SaveJob(str(path), src.mesh, src.variant)], results)
            out[name] = path
            continue
        try:
            save_with_torch25(src, path, results)
            out[name] = path
        except (AssertionError, subprocess.TimeoutExpired) as e:
            out.errors[name] = f"source {name} (torch {src.torch}): {e}"
    return out


@dataclass
class Reshard:
    args: list[str]
    out: Path
    proc: object

    def require(self) -> Path:
        assert self.proc.returncode == 0, (
            f"shardline {' '.join(self.args)} exited {self.proc.returncode}\n"
            f"--- stdout\n{self.proc.stdout[-4000:]}\n--- stderr\n{self.proc.stderr[-4000:]}")
        return self.out

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


class Reshards:
    def __init__(self, base: Path, sources: dict[str, Path]):
        self.base, self.sources = base, sources
        self.done: dict[tuple, Reshard] = {}

    def run(self, src: Path, mesh: Mesh, extra: tuple[str, ...] = (), name: str = "out") -> Reshard:
        key = (str(src), mesh, extra)
        if key not in self.done:
            out = self.base / f"{name}-{mesh.id}-{len(self.done)}"
            args = ["reshard", str(src), "--to", str(out), *mesh.cli_args(), *extra]
            self.done[key] = Reshard(args, out, harness.run_cli(args, timeout=RESHARD_TIMEOUT_S))
        return self.done[key]

    def case(self, case: str, extra: tuple[str, ...] = ()) -> Reshard:
        src, mesh = CASES[case]
        return self.run(self.sources[src], mesh, extra, name=case)


@pytest.fixture(scope="session")
def reshards(shardline, sources, tmp_path_factory) -> Reshards:
    return Reshards(tmp_path_factory.mktemp("resharded"), sources)


@pytest.fixture(scope="session")
def target_loads(reshards, sources, tmp_path_factory) -> dict[str, list[str]]:
    """(b) for every case whose reshard succeeded, grouped into one spawned job per world size."""
    by_world = defaultdict(list)
    for case, (src, mesh) in CASES.items():
        if src not in sources:  # its tests fail with the source's own error
            continue
        r = reshards.case(case)
        if r.proc.returncode != 0:
            continue
        s = SOURCES[src]
        by_world[mesh.world].append(tc.CheckJob(case, mesh, s.variant, str(sources[src]), s.mesh.tp, str(r.out)))
    base = tmp_path_factory.mktemp("target-loads")
    results = {}
    for world, jobs in sorted(by_world.items()):
        results |= tc.run_ranks(world, jobs, base / f"world{world}", timeout_s=240)
    return results


# ---------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------

def boxes_of(m: TensorStorageMetadata) -> list:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)


def layout_problems(path: Path, mesh: Mesh, variant: str, rng: bool = True) -> list[str]:
    """(a) + (d): keys, global shapes, dtypes, exact chunk boxes, planner_data, storage bounds."""
    problems = []
    for name in ("metadata.json", "common.pt"):
        if (path / name).exists():
            problems.append(f"{name} present: Megatron would detect the checkpoint as torch_dist")
    if not (path / ".metadata").is_file():
        return problems + [".metadata missing"]
    if list(path.glob("*.tmp")):
        problems.append(f"leftover temporary files {sorted(p.name for p in path.glob('*.tmp'))}")
    md = tc.read_metadata(path)
    want = tc.expected_tensors(mesh, variant, rng=rng)
    got = tc.tensor_keys(md)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        problems.append(f"tensor keys differ: missing {missing[:10]} ({len(missing)}), unexpected {extra[:10]} "
                        f"({len(extra)})")
    for key in sorted(set(want) & set(got)):
        w, g = want[key], got[key]
        if tuple(g.size) != w.size or g.properties.dtype != w.dtype:
            problems.append(f"{key}: {tuple(g.size)} {g.properties.dtype}, want {w.size} {w.dtype}")
        elif boxes_of(g) != w.boxes:
            problems.append(f"{key}: chunks {boxes_of(g)}, want {w.boxes}")
    want_bytes = tc.expected_bytes_keys(mesh, variant, rng=rng)
    got_bytes = set(md.state_dict_metadata) - set(got)
    if want_bytes != got_bytes:
        problems.append(f"bytes keys differ: missing {sorted(want_bytes - got_bytes)[:10]}, "
                        f"unexpected {sorted(got_bytes - want_bytes)[:10]}")
    planner = md.planner_data or {}
    bad = [(k, planner.get(k), tc.expected_planner_path(k)) for k in sorted(md.state_dict_metadata)
           if tuple(planner.get(k) or ()) != tc.expected_planner_path(k)]
    if bad:
        problems.append(f"planner_data differs from Megatron's nesting for {len(bad)} keys, e.g. {bad[:3]}")
    sizes = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
    for key in sorted(got_bytes):
        info = md.storage_data.get(MetadataIndex(key))
        if info is None:
            problems.append(f"bytes item {key}: no storage_data entry MetadataIndex({key!r}) (dcp.load raises KeyError)")
        elif info.relative_path not in sizes or info.offset + info.length > sizes[info.relative_path]:
            problems.append(f"bytes item {key}: stored at {info.relative_path}+{info.offset}:{info.length}, "
                            f"outside the rank files {sizes}")
    for key, m in got.items():
        for c in m.chunks:
            info = md.storage_data.get(MetadataIndex(key, torch.Size(c.offsets)))
            if info is None:
                problems.append(f"{key}: chunk at {tuple(c.offsets)} has no storage_data entry")
            elif info.relative_path not in sizes or info.offset + info.length > sizes[info.relative_path]:
                problems.append(f"{key}: stored at {info.relative_path}+{info.offset}:{info.length}, "
                                f"outside the rank files {sizes}")
    return problems


def rng_grid(keys) -> set[str]:
    return {k.split(".", 2)[1] for k in keys if k.startswith("rng_state.")}


def rng_items(path: Path) -> dict[str, dict[str, object]]:
    """{'(pp, tp)': {item name after the list index: canonical value}} (bytes and tensors)."""
    md = tc.read_metadata(path)
    tensors = {k: (tuple(m.size), m.properties.dtype) for k, m in tc.tensor_keys(md).items()
               if k.startswith("rng_state.")}
    values = tc.load_full(path, tensors) if tensors else {}
    values |= {k: v for k, v in tc.read_bytes_items(path).items() if k.startswith("rng_state.")}
    out = defaultdict(dict)
    for k, v in values.items():
        grid, rest = k[len("rng_state."):].split(").", 1)
        out[grid + ")"][rest] = tc.canon(v)
    return dict(out)


# ---------------------------------------------------------------------------------------------
# Harness self-test (no shardline)
# ---------------------------------------------------------------------------------------------

def test_layout_golden_layouts_t5():
    """layouts.md §5 T5: SwiGLU F=6, H=4, t=2, D=4; (row offset, rows) per FSDP rank."""
    p = tc.Param("x", (("x_w", (6, 4)), ("x_v", (6, 4))), "column")
    got = tc.pieces(p, Mesh(2, 1, 4))
    rows = {name: {r: [(pc.offsets[0], pc.sizes[0]) for pc in pcs if pc.rank % 2 == r] for r in (0, 1)}
            for name, pcs in got.items()}
    assert rows["x_w"] == {0: [(0, 2), (2, 1), (3, 0), (3, 0)], 1: [(3, 2), (5, 1), (6, 0), (6, 0)]}
    assert rows["x_v"] == {0: [(0, 0), (0, 1), (1, 2), (3, 0)], 1: [(3, 0), (3, 1), (4, 2), (6, 0)]}


def _swap_storage(src: Path, dst: Path, a: str, b: str) -> None:
    """A copy of `src` where keys a and b (same boxes) read each other's bytes."""
    shutil.copytree(src, dst)
    md = tc.read_metadata(dst)
    for c in md.state_dict_metadata[a].chunks:
        ia, ib = MetadataIndex(a, torch.Size(c.offsets)), MetadataIndex(b, torch.Size(c.offsets))
        md.storage_data[ia], md.storage_data[ib] = md.storage_data[ib], md.storage_data[ia]
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_harness_saves_and_loads_with_torch(sources, tmp_path):
    """The saver writes exactly the reference layout and Megatron's keys; torch loads it on other
    meshes into the reference values; a corrupted copy is caught."""
    problems = []
    for name, s in SOURCES.items():
        if s.torch != "2.15":  # test_torch25_source_is_s1_in_torch25s_format
            continue
        problems += [f"{name}: {p}" for p in layout_problems(sources[name], s.mesh, s.variant)]
        items = tc.read_bytes_items(sources[name])
        args = vars(items["args"])
        if {k: args[k] for k in MESH_FIELDS} != mesh_args(s.mesh):
            problems.append(f"{name}: args mesh fields {[args[k] for k in MESH_FIELDS]}")
        if rng_grid(tc.read_metadata(sources[name]).state_dict_metadata) != {f"(0, {t})" for t in range(s.mesh.tp)}:
            problems.append(f"{name}: rng grid {rng_grid(tc.read_metadata(sources[name]).state_dict_metadata)}")
        if items["optimizer.param_to_group_meta.module.module.module.decoder.layers.0.mlp.linear_fc1.weight.betas"] \
                != (0.9, 0.95):
            problems.append(f"{name}: param_to_group_meta betas not a tuple (0.9, 0.95)")
    rngs = rng_items(sources["S2"])
    if rngs["(0, 0)"] == rngs["(0, 1)"]:
        problems.append("S2: rng states of TP ranks 0 and 1 are equal (the rng tests would be vacuous)")
    assert not problems, "\n".join(problems[:40])

    broken = tmp_path / "S1-swapped"
    a = tc.state_key("decoder.layers.1.mlp.experts.linear_fc1.weight3_v", "exp_avg")
    b = tc.state_key("decoder.layers.1.mlp.experts.linear_fc1.weight3_v", "exp_avg_sq")
    _swap_storage(sources["S1"], broken, a, b)
    s1, s2 = SOURCES["S1"], SOURCES["S2"]
    jobs = [
        tc.CheckJob("S1 on tp2 dp2 ep2 etp2", Mesh(2, 1, 2, 2, etp=2), s1.variant, str(sources["S1"]), s1.mesh.tp),
        tc.CheckJob("S2 on tp2 dp2 ep1", Mesh(2, 1, 2, 1, etp=1), s2.variant, str(sources["S2"]), s2.mesh.tp),
        tc.CheckJob("S2 on tp1 cp2 dp2 ep4", Mesh(1, 2, 2, 4, etp=1), s2.variant, str(sources["S2"]), s2.mesh.tp),
        tc.CheckJob("control", s1.mesh, s1.variant, str(sources["S1"]), s1.mesh.tp, str(broken)),
    ]
    results = tc.run_ranks(4, jobs, tmp_path / "results")
    control = results.pop("control")
    problems = [f"[{label}] {p}" for label, ps in results.items() for p in ps]
    assert not problems, "\n".join(problems[:40])
    flagged = {k for k in (a, b) if any(k + ":" in p for p in control)}
    assert flagged == {a, b} and all("[resharded vs torch's reshard" in p for p in control), (
        "the comparison missed swapped exp_avg/exp_avg_sq bytes:\n" + "\n".join(control[:10]))


def _archive_records(path: Path, md, key: str) -> set[str]:
    """The record names of the torch.save archive that holds bytes item `key`."""
    info = md.storage_data[MetadataIndex(key)]
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return {n.split("/", 1)[1] for n in zipfile.ZipFile(io.BytesIO(data)).namelist()}


def test_torch25_source_is_s1_in_torch25s_format(sources):
    """S3 holds S1's checkpoint (the reference layout, every tensor and bytes item equal) in the
    format torch 2.5 writes, which differs from torch 2.15's where it is recorded: no `version` in
    `.metadata`, no `modules` in its StorageMeta, no `.format_version` / `.storage_alignment`
    records in the item archives (so data records sit at other offsets)."""
    s1, s3 = sources["S1"], sources["S3"]
    src = SOURCES["S3"]
    assert (src.mesh, src.variant) == (SOURCES["S1"].mesh, SOURCES["S1"].variant)
    problems = layout_problems(s3, src.mesh, src.variant)
    problems += harness.compare_state_dicts(tc.load_full(s3), tc.load_full(s1))
    items1, items3 = tc.read_bytes_items(s1), tc.read_bytes_items(s3)
    problems += [f"bytes item {k}: {items3.get(k)!r:.200}, S1 {items1.get(k)!r:.200}"
                 for k in sorted(set(items1) | set(items3)) if tc.canon(items1.get(k)) != tc.canon(items3.get(k))]
    assert not problems, "\n".join(problems[:40])

    md1, md3 = tc.read_metadata(s1), tc.read_metadata(s3)
    assert vars(md1).get("version") == "1.0.0" and "version" not in vars(md3)
    assert "modules" in vars(md1.storage_meta) and "modules" not in vars(md3.storage_meta)
    new_records = {".format_version", ".storage_alignment"}
    assert new_records <= _archive_records(s1, md1, "iteration")
    assert not new_records & _archive_records(s3, md3, "iteration")


# ---------------------------------------------------------------------------------------------
# (a) + (d) layout, (b) loads on the target mesh, (c) bytes items
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASE_IDS)
def test_reshard_layout(reshards, case):
    out = reshards.case(case).require()
    src, mesh = CASES[case]
    problems = layout_problems(out, mesh, SOURCES[src].variant)
    assert not problems, f"{case} ({src} -> {mesh.id}):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("case", CASE_IDS)
def test_reshard_loads_on_target_mesh(reshards, target_loads, case):
    reshards.case(case).require()
    problems = target_loads[case]
    assert not problems, f"{case} ({len(problems)} problems):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("case", CASE_IDS)
def test_reshard_bytes_items(reshards, sources, case):
    r = reshards.case(case)
    out = r.require()
    src_name, mesh = CASES[case]
    source = SOURCES[src_name]
    before, after = tc.read_bytes_items(sources[src_name]), tc.read_bytes_items(out)
    problems = []
    for key in sorted(before):
        if key == "args" or key.startswith("rng_state."):
            continue
        if key not in after:
            problems.append(f"{key}: missing")
        elif tc.canon(after[key]) != tc.canon(before[key]):
            problems.append(f"{key}: {after[key]!r}, source {before[key]!r}")
    stray = sorted(k for k in after if k not in before and not k.startswith("rng_state."))
    if stray:
        problems.append(f"bytes items the source does not have: {stray[:10]}")

    a_src, a_out = vars(before["args"]), vars(after["args"])
    if set(a_out) != set(a_src):
        problems.append(f"args fields differ: added {sorted(set(a_out) - set(a_src))}, "
                        f"removed {sorted(set(a_src) - set(a_out))}")
    for k, v in mesh_args(mesh).items():
        if a_out.get(k) != v:
            problems.append(f"args.{k} = {a_out.get(k)!r}, target mesh needs {v!r}")
    for k in sorted(set(a_src) - set(MESH_FIELDS)):
        if k in a_out and tc.canon(a_out[k]) != tc.canon(a_src[k]):
            problems.append(f"args.{k} = {a_out[k]!r}, source {a_src[k]!r} (not a mesh field)")

    src_rng, out_rng = rng_items(sources[src_name]), rng_items(out)
    want_grid = {f"(0, {t})" for t in range(mesh.tp)}
    if set(out_rng) != want_grid:
        problems.append(f"rng_state grid {sorted(out_rng)}, target (pp, tp) grid {sorted(want_grid)}")
    for grid in sorted(want_grid & set(out_rng)):
        origin = grid if grid in src_rng else "(0, 0)"
        if out_rng[grid] != src_rng[origin]:
            diff = sorted(k for k in set(out_rng[grid]) | set(src_rng[origin])
                          if out_rng[grid].get(k) != src_rng[origin].get(k))
            problems.append(f"rng_state.{grid} differs from the source's {origin} in {diff}")
    if source.mesh.tp != mesh.tp and not re.search(r"(?i)warn.*\brng\b|\brng\b.*warn", r.output):
        problems.append(f"the TP grid changed ({source.mesh.tp} -> {mesh.tp}) but no RNG warning was printed:\n"
                        f"{r.output[-1500:]}")
    assert not problems, f"{case}:\n" + "\n".join(problems[:40])


def test_reshard_rng_drop(reshards, sources):
    src, mesh = CASES["tp1to2"]
    r = reshards.case("tp1to2", ("--rng", "drop"))
    out = r.require()
    problems = layout_problems(out, mesh, SOURCES[src].variant, rng=False)
    left = sorted(k for k in tc.read_metadata(out).state_dict_metadata if k.startswith("rng_state"))
    if left:
        problems.append(f"--rng drop left {left[:6]}")
    assert not problems, "\n".join(problems[:40])


# ---------------------------------------------------------------------------------------------
# (e) round trip A -> B -> A
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_name,case", ROUND_TRIPS, ids=[f"{s}-via-{c}" for s, c in ROUND_TRIPS])
def test_round_trip(reshards, sources, src_name, case):
    source = SOURCES[src_name]
    via = reshards.case(case).require()
    back = reshards.run(via, source.mesh, name=f"{case}-back").require()
    md_a, md_back = tc.read_metadata(sources[src_name]), tc.read_metadata(back)
    ta, tb = tc.tensor_keys(md_a), tc.tensor_keys(md_back)
    b_tp = CASES[case][1].tp
    # RNG entries of TP ranks the intermediate mesh lacks come back as copies of (0, 0).
    lost_rng = {f"rng_state.(0, {t})." for t in range(b_tp, source.mesh.tp)}
    keys = {k for k in ta if not any(k.startswith(p) for p in lost_rng)}
    problems = []
    if set(ta) != set(tb):
        problems.append(f"tensor keys differ: {sorted(set(ta) ^ set(tb))[:10]}")
    keys &= set(tb)
    for k in sorted(keys):
        if boxes_of(ta[k]) != boxes_of(tb[k]) or tuple(ta[k].size) != tuple(tb[k].size):
            problems.append(f"{k}: chunks {boxes_of(tb[k])[:4]} {tuple(tb[k].size)}, original "
                            f"{boxes_of(ta[k])[:4]} {tuple(ta[k].size)}")
    spec = {k: (tuple(ta[k].size), ta[k].properties.dtype) for k in keys}
    a, b = tc.load_full(sources[src_name], spec), tc.load_full(back, spec)
    common_vocab = min(tc.padded_vocab(source.mesh.tp), tc.padded_vocab(b_tp))
    vocab_names = {n for p in tc.params() if p.vocab for n, _ in p.sections}
    for k in sorted(keys):
        x, y = a[k], b[k]
        if x.dim() and any(f".{n}." in k + "." for n in vocab_names):  # not the 0-d `step`
            x, y = x[:common_vocab], y[:common_vocab]
            if bool(b[k][common_vocab:].ne(0).any()):
                problems.append(f"{k}: padding rows past {common_vocab} are not zero after the round trip")
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                        y.reshape(-1).view(torch.uint8)):
            problems.append(harness.describe_mismatch(k, y, x))
    ba, bb = tc.read_bytes_items(sources[src_name]), tc.read_bytes_items(back)
    for k in sorted(set(ba) | set(bb)):
        if any(k.startswith(p) for p in lost_rng):
            continue
        if k not in ba or k not in bb or tc.canon(ba[k]) != tc.canon(bb[k]):
            problems.append(f"bytes item {k}: {bb.get(k)!r:.200}, original {ba.get(k)!r:.200}")
    assert not problems, f"{src_name} -> {case} -> back:\n" + "\n".join(problems[:40])


# ---------------------------------------------------------------------------------------------
# (f) rejected inputs
# ---------------------------------------------------------------------------------------------

def _rewrite_metadata(path: Path, md) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _append_item(path: Path, rank_file: str, t: torch.Tensor) -> _StorageInfo:
    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    data = buf.getvalue()
    f = path / rank_file
    offset = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(data)
    return _StorageInfo(relative_path=rank_file, offset=offset, length=len(data))


QKV = "decoder.layers.0.self_attention.linear_qkv.weight"   # 40 rows at tp1 dp4: 10 each
NORM = "decoder.final_layernorm.weight"


def _mutate(kind: str, ckpt: Path) -> None:
    md = tc.read_metadata(ckpt)
    ref = tc.reference_tensors(SOURCES["S1"].mesh.tp, SOURCES["S1"].variant)
    if kind == "truncated-rank-file":
        f = ckpt / "__1_0.distcp"
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 100)
        return
    if kind == "missing-chunk":
        key = tc.model_key(QKV)
        m = md.state_dict_metadata[key]
        gone = next(c for c in m.chunks if tuple(c.offsets) == (10, 0))
        m.chunks.remove(gone)
        del md.storage_data[MetadataIndex(key, torch.Size(gone.offsets))]
    elif kind == "overlapping-chunks":
        key = tc.model_key(QKV)
        m = md.state_dict_metadata[key]
        first = next(c for c in m.chunks if tuple(c.offsets) == (0, 0))
        grown = ChunkStorageMetadata(offsets=first.offsets, sizes=torch.Size([11, tc.HIDDEN]))  # rows 0..11 vs 10..20
        m.chunks[m.chunks.index(first)] = grown
        md.storage_data[MetadataIndex(key, first.offsets)] = _append_item(ckpt, "__0_0.distcp", ref[key][:11])
    elif kind == "exp-avg-shape":
        key = tc.state_key(NORM, "exp_avg")
        m = md.state_dict_metadata[key]
        for c in m.chunks:
            del md.storage_data[MetadataIndex(key, torch.Size(c.offsets))]
        n = tc.HIDDEN + 1
        m.size = torch.Size([n])
        m.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([n]))]
        md.storage_data[MetadataIndex(key, torch.Size([0]))] = _append_item(ckpt, "__0_0.distcp", torch.ones(n))
    else:
        raise ValueError(kind)
    _rewrite_metadata(ckpt, md)


# kind -> regexes the message must match (all of them)
BAD_INPUTS = {
    "truncated-rank-file": [r"__1_0\.distcp"],
    "missing-chunk": [re.escape(QKV), r"(?i)gap|missing|cover|hole"],
    "overlapping-chunks": [re.escape(QKV), r"(?i)overlap"],
    "exp-avg-shape": [re.escape(NORM), r"exp_avg", r"\b8\b", r"\b7\b"],
}


def _assert_rejected(r: Reshard, patterns: list[str], what: str) -> None:
    message = r.output
    assert r.proc.returncode != 0, f"{what}: shardline reshard exited 0:\n{message[-2000:]}"
    missing = [p for p in patterns if not re.search(p, message)]
    assert not missing, f"{what}: the message should match {missing}:\n{message[-2000:]}"
    assert not r.out.exists() or not any(r.out.iterdir()), (
        f"{what}: a failed reshard left {sorted(p.name for p in r.out.iterdir())} in {r.out}")


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_rejects_bad_input(shardline, sources, tmp_path, kind):
    ckpt = tmp_path / "in"
    shutil.copytree(sources["S1"], ckpt)
    _mutate(kind, ckpt)
    out = tmp_path / "out"
    args = ["reshard", str(ckpt), "--to", str(out), *CASES["tp1to2"][1].cli_args()]
    _assert_rejected(Reshard(args, out, harness.run_cli(args, timeout=RESHARD_TIMEOUT_S)), BAD_INPUTS[kind], kind)


@pytest.mark.parametrize("mesh,patterns", [
    pytest.param(Mesh(4, 1, 1, 1, etp=1), [r"\b2\b", r"\b4\b", r"(?i)group"], id="query-groups-2-tp-4"),
    pytest.param(Mesh(1, 1, 3, 3, etp=1), [r"\b4\b", r"\b3\b", r"(?i)expert"], id="experts-4-ep-3"),
])
def test_rejects_mesh_the_model_cannot_take(shardline, sources, tmp_path, mesh, patterns):
    with pytest.raises(ValueError):
        tc.check_mesh(mesh)
    out = tmp_path / "out"
    args = ["reshard", str(sources["S1"]), "--to", str(out), *mesh.cli_args()]
    _assert_rejected(Reshard(args, out, harness.run_cli(args, timeout=RESHARD_TIMEOUT_S)), patterns, mesh.id)


@pytest.mark.parametrize("src_name", list(SOURCES))
def test_inspect_reports_the_training_state(shardline, sources, src_name):
    """`inspect --json` of a torch-written training checkpoint: its mesh (from `args`), iteration,
    checkpoint version, optimizer moments, Adam's step (in the group settings, or per parameter for
    torch-AdamW) and every bytes item, with its value."""
    proc = harness.run_cli(["inspect", "--json", "--summary", str(sources[src_name])], timeout=RESHARD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    training = json.loads(proc.stdout)["training"]
    mesh = SOURCES[src_name].mesh
    assert training["mesh"] == {"tp": mesh.tp, "cp": mesh.cp, "dp": mesh.dp, "ep": mesh.ep, "etp": tc.etp_of(mesh)}
    assert training["iteration"] == str(tc.ITERATION)
    assert training["checkpoint_version"] == "3.0"
    states = training["optimizer_states"]
    assert states["exp_avg"]["tensors"] == states["exp_avg_sq"]["tensors"] > 0
    assert states["exp_avg"]["tensors"] == training["parameters"]["tensors"] - 1, "all but the expert_bias buffer"
    objects = training["objects"]
    if SOURCES[src_name].variant == "fused_adam":
        assert training["adam_steps"] == {str(tc.ADAM_STEP): sum(1 for k in objects if k.endswith(".step"))}
    else:
        assert training["adam_steps"] == {}
        assert states["step"]["tensors"] == states["exp_avg"]["tensors"]
    md = FileSystemReader(str(sources[src_name])).read_metadata()
    bytes_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert set(objects) == bytes_keys
    assert objects["opt_param_scheduler.lr_decay_style"] == '"cosine"'
    assert objects["args"].startswith("argparse.Namespace(")
    assert sorted(tuple(r) for r in training["rng_ranks"]) == [(0, t) for t in range(mesh.tp)]


# ---------------------------------------------------------------------------------------------
# Translation to Megatron-Core's torch_dist (issue 26)
# ---------------------------------------------------------------------------------------------

TORCH_DIST_MESH = Mesh(2, 1, 2, 2, etp=1)
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")


def torch_dist_form(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-FSDP tensors (canonical names) in torch_dist's form, from the brief
    (torch-dist.md §2): fc1 `[gate; up]`, experts stacked under `experts.experts.`, decoder layers
    stacked when every layer holds the same parameters, else per layer."""
    import megatron_load as ml

    layers: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    out: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        m = _LAYER.fullmatch(k)
        if m:
            layers[int(m.group(1))][m.group(2)] = t
        else:
            out[k] = t
    per_layer = {i: ml._torch_dist_per_layer(sub) for i, sub in layers.items()}
    kinds = {i: sorted(sub) for i, sub in per_layer.items()}
    if all(k == kinds[0] for k in kinds.values()):
        for k in kinds[0]:
            out[f"decoder.layers.{k}"] = torch.stack([per_layer[i][k] for i in sorted(per_layer)])
    else:
        for i, sub in per_layer.items():
            out |= {f"decoder.layers.{i}.{k}": t for k, t in sub.items()}
    return out


def test_translates_to_torch_dist_with_fully_reshardable_optimizer_state(reshards, sources, tmp_path):
    """S1 (Megatron-FSDP, TE FusedAdam) → `reshard --target torch_dist` on another mesh: a Megatron
    save directory at the source's iteration whose every tensor equals the reference in torch_dist's
    form — the model (in the job's bf16, rounded from its masters), `optimizer.state.param.*` (the
    fp32 masters), the moments — read back by
    torch's own DCP reader; a common.pt with args for the target mesh, the scheduler, and the
    optimizer's param_groups (dense and expert-parallel sub-optimizers) as `fully_reshardable`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    r = reshards.run(sources["S1"], TORCH_DIST_MESH, ("--target", "torch_dist"), name="torch-dist")
    root = r.require()
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(tc.ITERATION)
    ckpt = root / f"iter_{tc.ITERATION:07d}"
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert re.search(r"RNG states re-keyed for the target TP grid", r.output), r.output

    ref = tc.reference_tensors(TORCH_DIST_MESH.tp, "fused_adam")
    model, states = {}, {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for p in tc.params():
        for name, _ in p.sections:
            # The model's own copy in the job's dtype (`args.bf16`), rounded from its fp32 master
            # as Megatron-Core keeps and saves it; buffers as they are.
            model[name] = ref[tc.model_key(name)].to(torch.bfloat16) if p.optimized else ref[tc.model_key(name)]
            if p.optimized:
                states["param"][name] = ref[tc.model_key(name)]
                for s in ("exp_avg", "exp_avg_sq"):
                    states[s][name] = ref[tc.state_key(name, s)]
    want = torch_dist_form(model)
    for s, flat in states.items():
        want |= {f"optimizer.state.{s}.{k}": t for k, t in torch_dist_form(flat).items()}

    dcp_to_torch_save(ckpt, tmp_path / "all.pt")
    got = torch.load(tmp_path / "all.pt", weights_only=False)
    tensors = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == sorted(want)
    bad = [k for k, t in want.items() if tensors[k].dtype != t.dtype or not torch.equal(tensors[k], t)]
    assert not bad, f"{len(bad)} tensors differ from the reference, e.g. {bad[:5]}"
    others = sorted(k for k in got if k not in tensors and not k.startswith("rng_state/"))
    assert others and all(k.endswith(("._extra_state/shard_0_1",)) or "._extra_state/shard_" in k for k in others), others
    # One RNG ShardedObject per TP rank of the target, Megatron's rng_state_list: S1's (0, 0)
    # kept, the new TP rank given a copy of it (`--rng from-rank0`).
    tp = TORCH_DIST_MESH.tp
    assert sorted(k for k in got if k.startswith("rng_state/")) == [f"rng_state/shard_0.{t}_1.{tp}" for t in range(tp)]
    for t in range(tp):
        # Megatron-Core's torch strategy stores a ShardedObject's data as `[data]`.
        rng_check.assert_same_rng(got[f"rng_state/shard_0.{t}_1.{tp}"], [[tc.rng_entry(0)]])

    import megatron.core.safe_globals  # noqa: F401  (Megatron-Core's safe globals for weights_only)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    args = common["args"]
    for field, value in mesh_args(TORCH_DIST_MESH).items():
        assert getattr(args, field) == value, field
    assert (args.no_save_rng, args.no_save_optim, args.ckpt_format) == (False, False, "torch_dist")
    assert common["iteration"] == tc.ITERATION and common["checkpoint_version"] == 3.0
    assert common["opt_param_scheduler"] == tc.scheduler_state()
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    # Megatron's ChainedOptimizer: the dense sub-optimizer, then the expert-parallel one; each
    # group's settings exactly one parameter's param_to_group_meta.
    opt = common["optimizer"]
    assert sorted(opt) == [0, 1]
    for i, expert in ((0, False), (1, True)):
        assert opt[i]["param_state_sharding_type"] == "fully_reshardable"
        groups = opt[i]["optimizer"]["param_groups"]
        metas = {json.dumps(tc.group_meta(p, "fused_adam"), sort_keys=True)
                 for p in tc.params() if p.optimized and (p.expert is not None) == expert}
        assert sorted(json.dumps(g, sort_keys=True) for g in groups) == sorted(metas)
    # inspect finds Adam's step in the param_groups (the step is not the iteration).
    training = json.loads(harness.run_cli(["inspect", str(root), "--json"]).stdout)["training"]
    assert training["adam_steps"] == {str(tc.ADAM_STEP): 3} and training["adam_steps_by_group"], training


def test_megatron_core_loads_and_restores_the_translated_rng_states(reshards, sources, tmp_path):
    """The RNG ShardedObjects of S1 → torch_dist are what Megatron-LM's load_checkpoint asks for:
    Megatron-Core's `dist_checkpointing.load` of `ShardedObject('rng_state', (PP, TP), (pp, tp))`
    finds each, and random / numpy / torch take the states back (megatron_rng.py)."""
    root = reshards.run(sources["S1"], TORCH_DIST_MESH, ("--target", "torch_dist"), name="torch-dist").require()
    loaded = rng_check.megatron_rng(root / f"iter_{tc.ITERATION:07d}", TORCH_DIST_MESH.tp, tmp_path)
    assert len(loaded) == TORCH_DIST_MESH.tp
    for state in loaded:
        rng_check.assert_same_rng(state, [tc.rng_entry(0)])


def test_torch_adamw_steps_are_refused_for_torch_dist(shardline, sources, tmp_path):
    out = tmp_path / "out"
    args = ["reshard", str(sources["S2"]), "--to", str(out), *Mesh(2, 1, 2, 2, etp=1).cli_args(), "--target", "torch_dist"]
    _assert_rejected(Reshard(args, out, harness.run_cli(args, timeout=RESHARD_TIMEOUT_S)),
                     [r"per-parameter `step`", r"param_groups"], "adamw steps")


def _flat_items(d, p: str = "") -> dict:
    """A loaded state dict's leaves by their DCP key (RNG lists descended into)."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out |= _flat_items(v, f"{p}{k}.")
    elif isinstance(d, list) and p.startswith("rng_state."):
        for i, v in enumerate(d):
            out |= _flat_items(v, f"{p}{i}.")
    else:
        out[p[:-1]] = d
    return out


def test_torch_dist_translates_back_to_the_same_training_state(reshards, sources, tmp_path):
    """S1 → torch_dist (another mesh) → fsdp_dtensor on S1's mesh: torch's DCP reader finds every
    parameter (from the fp32 masters), moment, param_to_group_meta field, scheduler value,
    counter and RNG state of S1, equal: nothing is lost."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    there = reshards.run(sources["S1"], TORCH_DIST_MESH, ("--target", "torch_dist"), name="torch-dist").require()
    back = reshards.run(there, SOURCES["S1"].mesh, ("--target", "fsdp_dtensor"), name="back").require()

    def items(path):
        dcp_to_torch_save(path, tmp_path / f"{path.name}.pt")
        return _flat_items(torch.load(tmp_path / f"{path.name}.pt", weights_only=False))

    src, got = items(sources["S1"]), items(back)
    assert sorted(set(src) ^ set(got)) == []
    assert sum(k.startswith("rng_state.") for k in got) == 7
    bad = []
    for k in sorted(set(src) & set(got)):
        a, b = src[k], got[k]
        if k.startswith("rng_state."):
            try:
                rng_check.assert_same_rng(b, a)
                same = True
            except AssertionError:
                same = False
        else:
            same = (a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) else (k == "args" or a == b)
        if not same:
            bad.append(k)
    assert not bad, f"{len(bad)} items changed, e.g. {bad[:5]}"
    assert sum(k.startswith("optimizer.param_to_group_meta.") for k in got) > 100
    args = got["args"]
    for field, value in mesh_args(SOURCES["S1"].mesh).items():
        assert getattr(args, field) == value, field


def test_torch_dist_at_ep1_has_one_optimizer(reshards, sources):
    """At EP 1 experts are not expert-parallel (Megatron marks them `allreduce = not EP>1`), so a
    job has one DistributedOptimizer: the common state holds one optimizer's param_groups, the
    expert groups merged into the dense ones, not a ChainedOptimizer's {0, 1}."""
    import megatron.core.safe_globals  # noqa: F401

    mesh = Mesh(1, 1, 4, 1, etp=1)
    root = reshards.run(sources["S1"], mesh, ("--target", "torch_dist"), name="torch-dist-ep1").require()
    common = torch.load(root / f"iter_{tc.ITERATION:07d}" / "common.pt", weights_only=True)
    opt = common["optimizer"]
    assert opt["param_state_sharding_type"] == "fully_reshardable"
    groups = opt["optimizer"]["param_groups"]
    metas = {json.dumps(tc.group_meta(p, "fused_adam") | {"is_expert_parallel": False}, sort_keys=True)
             for p in tc.params() if p.optimized}
    assert sorted(json.dumps(g, sort_keys=True) for g in groups) == sorted(metas)
