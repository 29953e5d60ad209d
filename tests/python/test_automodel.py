"""NeMo Automodel training checkpoints exported back to the release: `model/` written by torch
itself (automodel_writer.py) in both of Automodel's formats, consolidated by `shardline export`
byte for byte, each tensor in the release's dtype; an unfinished save refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import automodel_writer
import harness
import reference as ref
import training_read as tc
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
    _hf_metadata(model, release)
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


# ---------------------------------------------------------------------------------------------
# Training saves resharded: `model/` and `optim/` re-tiled, per-rank files for the new world
# ---------------------------------------------------------------------------------------------

def _hf_metadata(model: Path, release: Path) -> None:
    """What Automodel's ConsolidatedHFAddon keeps of the release in `model/.hf_metadata/`
    (fsdp2-frameworks.md §1): its config, each tensor's 1-based file number from the release's
    index, and its original dtype as safetensors spells it."""
    meta = model / ".hf_metadata"
    meta.mkdir()
    (meta / "config.json").write_text((release / "config.json").read_text())
    weight_map = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    numbers = {k: int(f.split("-")[1]) for k, f in weight_map.items()}
    (meta / "fqn_to_file_index_mapping.json").write_text(json.dumps(numbers, indent=2, sort_keys=True))
    dtypes = {k: SAFETENSORS_DTYPES[t.dtype] for k, t in ref.load_hf_tensors(release).items()}
    (meta / "fqn_to_dtype_mapping.json").write_text(json.dumps(dtypes, indent=2, sort_keys=True))


RECIPE_CONFIG = ("step_scheduler:\n  global_batch_size: 8\ndistributed:\n  _target_: "
                 "nemo_automodel.components.distributed.config.FSDP2Config\n  dp_size: {dp}\n  tp_size: 1\n"
                 "  cp_size: 1\n  ep_size: {ep}\nmodel:\n  pretrained_model_name_or_path: tiny\n")


def _training_save(root: Path, release: Path, fmt: str, dtype: str = "bfloat16") -> Path:
    """`root/epoch_0_step_2/` after two AdamW steps on `WORLD` ranks, with the files Automodel
    writes around the tensors."""
    step = root / "epoch_0_step_2"
    harness.spawn_ranks(automodel_writer.save_training_worker, WORLD, (str(release), str(step), fmt, dtype),
                        "Automodel training save")
    _hf_metadata(step / "model", release)
    # As Automodel's `save_config` dumps the recipe config: block style, keys in order.
    (step / "config.yaml").write_text(RECIPE_CONFIG.format(dp=WORLD, ep=1))
    (step / "losses.json").write_text(json.dumps({"train_loss": 1.0}))
    return step


def _expected_boxes(key: str, shape: tuple[int, ...], world: int, optim: bool, ep: int = 1, experts: int = 0):
    """Automodel's FSDP2 placement of `key` on `world` ranks with `ep` expert-parallel ranks, as
    sorted `(offsets, sizes, rank)`: grouped native experts `[Shard(1), Shard(0)]` on
    `(ep_shard, ep)`, an expert's own HF key `Shard(1)` over its EP rank's `ep_shard` group (rank
    `s·ep + p`), the rest `Shard(0)` over every rank (fsdp2-frameworks.md §1.5)."""
    if not shape:
        return [((), (), 0)]
    name = key.removeprefix("optim.state.").rsplit(".", 1)[0] if optim else key
    grouped = optim and name.endswith(("gate_and_up_projs", "down_projs")) and len(shape) == 3
    m = automodel_writer.EXPERTS.match(key)
    shards = world // ep

    def pieces(n, parts):
        q = -(-n // parts)
        return [(j * q, min(q, n - j * q)) for j in range(parts) if j * q < n]

    out = []
    if grouped:
        slab = shape[0] // ep
        for g in range(world):
            s, p = divmod(g, ep)
            for j, (o, n) in enumerate(pieces(shape[1], shards)):
                if j == s:
                    out.append(((p * slab, o, 0), (slab, n, shape[2]), g))
    elif m and not optim and len(shape) == 2:
        owner = int(m["e"]) // (experts // ep) if ep > 1 else 0
        for s, (o, n) in enumerate(pieces(shape[1], shards)):
            out.append(((0, o), (shape[0], n), s * ep + owner))
    else:
        for g, (o, n) in enumerate(pieces(shape[0], world)):
            out.append(((o,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]), g))
    return sorted(out)


def _check_placements(step: Path, world: int, fmt: str, ep: int = 1, experts: int = 0) -> None:
    """Every chunk of `model/` and `optim/` is the piece FSDP2 gives a rank, in that rank's file."""
    from safetensors import safe_open

    problems = []

    def check(part, key, shape, got, optim):
        want = _expected_boxes(key, shape, world, optim, ep, experts)
        if not shape:  # a replica: DCP's save plan puts it on any rank
            got, want = [g[:2] for g in got], [w[:2] for w in want]
        if sorted(got) != want:
            problems.append(f"{part}/{key}: {sorted(got)[:3]}, FSDP2 places {want[:3]}")

    parts = [("optim", True)] + ([("model", False)] if fmt != "safetensors" else [])
    for part, optim in parts:
        md = tc.read_metadata(step / part)
        for key, m in tc.tensor_keys(md).items():
            got = [(tuple(c.offsets), tuple(c.sizes),
                    int(md.storage_data[MetadataIndex(key, c.offsets)].relative_path.split("_")[2])) for c in m.chunks]
            check(part, key, tuple(m.size), got, optim)
    if fmt == "safetensors":
        shapes, boxes = {}, {}
        for rank in range(world):
            path = step / "model" / f"shard-{rank + 1:05}-model-00001-of-00001.safetensors"
            with safe_open(str(path), framework="pt") as f:
                info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
                assert sorted(info) == sorted(f.keys()), path
                for key in f.keys():
                    size = tuple(f.get_slice(key).get_shape())
                    off = tuple(info[key]["saved_offsets"])
                    boxes.setdefault(key, []).append((off, size, rank))
                    shape = shapes.setdefault(key, [0] * len(size))
                    for d, (o, s) in enumerate(zip(off, size)):
                        shape[d] = max(shape[d], o + s)
        for key, got in boxes.items():
            check("model", key, tuple(shapes[key]), got, False)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("model,fmt", [("qwen3_moe", "safetensors"), ("llama", "torch_save")])
def test_a_training_save_reshards_and_loads_as_torch_reshards_it(tmp_path, model, fmt):
    release = FIXTURES / model
    source = _training_save(tmp_path / "ckpt", release, fmt)
    ours = tmp_path / "dp2" / "epoch_0_step_2"
    proc = run_cli(["reshard", str(source), "--to", str(ours), "--dp", "2"])
    assert proc.returncode == 0, proc.stderr
    names = sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
    model_files = ([f"model/shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)] if fmt == "safetensors"
                   else ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp"])
    hf_metadata = [f"model/.hf_metadata/{f}" for f in ("config.json", "fqn_to_dtype_mapping.json",
                                                        "fqn_to_file_index_mapping.json")]
    assert names == sorted(["config.yaml", "losses.json", "step_scheduler.pt", *hf_metadata,
                            *model_files, "optim/.metadata", "optim/__0_0.distcp", "optim/__1_0.distcp",
                            "rng/rng_global_rank_0.pt", "rng/rng_global_rank_1.pt",
                            "dataloader/dataloader_dp_rank_0.pt", "dataloader/dataloader_dp_rank_1.pt"]), names
    for rel in ("losses.json", "step_scheduler.pt", "rng/rng_global_rank_1.pt"):
        assert (ours / rel).read_bytes() == (source / rel).read_bytes(), rel
    # The recipe config names the new mesh, every other byte kept.
    assert (ours / "config.yaml").read_text() == RECIPE_CONFIG.format(dp=2, ep=1)
    _check_placements(ours, 2, fmt)
    proc = run_cli(["inspect", "--json", "--summary", str(ours)])
    assert proc.returncode == 0, proc.stderr
    t = json.loads(proc.stdout)["training"]
    exp_avg = [k for k in tc.read_metadata(ours / "optim").state_dict_metadata if k.endswith(".exp_avg")]
    assert t["framework"] == "NeMo Automodel" and t["iteration"] == "2 (epoch 0)", t
    assert t["data_parallel"].startswith("2 ") and t["dataloader_ranks"] == [0, 1], t
    assert t["optimizer_states"]["exp_avg"]["tensors"] == len(exp_avg) and t["adam_steps"] == {"2.0": len(exp_avg)}, t
    assert t["objects"]["sched.lr_decay_style"] == '"cosine"', t["objects"]
    assert t["files"]["rng/"].startswith("2 files, one per global rank"), t["files"]
    assert t["parameters"]["tensors"] == len(ref.load_hf_tensors(release)), t["parameters"]
    harness.spawn_ranks(automodel_writer.load_training_worker, 2,
                        (str(release), str(source), str(ours), fmt, "bfloat16"), "Automodel training load")
    # To more ranks than saved: the new rank starts from rank 0's per-rank states.
    more = tmp_path / "dp4" / "epoch_0_step_2"
    proc = run_cli(["reshard", str(source), "--to", str(more), "--dp", "4"])
    assert proc.returncode == 0, proc.stderr
    assert "1 of 4 ranks start from rank 0's state" in proc.stderr, proc.stderr
    assert (more / "rng" / "rng_global_rank_3.pt").read_bytes() == (source / "rng" / "rng_global_rank_0.pt").read_bytes()
    _check_placements(more, 4, fmt)
    # A -> B -> A: every tensor of `model/` and `optim/` back in its chunks, byte for byte.
    back = tmp_path / "dp3" / "epoch_0_step_2"
    proc = run_cli(["reshard", str(ours), "--to", str(back), "--dp", str(WORLD)])
    assert proc.returncode == 0, proc.stderr
    _check_placements(back, WORLD, fmt)
    harness.spawn_ranks(automodel_writer.load_training_worker, WORLD,
                        (str(release), str(source), str(back), fmt, "bfloat16"), "Automodel training load")
    # The resharded save consolidates to the same release as the source.
    a, b = tmp_path / "hf-a", tmp_path / "hf-b"
    assert _export(source, release, a).returncode == 0
    proc = _export(ours, release, b)
    assert proc.returncode == 0, proc.stderr
    ta, tb = ref.load_hf_tensors(a), ref.load_hf_tensors(b)
    assert set(ta) == set(tb) and all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)


def test_what_cannot_be_resharded_is_refused_and_nothing_is_written(tmp_path):
    release = FIXTURES / "llama"
    source = _training_save(tmp_path / "ckpt", release, "safetensors")
    out = tmp_path / "out" / "epoch_0_step_2"

    def refused(*needles: str) -> None:
        proc = run_cli(["reshard", str(source), "--to", str(out), "--dp", "2"])
        assert proc.returncode != 0, proc.stdout
        for needle in needles:
            assert needle in proc.stderr, proc.stderr
        assert not out.parent.exists(), sorted(out.parent.rglob("*"))

    # An unfinished save.
    (source / ".incomplete").write_text("")
    refused("still being written")
    (source / ".incomplete").unlink()
    # Tensor or expert parallelism asked for, and --rng drop, which Automodel cannot take.
    proc = run_cli(["reshard", str(source), "--to", str(out), "--dp", "2", "--tp", "2"])
    assert proc.returncode != 0 and "data and expert parallelism (--dp, --ep) only" in proc.stderr, proc.stderr
    proc = run_cli(["reshard", str(source), "--to", str(out), "--dp", "2", "--rng", "drop"])
    assert proc.returncode != 0 and "has no option to skip it" in proc.stderr, proc.stderr
    assert not out.parent.exists()
    # A truncated model shard.
    shard = source / "model" / "shard-00002-model-00001-of-00001.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) - 64])
    refused("shard-00002-model-00001-of-00001.safetensors")
    shard.write_bytes(whole)
    # A missing optimizer rank file: a tensor without all of its chunks.
    optim_file = source / "optim" / "__1_0.distcp"
    kept = optim_file.read_bytes()
    optim_file.unlink()
    refused("__1_0.distcp")
    optim_file.write_bytes(kept)
    # An optimizer state whose geometry is not its parameter's: optim/ saved again with a norm's
    # moment of another length.
    import shutil
    import torch.distributed.checkpoint as dcp_
    shutil.rmtree(source / "optim")
    bad = {"optim": {"state.model.norm.weight.exp_avg": torch.zeros(5), "state.model.norm.weight.step": torch.tensor(2.0)},
           "sched": automodel_writer.sched_state(2)}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_.save(bad, checkpoint_id=str(source / "optim"), no_dist=True)
    refused("`optim.state.model.norm.weight.exp_avg` cannot be resharded like its parameter `model.norm.weight`",
            "global shape [5]")


def test_a_pipeline_reshards_a_save_and_publishes_its_release(tmp_path):
    # The nightly job's shape: reshard a training save for another DP degree, export the
    # resharded save to HF as the release its `model/.hf_metadata/` describes (no `like`),
    # upload both.
    import subprocess

    release = FIXTURES / "qwen3_moe"
    source = _training_save(tmp_path / "ckpt", release, "safetensors")
    out = tmp_path / "published"
    spec = tmp_path / "automodel.yaml"
    spec.write_text(f"""apiVersion: shardline/v1
kind: Pipeline
name: automodel-nightly
steps:
  - {{id: reshard, uses: checkpoint.reshard, with: {{path: "{source}", tp: 1, dp: 2}}}}
  - {{id: export, uses: checkpoint.export, needs: [reshard]}}
  - {{id: upload-ckpt, uses: store.upload, needs: [reshard], with: {{to: "file://{out}/ckpt"}}}}
  - {{id: upload-hf, uses: store.upload, needs: [export], with: {{to: "file://{out}/hf"}}}}
""")
    proc = subprocess.run([str(harness.shardline_bin()), "run", str(spec), "--state-dir", str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = out / "ckpt"
    assert sorted(p.name for p in (ckpt / "model").glob("*.safetensors")) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rng_global_rank_0.pt", "rng_global_rank_1.pt"]
    assert not (ckpt / ".incomplete").exists()
    _check_placements(ckpt, 2, "safetensors")
    # The export is the release the source consolidates to.
    want = tmp_path / "hf-source"
    assert _export(source, release, want).returncode == 0
    a, b = ref.load_hf_tensors(want), ref.load_hf_tensors(out / "hf")
    assert set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_field_report_004_transposed_grouped_experts_keep_their_swapped_placement(tmp_path):
    # Step3p5's adapter keeps experts grouped on disk, transposed from the native layout; since
    # Automodel PR #1691 (field report 004) the native `Shard(1)` moves to dim 2 with the
    # transpose. A reshard must keep each tensor on the dim its chunks show — dim 2 here — and
    # the result must load where those DTensors (global [E, H, I], not [E, H·S, I/S]) expect it.
    release = FIXTURES / "qwen3_moe"
    step = tmp_path / "ckpt" / "epoch_0_step_2"
    harness.spawn_ranks(automodel_writer.save_training_worker, WORLD,
                        (str(release), str(step), "safetensors", "bfloat16", True), "Step3p5-layout save")
    ours = tmp_path / "dp2" / "epoch_0_step_2"
    proc = run_cli(["reshard", str(step), "--to", str(ours), "--dp", "2"])
    assert proc.returncode == 0, proc.stderr
    from safetensors import safe_open

    cfg = json.loads((release / "config.json").read_text())
    experts, hidden, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    q = -(-inter // 2)
    seen = 0
    for rank in range(2):
        path = ours / "model" / f"shard-{rank + 1:05}-model-00001-of-00001.safetensors"
        with safe_open(str(path), framework="pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():
                if key.endswith("moe.down_proj.weight"):
                    seen += 1
                    rows = min(q, inter - rank * q)
                    assert tuple(f.get_slice(key).get_shape()) == (experts, hidden, rows), key
                    assert info[key]["saved_offsets"] == [0, 0, rank * q], (key, info[key])
    assert seen == 2 * cfg["num_hidden_layers"], seen
    harness.spawn_ranks(automodel_writer.load_training_worker, 2,
                        (str(release), str(step), str(ours), "safetensors", "bfloat16", True), "Step3p5-layout load")


def test_expert_parallel_saves_reshard_between_ep_meshes_and_load(tmp_path):
    # Saved on 4 ranks as (ep_shard 2, ep 2): grouped native experts `[Shard(1), Shard(0)]`,
    # each expert's HF key on its EP rank's two ranks. To (ep_shard 1, ep 2) on 2 ranks, to no
    # expert parallelism on 3, and back.
    release = FIXTURES / "qwen3_moe"
    experts = json.loads((release / "config.json").read_text())["num_local_experts"]
    step = tmp_path / "ckpt" / "epoch_0_step_2"
    harness.spawn_ranks(automodel_writer.save_training_worker, 4,
                        (str(release), str(step), "safetensors", "bfloat16", False, 2), "Automodel EP save")
    _check_placements(step, 4, "safetensors", ep=2, experts=experts)  # the harness saves as Automodel does
    for name, dp, ep in (("dp2-ep2", 2, 2), ("dp3", 3, 1)):
        ours = tmp_path / name / "epoch_0_step_2"
        proc = run_cli(["reshard", str(step), "--to", str(ours), "--dp", str(dp), "--ep", str(ep)])
        assert proc.returncode == 0, proc.stderr
        _check_placements(ours, dp, "safetensors", ep=ep, experts=experts)
        harness.spawn_ranks(automodel_writer.load_training_worker, dp,
                            (str(release), str(step), str(ours), "safetensors", "bfloat16", False, ep),
                            f"Automodel {name} load")
    back = tmp_path / "back" / "epoch_0_step_2"
    proc = run_cli(["reshard", str(tmp_path / "dp3" / "epoch_0_step_2"), "--to", str(back), "--dp", "4", "--ep", "2"])
    assert proc.returncode == 0, proc.stderr
    _check_placements(back, 4, "safetensors", ep=2, experts=experts)
    harness.spawn_ranks(automodel_writer.load_training_worker, 4,
                        (str(release), str(step), str(back), "safetensors", "bfloat16", False, 2), "Automodel back load")
    proc = run_cli(["reshard", str(step), "--to", str(tmp_path / "bad"), "--dp", "3", "--ep", "3"])
    assert proc.returncode != 0 and "does not divide" in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists()
