"""Real Megatron-FSDP (`--ckpt-format fsdp_dtensor`) training checkpoints, written and read with
torch.distributed in spawned gloo ranks (the `shardline reshard` tests, test_reshard.py).

A small MoE GPT is described here by hand (`params()`), independently of the Rust code: Megatron
parameter names, global shapes, TP modes, fused SwiGLU sections and experts. `pieces()` is the
Megatron-FSDP chunk layout of that model on a mesh, written from layouts.md §1.4/§3: TP split
first, then the TP-local tensor's dim-0 rows over the FSDP group (dp·cp ranks for dense
parameters, expert-DP = world/(etp·ep) for experts), q = ceil(rows/D) rows per rank, clipped
(uneven, possibly empty). A fused fc1 is sharded as the TP-local [w_r; v_r] and its `_w`/`_v`
sections are cut from that, so one FSDP rank can hold the end of `_w` and the start of `_v`.
Global ranks: tp_rank + tp·fsdp_rank (dense), etp_rank + etp·(ep_rank + ep·edp_rank) (experts);
expert g is owned by EP rank g // (E/ep). Empty pieces write nothing.

`save_training_checkpoint` (in each rank) builds the state dict the way Megatron's fsdp_dtensor
save does and calls `dcp.save`; `load_on_mesh` requests one rank's boxes with `dcp.load`. Uneven
boxes: like Megatron's `update_uneven_dtensor_chunk_metadata`, each DTensor's local tensor gets
`__create_chunk_list__` / `__create_write_items__` overrides (torch's DTensor forwards both to
its `_local_tensor`); here the chunk is computed arithmetically from the layout (no all-gather).
Values are pseudo-random per key and seed (`global_value`), so saves of the same model on any two
meshes hold the same global tensors.
The same code runs under torch 2.5 (`python training_ckpt.py save ...`, see `main`), which writes
the same checkpoint in its own format (test_reshard.py's source S3).

Key forms (NVIDIA/Megatron-LM at d98e8a64, read for facts; paths relative to the repo):
* Top level, megatron/training/checkpointing.py `generate_state_dict` L1556-1640: `args`
  (argparse.Namespace, L1571), `checkpoint_version` = 3.0 (L1572), `iteration` (L1574), `model`
  (L1595, `state_dict_for_save_checkpoint()`), `optimizer` (L1614-1624, fsdp_dtensor branch),
  `opt_param_scheduler` (L1626-1627, `OptimizerParamScheduler.state_dict`,
  megatron/core/optimizer_param_scheduler.py L302-316: max_lr, lr_warmup_steps, num_steps,
  lr_decay_style, lr_decay_steps, min_lr, start_wd, end_wd, wd_incr_style, wd_incr_steps),
  `rng_state` (L1634-1635); `num_floating_point_operations_so_far` (save_checkpoint, L822).
  `preprocess_fsdp_dtensor_state_dict` L1730-1755 then splits SwiGLU fc1, re-indexes experts and
  attaches the uneven chunk metadata (uneven_dtensor.py `preprocess_state_dict_for_uneven_dtensor`).
* Model: `state_dict['model']` is a flat dict keyed `module.<fqn>` (MegatronFSDP over
  Float16Module), so the DCP key is `model.module.decoder.layers.0.mlp.linear_fc1.weight_w`,
  planner_data `('model', 'module.decoder.layers.0.mlp.linear_fc1.weight_w')`.
  `router.expert_bias` is a buffer: a plain fp32 tensor, `('model', 'module.decoder.layers.1.mlp.router.expert_bias')`.
* Optimizer: megatron/core/optimizer/distrib_optimizer.py `sharded_param_state_fsdp_dtensor`
  L1635-1657 returns `{"state": {name: state}, "param_to_group_meta": {name: group - params}}`
  (`_param_groups_to_param2group_meta` L1584-1594); `_param_name` L1441-1460 names come from
  `named_parameters()` of the DDP wrapper, expert indices made global: `module.module.module.<fqn>`.
  DCP key `optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight_w.exp_avg`,
  planner_data `('optimizer', 'state', 'module.module.module.decoder.layers.0.mlp.linear_fc1.weight_w', 'exp_avg')`.
  The SwiGLU split (fsdp_dtensor_checkpoint.py `handle_swiglu_in_state_dict` L369-392) splits
  exp_avg/exp_avg_sq and copies other entries (the torch-AdamW `step`) to both halves:
  `optimizer.state.module.module.module.<fqn>_w.step` (0-d fp32 tensor, variant "adamw" here).
  param_to_group_meta is never rewritten: LIVE names, unsplit, e.g.
  `optimizer.param_to_group_meta.module.module.module.decoder.layers.0.mlp.linear_fc1.weight.lr`,
  planner_data `('optimizer', 'param_to_group_meta', 'module.module.module.decoder.layers.0.mlp.linear_fc1.weight', 'lr')`;
  experts `...decoder.layers.1.mlp.experts.linear_fc1.weight3.step` (global index). Fields: TE
  FusedAdam's lr, bias_correction, betas, eps, weight_decay, step; Megatron's is_expert_parallel,
  default_config, wd_mult, lr_mult, is_decoupled_lr, max_lr, min_lr (optimizer/__init__.py L393-411).
* RNG: checkpointing.py `get_rng_state` L451-510: `rng_state_list = [rng_state]` (a one-element
  list unless data_parallel_random_init, L477-486) and for fsdp_dtensor (L505-508)
  `{f'({pp_rank}, {tp_rank})': rng_state_list}`: the key is the STRING "(0, 1)" (a space after
  the comma), the list index is the int 0 (DCP descends into a list holding a dict). DCP keys:
  `rng_state.(0, 1).0.random_rng_state` (bytes), `rng_state.(0, 1).0.np_rng_state` (bytes),
  `rng_state.(0, 1).0.torch_rng_state`, `rng_state.(0, 1).0.cuda_rng_state` (uint8 tensors),
  `rng_state.(0, 1).0.rng_tracker_states.model-parallel-rng` (also data-parallel-rng,
  expert-parallel-rng; tensor_parallel/random.py L95-101); planner_data
  `('rng_state', '(0, 1)', 0, 'rng_tracker_states', 'model-parallel-rng')`. On load (L3076-3092)
  the loader looks up `f'({pp_rank}, {tp_rank})'` and otherwise falls back to the first entry.
  On CPU torch_rng_state and cuda_rng_state both come from torch.get_rng_state(); all values here
  depend only on (pp, tp) so that DCP's dedup (one writer per key) is deterministic.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mesh import Mesh, free_port
# Reading a checkpoint in one process, re-exported for the tests.
from training_read import canon, load_full, read_bytes_items, read_item, read_metadata, tensor_keys  # noqa: F401

# torch's DCP logger logs every load at DEBUG; keep it out of pytest's captured logs.
logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.WARNING)

# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

VOCAB = 37            # real vocab rows
DIVISOR = 8           # args.make_vocab_size_divisible_by: padded = ceil(V/(8·tp))·8·tp = 40 / 48 / 64
HIDDEN = 7            # odd: row-parallel and 1-D tensors shard unevenly
# linear_qkv rows (6 + 2·2)·4 = 40 (14/14/12 over 3 ranks). Every size divides by 4 but the
# query groups, so tp 4 fails only for the reason Megatron gives (ng % tp).
HEADS, GROUPS, HEAD_DIM = 6, 2, 4
FFN = 20              # dense fc1 _w/_v [20, 7], fused TP-local [40/tp, 7]
EXPERTS, MOE_FFN = 4, 6
SHARED_FFN = 4
LAYERS = 2            # layer 0 dense MLP, layer 1 MoE (+ shared expert)
SEED = 20260822
ITERATION, ADAM_STEP = 1300, 1287     # Adam's step is not the iteration (skipped steps)
LR, MIN_LR, WD = 2.5e-4, 2.5e-5, 0.1

MODEL_PREFIX = "module."                  # keys of state_dict["model"]
OPT_PREFIX = "module.module.module."      # keys of optimizer.state / optimizer.param_to_group_meta
RNG_TRACKERS = ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng")
VARIANTS = ("fused_adam", "adamw")        # adamw: torch-AdamW fallback, per-parameter 0-d `step`


@dataclass(frozen=True)
class Param:
    """One live Megatron parameter (or buffer). `sections`: its on-disk tensors (name, global
    shape; vocab rows unpadded); two for a split SwiGLU fc1 (`_w`, `_v`), else one."""
    live: str
    sections: tuple[tuple[str, tuple[int, ...]], ...]
    mode: str                   # column (dim 0) | row (dim 1) | replicated | buffer (plain tensor)
    expert: int | None = None   # global expert index
    vocab: bool = False
    no_wd: bool = False

    @property
    def optimized(self) -> bool:
        return self.mode != "buffer"


def params() -> list[Param]:
    h = HIDDEN
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM

    def one(name, shape, mode, **kw):
        return Param(name, ((name, shape),), mode, **kw)

    def swiglu(name, f, **kw):
        return Param(name, ((f"{name}_w", (f, h)), (f"{name}_v", (f, h))), "column", **kw)

    out = [one("embedding.word_embeddings.weight", (VOCAB, h), "column", vocab=True)]
    for i in range(LAYERS):
        L = f"decoder.layers.{i}"
        out += [one(f"{L}.self_attention.linear_qkv.layer_norm_weight", (h,), "replicated", no_wd=True),
                one(f"{L}.self_attention.linear_qkv.weight", (qkv_rows, h), "column"),
                one(f"{L}.self_attention.linear_proj.weight", (h, HEADS * HEAD_DIM), "row")]
        if i == 0:
            out += [one(f"{L}.mlp.linear_fc1.layer_norm_weight", (h,), "replicated", no_wd=True),
                    swiglu(f"{L}.mlp.linear_fc1.weight", FFN),
                    one(f"{L}.mlp.linear_fc2.weight", (h, FFN), "row")]
        else:
            out += [one(f"{L}.pre_mlp_layernorm.weight", (h,), "replicated", no_wd=True),
                    one(f"{L}.mlp.router.weight", (EXPERTS, h), "replicated"),
                    one(f"{L}.mlp.router.expert_bias", (EXPERTS,), "buffer")]
            for g in range(EXPERTS):
                out += [swiglu(f"{L}.mlp.experts.linear_fc1.weight{g}", MOE_FFN, expert=g),
                        one(f"{L}.mlp.experts.linear_fc2.weight{g}", (h, MOE_FFN), "row", expert=g)]
            out += [swiglu(f"{L}.mlp.shared_experts.linear_fc1.weight", SHARED_FFN),
                    one(f"{L}.mlp.shared_experts.linear_fc2.weight", (h, SHARED_FFN), "row")]
    out += [one("decoder.final_layernorm.weight", (h,), "replicated", no_wd=True),
            one("output_layer.weight", (VOCAB, h), "column", vocab=True)]
    return out


def padded_vocab(tp: int) -> int:
    m = DIVISOR * tp
    return -(-VOCAB // m) * m


def etp_of(mesh: Mesh) -> int:
    return mesh.etp if mesh.etp is not None else mesh.tp


def expert_dp(mesh: Mesh) -> int:
    return mesh.world // (etp_of(mesh) * mesh.ep)


def check_mesh(mesh: Mesh) -> None:
    """The divisibility Megatron needs for this model on `mesh` (ValueError otherwise)."""
    etp = etp_of(mesh)
    problems = []
    if GROUPS % mesh.tp:
        problems.append(f"num_query_groups {GROUPS} % tp {mesh.tp}")
    for what, n, t in (("ffn", FFN, mesh.tp), ("shared ffn", SHARED_FFN, mesh.tp),
                       ("heads·head_dim", HEADS * HEAD_DIM, mesh.tp), ("moe ffn", MOE_FFN, etp)):
        if n % t:
            problems.append(f"{what} {n} % {t}")
    if EXPERTS % mesh.ep:
        problems.append(f"num_experts {EXPERTS} % ep {mesh.ep}")
    if mesh.world % (etp * mesh.ep):
        problems.append(f"world {mesh.world} % (etp {etp} · ep {mesh.ep})")
    if problems:
        raise ValueError(f"mesh {mesh.id} cannot take the model: " + "; ".join(problems))


def section_shape(shape: tuple[int, ...], p: Param, vocab_tp: int) -> tuple[int, ...]:
    return (padded_vocab(vocab_tp), *shape[1:]) if p.vocab else tuple(shape)


def fsdp_rows(rows: int, d: int, j: int) -> tuple[int, int]:
    q = -(-rows // d)
    return min(j * q, rows), min((j + 1) * q, rows)


@dataclass(frozen=True)
class Piece:
    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.sizes)


def pieces(p: Param, mesh: Mesh, vocab_tp: int | None = None) -> dict[str, list[Piece]]:
    """Every rank's piece of each on-disk section of `p` on `mesh` (empty pieces included).
    `vocab_tp`: the TP size whose padded vocab to use (default mesh.tp)."""
    vocab_tp = mesh.tp if vocab_tp is None else vocab_tp
    shapes = [section_shape(s, p, vocab_tp) for _, s in p.sections]
    names = [n for n, _ in p.sections]
    if p.mode == "buffer":
        return {names[0]: [Piece(r, (0,) * len(shapes[0]), shapes[0]) for r in range(mesh.world)]}
    if p.expert is None:
        t, d = mesh.tp, mesh.cp * mesh.dp
        rank_of = lambda r, j: r + mesh.tp * j  # noqa: E731
    else:
        t, d = etp_of(mesh), expert_dp(mesh)
        ep_rank = p.expert // (EXPERTS // mesh.ep)
        rank_of = lambda r, j: r + t * (ep_rank + mesh.ep * j)  # noqa: E731
    out: dict[str, list[Piece]] = {n: [] for n in names}
    if p.mode == "column":
        n = [s[0] // t for s in shapes]
        local_rows = sum(n)
        for c, (name, shape) in enumerate(zip(names, shapes)):
            a = sum(n[:c])
            for r in range(t):
                for j in range(d):
                    lo_j, hi_j = fsdp_rows(local_rows, d, j)
                    lo, hi = max(lo_j, a), min(hi_j, a + n[c])
                    start = min(max(lo_j - a, 0), n[c])
                    out[name].append(Piece(rank_of(r, j), (r * n[c] + start, *[0] * (len(shape) - 1)),
                                           (max(hi - lo, 0), *shape[1:])))
    elif p.mode == "row":
        (name, shape), = zip(names, shapes)
        cols = shape[1] // t
        for r in range(t):
            for j in range(d):
                lo, hi = fsdp_rows(shape[0], d, j)
                out[name].append(Piece(rank_of(r, j), (lo, r * cols), (hi - lo, cols)))
    elif p.mode == "replicated":
        (name, shape), = zip(names, shapes)
        for r in range(t):
            for j in range(d):
                lo, hi = fsdp_rows(shape[0], d, j)
                out[name].append(Piece(rank_of(r, j), (lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:])))
    else:
        raise ValueError(p.mode)
    return out


def holds(p: Param, mesh: Mesh, rank: int) -> bool:
    """Whether `rank` has parameter `p` at all (experts: only the ranks of the owning EP rank)."""
    if p.expert is None:
        return True
    etp = etp_of(mesh)
    return (rank // etp) % mesh.ep == p.expert // (EXPERTS // mesh.ep)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------

def model_key(name: str) -> str:
    return f"model.{MODEL_PREFIX}{name}"


def state_key(name: str, state: str) -> str:
    return f"optimizer.state.{OPT_PREFIX}{name}.{state}"


def group_key(live: str, field: str) -> str:
    return f"optimizer.param_to_group_meta.{OPT_PREFIX}{live}.{field}"


def rng_key(tp_rank: int, *rest: str, pp_rank: int = 0) -> str:
    return ".".join(("rng_state", f"({pp_rank}, {tp_rank})", "0", *rest))


def global_value(name: str, kind: str, p: Param, shape: tuple[int, ...], vocab_tp: int) -> torch.Tensor:
    """The global tensor of section `name` (kind: param | exp_avg | exp_avg_sq), fp32; vocab rows
    padded with zeros for `vocab_tp`."""
    g = torch.Generator().manual_seed((zlib.crc32(f"{kind}:{name}".encode()) + SEED) % (2 ** 63))
    if kind == "exp_avg_sq":
        t = torch.rand(shape, generator=g) * 1e-3
    elif kind == "exp_avg":
        t = torch.randn(shape, generator=g) * 1e-2
    else:
        t = torch.randn(shape, generator=g)
    if p.vocab:
        full = torch.zeros(section_shape(shape, p, vocab_tp), dtype=torch.float32)
        full[:shape[0]] = t
        t = full
    return t.to(torch.float32).contiguous()


def reference_tensors(vocab_tp: int, variant: str) -> dict[str, torch.Tensor]:
    """Flat DCP key -> global tensor: parameters, moments, (adamw) steps, the expert_bias buffer."""
    out = {}
    for p in params():
        for name, shape in p.sections:
            out[model_key(name)] = global_value(name, "param", p, shape, vocab_tp)
            if p.optimized:
                for s in ("exp_avg", "exp_avg_sq"):
                    out[state_key(name, s)] = global_value(name, s, p, shape, vocab_tp)
                if variant == "adamw":
                    out[state_key(name, "step")] = torch.tensor(float(ADAM_STEP))
    return out


def group_meta(p: Param, variant: str) -> dict:
    """param_to_group_meta value of `p`: the param group minus `params`."""
    wd_mult = 0.0 if p.no_wd else 1.0
    meta = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": WD * wd_mult}
    if variant == "fused_adam":
        meta |= {"bias_correction": True, "step": ADAM_STEP}
    else:  # torch.optim.AdamW's own group flags; the step lives in the state
        meta |= {"amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
                 "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    meta |= {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": p.expert is not None,
             "is_decoupled_lr": False, "max_lr": LR, "min_lr": MIN_LR, "default_config": True}
    return meta


def scheduler_state() -> dict:
    return {"max_lr": LR, "lr_warmup_steps": 100, "num_steps": ITERATION * 16, "lr_decay_style": "cosine",
            "lr_decay_steps": 100000, "min_lr": MIN_LR, "start_wd": WD, "end_wd": WD,
            "wd_incr_style": "constant", "wd_incr_steps": 100000}


def make_args(mesh: Mesh, rank: int) -> argparse.Namespace:
    etp = etp_of(mesh)
    return argparse.Namespace(
        tensor_model_parallel_size=mesh.tp, pipeline_model_parallel_size=1, context_parallel_size=mesh.cp,
        expert_model_parallel_size=mesh.ep, expert_tensor_parallel_size=etp, data_parallel_size=mesh.dp,
        world_size=mesh.world, rank=rank, local_rank=rank, padded_vocab_size=padded_vocab(mesh.tp),
        vocab_size=VOCAB, make_vocab_size_divisible_by=DIVISOR, num_layers=LAYERS, hidden_size=HIDDEN,
        ffn_hidden_size=FFN, num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
        kv_channels=HEAD_DIM, num_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[0, 1],
        moe_shared_expert_intermediate_size=SHARED_FFN, moe_router_enable_expert_bias=True,
        moe_grouped_gemm=True, swiglu=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", position_embedding_type="rope", ckpt_format="fsdp_dtensor",
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params", bf16=True,
        seed=1234, lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        micro_batch_size=1, global_batch_size=16, seq_length=64, train_iters=100000,
        consumed_train_samples=ITERATION * 16, consumed_valid_samples=320, iteration=ITERATION,
        data_parallel_random_init=False, no_save_rng=False, no_save_optim=None, save="/ckpt", load="/ckpt",
        transformer_impl="transformer_engine", tokenizer_type="NullTokenizer")


def rng_entry(tp_rank: int, pp_rank: int = 0) -> dict:
    """One element of Megatron's rng_state list, a function of (pp, tp) only."""
    base = SEED + 1000 * pp_rank + 10 * tp_rank
    random.seed(base)
    np.random.seed(base % 2 ** 32)
    torch.manual_seed(base)
    entry = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state()}
    torch.manual_seed(base + 1)
    entry["cuda_rng_state"] = torch.get_rng_state()
    trackers = {}
    for i, name in enumerate(RNG_TRACKERS):
        torch.manual_seed(base + 2 + i)
        trackers[name] = torch.get_rng_state()
    entry["rng_tracker_states"] = trackers
    return entry


def rng_tensor_names() -> list[tuple[str, ...]]:
    return [("torch_rng_state",), ("cuda_rng_state",)] + [("rng_tracker_states", n) for n in RNG_TRACKERS]


def rng_bytes_names() -> list[str]:
    return ["random_rng_state", "np_rng_state"]


# --------------------------------------------------------------------------------------------
# Expected .metadata
# --------------------------------------------------------------------------------------------

@dataclass
class Expected:
    size: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]   # sorted, non-empty, deduplicated


def expected_tensors(mesh: Mesh, variant: str, rng: bool = True) -> dict[str, Expected]:
    """Every tensor key of a checkpoint of this model saved on `mesh`, with its chunk boxes."""
    out: dict[str, Expected] = {}
    for p in params():
        for name, boxes in pieces(p, mesh).items():
            shape = section_shape(dict(p.sections)[name], p, mesh.tp)
            uniq = sorted({(pc.offsets, pc.sizes) for pc in boxes if not pc.empty})
            out[model_key(name)] = Expected(shape, torch.float32, uniq)
            if p.optimized:
                for s in ("exp_avg", "exp_avg_sq"):
                    out[state_key(name, s)] = Expected(shape, torch.float32, list(uniq))
                if variant == "adamw":
                    out[state_key(name, "step")] = Expected((), torch.float32, [((), ())])
    if rng:
        n = torch.get_rng_state().numel()
        for t in range(mesh.tp):
            for parts in rng_tensor_names():
                out[rng_key(t, *parts)] = Expected((n,), torch.uint8, [((0,), (n,))])
    return out


def expected_bytes_keys(mesh: Mesh, variant: str, rng: bool = True) -> set[str]:
    keys = {"args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"}
    keys |= {f"opt_param_scheduler.{k}" for k in scheduler_state()}
    for p in params():
        if p.optimized:
            keys |= {group_key(p.live, f) for f in group_meta(p, variant)}
    if rng:
        keys |= {rng_key(t, n) for t in range(mesh.tp) for n in rng_bytes_names()}
    return keys


def expected_planner_path(key: str) -> tuple:
    """The planner_data path Megatron's nesting gives a flat key."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    if key.startswith("optimizer.state."):
        rest = key[len("optimizer.state."):]
        if rest.endswith((".exp_avg", ".exp_avg_sq", ".step")):
            name, state = rest.rsplit(".", 1)
            return ("optimizer", "state", name, state)
    if key.startswith("optimizer.param_to_group_meta."):
        name, field = key[len("optimizer.param_to_group_meta."):].rsplit(".", 1)
        return ("optimizer", "param_to_group_meta", name, field)
    if key.startswith("opt_param_scheduler."):
        return ("opt_param_scheduler", key[len("opt_param_scheduler."):])
    if key.startswith("rng_state."):
        grid, rest = key[len("rng_state."):].split(").", 1)
        index, *names = rest.split(".", 2) if "rng_tracker_states" in rest else rest.split(".", 1)
        return ("rng_state", grid + ")", int(index), *names)
    return (key,)



# --------------------------------------------------------------------------------------------
# In the ranks: DTensors with Megatron-FSDP's uneven boxes
# --------------------------------------------------------------------------------------------

def _attach_chunk(dt: DTensor, offsets: tuple[int, ...]) -> DTensor:
    """What Megatron's update_uneven_dtensor_chunk_metadata attaches, computed arithmetically."""
    local = dt._local_tensor
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local.shape))

    def create_write_items(fqn: str, tensor) -> list[WriteItem]:
        if tensor.to_local().numel() == 0:
            return []  # empty shards write nothing (uneven_dtensor.py)
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets),
                          tensor_data=TensorWriteData(chunk=chunk,
                                                      properties=TensorProperties.create_from_tensor(tensor.to_local()),
                                                      size=tensor.size()))]

    local.__create_chunk_list__ = lambda: [chunk]
    local.__create_write_items__ = create_write_items
    return dt


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class RankMeshes:
    """The DeviceMeshes a Megatron-FSDP rank puts its DTensors on: ("dp_cp", "tp") for dense
    parameters, its "dp_cp" dimension alone for TP-replicated ones, and the expert ("dp_cp", "tp")
    mesh of this rank's EP group.

    No process groups are created (`_init_backend=False`): nothing here runs a DTensor collective,
    the chunk of every DTensor is attached explicitly, and group creation would cost seconds per
    spawned job on this 2-core machine."""

    def __init__(self, mesh: Mesh):
        world, rank = mesh.world, dist.get_rank()
        etp = etp_of(mesh)
        dense = torch.arange(world).reshape(mesh.cp * mesh.dp, mesh.tp)
        self.dense = DeviceMesh("cpu", dense, mesh_dim_names=("dp_cp", "tp"), _init_backend=False)
        self.dp_only = DeviceMesh("cpu", dense[:, rank % mesh.tp], mesh_dim_names=("dp_cp",), _init_backend=False)
        ep_rank = (rank // etp) % mesh.ep
        grid = torch.arange(world).reshape(expert_dp(mesh), mesh.ep, etp)
        self.expert = DeviceMesh("cpu", grid[:, ep_rank, :].contiguous(), mesh_dim_names=("dp_cp", "tp"),
                                 _init_backend=False)

    def for_param(self, p: Param):
        placements_2d = [Shard(0), Shard(1 if p.mode == "row" else 0)]
        if p.expert is not None:
            return self.expert, placements_2d
        if p.mode == "replicated":
            return self.dp_only, [Shard(0)]
        return self.dense, placements_2d


def _box(t: torch.Tensor, pc: Piece) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(pc.offsets, pc.sizes))].contiguous()


def _dtensor(local: torch.Tensor, pc: Piece, shape, meshes: RankMeshes, p: Param) -> DTensor:
    mesh, placements = meshes.for_param(p)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                            stride=_contiguous_stride(shape))
    return _attach_chunk(dt, pc.offsets)


def _my_piece(boxes: list[Piece], rank: int) -> Piece:
    mine = [pc for pc in boxes if pc.rank == rank]
    assert len(mine) == 1, f"rank {rank} has {len(mine)} pieces"
    return mine[0]


def rank_state_dict(mesh: Mesh, rank: int, variant: str, meshes: RankMeshes) -> dict:
    """The state dict rank `rank` of a Megatron-FSDP job on `mesh` hands to dcp.save."""
    ref = reference_tensors(mesh.tp, variant)
    model, state, to_group = {}, {}, {}
    for p in params():
        if not holds(p, mesh, rank):
            continue
        for name, boxes in pieces(p, mesh).items():
            shape = section_shape(dict(p.sections)[name], p, mesh.tp)
            if p.mode == "buffer":
                model[MODEL_PREFIX + name] = ref[model_key(name)].clone()
                continue
            pc = _my_piece(boxes, rank)
            model[MODEL_PREFIX + name] = _dtensor(_box(ref[model_key(name)], pc), pc, shape, meshes, p)
            st = {s: _dtensor(_box(ref[state_key(name, s)], pc), pc, shape, meshes, p)
                  for s in ("exp_avg", "exp_avg_sq")}
            if variant == "adamw":
                st["step"] = ref[state_key(name, "step")].clone()
            state[OPT_PREFIX + name] = st
        if p.optimized:
            to_group[OPT_PREFIX + p.live] = group_meta(p, variant)
    tp_rank = rank % mesh.tp
    return {
        "args": make_args(mesh, rank),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model,
        "optimizer": {"state": state, "param_to_group_meta": to_group},
        "opt_param_scheduler": scheduler_state(),
        "rng_state": {f"(0, {tp_rank})": [rng_entry(tp_rank)]},
        "num_floating_point_operations_so_far": 7.25e15,
    }


def request_state_dict(mesh: Mesh, rank: int, variant: str, meshes: RankMeshes, vocab_tp: int | None = None,
                       skip=lambda key: False) -> tuple[dict, dict[str, Piece]]:
    """A load request for this rank's boxes of every tensor (NaN-filled) and the boxes by flat key."""
    vocab_tp = mesh.tp if vocab_tp is None else vocab_tp
    model, state, where = {}, {}, {}
    for p in params():
        if not holds(p, mesh, rank):
            continue
        for name, boxes in pieces(p, mesh, vocab_tp).items():
            shape = section_shape(dict(p.sections)[name], p, vocab_tp)
            if skip(model_key(name)):
                continue
            if p.mode == "buffer":
                model[MODEL_PREFIX + name] = torch.full(shape, float("nan"))
                where[model_key(name)] = Piece(rank, (0,) * len(shape), shape)
                continue
            pc = _my_piece(boxes, rank)
            model[MODEL_PREFIX + name] = _dtensor(torch.full(pc.sizes, float("nan")), pc, shape, meshes, p)
            where[model_key(name)] = pc
            st = {}
            for s in ("exp_avg", "exp_avg_sq"):
                st[s] = _dtensor(torch.full(pc.sizes, float("nan")), pc, shape, meshes, p)
                where[state_key(name, s)] = pc
            if variant == "adamw":
                st["step"] = torch.tensor(float("nan"))
                where[state_key(name, "step")] = Piece(rank, (), ())
            state[OPT_PREFIX + name] = st
    return {"model": model, "optimizer": {"state": state}}, where


def _flat_locals(sd: dict) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd["model"].items():
        out[f"model.{k}"] = v.to_local() if isinstance(v, DTensor) else v
    for name, st in sd["optimizer"]["state"].items():
        for s, v in st.items():
            out[f"optimizer.state.{name}.{s}"] = v.to_local() if isinstance(v, DTensor) else v
    return out


def save_training_checkpoint(path: str, mesh: Mesh, variant: str, meshes: RankMeshes) -> None:
    rank = dist.get_rank()
    sd = rank_state_dict(mesh, rank, variant, meshes)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


def load_on_mesh(path: str, mesh: Mesh, variant: str, meshes: RankMeshes, vocab_tp: int | None = None,
                 skip=lambda key: False) -> tuple[dict[str, torch.Tensor], dict[str, Piece]]:
    """This rank's Megatron-FSDP boxes of every parameter, moment and step, loaded with dcp.load
    from the checkpoint at `path`: ({flat key: local tensor}, {flat key: box})."""
    sd, where = request_state_dict(mesh, dist.get_rank(), variant, meshes, vocab_tp, skip)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    return _flat_locals(sd), where


def _mismatch(key: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape:
        return f"{key}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    if bool(same.all()) and not bool(got.isnan().any()):
        return None
    bad = (~same).nonzero()
    nan = int(got.isnan().sum())
    first = tuple(bad[0].tolist()) if len(bad) else None
    msg = f"{key}: {int((~same).sum())}/{got.numel()} differ, first at {first}"
    if first is not None:
        msg += f" (got {got[first].item()!r}, want {want[first].item()!r})"
    if nan:
        msg += f"; {nan} never written (NaN)"
    return msg


# --------------------------------------------------------------------------------------------
# Jobs run in the ranks
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SaveJob:
    path: str
    mesh: Mesh
    variant: str


@dataclass(frozen=True)
class CheckJob:
    """On `mesh`: load `src` (saved on a mesh of TP `src_tp`) into this rank's boxes and compare
    with the global reference; with `out` (a resharded copy), also load `out` into the same boxes
    and compare with what torch read from `src` (vocab tensors whose padded size changed: with the
    reference, real rows equal and padding zero)."""
    label: str
    mesh: Mesh
    variant: str
    src: str
    src_tp: int
    out: str | None = None


def _check(job: CheckJob, meshes: RankMeshes) -> list[str]:
    rank = dist.get_rank()
    mesh = job.mesh
    problems: list[str] = []
    same_vocab = padded_vocab(job.src_tp) == padded_vocab(mesh.tp)
    vocab_keys = {k for p in params() if p.vocab for n, _ in p.sections
                  for k in (model_key(n), state_key(n, "exp_avg"), state_key(n, "exp_avg_sq"))}

    # The original: vocab tensors with the source's padded rows (TP-split on the target mesh).
    ref_src = reference_tensors(job.src_tp, job.variant)
    try:
        src_loaded, src_where = load_on_mesh(job.src, mesh, job.variant, meshes, vocab_tp=job.src_tp)
    except BaseException as e:  # CheckpointException is a BaseException
        return [f"rank {rank}: dcp.load of the original raised {type(e).__name__}: {e}"]
    for key, pc in src_where.items():
        m = _mismatch(key, src_loaded[key], _box(ref_src[key], pc))
        if m:
            problems.append(f"rank {rank} [original vs reference] {m}")
    if job.out is None:
        return problems

    ref_out = reference_tensors(mesh.tp, job.variant)
    try:
        out_loaded, out_where = load_on_mesh(job.out, mesh, job.variant, meshes)
    except BaseException as e:
        return problems + [f"rank {rank}: dcp.load of the resharded checkpoint raised {type(e).__name__}: {e}"]
    for key, pc in out_where.items():
        got = out_loaded[key]
        if key in vocab_keys and not same_vocab:
            m = _mismatch(key, got, _box(ref_out[key], pc))
            if m:
                problems.append(f"rank {rank} [resharded vs reference, padded vocab {padded_vocab(mesh.tp)}] "
                                f"box {pc.offsets}+{pc.sizes}: {m}")
        else:
            assert src_where[key] == pc, (key, src_where[key], pc)
            m = _mismatch(key, got, src_loaded[key])
            if m:
                problems.append(f"rank {rank} [resharded vs torch's reshard of the original] "
                                f"box {pc.offsets}+{pc.sizes}: {m}")
    return problems


def worker(rank: int, world: int, port: int, jobs: list, result_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for i, job in enumerate(jobs):
            meshes = RankMeshes(job.mesh)
            if isinstance(job, SaveJob):
                save_training_checkpoint(job.path, job.mesh, job.variant, meshes)
                # Without it torch 2.5's gloo sometimes hung in destroy_process_group right after
                # dcp.save (2 of 15 runs here, 0 of 20 with it).
                dist.barrier()
                continue
            try:
                problems = _check(job, meshes)
            except Exception:
                problems = [f"rank {rank}: {traceback.format_exc()}"]
            Path(result_dir, f"{i}.rank{rank}.json").write_text(json.dumps(problems))
            dist.barrier()
        # Every job of every rank is done (the barriers above): what follows is teardown only.
        Path(result_dir, f"done.rank{rank}").write_text("")
    except BaseException:
        raise RuntimeError(f"rank {rank}/{world} failed:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, jobs: list, result_dir, timeout_s: float = 150.0) -> dict[str, list[str]]:
    """Run `jobs` (all on meshes of `world` ranks) in `world` spawned gloo processes; return the
    problems of each CheckJob by label."""
    for job in jobs:
        assert job.mesh.world == world, (job, world)
        check_mesh(job.mesh)
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(worker, args=(world, free_port(), jobs, str(result_dir)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    done_at = None
    while not ctx.join(timeout=1):
        if done_at is None and all((result_dir / f"done.rank{r}").exists() for r in range(world)):
            done_at = time.monotonic()
        if done_at is not None and time.monotonic() > done_at + 20:
            # Every rank finished its jobs; one is stuck in gloo's teardown (torch 2.5's
            # destroy_process_group hangs now and then after a save, more often on a loaded
            # machine). Its work is complete: stop it rather than fail on it.
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            break
        if done_at is None and time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise AssertionError(f"{world}-rank job did not finish in {timeout_s:.0f}s")
    results = {}
    for i, job in enumerate(jobs):
        if isinstance(job, CheckJob):
            results[job.label] = [m for r in range(world)
                                  for m in json.loads((result_dir / f"{i}.rank{r}.json").read_text())]
    return results


def main(argv: list[str] | None = None) -> None:
    """`save OUT --mesh tp,cp,dp,ep,etp --variant V --results DIR`: a SaveJob run by this
    interpreter's torch (test_reshard.py runs it with torch 2.5); prints torch's version."""
    ap = argparse.ArgumentParser(prog="training_ckpt.py")
    ap.add_argument("command", choices=["save"])
    ap.add_argument("out")
    ap.add_argument("--mesh", required=True, help="tp,cp,dp,ep,etp")
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--results", required=True)
    a = ap.parse_args(argv)
    mesh = Mesh(*map(int, a.mesh.split(",")))
    run_ranks(mesh.world, [SaveJob(a.out, mesh, a.variant)], a.results)
    print(torch.__version__)


if __name__ == "__main__":
    main()
