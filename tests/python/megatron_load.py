"""Load a Megatron `torch_dist` checkpoint with Megatron-Core itself and check every shard.

What it proves
--------------
A checkpoint directory (Megatron-LM's save root with `latest_checkpointed_iteration.txt`, or the
`iter_NNNNNNN/` / `release/` directory itself) is loaded with **Megatron-Core's own
`megatron.core.dist_checkpointing.load`** (megatron-core from PyPI, see scripts/setup-python) in
>= 2 gloo processes on CPU, at a tensor-parallel size (and expert-parallel size) chosen by the
caller, which may differ from the one the checkpoint was written with. The requests are not
hand-built: every process builds the real `GPTModel` with Megatron-Core's local (non-Transformer-
Engine) layer spec on CPU (`use_cpu_initialization=True`) and asks it for `sharded_state_dict()`,
so the keys, the prepended layer axes, the TP/EP offsets, the SwiGLU factory
(`apply_swiglu_sharded_factory`), the `_extra_state` ShardedObjects, the replica ids and the
`allow_shape_mismatch` vocabulary tensors are exactly what a Megatron-LM job at that mesh would
request. The default load path is used (`validate_access_integrity=True`, strictness
`assume_ok_unexpected`, factories merged by Megatron-Core), as Megatron-LM's `load_checkpoint` does.

Every loaded value is then compared, bit for bit, with the slice of the expected global tensor the
request names (for the SwiGLU factory: Megatron-Core's own merge of the expected pieces, i.e. the
local `[gate_r; up_r]`). The expected global tensors come from the HF release through the suite's
independent reference (reference.py: QKV interleaved per query group, vocabulary zero-padded to a
multiple of 128 x TP, ...) turned into torch_dist's form here: SwiGLU fc1 whole as `[gate; up]`,
experts under `mlp.experts.experts.` with an expert axis, and homogeneous decoder layers stacked
under `decoder.layers.<sub>` with a leading layer axis. Nothing here reads Shardline's tables.

Besides the values it checks: every key the model requests exists with exactly the requested
global shape (else Megatron-Core's load raises, and the report names the missing key), the dtype
stored in `.metadata` for each requested tensor equals the expected dtype (the load itself would
cast silently), every `_extra_state` object is loaded and is `None` or an empty tensor, and the
common state carries `checkpoint_version` >= 3. Keys the checkpoint holds beyond the request are
listed (`extra_keys`), not failed: Megatron-Core reads only what is requested.

`--forward` (dense llama at TP=1) also puts the loaded state dict into an fp32 build of the model
with `load_state_dict`, as Megatron-LM does, runs Megatron-Core's own forward on CPU and compares
its logits with those of the HF model computed in plain torch from the HF tensors (no Megatron
names, no reference mapping). That closes the loop the shard check cannot: it shows the
reference's layouts (QKV interleave, `[gate; up]`) are the ones Megatron-Core computes with
(measured difference 1.2e-7 against logits up to 0.58; fc1 stored `[up; gate]` gives 1.9e-2).

Spec choices. The local spec would request the MoE pre-MLP norm as
`mlp.linear_fc1.layer_norm_weight` (it renames it even for MoE layers); the model is built to
request the TE spec's `pre_mlp_layernorm.weight` instead, the name Megatron-LM's production (TE)
spec saves. `--te-extra-state` additionally requests TE's `core_attention._extra_state` per
layer, which a TE-spec job requests and the local spec has not; use it for checkpoints meant for
TE jobs (Shardline's), not for the Megatron-Core-written fixtures (local spec).

How Shardline's writer plugs in
-------------------------------
Convert the same HF release to `torch_dist`, then load it at meshes other than the written one:

    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/llama --arch llama \
        --tp 1 --te-extra-state --forward
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/llama --arch llama \
        --tp 2 --te-extra-state
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/qwen3_moe --arch qwen3_moe \
        --tp 2 --ep 2 --te-extra-state

OUT is the save root (with `latest_checkpointed_iteration.txt`) or the checkpoint directory.
It prints one line per problem (naming the torch_dist key, the layer/expert and the request's
offsets, or the load error) and a summary, and exits 1 on any problem, 2 on a usage error;
`-v` lists the requested keys with their on-disk shapes and dtypes, `--json F` writes the reports.
From Python: `run(ckpt, hf_dir, arch, [(tp, ep, etp), ...])` returns a `LoadReport` per mesh,
and `run_jobs([Job(...), ...])` runs loads of several checkpoints in one spawn of the processes
(test_megatron_core.py does: Megatron-Core's import and the process start dominate the time).
The world is the smallest >= 2 that every mesh divides (DP fills the rest).

Tested against checkpoints Megatron-Core 0.16.1 wrote itself (tests/fixtures/torch-dist-llama-tp2,
tests/fixtures/torch-dist-qwen3_moe-tp1ep2; see megatron_fixture.py), against a single-chunk
plain-DCP checkpoint in the form an offline writer emits, and against broken copies of them.
Families: llama-style dense GQA models and qwen3_moe (every layer MoE); others raise
NotImplementedError (per-layer stacks, MLA, GDN, MTP need their own model configs here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference as ref  # noqa: E402
from mesh import free_port  # noqa: E402

ARCHS = ("llama", "qwen3_moe")
# What Megatron-LM's checkpointing passes as sharded_state_dict metadata without a distributed
# optimizer (`_build_sharded_state_dict_metadata`, brief torch-dist.md §1.3).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
TRACKER = "latest_checkpointed_iteration.txt"


# --------------------------------------------------------------------------------------------
# Expected tensors: HF release -> torch_dist global tensors (independent of Megatron-Core)
# --------------------------------------------------------------------------------------------

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"(.*)\.experts\.linear_fc([12])\.weight(\d+)(_w|_v)?$")


def _torch_dist_per_layer(sub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's reference tensors (fsdp_dtensor split form) in torch_dist's form: fc1 whole as
    [gate; up]; experts stacked on a leading expert axis under `experts.experts.`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in sorted(sub):
        t = sub[name]
        m = _EXPERT.fullmatch(name)
        if m:
            base, fc, g, half = m.group(1), m.group(2), int(m.group(3)), m.group(4)
            if half == "_v":
                continue
            if fc == "1":
                w, v = t, sub[f"{base}.experts.linear_fc1.weight{g}_v"] if half else None
                t = torch.cat([w, v], dim=0) if half else w
            experts.setdefault(f"{base}.experts.experts.linear_fc{fc}.weight", {})[g] = t
        elif name.endswith(".weight_w"):
            stem = name[: -len("_w")]
            out[stem] = torch.cat([t, sub[stem + "_v"]], dim=0).contiguous()
        elif name.endswith(".weight_v"):
            continue
        else:
            out[name] = t
    for key, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"{key}: expert indices {sorted(per)} are not 0..E-1")
        out[key] = torch.stack([per[g] for g in range(len(per))]).contiguous()
    return out


def expected_globals(hf_dir, tp: int, etp: int | None = None) -> dict[str, torch.Tensor]:
    """`{torch_dist key: global tensor}` for the HF release at load TP `tp` (the vocabulary is
    padded for it). Homogeneous decoder layers are stacked with a leading layer axis."""
    cfg = ref.load_config(hf_dir)
    flat = ref.megatron_state_dict(cfg, ref.load_hf_tensors(hf_dir), tp, etp or tp)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        m = _LAYER.fullmatch(k)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
        elif k.startswith(("mtp.", "vision_model.", "language_model.")):
            raise NotImplementedError(f"{k}: MTP and multimodal models are not covered here")
        else:
            out[k] = t
    per_layer = {i: _torch_dist_per_layer(sub) for i, sub in layers.items()}
    n = cfg["num_hidden_layers"]
    if sorted(per_layer) != list(range(n)):
        raise ValueError(f"decoder layers {sorted(per_layer)} are not 0..{n - 1}")
    shapes = {i: {k: (tuple(t.shape), t.dtype) for k, t in sub.items()} for i, sub in per_layer.items()}
    if any(shapes[i] != shapes[0] for i in shapes):
        # Megatron stores non-homogeneous stacks per layer (brief torch-dist.md §2.2).
        for i, sub in per_layer.items():
            out.update({f"decoder.layers.{i}.{k}": t for k, t in sub.items()})
    else:
        for k in per_layer[0]:
            out[f"decoder.layers.{k}"] = torch.stack([per_layer[i][k] for i in range(n)]).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# The Megatron-Core model (built inside an initialised gloo process group)
# --------------------------------------------------------------------------------------------

def quiet_megatron() -> None:
    """Megatron-Core warns at import about the absent Transformer Engine / Apex (expected here)."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=".*Please use DTensor instead.*")  # MCore's torch ShardedTensors
    import logging
    logging.getLogger("megatron").setLevel(logging.ERROR)


def hf_arch(hf_dir) -> str:
    cfg = ref.load_config(hf_dir)
    if cfg.get("model_type") in ("llama", "mistral", "qwen2", "qwen3"):
        return "llama"
    if cfg.get("model_type") == "qwen3_moe":
        return "qwen3_moe"
    raise NotImplementedError(f"model_type {cfg.get('model_type')!r} (supported: {ARCHS})")


def transformer_config(hf_dir, arch: str, tp: int, ep: int = 1, etp: int | None = None,
                       dtype: torch.dtype = torch.bfloat16):
    """Megatron-Core TransformerConfig of the HF release (the dims Megatron-Bridge's llama /
    qwen3_moe providers set), bf16 parameters allocated on CPU, not initialised."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = ref.load_config(hf_dir)
    if arch not in ARCHS:
        raise NotImplementedError(f"--arch {arch!r} (supported: {ARCHS})")
    if hf_arch(hf_dir) != arch:
        raise ValueError(f"{hf_dir} is a {cfg.get('model_type')} release, not --arch {arch}")
    kw = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        kv_channels=ref._head_dim(cfg),
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(cfg.get("attention_bias", False)),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=True,  # also sets the params' TP attributes (partition_dim)
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
    )
    if arch == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise NotImplementedError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step)")
        kw.update(
            qk_layernorm=True,
            num_moe_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream at build; keys are the same
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp or tp,
        )
    elif ep != 1:
        raise ValueError(f"--ep {ep} given for a model without experts")
    return TransformerConfig(**kw)


def layer_spec(config):
    """Megatron-Core's local layer spec; for MoE layers the pre-MLP norm keeps the TE spec's
    on-disk name `pre_mlp_layernorm.weight` (the local spec would rename it to
    `mlp.linear_fc1.layer_norm_weight`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if config.num_moe_experts:
        keys_map = dict(spec.submodules.sharded_state_dict_keys_map)
        keys_map.pop("pre_mlp_layernorm.", None)
        spec.submodules.sharded_state_dict_keys_map = keys_map
    return spec


def build_model(hf_dir, arch: str, tp: int, ep: int = 1, etp: int | None = None,
                dtype: torch.dtype = torch.bfloat16):
    """The GPTModel of the release at (tp, ep), bf16; model parallel state must be initialised."""
    from megatron.core.models.gpt import GPTModel

    cfg = ref.load_config(hf_dir)
    config = transformer_config(hf_dir, arch, tp, ep, etp, dtype)
    rope = cfg.get("rope_parameters") or {}
    model = GPTModel(
        config, layer_spec(config),
        vocab_size=ref.padded_vocab_size(cfg["vocab_size"], tp),
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", cfg.get("rope_theta", 10000))),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
    )
    # Megatron-LM wraps a bf16 model in Float16Module, which casts every parameter (the torch
    # norms of the local spec are created in fp32) to bf16; the keys are unchanged.
    return model.to(dtype)


def world_size_for(tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Smallest world >= 2 that the dense (tp·dp) and expert (etp·ep·edp) meshes both divide."""
    import math

    unit = math.lcm(tp, ep * (etp or tp))
    return unit * max(1, -(-2 // unit))


def init_model_parallel(tp: int, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp or tp)


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # A short collective timeout: a rank stuck in a collective fails the run instead of hanging it.
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))


def sharded_request(model) -> dict:
    """The model's sharded state dict as Megatron-LM requests it (checkpointing.py passes the
    content metadata; Megatron-Core adds the dp_cp group to it)."""
    return model.sharded_state_dict(metadata=dict(CONTENT_METADATA))


def resolve_checkpoint_dir(path) -> Path:
    """A Megatron save root (with the tracker file) -> its checkpoint directory; a checkpoint
    directory (with metadata.json) -> itself."""
    path = Path(path)
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return path / "release"
        if not text.isdigit():
            raise ValueError(f"{tracker}: {text!r} is neither an iteration nor 'release'")
        return path / f"iter_{int(text):07d}"
    if (path / "metadata.json").is_file():
        return path
    raise FileNotFoundError(f"{path}: neither {TRACKER} nor metadata.json")


# --------------------------------------------------------------------------------------------
# Comparing what was loaded with what was expected
# --------------------------------------------------------------------------------------------

def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))
    else:
        yield path, tree


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _map_tree(fn, tree):
    if isinstance(tree, dict):
        return {k: _map_tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tree(fn, v) for v in tree]
    return fn(tree)


def _where(st) -> str:
    """`layer 1, expert 3, offsets (1, 48, 0)` for a ShardedTensor or ShardedObject request."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    off = tuple(st.global_offset)
    if isinstance(st, ShardedObject):
        return f"object offsets {off}"
    p = st.prepend_axis_num
    parts = []
    if p >= 1:
        parts.append(f"layer {off[0]}")
    if p >= 2:
        parts.append(f"expert {off[1]}")
    parts.append(f"offsets {off} of {tuple(st.global_shape)}")
    return ", ".join(parts)


class _Expectation:
    def __init__(self, globals_: dict[str, torch.Tensor], problems: list[str]):
        self.globals = globals_
        self.problems = problems
        self.used: set[str] = set()

    def local(self, st) -> torch.Tensor | None:
        want = self.globals.get(st.key)
        if want is None:
            self.problems.append(f"{st.key}: requested by Megatron-Core ({_where(st)}) but the "
                                 f"reference has no such tensor")
            return None
        self.used.add(st.key)
        if tuple(want.shape) != tuple(st.global_shape):
            self.problems.append(f"{st.key}: Megatron-Core requests global shape {tuple(st.global_shape)}, "
                                 f"the reference has {tuple(want.shape)}")
            return None
        sizes = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        idx = tuple(slice(o, o + s) for o, s in zip(st.global_offset, sizes))
        return want[idx].reshape(st.local_shape).to(st.dtype)


@dataclass
class LoadReport:
    tp: int
    ep: int
    etp: int
    world: int
    tensors_checked: int = 0          # ShardedTensor requests compared, over all ranks
    factories_checked: int = 0        # SwiGLU (factory) requests compared, over all ranks
    objects_loaded: int = 0           # ShardedObject requests loaded, over all ranks
    keys: dict = field(default_factory=dict)   # torch_dist key -> [global shape, on-disk dtype]
    extra_keys: list = field(default_factory=list)  # stored, not requested
    common: dict = field(default_factory=dict)
    forward_checked: int = 0          # ranks whose loaded model's logits were compared with HF's
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return (f"tp={self.tp} ep={self.ep} etp={self.etp} on {self.world} gloo processes: "
                f"{len(self.keys)} keys requested; {self.tensors_checked} tensor shards, "
                f"{self.factories_checked} SwiGLU factory shards, {self.objects_loaded} extra-state objects "
                f"loaded" + (f"; logits equal HF's on {self.forward_checked} ranks" if self.forward_checked else "")
                + f"; {len(self.problems)} problems")


def _stored_metadata(ckpt_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt_dir)).read_metadata()


def _te_extra_state_requests(model, sd: dict) -> None:
    """The `_extra_state` ShardedObjects a TE-spec model requests and the local spec has not:
    TEDotProductAttention's, one per layer (made the way Megatron-Core makes extra-state objects,
    `make_sharded_object_for_checkpoint` with the layer offset)."""
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    n = model.config.num_layers
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        sd[f"decoder.layers.{i}.self_attention.core_attention._extra_state"] = make_sharded_object_for_checkpoint(
            None, "decoder.layers.self_attention.core_attention._extra_state", ((0, i, n),))


# --------------------------------------------------------------------------------------------
# Forward check: the loaded Megatron-Core model computes what the HF model computes
# --------------------------------------------------------------------------------------------

FORWARD_TOKENS = [1, 5, 9, 200, 17, 3, 64, 255]
FORWARD_ATOL = 1e-5  # fp32 logits of two implementations of one network (tiny llama: 1.2e-7)


def hf_llama_logits(hf_dir, tokens: list[int]) -> torch.Tensor:
    """[seq, vocab] fp32 logits of the HF llama release, computed in plain torch from its tensors
    by the HF formulas (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU, lm_head): no
    Megatron names, no reference mapping."""
    cfg = ref.load_config(hf_dir)
    w = {k: t.float() for k, t in ref.load_hf_tensors(hf_dir).items()}
    nh, d = cfg["num_attention_heads"], ref._head_dim(cfg)
    ng = cfg.get("num_key_value_heads") or nh
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    s = len(tokens)

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # [heads, s, d]
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos + half * sin

    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = norm(x, w[f"{p}.input_layernorm.weight"])
        q = (h @ w[f"{p}.self_attn.q_proj.weight"].T).view(s, nh, d).transpose(0, 1)
        k = (h @ w[f"{p}.self_attn.k_proj.weight"].T).view(s, ng, d).transpose(0, 1)
        v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).view(s, ng, d).transpose(0, 1)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // ng, 0), v.repeat_interleave(nh // ng, 0)
        att = (q @ k.transpose(1, 2)) / d ** 0.5
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(s, nh * d)
        x = x + o @ w[f"{p}.self_attn.o_proj.weight"].T
        h = norm(x, w[f"{p}.post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(h @ w[f"{p}.mlp.gate_proj.weight"].T) * (h @ w[f"{p}.mlp.up_proj.weight"].T)
        x = x + g @ w[f"{p}.mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ head.T


class _cpu_forward:
    """Megatron-Core 0.16's forward on a CPU-only machine: RoPE moves its frequencies to
    `torch.cuda.current_device()` and attention dropout forks the CUDA RNG tracker; both are
    redirected for the duration of the forward only."""

    def __enter__(self):
        import contextlib

        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.tracker = get_cuda_rng_tracker()
        self.saved = (torch.cuda.current_device, self.tracker.__dict__.get("fork"))
        torch.cuda.current_device = lambda: "cpu"
        self.tracker.fork = lambda *a, **k: contextlib.nullcontext()
        return self

    def __exit__(self, *exc):
        torch.cuda.current_device = self.saved[0]
        if self.saved[1] is None:
            del self.tracker.fork
        else:
            self.tracker.fork = self.saved[1]


def forward_check(sd: dict, loaded: dict, hf_dir, arch: str, tp: int) -> list[str]:
    """Put the loaded state dict, upcast exactly to fp32, into an fp32 build of the same model the
    way Megatron-LM puts a checkpoint into its model (`load_state_dict`), run Megatron-Core's
    forward and compare its logits with the HF model's."""
    model = build_model(hf_dir, arch, tp, dtype=torch.float32)
    state = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
             for k, v in ((k, loaded[k]) for k in sd)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    problems = [f"forward: model.load_state_dict: missing {k}" for k in missing if not k.endswith("_extra_state")]
    problems += [f"forward: model.load_state_dict: unexpected {k}" for k in unexpected]
    if problems:
        return problems
    vocab = ref.load_config(hf_dir)["vocab_size"]
    ids = torch.tensor([FORWARD_TOKENS])
    mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)  # True = masked
    model.eval()
    with torch.no_grad(), _cpu_forward():
        got = model(ids, torch.arange(ids.shape[1])[None], mask)[0, :, :vocab].float()
    want = hf_llama_logits(hf_dir, FORWARD_TOKENS)
    err = (got - want).abs().max().item()
    if not err <= FORWARD_ATOL:
        return [f"forward: Megatron-Core's logits differ from the HF model's by up to {err:.3g} "
                f"(tolerance {FORWARD_ATOL}; HF logits up to {want.abs().max().item():.3g})"]
    print(f"forward: max |logit difference| {err:.3g}, HF logits up to {want.abs().max().item():.3g}",
          file=sys.stderr)
    return []


def _describe_load_error(e: BaseException) -> str:
    """DCP's CheckpointException carries one wrapped exception per failing rank; name their
    messages rather than the whole traceback."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = {}
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)  # (exc, trace)
            causes.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
        return f"{type(e).__name__}: " + "; ".join(f"{msg} (ranks {ranks})" for msg, ranks in causes.items())
    return f"{type(e).__name__}: {e}"


def check_load(ckpt_dir: Path, hf_dir, arch: str, tp: int, ep: int, etp: int,
               te_extra_state: bool = False, forward: bool = False) -> dict:
    """On every rank of an initialised gloo world: build the model at (tp, ep, etp), load the
    checkpoint with Megatron-Core, compare. Returns this rank's partial report (a dict)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    init_model_parallel(tp, ep, etp)
    model = build_model(hf_dir, arch, tp, ep, etp)
    sd = sharded_request(model)
    if te_extra_state:
        _te_extra_state_requests(model, sd)
    problems: list[str] = []
    expect = _Expectation(expected_globals(hf_dir, tp, etp), problems)

    # Expected local values, computed before the load (the load fills the request tensors).
    expected: dict[tuple, object] = {}
    kinds: dict[tuple, object] = {}
    for path, leaf in _leaves(sd):
        kinds[path] = leaf
        if isinstance(leaf, ShardedTensor):
            expected[path] = expect.local(leaf)
        elif isinstance(leaf, ShardedTensorFactory):
            pieces = leaf.build()
            exp_pieces = _map_tree(lambda st: expect.local(st) if isinstance(st, ShardedTensor) else st, pieces)
            if any(v is None for _, v in _leaves(exp_pieces)):
                expected[path] = None
            else:
                expected[path] = leaf.merge_fn(exp_pieces)
            kinds[path] = (leaf, [st for _, st in _leaves(pieces) if isinstance(st, ShardedTensor)])
    # Requests get NaN-filled (floating) data first, so nothing unloaded can pass for loaded.
    with torch.no_grad():
        for path, leaf in _leaves(sd):
            if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and leaf.data.is_floating_point():
                leaf.data.fill_(float("nan"))

    requested = {}
    for path, leaf in _leaves(sd):
        pieces = kinds[path][1] if isinstance(kinds[path], tuple) else [leaf]
        for st in pieces:
            if isinstance(st, ShardedTensor):
                requested[st.key] = [list(st.global_shape), str(st.dtype).replace("torch.", "")]
            elif isinstance(st, ShardedObject):
                requested[st.key + "/object"] = [list(st.global_shape), "object"]

    tensors = factories = objects = 0
    common: dict = {}
    try:
        loaded = dist_checkpointing.load(sd, str(ckpt_dir))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        problems.append(f"Megatron-Core dist_checkpointing.load failed: {_describe_load_error(e)}"[:4000])
        loaded = None

    if loaded is not None:
        from harness import describe_mismatch

        for path, leaf in _leaves(sd):
            kind = kinds[path]
            try:
                got = _get(loaded, path)
            except (KeyError, IndexError, TypeError):
                key = kind[0].key if isinstance(kind, tuple) else leaf.key
                problems.append(f"{key}: request {'.'.join(map(str, path))} absent from the loaded state dict")
                continue
            if isinstance(leaf, ShardedObject):
                objects += 1
                if not (got is None or (isinstance(got, torch.Tensor) and got.numel() == 0)):
                    problems.append(f"{leaf.key} ({_where(leaf)}): _extra_state payload is {type(got).__name__} "
                                    f"{got!r:.80}, expected None or an empty tensor")
                continue
            want = expected.get(path)
            if want is None:
                continue  # reported when the expectation was built
            if isinstance(kind, tuple):
                factories += 1
                fac, pieces = kind
                label = f"{fac.key} (SwiGLU factory, " + "; ".join(_where(st) for st in pieces) + ")"
            else:
                tensors += 1
                label = f"{leaf.key} ({_where(leaf)})"
            if not isinstance(got, torch.Tensor):
                problems.append(f"{label}: loaded a {type(got).__name__}, not a tensor")
            elif not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
                problems.append(describe_mismatch(label, got, want))
        common = {k: loaded.get(k) for k in ("checkpoint_version", "iteration", "content_metadata")
                  if k in loaded}
        if "args" in loaded:
            a = loaded["args"]
            common["args"] = {k: getattr(a, k, None) for k in (
                "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
                "num_attention_heads", "no_save_optim", "no_save_rng")}

    forward_done = False
    if forward and loaded is not None:
        if arch != "llama" or tp != 1:
            problems.append(f"forward check implemented for dense llama at TP=1 only (asked: {arch}, tp={tp})")
        else:
            problems += forward_check(sd, loaded, hf_dir, arch, tp)
            forward_done = True
    if torch.distributed.get_rank() == 0:
        unrequested = sorted(set(expect.globals) - expect.used)
        for k in unrequested:
            problems.append(f"{k}: in the reference but not requested by the Megatron-Core model (rank 0)")
    return dict(problems=problems, tensors=tensors, factories=factories, objects=objects,
                requested=requested, common=common, forward=forward_done)


def _finish_report(ckpt_dir: Path, hf_dir, tp: int, ep: int, etp: int, world: int, parts: list[dict]) -> LoadReport:
    rep = LoadReport(tp=tp, ep=ep, etp=etp, world=world)
    requested: dict = {}
    for rank, part in enumerate(parts):
        rep.problems += [f"[rank {rank}] {p}" for p in part["problems"]]
        rep.tensors_checked += part["tensors"]
        rep.factories_checked += part["factories"]
        rep.objects_loaded += part["objects"]
        rep.forward_checked += bool(part.get("forward"))
        requested.update(part["requested"])
        rep.common = rep.common or part["common"]
    # On-disk checks from the DCP metadata: dtype of every requested tensor, unrequested keys.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = _stored_metadata(ckpt_dir).state_dict_metadata
    except Exception as e:  # a missing or unreadable .metadata: Megatron-Core's load failed on it too
        rep.problems.append(f"{ckpt_dir}/.metadata unreadable: {type(e).__name__}: {e}")
        return rep
    want = expected_globals(hf_dir, tp, etp)
    stored_objects = {k.split("/shard_")[0] for k, v in md.items() if not isinstance(v, TensorStorageMetadata)}
    for key, (shape, dtype) in sorted(requested.items()):
        if key.endswith("/object"):
            rep.keys[key] = shape
            continue
        meta = md.get(key)
        if isinstance(meta, TensorStorageMetadata):
            on_disk = meta.properties.dtype
            rep.keys[key] = [list(meta.size), str(on_disk).replace("torch.", "")]
            if key in want and on_disk != want[key].dtype:
                rep.problems.append(f"{key}: stored as {on_disk}, the reference is {want[key].dtype} "
                                    f"(the load casts silently)")
        else:
            rep.keys[key] = [shape, "absent"]
    requested_objects = {k[: -len("/object")] for k in requested if k.endswith("/object")}
    rep.extra_keys = sorted(
        [k for k, v in md.items() if isinstance(v, TensorStorageMetadata) and k not in requested]
        + [f"{k} (object)" for k in stored_objects - requested_objects])
    version = rep.common.get("checkpoint_version")
    loaded = any(part["tensors"] or part["factories"] or part["objects"] for part in parts)
    if loaded and (version is None or float(version) < 3.0):
        rep.problems.append(f"common state: checkpoint_version is {version!r}, Megatron-LM writes 3.0 "
                            f"(< 2.0 triggers its legacy QKV re-ordering)")
    return rep


@dataclass(frozen=True)
class Job:
    """One load: checkpoint, HF release, family, mesh (etp None = tp), TE extra-state requests."""
    ckpt: str
    hf_dir: str
    arch: str | None = None
    tp: int = 1
    ep: int = 1
    etp: int | None = None
    te_extra_state: bool = False
    forward: bool = False


def _worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    quiet_megatron()
    init_gloo(rank, world, port)
    try:
        results = []
        for ckpt_dir, hf_dir, arch, tp, ep, etp, te, fwd in jobs:
            results.append(check_load(Path(ckpt_dir), hf_dir, arch, tp, ep, etp, te, fwd))
        with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
            json.dump(results, f, default=str)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_jobs(jobs: list[Job]) -> list[LoadReport]:
    """Run every load in one spawn of max(world) gloo processes (Megatron-Core's import and the
    process start dominate the time) and return one report per job, in order. Every rank takes
    part in every load (Megatron-Core 0.16's load is collective); a mesh smaller than the world
    gets data parallelism world / tp. A load that fails is reported and the next one runs."""
    import torch.multiprocessing as mp

    resolved = []
    for j in jobs:
        arch = j.arch or hf_arch(j.hf_dir)
        etp = int(j.etp or j.tp)
        resolved.append((str(resolve_checkpoint_dir(j.ckpt)), str(j.hf_dir), arch, int(j.tp), int(j.ep), etp,
                         bool(j.te_extra_state), bool(j.forward)))
    world = max(world_size_for(tp, ep, etp) for _, _, _, tp, ep, etp, _, _ in resolved)
    for _, _, _, tp, ep, etp, _, _ in resolved:
        if world % tp or world % (ep * etp):
            raise ValueError(f"mesh tp={tp} ep={ep} etp={etp} does not divide the world size {world}")
    with tempfile.TemporaryDirectory(prefix="megatron_load.") as out:
        mp.spawn(_worker, args=(world, free_port(), resolved, out), nprocs=world, join=True)
        parts = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
    return [_finish_report(Path(ckpt), hf, tp, ep, etp, world, [p[i] for p in parts])
            for i, (ckpt, hf, _, tp, ep, etp, _, _) in enumerate(resolved)]


def run(ckpt, hf_dir, arch: str | None = None, meshes=((1, 1, None),), te_extra_state: bool = False,
        forward: bool = False) -> list[LoadReport]:
    """Load `ckpt` once per mesh `(tp, ep, etp)` (etp None = tp); one report per mesh."""
    return run_jobs([Job(str(ckpt), str(hf_dir), arch, tp, ep, etp, te_extra_state, forward)
                     for tp, ep, etp in meshes])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="Megatron save root (with latest_checkpointed_iteration.txt) or checkpoint dir")
    p.add_argument("--hf", required=True, help="the HF release the checkpoint was converted from")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load at")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size to load at (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: tp)")
    p.add_argument("--arch", choices=ARCHS, default=None, help="model family (default: from config.json)")
    p.add_argument("--te-extra-state", action="store_true",
                   help="also request TE core_attention._extra_state objects (what a TE-spec job requests)")
    p.add_argument("--forward", action="store_true",
                   help="also run Megatron-Core's forward on the loaded model and compare its logits with "
                        "the HF model's (dense llama at --tp 1)")
    p.add_argument("--json", type=Path, help="write the reports (keys, shapes, problems) here")
    p.add_argument("-v", "--verbose", action="store_true", help="print the requested keys and shapes")
    a = p.parse_args(argv)
    try:
        reports = run(a.ckpt, a.hf, a.arch, [(a.tp, a.ep, a.etp)], a.te_extra_state, a.forward)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"megatron_load: {e}", file=sys.stderr)
        return 2
    for rep in reports:
        for prob in rep.problems:
            print(f"MISMATCH {prob}")
        if a.verbose:
            for k, v in rep.keys.items():
                print(f"  {k}: {v}")
            for k in rep.extra_keys:
                print(f"  (stored, not requested) {k}")
            print(f"  common state: {rep.common}")
        print(("OK   " if rep.ok else "FAIL ") + rep.summary())
    if a.json:
        a.json.write_text(json.dumps([rep.__dict__ for rep in reports], indent=1, default=str))
    return 0 if all(rep.ok for rep in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
