"""`shardline convert --target torch_dist`, judged by Megatron-Core itself (issue 26).

Shardline converts the tiny HF releases to Megatron save directories at one mesh; Megatron-Core's
own `dist_checkpointing.load` (megatron_load.py: the real GPTModel's `sharded_state_dict()` on CPU,
2 gloo processes) loads them at **another** TP/EP and every shard must equal the slice of the
suite's independent reference (reference.py, from the HF tensors; nothing here reads Shardline's
tables). The dense llama also runs Megatron-Core's forward at TP=1 and must give the HF model's
logits. The on-disk keys and global shapes of llama and qwen3_moe must be exactly those
Megatron-Core 0.16.1 wrote itself for the same models (the committed fixtures of
test_megatron_core.py). The 2025 families load the same way, each at a TP/EP other than the
written one: deepseek_v3 (MLA, a dense first layer then MoE, MTP) from its bf16 and its block-FP8
release, qwen3_next (GDN and gated full-attention layers, MoE), gpt_oss from its MXFP4 and its
bf16 release (megatron_load.py's docstring says which parts of those models are built around
Megatron-Core 0.16.1's CPU limits, and how). The container must be what Megatron-LM's loader
reads: tracker `release`, the 4-field `metadata.json`, a `common.pt` that
`torch.load(weights_only=True)` opens under Megatron-Core's safe globals with `args` giving the
mesh and the model's dimensions.

The optimizer part of `reshard --target torch_dist` (the fully_reshardable distributed-optimizer
state) is judged by Megatron-Core's own DistributedOptimizer: built on CPU around the model at
another mesh, it asks for its state (`sharded_state_dict(..., is_loading=True)`), the load fills
it, its `load_state_dict` takes it, and every shard and every master / moment range it then holds
must be the reference's (megatron_load.py `optimizer=True`).

All loads run in one spawn of the processes (module fixture `reports`).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import megatron_load as ml
from harness import FIXTURES, run_cli
from test_megatron_core import FIXTURE_MOE_TENSORS, FIXTURE_TENSORS

ml.quiet_megatron()
import megatron.core.safe_globals  # noqa: E402,F401  (registers Megatron-Core's safe globals)

HF_LLAMA = FIXTURES / "llama"
HF_QWEN3_MOE = FIXTURES / "qwen3_moe"
EP2 = ["--tp", "1", "--ep", "2", "--dp", "2"]

# (name, release, arch, written mesh flags, loads as (tp, ep) or (tp, ep, etp))
CONVERSIONS = [
    ("llama-tp2", HF_LLAMA, "llama", ["--tp", "2"], [(1, 1)]),
    ("llama-tp1", HF_LLAMA, "llama", ["--tp", "1"], [(2, 1)]),
    ("moe-tp1ep2", HF_QWEN3_MOE, "qwen3_moe", EP2, [(2, 1)]),
    ("moe-tp2", HF_QWEN3_MOE, "qwen3_moe", ["--tp", "2"], [(1, 2)]),
    ("deepseek_v3-tp2", FIXTURES / "deepseek_v3", "deepseek_v3", ["--tp", "2"], [(1, 2)]),
    ("deepseek_v3_fp8-tp1ep2", FIXTURES / "deepseek_v3_fp8", "deepseek_v3", EP2, [(2, 1)]),
    ("qwen3_next-tp2", FIXTURES / "qwen3_next", "qwen3_next", ["--tp", "2"], [(1, 2)]),
    ("qwen3_next-tp1ep2", FIXTURES / "qwen3_next", "qwen3_next", EP2, [(2, 1)]),
    ("gpt_oss-tp2", FIXTURES / "gpt_oss", "gpt_oss", ["--tp", "2"], [(1, 2)]),
    # Megatron-Core refuses biased experts at expert-TP > 1: TP 2 loads at ETP 1.
    ("gpt_oss_bf16-tp1ep2", FIXTURES / "gpt_oss_bf16", "gpt_oss", EP2, [(2, 1, 1)]),
]
NEW_FAMILIES = ("deepseek_v3", "qwen3_next", "gpt_oss")
# Optimizer state: `convert --optimizer-state` (fsdp_dtensor tp1·dp2: the release's weights as the
# model and the masters, zero fp32 moments) resharded to torch_dist at one mesh, restored by
# Megatron-Core's DistributedOptimizer at another: (name, release, torch_dist mesh, load (tp, ep)).
# Loaded at TP1·EP2 the experts get their own optimizer (ChainedOptimizer of two).
OPTIMIZER_RESHARDS = [
    ("llama-opt-tp2", HF_LLAMA, ["--tp", "2", "--dp", "1"], (1, 1)),
    ("moe-opt-tp1ep2", HF_QWEN3_MOE, EP2, (2, 1)),
    ("moe-opt-tp2", HF_QWEN3_MOE, ["--tp", "2", "--dp", "1"], (1, 2)),
]


def convert(release: Path, out: Path, mesh: list[str]) -> Path:
    res = run_cli(["convert", "--from", str(release), "--to", str(out), "--target", "torch_dist", *mesh])
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("torch_dist_convert")
    return {name: convert(release, base / name, mesh) for name, release, _, mesh, _ in CONVERSIONS}


@pytest.fixture(scope="module")
def optimizer_converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("torch_dist_optimizer")
    sources, out = {}, {}
    for name, release, mesh, _ in OPTIMIZER_RESHARDS:
        src = sources.get(release)
        if src is None:
            src = sources[release] = base / f"{release.name}-fsdp_dtensor"
            res = run_cli(["convert", "--from", str(release), "--to", str(src), "--tp", "1", "--dp", "2",
                           "--optimizer-state"])
            assert res.returncode == 0, res.stderr
        vocab = json.loads((release / "config.json").read_text())["vocab_size"]
        res = run_cli(["reshard", str(src), "--to", str(base / name), "--target", "torch_dist", *mesh,
                       "--vocab-size", str(vocab)])
        assert res.returncode == 0, res.stderr
        out[name] = base / name
    return out


@pytest.fixture(scope="module")
def reports(converted, optimizer_converted):
    jobs = {}
    for name, release, arch, _, loads in CONVERSIONS:
        for tp, ep, *etp in loads:
            jobs[f"{name}@tp{tp}ep{ep}"] = ml.Job(str(converted[name]), str(release), arch, tp=tp, ep=ep,
                                                  etp=etp[0] if etp else None, te_extra_state=True)
    # Megatron-Core's forward at TP=1 (the local spec: no TE core_attention request, whose object
    # the checkpoint holds for TE jobs and the local model would refuse in load_state_dict).
    jobs["llama-tp2@tp1-forward"] = ml.Job(str(converted["llama-tp2"]), str(HF_LLAMA), "llama", tp=1, forward=True)
    for name, release, _, (tp, ep) in OPTIMIZER_RESHARDS:
        jobs[f"{name}@tp{tp}ep{ep}"] = ml.Job(str(optimizer_converted[name]), str(release), ml.hf_arch(release),
                                              tp=tp, ep=ep, te_extra_state=True, optimizer=True)
    return dict(zip(jobs, ml.run_jobs(list(jobs.values()))))


def _assert_ok(rep):
    assert rep.ok, rep.summary() + "\n" + "\n".join(rep.problems)


@pytest.mark.parametrize("name", [c[0] for c in CONVERSIONS if c[2] not in NEW_FAMILIES])
def test_megatron_core_loads_the_conversion_at_another_mesh(reports, name):
    (_, _, arch, _, loads) = next(c for c in CONVERSIONS if c[0] == name)
    for tp, ep, *_ in loads:
        rep = reports[f"{name}@tp{tp}ep{ep}"]
        _assert_ok(rep)
        want = FIXTURE_TENSORS if arch == "llama" else FIXTURE_MOE_TENSORS
        # Keys and global shapes exactly as Megatron-Core 0.16.1 wrote them for the same model.
        assert {k: tuple(v[0]) for k, v in rep.keys.items() if not k.endswith("/object")} == want
        assert all(v[1] == "bfloat16" for k, v in rep.keys.items() if not k.endswith("/object"))
        assert rep.tensors_checked > 0 and rep.factories_checked > 0 and rep.objects_loaded > 0


def _new_family_report(reports, name):
    (_, _, _, mesh, loads) = next(c for c in CONVERSIONS if c[0] == name)
    (tp, ep, *_), = loads
    rep = reports[f"{name}@tp{tp}ep{ep}"]
    _assert_ok(rep)
    written = dict(zip(mesh[::2], mesh[1::2]))
    assert (str(tp), str(ep)) != (written.get("--tp", "1"), written.get("--ep", "1"))
    tensors = {k: v for k, v in rep.keys.items() if not k.endswith("/object")}
    objects = {k[: -len("/object")]: v for k, v in rep.keys.items() if k.endswith("/object")}
    # On disk every tensor is bf16 except the router's float32 expert bias (archs-2025.md §2).
    assert {k for k, v in tensors.items() if v[1] != "bfloat16"} == {
        k for k in tensors if k.endswith(".router.expert_bias")}
    assert all(v[1] == "float32" for k, v in tensors.items() if k.endswith(".router.expert_bias"))
    assert rep.tensors_checked > 0 and rep.factories_checked > 0 and rep.objects_loaded > 0
    return rep, tensors, objects


@pytest.mark.parametrize("name", ["deepseek_v3-tp2", "deepseek_v3_fp8-tp1ep2"])
def test_megatron_core_loads_deepseek_v3_with_mla_a_dense_first_layer_and_mtp(reports, name):
    """Per-layer keys (dense layer 0, MoE layers 1-2: `moe_layer_freq` is a list), MLA's latent
    norms under the TE names, shared experts, the float32 expert bias, and the MTP layer (its
    decoder layer under `transformer_layer`): every shard bit-exact, the FP8 release dequantized."""
    rep, tensors, objects = _new_family_report(reports, name)
    assert not [k for k in tensors if k.startswith("decoder.layers.") and not k.split(".")[2].isdigit()]
    assert tensors["decoder.layers.0.mlp.linear_fc1.weight"] == [[192, 64], "bfloat16"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in tensors
    assert tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == [[8, 64, 64], "bfloat16"]
    assert tensors["decoder.layers.2.self_attention.linear_kv_down_proj.weight"] == [[40, 64], "bfloat16"]
    for mla in ("linear_q_up_proj", "linear_kv_up_proj"):
        assert f"decoder.layers.1.self_attention.{mla}.layer_norm_weight" in tensors
    mtp = {k for k in tensors if k.startswith("mtp.layers.0.")}
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
            "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight"} <= mtp
    assert tensors["mtp.layers.0.eh_proj.weight"] == [[64, 128], "bfloat16"]
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention._extra_state" in objects
    assert objects["decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state"] == [8]


@pytest.mark.parametrize("name", ["qwen3_next-tp2", "qwen3_next-tp1ep2"])
def test_megatron_core_loads_qwen3_next_with_gdn_and_gated_attention_layers(reports, name):
    """Per-layer keys (`linear_attention_freq`): GDN layers 0-2 with `in_proj` and `conv1d` in
    Megatron-Core's named sections and `in_proj`'s `_extra_state`, full-attention layer 3 with the
    output gate in `linear_qkv`, every layer MoE with a gated shared expert."""
    rep, tensors, objects = _new_family_report(reports, name)
    for i in range(3):
        sa = f"decoder.layers.{i}.self_attention"
        assert {f"{sa}.in_proj.weight.{s}" for s in ("query", "key", "value", "z", "beta", "alpha")} <= set(tensors)
        assert {f"{sa}.conv1d.weight.{s}" for s in ("query", "key", "value")} <= set(tensors)
        assert {f"{sa}.in_proj.layer_norm_weight", f"{sa}.out_norm.weight", f"{sa}.A_log"} <= set(tensors)
        assert f"{sa}.in_proj._extra_state" in objects and f"{sa}.linear_qkv.weight" not in tensors
    # 8 heads of 8 with their gates, 2 KV groups: 2 x (4 + 4 + 1 + 1) x 8 rows.
    assert tensors["decoder.layers.3.self_attention.linear_qkv.weight"] == [[160, 64], "bfloat16"]
    assert "decoder.layers.3.self_attention.in_proj.weight.query" not in tensors
    assert all(f"decoder.layers.{i}.mlp.shared_experts.gate_weight" in tensors for i in range(4))


@pytest.mark.parametrize("name", ["gpt_oss-tp2", "gpt_oss_bf16-tp1ep2"])
def test_megatron_core_loads_gpt_oss_with_sinks_and_biased_experts(reports, name):
    """Stacked layers; the attention sinks as `core_attention.softmax_offset` (split by head
    under TP); biased experts whose fc1 weight and bias are `[gate; up]` at every TP; the MXFP4
    release dequantized."""
    rep, tensors, objects = _new_family_report(reports, name)
    assert tensors["decoder.layers.self_attention.core_attention.softmax_offset"] == [[2, 8], "bfloat16"]
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == [[2, 4, 192, 64], "bfloat16"]
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.bias"] == [[2, 4, 192], "bfloat16"]
    assert {"decoder.layers.mlp.router.bias", "decoder.layers.self_attention.linear_qkv.bias",
            "decoder.layers.self_attention.linear_proj.bias",
            "decoder.layers.mlp.experts.experts.linear_fc2.bias"} <= set(tensors)
    assert objects["decoder.layers.self_attention.core_attention._extra_state"] == [2]


def test_megatron_core_forward_on_the_conversion_gives_the_hf_logits(reports):
    rep = reports["llama-tp2@tp1-forward"]
    _assert_ok(rep)
    assert rep.forward_checked == 2


@pytest.mark.parametrize("name", [r[0] for r in OPTIMIZER_RESHARDS])
def test_megatron_core_distributed_optimizer_restores_the_optimizer_state_at_another_mesh(reports, name):
    """Megatron-Core's own DistributedOptimizer (DDP + get_megatron_optimizer, CPU, 2 gloo ranks)
    requests its fully_reshardable state at a mesh other than the written one — llama TP2 -> TP1
    with DP 2, qwen3_moe TP1·EP2 -> TP2 and TP2 -> TP1·EP2 (the experts in their own optimizer)
    —: every `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>` shard (SwiGLU factories,
    layer and expert axes as the model's) loads bit-exactly (master = the release's weight in
    fp32, moments zero), its `load_state_dict` takes the result, and the master and moments of
    every parameter range each rank's optimizer then holds are the reference's."""
    (_, _, mesh, (tp, ep)) = next(r for r in OPTIMIZER_RESHARDS if r[0] == name)
    written = dict(zip(mesh[::2], mesh[1::2]))
    assert (str(tp), str(ep)) != (written["--tp"], written.get("--ep", "1"))
    rep = reports[f"{name}@tp{tp}ep{ep}"]
    _assert_ok(rep)
    tensors = {k: v for k, v in rep.keys.items() if not k.endswith("/object")}
    model = {k for k in tensors if not k.startswith("optimizer.")}
    states = ("param", "exp_avg", "exp_avg_sq")
    # Megatron-Core requests each parameter's three states under the parameter's key, with its
    # global shape; all three are float32 on disk, as its distributed optimizer keeps them (the
    # master is the release's bf16 weight widened, exactly: the source held no fp32 master).
    assert set(tensors) - model == {f"optimizer.state.{s}.{k}" for s in states for k in model}
    for k in model:
        assert all(tensors[f"optimizer.state.{s}.{k}"][0] == tensors[k][0] for s in states), k
        assert all(tensors[f"optimizer.state.{s}.{k}"][1] == "float32" for s in states), k
    # Three optimizer shards for every model shard (all of them parameters), each compared.
    model_shards = rep.tensors_checked + rep.factories_checked - rep.optimizer_shards_checked
    assert rep.optimizer_shards_checked == 3 * model_shards > 0
    assert rep.optimizer_states_checked > 0
    assert rep.optimizer_count == (2 if ep > 1 else 1)
    # `convert --optimizer-state` writes no parameter groups: the common state has no optimizer
    # part, and the job's own groups are used for load_state_dict.
    assert rep.optimizer_param_groups == "job" and rep.common.get("optimizer") == {}


def test_save_directory_is_what_megatron_lm_reads(converted):
    root = converted["llama-tp2"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    ckpt = root / "release"
    assert json.loads((ckpt / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}
    common = torch.load(ckpt / "common.pt", weights_only=True)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    args = common["args"]
    assert type(args).__name__ == "Namespace"
    cfg = json.loads((HF_LLAMA / "config.json").read_text())
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"])
    assert args.padded_vocab_size == 256 and args.no_save_optim and args.no_save_rng
    # One rank file per TP rank, and the objects in a second file of rank 0.
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp"]


def test_every_te_module_has_its_extra_state_and_replicas_are_written_once_spread_over_dp(converted):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(converted["moe-tp1ep2"] / "release")).read_metadata()
    objects = {k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")}
    layer = {f"decoder.layers.self_attention.{m}._extra_state/shard_{layer}_2"
             for m in ("linear_qkv", "core_attention", "linear_proj", "q_layernorm", "k_layernorm")
             for layer in (0, 1)}
    experts = {f"decoder.layers.mlp.experts.experts.{m}._extra_state/shard_{layer}.{e}_2.8"
               for m in ("linear_fc1", "linear_fc2") for layer in (0, 1) for e in range(8)}
    assert objects == layer | experts
    # Every element of every tensor is stored once: chunk volumes add up to the global volume.
    for key, tmd in md.state_dict_metadata.items():
        if hasattr(tmd, "chunks"):
            vol = sum(torch.Size(c.sizes).numel() for c in tmd.chunks)
            assert vol == tmd.size.numel(), key
    # EP rank 1 (rank 1) holds experts 4..7, and its objects with them.
    files = {}
    for idx, info in md.storage_data.items():
        files.setdefault(info.relative_path, set()).add(idx.fqn)
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.5_2.8" in files["__1_1.distcp"]
    # The dense tensors, replicated over the 2 DP ranks, are spread over both (as a fully
    # parallel save spreads them), each written by one.
    dense = {k for k in md.state_dict_metadata if "experts" not in k and hasattr(md.state_dict_metadata[k], "chunks")}
    assert dense & files["__0_0.distcp"] and dense & files["__1_0.distcp"]


def test_refuses_what_it_cannot_write_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    res = run_cli(["convert", "--from", str(HF_LLAMA), "--to", str(out), "--target", "torch_dist",
                   "--format", "dcp-safetensors"])
    assert res.returncode != 0 and "--format dcp-safetensors does not apply" in res.stderr
    res = run_cli(["convert", "--from", str(HF_QWEN3_MOE), "--to", str(out), "--target", "torch_dist",
                   "--tp", "3"])
    assert res.returncode != 0 and "not divisible by tp (3)" in res.stderr, res.stderr
    assert not out.exists()
    convert(HF_LLAMA, out, [])
    res = run_cli(["convert", "--from", str(HF_LLAMA), "--to", str(out), "--target", "torch_dist"])
    assert res.returncode != 0 and "pass --overwrite" in res.stderr
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_validate_agrees_on_a_torch_written_checkpoint_whose_chunks_span_layers(converted, tmp_path):
    """A writer free to chunk as it likes (here torch's own DCP save, one chunk per key: each
    spans every layer, and fc1's gate and up) is validated bit-exactly, and so are Shardline's
    conversions; a changed `[gate; up]` order is caught."""
    from test_megatron_core import write_single_chunk_checkpoint

    single = write_single_chunk_checkpoint(HF_LLAMA, tmp_path / "single")
    swapped = dict(ml.expected_globals(HF_LLAMA, tp=1))
    fc1 = swapped["decoder.layers.mlp.linear_fc1.weight"]
    swapped["decoder.layers.mlp.linear_fc1.weight"] = torch.cat(fc1.chunk(2, dim=1)[::-1], dim=1).contiguous()
    bad = write_single_chunk_checkpoint(HF_LLAMA, tmp_path / "swapped", swapped)
    for name, release, *_ in CONVERSIONS:
        res = run_cli(["validate", str(converted[name]), "--against", str(release), "--json"])
        assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli(["validate", str(single), "--against", str(HF_LLAMA), "--json"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["tensors"] == 9
    res = run_cli(["validate", str(bad), "--against", str(HF_LLAMA), "--json"])
    assert res.returncode == 1, res.stdout + res.stderr
    findings = json.loads(res.stdout)["findings"]
    assert [f["key"] for f in findings] == ["decoder.layers.mlp.linear_fc1.weight"], findings
    assert "global index [0, 0, 0]" in findings[0]["message"], findings


def test_a_dp_reshardable_optimizer_is_refused_with_the_reason_and_nothing_is_written(tmp_path):
    """Megatron-LM's default distributed-optimizer format stores flat buckets whose mapping to
    parameters is not in the checkpoint: translating it is refused, saying how to re-save."""
    import torch.distributed.checkpoint as dcp
    from argparse import Namespace

    import warnings
    ckpt = tmp_path / "save" / "iter_0000010"
    ckpt.mkdir(parents=True)
    sd = dict(ml.expected_globals(HF_LLAMA, tp=1))
    sd["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16).bucket_idx_0.exp_avg"] = \
        torch.zeros(1024, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.save(sd, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 10, "args": Namespace(tensor_model_parallel_size=1),
                "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}, ckpt / "common.pt")
    (ckpt / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("10")
    out = tmp_path / "out"
    res = run_cli(["reshard", str(tmp_path / "save"), "--to", str(out), "--tp", "1", "--dp", "2",
                   "--target", "fsdp_dtensor"])
    assert res.returncode != 0
    assert "dp_reshardable" in res.stderr and "--dist-ckpt-optim-fully-reshardable" in res.stderr, res.stderr
    assert not out.exists()
    # Its model alone still exports (the optimizer's buckets are not read).
    res = run_cli(["export", str(tmp_path / "save"), "--to", str(tmp_path / "hf"), "--like", str(HF_LLAMA)])
    assert res.returncode == 0, res.stderr


def _drop_extra_state(ckpt: Path) -> str:
    import pickle as pkl
    md_path = ckpt / "release" / ".metadata"
    md = pkl.loads(md_path.read_bytes())
    key = sorted(k for k in md.state_dict_metadata if "_extra_state/shard_0_" in k)[0]
    del md.state_dict_metadata[key]
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    if md.planner_data:
        md.planner_data.pop(key, None)
    md_path.write_bytes(pkl.dumps(md))
    return key


def _common_version(ckpt: Path, version) -> str:
    path = ckpt / "release" / "common.pt"
    common = torch.load(path, weights_only=False)
    common["checkpoint_version"] = version
    torch.save(common, path)
    return "checkpoint_version is 9.0"


def _truncate(ckpt: Path) -> str:
    path = ckpt / "release" / "__1_0.distcp"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return "__1_0.distcp"


@pytest.mark.parametrize("kind", ["extra_state", "version", "truncated", "mesh"])
def test_bad_torch_dist_input_gets_a_clear_error_and_nothing_is_written(converted, tmp_path, kind):
    """A missing `_extra_state` object (validate names it: Megatron-Core's load would fail on it),
    an unknown common-state version, a truncated rank file, a target mesh the model cannot take:
    each refused with what is wrong, and nothing written."""
    import shutil
    ckpt = tmp_path / "in"
    shutil.copytree(converted["llama-tp2"], ckpt)
    mesh = ["--tp", "1", "--dp", "2"]
    if kind == "extra_state":
        key = _drop_extra_state(ckpt)
        res = run_cli(["validate", str(ckpt), "--against", str(HF_LLAMA), "--json"])
        assert res.returncode == 1, res.stdout + res.stderr
        findings = json.loads(res.stdout)["findings"]
        assert [f["key"] for f in findings] == [key], findings
        assert "requests every one" in findings[0]["message"], findings
        return
    expect = {"version": lambda: _common_version(ckpt, 9.0), "truncated": lambda: _truncate(ckpt),
              "mesh": lambda: "does not divide"}[kind]()
    if kind == "mesh":
        mesh = ["--tp", "3", "--dp", "1"]
    for target in ("fsdp_dtensor", "torch_dist"):
        out = tmp_path / f"out-{target}"
        res = run_cli(["reshard", str(ckpt), "--to", str(out), *mesh, "--target", target])
        assert res.returncode != 0, res.stdout
        assert expect in res.stderr, res.stderr
        assert not out.exists(), f"{target}: {sorted(p.name for p in out.rglob('*'))}"
