"""The `shardline` wheel as a user installs it (pip, a fresh venv, no Rust toolchain): its CLI is
the workspace's; `shardline.open` reads checkpoints written by torch itself (several ranks, uneven
shards, torch 2.15 and 2.5), by Shardline in every dialect and by NeMo Automodel's writer equal to
what `dcp.load` returns, whole and in random slices, reading only the chunks a slice meets; a
corrupt checkpoint raises the CLI's message; convert, plan, validate, reshard and export from
Python write what the CLI writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import automodel_writer
import dcp_writer
import harness
import reference as ref
from harness import Mesh

WRITER = Path(dcp_writer.__file__)


def dcp_load(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory as torch's own reader loads it."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    state = {k: harness.nan_like_spec(m.size, m.properties.dtype) if m.properties.dtype.is_floating_point
             else torch.zeros(m.size, dtype=m.properties.dtype)
             for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)))
    return state


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s elements in order (NaN-safe, bit for bit), whatever its strides."""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8) if t.numel() else flat


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(bits(got), bits(want))


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory) -> dict[str, Path]:
    """The same state saved by 4 gloo ranks with torch 2.15 and with torch 2.5."""
    base = tmp_path_factory.mktemp("torch-written")
    out = {"2.15": base / "torch-2.15", "2.5": base / "torch-2.5"}
    r = subprocess.run([sys.executable, WRITER, out["2.15"]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1].startswith("2.15"), r.stderr[-3000:]
    harness.run_old_torch([WRITER, out["2.5"]], "dcp.save from 4 ranks")
    return out


def test_the_wheel_installs_without_rust_and_ships_the_workspace_cli(installed_wheel, sl, shardline):
    workspace = tomllib.loads((harness.ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    installed = subprocess.run([installed_wheel.cli, "--version"], capture_output=True, text=True, timeout=60)
    built = subprocess.run([shardline, "--version"], capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout == built.stdout == f"shardline {workspace}\n"
    assert sl.__version__ == workspace
    # The venv's own interpreter imports it with no torch, no numpy and no cargo about.
    env = {"PATH": f"{installed_wheel.venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([installed_wheel.python, "-c", "import shardline, shutil; "
                        "print(shardline.__version__, shutil.which('shardline'))"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [workspace, str(installed_wheel.cli)]


@pytest.mark.parametrize("version", ["2.15", "2.5"])
def test_open_reads_what_torch_saved_from_several_ranks(sl, torch_written, version):
    ckpt = torch_written[version]
    want = dcp_load(ckpt)
    assert set(want) == set(dcp_writer.global_tensors())
    torch_md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    with sl.open(ckpt) as f:
        assert f.keys() == sorted(want)
        for key, w in want.items():
            got = f.get_tensor(key)
            assert same(got, w), f"{key}: {got} != {w}"
            md = f.metadata(key)
            assert md.shape == tuple(w.shape) and md.dtype == str(w.dtype).removeprefix("torch.")
            assert sorted(c.offsets for c in md.chunks) == sorted(tuple(c.offsets) for c in torch_md[key].chunks)
        # The values torch's writers were given, too (dcp.load could be wrong in the same way).
        for key, t in dcp_writer.global_tensors().items():
            assert same(f.get_tensor(key), t), key
        assert sorted(f.object_keys()) == ["args", "step"]
        assert f.get_object("step") == 5
        assert f.get_object("args") == argparse.Namespace(lr=0.1, name="run-7", layers=[1, 2])
        assert len(f.metadata("rows").chunks) == 4 and len(f.metadata("odd").chunks) >= 3


def test_numpy_arrays_hold_the_same_values(torch_written, sl):
    want = dcp_writer.global_tensors()
    with sl.open(torch_written["2.15"], framework="np") as f:
        for key in ("rows", "grid", "odd", "ids", "flags", "scalar"):
            got = f.get_tensor(key)
            assert isinstance(got, np.ndarray) and np.array_equal(got, want[key].numpy()), key
        assert np.array_equal(f.get_slice("rows")[2:5, 1], want["rows"][2:5, 1].numpy())
        # numpy has no bfloat16; without ml_dtypes (the suite's venv has none) that is said.
        assert importlib.util.find_spec("ml_dtypes") is None
        with pytest.raises(TypeError, match="numpy has no bfloat16"):
            f.get_tensor("cols")


def random_index(rng: random.Random, shape: tuple[int, ...]):
    index = []
    for n in shape:
        kind = rng.choice(["slice", "slice", "step", "int", "all"])
        if kind == "int":
            index.append(rng.randrange(-n, n) if n else slice(None))
        elif kind == "all":
            index.append(slice(None))
        else:
            a, b = sorted(rng.randrange(-n - 2, n + 3) for _ in range(2))
            index.append(slice(a, b, rng.randrange(1, 4) if kind == "step" else None))
    if len(index) > 1 and rng.random() < 0.2:
        at = rng.randrange(len(index))
        index[at:] = [Ellipsis, *index[at + 1:]]
    return tuple(index)


def test_random_slices_equal_the_slices_of_the_whole(sl, torch_written, conversions):
    rng = random.Random(2026)
    shardline_ckpt = conversions.get("qwen3_moe", Mesh(2, 1, 3, 1))
    for ckpt in (torch_written["2.15"], torch_written["2.5"], shardline_ckpt):
        with sl.open(ckpt) as f:
            keys = f.keys()
            for _ in range(150):
                key = rng.choice(keys)
                whole = f.get_tensor(key)
                if whole.dim() == 0:
                    continue
                index = random_index(rng, tuple(whole.shape))
                got = f.get_slice(key)[index]
                want = whole[index]
                assert same(got, want.contiguous()), f"{ckpt.name} {key}{index}: {got} != {want}"


def test_open_reads_shardline_checkpoints_in_every_dialect(sl, conversions):
    # Uneven FSDP shards (dp 3), TP, experts (EP needs dp·tp divisible by ep·etp); torch_dist's save directory; DCP-safetensors.
    plain = conversions.get("qwen3_moe", Mesh(2, 1, 3, 1))
    want = dcp_load(plain)
    with sl.open(plain) as f:
        assert f.keys() == sorted(want)
        for key, w in want.items():
            assert same(f.get_tensor(key), w), key
    as_safetensors = conversions.get("qwen3_moe", Mesh(2, 1, 3, 1), fmt="dcp-safetensors")
    with sl.open(as_safetensors) as f:
        assert f.format == "dcp-safetensors" and f.keys() == sorted(want)
        for key, w in want.items():
            assert same(f.get_tensor(key), w), key
    torch_dist = conversions.get("llama", Mesh(1, 1, 3, 1), extra=("--target", "torch_dist"))
    want = dcp_load(torch_dist / "release")
    with sl.open(torch_dist) as f:  # the save directory: its tracker names release/
        assert Path(f.path) == torch_dist / "release" and f.keys() == sorted(want)
        for key, w in want.items():
            assert same(f.get_tensor(key), w), key


def test_a_slice_reads_only_the_chunks_it_meets(sl, shardline, tmp_path):
    release, ckpt = tmp_path / "release", tmp_path / "ckpt"
    harness.run_cli(["synth", "--arch", "llama", "--size", "4MB", "--seed", "3", str(release)])
    r = harness.run_cli(["convert", "--from", str(release), "--to", str(ckpt), "--dp", "256"])
    assert r.returncode == 0, r.stderr
    md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    key = max((k for k, m in md.items() if isinstance(m, TensorStorageMetadata) and len(m.size) == 2),
              key=lambda k: md[k].size.numel())
    rows, cols = md[key].size
    elem = torch.empty((), dtype=md[key].properties.dtype).element_size()
    lo, hi = rows // 3, rows // 3 + rows // 10
    meets = [c for c in md[key].chunks if c.offsets[0] < hi and lo < c.offsets[0] + c.sizes[0] and c.sizes.numel()]
    assert 1 < len(meets) < 256 // 4
    with sl.open(ckpt) as f:
        got = f.get_slice(key)[lo:hi]
        assert f.last_read == {"chunks": len(meets), "bytes_read": (hi - lo) * cols * elem, "reads": len(meets)}
        assert same(got, f.get_tensor(key)[lo:hi])
        # A column of those rows: one read per chunk still (its rows are close in the file).
        f.get_slice(key)[lo:hi, 5]
        assert f.last_read["chunks"] == len(meets) and f.last_read["reads"] == len(meets)


def test_objects_are_read_without_running_what_they_name(sl, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(6.0), "payload": Payload(), "dtype": torch.bfloat16}, checkpoint_id=str(ckpt))
    with sl.open(ckpt) as f:
        got = f.get_object("payload")
        assert isinstance(got, sl.PickledObject) and got.callable == "posix.system"
        assert got.args == (f"touch {marker}",)
        assert f.get_object("dtype").callable == "torch.bfloat16"
        assert f.get_object_bytes("payload")[:2] == b"PK"  # the torch.save archive, untouched
        with pytest.raises(KeyError, match="bytes item"):
            f.get_tensor("payload")
    assert not marker.exists()


def cli_error(shardline, ckpt: Path) -> str:
    r = subprocess.run([shardline, "inspect", ckpt], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    return r.stderr.strip().removeprefix("error: ")


def test_a_corrupt_checkpoint_raises_the_clis_message(sl, shardline, torch_written, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(torch_written["2.15"], ckpt)
    # A rank file cut short: its archives' framing is gone.
    rank_file = ckpt / "__1_0.distcp"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    with pytest.raises(sl.ShardlineError) as e:
        sl.open(ckpt)
    assert str(e.value) and str(e.value) in cli_error(shardline, ckpt)
    # A `.metadata` that is not a pickle.
    (ckpt / ".metadata").write_bytes(b"\x80\x02not a checkpoint")
    with pytest.raises(sl.ShardlineError) as e:
        sl.open(ckpt)
    assert str(e.value) in cli_error(shardline, ckpt)
    with pytest.raises(sl.ShardlineError, match="no checkpoint"):
        sl.open(tmp_path)


def convert_json(*args) -> dict:
    r = harness.run_cli(list(map(str, args)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_api_writes_what_the_cli_writes(sl, tmp_path):
    release = harness.fixture_dir("qwen3_moe")
    seen = []
    report = sl.convert(release, tmp_path / "api", tp=2, dp=3, progress=lambda done, total: seen.append((done, total)))
    cli = convert_json("convert", "--from", release, "--to", tmp_path / "cli", "--tp", 2, "--dp", 3, "--json")
    for field in ("model_type", "world", "chunks", "tensor_bytes", "file_bytes", "source_bytes", "unconverted"):
        assert report[field] == cli[field], field
    assert report["mesh"] == cli["mesh"] and Path(report["out"]) == tmp_path / "api"
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "api").iterdir()) and ".metadata" in names
    for name in names:  # byte for byte: the CLI's output is what the rest of the suite checks
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    # Progress: the first report as it starts, the last with everything done.
    assert seen and seen[-1][0] == seen[-1][1] > 0 and seen[0][0] <= seen[-1][0]
    ok = sl.validate(tmp_path / "api", release)
    assert ok and ok.ok and ok.findings == [] and ok.tensors == len(dcp_load(tmp_path / "api"))


def test_plan_is_the_clis_dry_run(sl):
    release = harness.fixture_dir("qwen3_moe")
    got = sl.plan(release, tp=2, dp=3, target="torch_dist")
    want = convert_json("convert", "--from", release, "--tp", 2, "--dp", 3, "--target", "torch_dist", "--dry-run", "--json")
    for field in ("model_type", "mesh", "world", "bytes_per_rank", "unconverted"):
        assert got[field] == want[field], field
    assert [(t["key"], t["shape"], t["chunks"]) for t in got["tensors"]] == \
        [(t["key"], t["shape"], t["chunks"]) for t in want["tensors"]]


def cli_message(*args) -> str:
    r = harness.run_cli(list(map(str, args)))
    assert r.returncode == 2, r.stdout
    return r.stderr.strip().removeprefix("error: ")


def test_api_errors_carry_the_clis_messages(sl, tmp_path):
    release = harness.fixture_dir("llama")
    with pytest.raises(sl.ShardlineError) as e:
        sl.convert(release, tmp_path / "a", target="torch_dist", optimizer_state=True)
    assert str(e.value) == cli_message("convert", "--from", release, "--to", tmp_path / "a",
                                       "--target", "torch_dist", "--optimizer-state")
    with pytest.raises(sl.ShardlineError) as e:
        sl.convert(release, tmp_path / "b", tp=3)
    assert str(e.value) == cli_message("convert", "--from", release, "--to", tmp_path / "b", "--tp", 3)
    assert "cannot plan" in str(e.value) and not (tmp_path / "b" / ".metadata").exists()
    unknown = tmp_path / "unknown"
    shutil.copytree(release, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    with pytest.raises(sl.ShardlineError) as e:
        sl.plan(unknown)
    assert str(e.value) == cli_message("convert", "--from", unknown, "--dry-run")
    with pytest.raises(ValueError, match="target `nope`"):
        sl.convert(release, tmp_path / "c", target="nope")


def test_validate_reports_a_changed_byte(sl, tmp_path):
    release = harness.fixture_dir("llama")
    out = tmp_path / "ckpt"
    sl.convert(release, out, dp=2)
    with sl.open(out) as f:  # a byte in the middle of one chunk's data
        key = f.keys()[0]
        chunk = max(f.metadata(key).chunks, key=lambda c: c.length)
    rank_file = out / chunk.file
    data = bytearray(rank_file.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x40
    rank_file.write_bytes(bytes(data))
    report = sl.validate(out, release)
    assert not report and [k for k, _ in report.findings] == [key], report


def test_a_progress_callback_that_raises_cancels_and_leaves_no_checkpoint(sl, tmp_path):
    def stop(done, total):
        raise RuntimeError(f"stopped at {done} of {total}")

    with pytest.raises(RuntimeError, match="stopped at"):
        sl.convert(harness.fixture_dir("qwen3_moe"), tmp_path / "out", dp=2, progress=stop)
    assert not (tmp_path / "out" / ".metadata").exists()


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()), (a, b)
    for name in names:
        if (a / name).is_file():
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_reshard_and_export_from_python_write_what_the_cli_writes(sl, tmp_path):
    release = harness.fixture_dir("qwen3_moe")
    sl.convert(release, tmp_path / "trained", tp=2, dp=2, optimizer_state=True)
    planned = sl.reshard(tmp_path / "trained", tp=1, dp=3, dry_run=True)
    assert "out" not in planned and planned["optimizer_states"] > 0 and planned["to"].startswith("tp1")
    done = sl.reshard(tmp_path / "trained", tmp_path / "api", tp=1, dp=3)
    r = harness.run_cli(["reshard", str(tmp_path / "trained"), "--to", str(tmp_path / "cli"), "--tp", "1", "--dp", "3",
                         "--json"])
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    for field in ("from", "to", "files", "tensor_bytes", "file_bytes", "chunks", "optimizer_states", "notes"):
        assert done[field] == cli[field], field
    same_files(tmp_path / "api", tmp_path / "cli")
    # Back to the release: equal to its own tensors, read by the safetensors library.
    exported = sl.export(tmp_path / "api", tmp_path / "hf", like=release, max_file_size=200_000)
    assert exported["files"] and len(exported["files"]) > 1 and "config.json" in exported["copied"]
    r = harness.run_cli(["export", str(tmp_path / "api"), "--to", str(tmp_path / "hf-cli"), "--like", str(release),
                         "--max-file-size", "200000"])
    assert r.returncode == 0, r.stderr
    same_files(tmp_path / "hf", tmp_path / "hf-cli")
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    want, got = tensors(release), tensors(tmp_path / "hf")
    assert got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    with pytest.raises(sl.ShardlineError, match="cannot reshard|torchtitan"):
        sl.reshard(tmp_path / "trained", tmp_path / "never", tp=3, dp=1)


def test_a_torchtitan_checkpoint_reshards_from_python_as_from_the_cli(sl, conversions, tmp_path):
    # The FSDP2 planner behind both: a torchtitan folder, resharded for (dp 4, ep 2).
    titan = conversions.get("qwen3_moe", Mesh(1, 1, 3, 1), extra=("--target", "torchtitan"))
    done = sl.reshard(titan, tmp_path / "api" / "step-0", dp=4, ep=2)
    r = harness.run_cli(["reshard", str(titan), "--to", str(tmp_path / "cli" / "step-0"), "--dp", "4", "--ep", "2",
                         "--json"])
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    for field in ("from", "to", "files", "tensor_bytes", "file_bytes", "chunks", "notes"):
        assert done[field] == cli[field], field
    assert done["files"] == 4 and done["to"].startswith("tp1·cp1·dp4·ep2"), done
    same_files(tmp_path / "api" / "step-0", tmp_path / "cli" / "step-0")


def test_open_reads_a_torchtitan_folder_and_an_automodel_save(sl, conversions, tmp_path):
    # A torchtitan checkpoint folder stands for its latest complete step-N.
    titan = conversions.get("qwen3_moe", Mesh(1, 1, 3, 1), extra=("--target", "torchtitan"))
    want = dcp_load(titan / "step-0")
    with sl.open(titan) as f:
        assert Path(f.path) == titan / "step-0" and f.keys() == sorted(want)
        for key, w in want.items():
            assert same(f.get_tensor(key), w), key
    # A NeMo Automodel save stands for its model/: HF-named safetensors with DCP_SHARDING_INFO,
    # written by torch's HuggingFaceStorageWriter from 3 gloo ranks.
    release = harness.fixture_dir("llama")
    model = tmp_path / "epoch_0_step_1" / "model"
    model.mkdir(parents=True)
    harness.spawn_ranks(automodel_writer.save_worker, 3, (str(release), str(model), "safetensors", ""), "Automodel save")
    want = ref.load_hf_tensors(release)
    with sl.open(tmp_path / "epoch_0_step_1") as f:
        assert f.format == "dcp-safetensors" and f.keys() == sorted(want)
        for key, w in want.items():
            assert same(f.get_tensor(key), w), key
            assert len(f.metadata(key).chunks) >= 1
