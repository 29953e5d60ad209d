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
request names (for a factory — the SwiGLU one, GDN's split of `in_proj` / `conv1d` into named
sections —: Megatron-Core's own merge of the expected pieces, e.g. the local `[gate_r; up_r]`).
The expected global tensors come from the HF release through the suite's independent reference
(reference.py: QKV interleaved per query group, GDN's projections in natural order, FP8 / MXFP4
dequantized, vocabulary zero-padded to a multiple of 128 x TP, ...) turned into torch_dist's form
here: fc1 (and its bias) whole as `[gate; up]` whatever the TP, experts' weights and biases under
`mlp.experts.experts.` with an expert axis, decoder layers stacked under `decoder.layers.<sub>`
with a leading layer axis when the family's Megatron config keeps them homogeneous and per layer
(`decoder.layers.<i>.<sub>`) when it does not, MTP layers per layer under `mtp.layers.<k>.`.
Nothing here reads Shardline's tables.

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

`--optimizer` (`Job(optimizer=True)`) also judges the distributed-optimizer state a checkpoint
holds in the `fully_reshardable` form (`optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`,
what `reshard --target torch_dist` writes) by Megatron-Core's own optimizer, not by a hand-built
request: around the model, every process builds Megatron-LM's training setup — Megatron-Core's
DistributedDataParallel with the distributed optimizer and `get_megatron_optimizer` (a
ChainedOptimizer of one DistributedOptimizer for the dense parameters and, at EP > 1, one for the
experts over the expert-data-parallel group) — asks it for
`sharded_state_dict(model_request, is_loading=True, metadata={distrib_optim_sharding_type:
'fully_reshardable', ...})` and loads that together with the model's request (under `optimizer`,
in one `dist_checkpointing.load`, as `load_checkpoint` does). Every optimizer shard is compared
like a model shard: the master (`param`) must be the reference's model tensor in fp32 (the slice
the request names; SwiGLU factories and expert axes as the model's), the moments zero (the
optimizer state of `convert --optimizer-state`, the suite's only source of it for HF families).
Then the optimizer's own `load_state_dict` takes the loaded dict — param groups from the
checkpoint's common state, or the job's own where it has none (a checkpoint written without
groups, which Megatron-LM would not restore) — and the fp32 master and both moments of every
parameter range each rank's optimizer now owns (its data-parallel range of the flattened
parameter) must equal that range of the expected tensor. What it takes on a CPU with
Megatron-Core 0.16.1, none of which touches the checkpoint: CUDA allocations and the CUDA
tensor-type check redirected while the optimizer is built and loaded (`_cpu_optimizer`); one step
on zero gradients first, because torch's AdamW (the inner optimizer without TE / Apex) has no
state before it and the distributed optimizer reads `step` from that state
(`build_optimizer`); torch AdamW's per-parameter `step` kept through the restore, which 0.16.1
copies from the loaded state without being given one (`_keep_torch_adam_step`); and expert
parameters marked expert-parallel at EP > 1 as Transformer Engine's linears mark them (the
local spec's do not).

Spec choices. Where the TE spec fuses a norm into the linear after it, the local spec has a
separate norm, which it requests under its own name (and it renames the MoE pre-MLP norm to
`mlp.linear_fc1.layer_norm_weight` even for MoE layers); each layer is built to request the TE
spec's names instead, the ones Megatron-LM's production (TE) spec saves (`_te_names`: the layer's
own `sharded_state_dict_keys_map`). `--te-extra-state` additionally requests TE's
`core_attention._extra_state` per attention, which a TE-spec job requests and the local spec has
not; use it for checkpoints meant for TE jobs (Shardline's), not for the Megatron-Core-written
fixtures (local spec).

Families and what is, and is not, Megatron-Core's own request. The configs follow what
Megatron-Bridge's provider for the family sets (`transformer_config`). llama-style dense GQA
models and qwen3_moe: Megatron-Core's local layer spec as is. gpt_oss: the local spec as is
(biased linears, learnable softmax offsets = the sinks, TP-sharded by head, sliding window,
quick-GELU GLU whose fc1 and fc1 bias go through the SwiGLU factory); Megatron-Core refuses
biased experts at expert-TP > 1, so it loads at ETP 1. deepseek_v3 (MLA, dense first layers then
MoE with shared experts and a float32 expert bias, MTP): Megatron-Core's own
`get_gpt_decoder_block_spec(use_transformer_engine=False)` and `get_gpt_mtp_block_spec`, as
DeepSeekV3Bridge builds them without TE, with one substitution: 0.16.1's MLA passes
`k_channels`/`v_channels` to its core attention, which the local DotProductAttention rejects, so
the core attention is a DotProductAttention that ignores them (`_mla_local_core_attention`; it
has no checkpoint state). qwen3_next (GDN and gated full attention, MoE with a gated shared
expert): Megatron-Core 0.16.1 builds hybrid GDN blocks only with TE
(`get_transformer_block_with_experimental_attention_variant_spec` asserts it), so the block is
assembled here with that function's structure from Megatron-Core's own pieces on the local
backend: `get_gated_delta_net_module_spec` with ColumnParallelLinear for `in_proj` and a separate
RMSNorm before it, the local MoE, the local GQA spec for the full-attention layers
(`_gdn_layer_spec`, `layer_spec`). Every module, and so every request (keys, TP offsets, GDN's
split factory, `_extra_state` objects, per-layer keys from `linear_attention_freq` /
`hetereogenous_dist_checkpoint`), is Megatron-Core's. To build on a CPU without TE or the
flash-linear-attention kernels, the build (not the load) runs with `torch.cuda.current_device`
returning the CPU, the CUDA RNG tracker's fork a no-op, GDN's `HAVE_FLA` set (its kernels only
run in forward) and MLA's `HAVE_TE` cleared (`_cpu_build`). Not set, because the local torch
norm refuses it: Qwen3-Next's `layernorm_zero_centered_gamma` (arithmetic only; no key or shape).
Position embeddings hold no parameters: gpt-oss's yarn is built as plain RoPE (MLA builds its own
from `rope_type`).

How Shardline's writer plugs in
-------------------------------
Convert the same HF release to `torch_dist`, then load it at meshes other than the written one:

    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/llama --arch llama \
        --tp 1 --te-extra-state --forward
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/llama --arch llama \
        --tp 2 --te-extra-state
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/qwen3_moe --arch qwen3_moe \
        --tp 2 --ep 2 --te-extra-state
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/gpt_oss --tp 2 --etp 1 \
        --te-extra-state
    # a `reshard --target torch_dist` of `convert --optimizer-state`'s output, with its optimizer:
    .venv/bin/python tests/python/megatron_load.py OUT --hf tests/fixtures/hf-tiny/qwen3_moe --tp 1 --ep 2 \
        --te-extra-state --optimizer

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
Families (`ARCHS`): llama-style dense GQA models, qwen3_moe (every layer MoE), deepseek_v3,
qwen3_next and gpt_oss (test_torch_dist_convert.py loads Shardline's conversions of all of them);
others raise NotImplementedError.
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
from mesh import free_port, leave_gloo  # noqa: E402

ARCHS = ("llama", "qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss")
# What Megatron-LM's checkpointing passes as sharded_state_dict metadata without a distributed
# optimizer (`_build_sharded_state_dict_metadata`, brief torch-dist.md §1.3).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# ... and with the distributed optimizer's fully_reshardable state (`--dist-ckpt-optim-fully-reshardable`).
OPTIMIZER_METADATA = dict(CONTENT_METADATA, distrib_optim_sharding_type="fully_reshardable",
                          distrib_optim_fully_reshardable_mem_efficient=False)
# `optimizer.state.<state>.<model key>`: DistributedOptimizer's fully_reshardable keys (`fp32_param`
# is the non-distributed optimizers' name for the master, accepted as `param` on load).
_OPT_STATE = re.compile(r"optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)$")
MOMENTS = ("exp_avg", "exp_avg_sq")
TRACKER = "latest_checkpointed_iteration.txt"


# --------------------------------------------------------------------------------------------
# Expected tensors: HF release -> torch_dist global tensors (independent of Megatron-Core)
# --------------------------------------------------------------------------------------------

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_BLOCK_LAYER = re.compile(r"(decoder\.layers|mtp\.layers)\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"(.*)\.experts\.linear_fc([12])\.(weight|bias)(\d+)(_w|_v)?$")


def _torch_dist_per_layer(sub: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's reference tensors (fsdp_dtensor split form) in torch_dist's form: fc1 whole as
    [gate; up]; experts (weights and biases) stacked on a leading expert axis under
    `experts.experts.`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in sorted(sub):
        t = sub[name]
        m = _EXPERT.fullmatch(name)
        if m:
            base, fc, kind, g, half = m.group(1), m.group(2), m.group(3), int(m.group(4)), m.group(5)
            if half == "_v":
                continue
            if half:
                t = torch.cat([t, sub[f"{base}.experts.linear_fc{fc}.{kind}{g}_v"]], dim=0)
            experts.setdefault(f"{base}.experts.experts.linear_fc{fc}.{kind}", {})[g] = t
        elif name.endswith((".weight_w", ".bias_w")):
            stem = name[: -len("_w")]
            out[stem] = torch.cat([t, sub[stem + "_v"]], dim=0).contiguous()
        elif name.endswith((".weight_v", ".bias_v")):
            continue
        else:
            out[name] = t
    for key, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"{key}: expert indices {sorted(per)} are not 0..E-1")
        out[key] = torch.stack([per[g] for g in range(len(per))]).contiguous()
    return out


def non_homogeneous_layers(hf_dir) -> bool:
    """Whether Megatron-Core stores the decoder per layer (`decoder.layers.<i>.`) rather than
    stacked, by what `transformer_config` sets for the family (TransformerBlock.sharded_state_dict,
    torch-dist.md §2.2): DeepSeek-V3's `moe_layer_freq` is a list (any list makes the block
    non-homogeneous, also one without dense layers), Qwen3-Next sets `linear_attention_freq` and
    `hetereogenous_dist_checkpoint`."""
    return ref.load_config(hf_dir).get("model_type") in ("deepseek_v3", "qwen3_next")


def expected_globals(hf_dir, tp: int, etp: int | None = None) -> dict[str, torch.Tensor]:
    """`{torch_dist key: global tensor}` for the HF release at load TP `tp` (the vocabulary is
    padded for it). Decoder layers are stacked with a leading layer axis, or kept per layer when
    the family's Megatron config makes them non-homogeneous; MTP layers are always per layer.

    `etp` is accepted for symmetry with the loads and not used: every fused fc1 is stored through
    Megatron-Core's SwiGLU factory (whenever `gated_linear_unit`, also gpt-oss's quick-GELU GLU),
    whose global tensor is `[gate; up]` whatever the (expert-)TP, i.e. the reference's ETP=1
    layout (its gpt-oss fc1 is ETP-dependent only in the fsdp_dtensor form)."""
    del etp
    cfg = ref.load_config(hf_dir)
    flat = ref.megatron_state_dict(cfg, ref.load_hf_tensors(hf_dir), tp, 1)
    blocks: dict[str, dict[int, dict[str, torch.Tensor]]] = {"decoder.layers": {}, "mtp.layers": {}}
    out: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        m = _BLOCK_LAYER.fullmatch(k)
        if m:
            blocks[m.group(1)].setdefault(int(m.group(2)), {})[m.group(3)] = t
        elif k.startswith(("vision_model.", "language_model.")):
            raise NotImplementedError(f"{k}: multimodal models are not covered here")
        else:
            out[k] = t
    layers = {i: _torch_dist_per_layer(sub) for i, sub in blocks["decoder.layers"].items()}
    n = cfg["num_hidden_layers"]
    if sorted(layers) != list(range(n)):
        raise ValueError(f"decoder layers {sorted(layers)} are not 0..{n - 1}")
    shapes = {i: {k: (tuple(t.shape), t.dtype) for k, t in sub.items()} for i, sub in layers.items()}
    homogeneous = all(shapes[i] == shapes[0] for i in shapes)
    if non_homogeneous_layers(hf_dir) or not homogeneous:
        # Megatron stores non-homogeneous stacks per layer (brief torch-dist.md §2.2).
        for i, sub in layers.items():
            out.update({f"decoder.layers.{i}.{k}": t for k, t in sub.items()})
    else:
        for k in layers[0]:
            out[f"decoder.layers.{k}"] = torch.stack([layers[i][k] for i in range(n)]).contiguous()
    for k, sub in blocks["mtp.layers"].items():
        out.update({f"mtp.layers.{k}.{name}": t for name, t in _torch_dist_per_layer(sub).items()})
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
    if cfg.get("model_type") in ("qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss"):
        return cfg["model_type"]
    raise NotImplementedError(f"model_type {cfg.get('model_type')!r} (supported: {ARCHS})")


def _rope(cfg) -> dict:
    return cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0),
                                          **(cfg.get("rope_scaling") or {})}


def _linear_attention_pattern(cfg) -> list[int]:
    """Qwen3-Next's layer kinds as Megatron's `linear_attention_freq` list (1 = GDN)."""
    if cfg.get("layer_types"):
        return [1 if t == "linear_attention" else 0 for t in cfg["layer_types"]]
    every = cfg["full_attention_interval"]
    return [0 if (i + 1) % every == 0 else 1 for i in range(cfg["num_hidden_layers"])]


def transformer_config(hf_dir, arch: str, tp: int, ep: int = 1, etp: int | None = None,
                       dtype: torch.dtype = torch.bfloat16):
    """Megatron-Core TransformerConfig of the HF release: what Megatron-Bridge's provider for the
    family sets (its `provider_bridge`) that changes parameters or their layout, bf16 parameters
    allocated on CPU. Fusion and dispatcher settings that need CUDA or Transformer Engine
    (bias_activation_fusion, alltoall, grouped GEMM, permute fusion) are left off: they change no
    key. Per family:

    - deepseek_v3 (DeepSeekV3Bridge): MLATransformerConfig with q/kv LoRA ranks, nope/rope/v
      head dims, `qk_layernorm` (the q/kv latent norms), `moe_layer_freq` = first_k_dense_replace
      dense layers then MoE, shared experts of n_shared_experts x moe_intermediate_size, sigmoid
      routing with the float32 `expert_bias`, and `mtp_num_layers` = num_nextn_predict_layers.
    - qwen3_next (Qwen3NextBridge): `experimental_attention_variant="gated_delta_net"` with
      `linear_attention_freq` (as a list from `layer_types`), the linear-attention dims, gated
      full attention (`attention_output_gate`), q/k norms, MoE with a gated shared expert and
      `hetereogenous_dist_checkpoint`. Not set: `layernorm_zero_centered_gamma` (the local torch
      RMSNorm refuses it; it changes the norms' arithmetic, not their keys or shapes).
    - gpt_oss (GPTOSSBridge): biased linears (`add_bias_linear`, so also router and expert
      biases), learnable softmax offsets (`softmax_type="learnable"`: the attention sinks),
      sliding window on every other layer, the clamped quick-GELU GLU, MoE of intermediate_size.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

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
    moe = dict(
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream at build; keys are the same
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
        moe_router_topk=cfg.get("num_experts_per_tok"),
    )
    config_class = TransformerConfig
    if arch == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise NotImplementedError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step)")
        kw.update(moe, qk_layernorm=True, num_moe_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                  moe_ffn_hidden_size=cfg["moe_intermediate_size"])
    elif arch == "deepseek_v3":
        config_class = MLATransformerConfig
        n, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
        rope = _rope(cfg)
        kw.update(
            moe,
            multi_latent_attention=True,
            qk_layernorm=True,
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_head_dim=cfg["qk_nope_head_dim"],
            qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_type="yarn" if rope.get("rope_type") == "yarn" else "rope",
            rotary_base=float(rope.get("rope_theta", 10000.0)),
            num_moe_experts=cfg["n_routed_experts"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1),
            moe_layer_freq=[0] * dense + [1] * (n - dense),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_pre_softmax=True,
            moe_router_dtype="fp32",
            moe_router_num_groups=cfg.get("n_group"),
            moe_router_group_topk=cfg.get("topk_group"),
            moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor"),
            mtp_num_layers=cfg.get("num_nextn_predict_layers") or None,
        )
    elif arch == "qwen3_next":
        kw.update(
            moe,
            qk_layernorm=True,
            attention_output_gate=True,
            num_moe_experts=cfg["num_experts"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=_linear_attention_pattern(cfg),
            linear_conv_kernel_dim=cfg["linear_conv_kernel_dim"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_num_key_heads=cfg["linear_num_key_heads"],
            linear_num_value_heads=cfg["linear_num_value_heads"],
            hetereogenous_dist_checkpoint=True,
        )
    elif arch == "gpt_oss":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw.update(
            moe,
            add_bias_linear=True,
            add_qkv_bias=False,
            activation_func=quick_gelu,
            activation_func_clamp_value=7.0,
            glu_linear_offset=1.0,
            softmax_type="learnable",
            window_size=(cfg["sliding_window"] - 1, 0),
            window_attn_skip_freq=2,
            num_moe_experts=cfg["num_local_experts"],
            moe_ffn_hidden_size=cfg["intermediate_size"],
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
        )
    if ep != 1 and not kw.get("num_moe_experts"):
        raise ValueError(f"--ep {ep} given for a model without experts")
    return config_class(**kw)


def _te_names(spec):
    """A TransformerLayer spec of Megatron-Core's local backend whose checkpoint keys are the
    Transformer-Engine spec's, the names Megatron-LM's production jobs save (and Shardline
    writes): the TE spec fuses a norm into the linear after it (`<linear>.layer_norm_weight`)
    where the local spec has a separate norm module. Renamed through the layer's own
    `sharded_state_dict_keys_map`, as the local spec already does for dense GQA layers:

    - GQA attention: `input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`;
      GDN: -> `self_attention.in_proj.layer_norm_`; MLA keeps its `input_layernorm`, and its
      latent norms `q_layernorm.` / `kv_layernorm.` -> `linear_q_up_proj.layer_norm_` /
      `linear_kv_up_proj.layer_norm_`.
    - Dense MLP: `pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`; MoE layers keep
      `pre_mlp_layernorm` (the TE spec has a separate norm there too)."""
    from dataclasses import replace

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    sub = spec.submodules
    attention, mlp = sub.self_attention.module, sub.mlp.module
    keys = {}
    if attention is MLASelfAttention:
        keys["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
    elif attention is GatedDeltaNet:
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    else:
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if not issubclass(mlp, MoELayer):
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return replace(spec, submodules=replace(sub, sharded_state_dict_keys_map=keys))


def _gdn_layer_spec(config):
    """A Qwen3-Next GDN layer on Megatron-Core's local backend. Megatron-Core 0.16.1 builds
    hybrid GDN blocks only for Transformer Engine
    (`get_transformer_block_with_experimental_attention_variant_spec` asserts
    `transformer_impl == "transformer_engine"`), so this is that function's GDN layer with the
    local modules in place of TE's: Megatron-Core's own `get_gated_delta_net_module_spec` with a
    local backend whose fused norm-linear is a plain ColumnParallelLinear, a separate RMSNorm in
    front (TE fuses it into `in_proj`; renamed to its key by `_te_names`), the local MoE."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    class Local(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return ColumnParallelLinear

    backend = Local()
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=get_gated_delta_net_module_spec(config, backend=backend),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_moe_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts,
                                                moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _mla_local_core_attention(spec):
    """The one change Megatron-Core 0.16.1's local MLA spec needs to be built at all:
    MLASelfAttention passes `k_channels` / `v_channels` to its core attention, which the local
    DotProductAttention does not accept (TypeError; only TEDotProductAttention does). The core
    attention is swapped for a DotProductAttention that takes and ignores them; it holds no
    parameter (vanilla softmax) and requests nothing from the checkpoint, so the request is
    unchanged (the TE spec's core_attention `_extra_state` is added by `--te-extra-state`)."""
    from dataclasses import replace

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    attention = spec.submodules.self_attention
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=MLADotProductAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


def layer_spec(config):
    """The decoder's spec on Megatron-Core's local backend, with the TE spec's checkpoint names
    (`_te_names`): one layer spec for homogeneous models; for DeepSeek-V3 Megatron-Core's own
    `get_gpt_decoder_block_spec(use_transformer_engine=False)` (what DeepSeekV3Bridge builds
    without TE: dense and MoE MLA layers by `moe_layer_freq`); for Qwen3-Next a block of GDN
    layers (`_gdn_layer_spec`) and gated full-attention layers (the local GQA spec) by
    `linear_attention_freq`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if config.multi_latent_attention:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        block.layer_specs = [_te_names(_mla_local_core_attention(s)) for s in block.layer_specs]
        return block
    spec = _te_names(get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                              qk_layernorm=config.qk_layernorm, normalization="RMSNorm"))
    if config.experimental_attention_variant == "gated_delta_net":
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        gdn = _te_names(_gdn_layer_spec(config))
        specs = [gdn if linear else spec for linear in config.linear_attention_freq]
        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=spec.submodules.input_layernorm)
    return spec


class _cpu_build:
    """Megatron-Core 0.16.1 allocates a few parameters and buffers on `torch.cuda.current_device()`
    even with `use_cpu_initialization` (GatedDeltaNet's conv1d / dt_bias / A_log, the learnable
    softmax offset of DotProductAttention, the router's expert_bias), GatedDeltaNet initialises
    them under the CUDA RNG tracker, and GatedDeltaNet's constructor refuses to run without the
    flash-linear-attention kernels (`HAVE_FLA`), which only its forward uses; and
    multi_latent_attention.py believes Transformer Engine present (`HAVE_TE`: its import of
    Megatron-Core's TE extension succeeds, with mock classes, when TE is absent), so MLA's
    constructor calls `isinstance(linear_proj, TELinear)` with a mock and raises TypeError (the
    guarded branch is FP8/FP4-only). For the build only: the current device is the CPU, the
    tracker's fork is a no-op, `HAVE_FLA` is set and MLA's `HAVE_TE` cleared."""

    def __enter__(self):
        import contextlib

        import megatron.core.ssm.gated_delta_net as gdn
        import megatron.core.transformer.multi_latent_attention as mla
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.gdn, self.mla = gdn, mla
        self.tracker = get_cuda_rng_tracker()
        self.saved = (torch.cuda.current_device, self.tracker.__dict__.get("fork"), gdn.HAVE_FLA, mla.HAVE_TE)
        torch.cuda.current_device = lambda: "cpu"
        self.tracker.fork = lambda *a, **k: contextlib.nullcontext()
        gdn.HAVE_FLA, mla.HAVE_TE = True, False
        return self

    def __exit__(self, *exc):
        torch.cuda.current_device, fork, self.gdn.HAVE_FLA, self.mla.HAVE_TE = self.saved
        if fork is None:
            del self.tracker.fork
        else:
            self.tracker.fork = fork


def build_model(hf_dir, arch: str, tp: int, ep: int = 1, etp: int | None = None,
                dtype: torch.dtype = torch.bfloat16):
    """The GPTModel of the release at (tp, ep), bf16; model parallel state must be initialised.
    Models with MTP layers get Megatron-Core's own `get_gpt_mtp_block_spec` (local backend) over
    the decoder's last layer spec, as the GPT providers build it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    cfg = ref.load_config(hf_dir)
    config = transformer_config(hf_dir, arch, tp, ep, etp, dtype)
    spec = layer_spec(config)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    rope = _rope(cfg)
    with _cpu_build():
        model = GPTModel(
            config, spec,
            vocab_size=ref.padded_vocab_size(cfg["vocab_size"], tp),
            max_sequence_length=cfg.get("max_position_embeddings", 4096),
            position_embedding_type="rope",
            rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
            rotary_base=int(rope.get("rope_theta", 10000)),
            share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
            mtp_block_spec=mtp,
        )
    # Megatron-LM wraps a bf16 model in Float16Module, which casts every parameter (the torch
    # norms of the local spec are created in fp32) to bf16; the keys are unchanged. The router's
    # expert_bias goes back to float32 when its state is taken (`_maintain_float32_expert_bias`).
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
# Megatron-Core's distributed optimizer on CPU (the fully_reshardable optimizer state)
# --------------------------------------------------------------------------------------------

class _cpu_optimizer:
    """Megatron-Core 0.16.1's DDP and distributed optimizer assume CUDA in three places that do
    not touch the checkpoint: the param/grad buffers and `load_state_dict`'s placeholder state
    are allocated on `torch.cuda.current_device()`, the mixed-precision optimizer's unity loss
    scale on `'cuda'`, and `_build_model_and_main_param_groups` takes a parameter only if
    `param.type()` names a CUDA type ('torch.cuda.BFloat16Tensor', ...). While the optimizer is
    built, asked for its sharded state dict and given the loaded one: the current device is the
    CPU, `torch.tensor(..., device='cuda')` makes a CPU tensor, and `Tensor.type()` without
    arguments names a CPU tensor's type by its CUDA counterpart."""

    def __enter__(self):
        real_type, real_tensor = torch.Tensor.type, torch.tensor
        self.saved = (torch.cuda.current_device, real_type, real_tensor)

        def cuda_type(t, *args, **kwargs):
            name = real_type(t, *args, **kwargs)
            if args or kwargs or not name.startswith("torch.") or name.startswith("torch.cuda."):
                return name
            return "torch.cuda." + name[len("torch."):]

        def tensor(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return real_tensor(*args, **kwargs)

        torch.cuda.current_device = lambda: "cpu"
        torch.Tensor.type = cuda_type
        torch.tensor = tensor
        return self

    def __exit__(self, *exc):
        torch.cuda.current_device, torch.Tensor.type, torch.tensor = self.saved


def sub_optimizers(opt) -> list:
    return list(getattr(opt, "chained_optimizers", None) or [opt])


def build_optimizer(model, ep: int = 1):
    """Megatron-LM's training setup around `model`: Megatron-Core's DistributedDataParallel with
    the distributed optimizer and `get_megatron_optimizer` (Adam, bf16, fp32 masters,
    `use_distributed_optimizer`), i.e. a ChainedOptimizer over one DistributedOptimizer for the
    dense parameters (over the data-parallel group) and, when the experts are expert-parallel,
    one for the experts (over the expert-data-parallel group). Returns the optimizer.

    Expert parameters are marked the way Transformer Engine's expert linears mark them
    (`allreduce = not expert_parallel`, expert_parallel being EP > 1: TELinear,
    TEGroupedLinear), which decides the dense / expert split; the local spec's linears mark
    nothing, which would keep the experts with the dense parameters at any EP.

    Without TE or Apex the inner optimizer is torch's AdamW, which has no state before its first
    step, and DistributedOptimizer.state_dict() (so also its sharded_state_dict) reads `step`
    from that state (TE's FusedAdam keeps it in the param groups): every sub-optimizer first
    takes Megatron-Core's own `_init_optimizer_states_with_dummy_values` (one step on zero
    gradients), whose values the load replaces."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    for name, param in model.named_parameters():
        if ".experts." in name:
            param.allreduce = not ep > 1
    with _cpu_optimizer():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                                     params_dtype=torch.bfloat16,
                                                     use_distributed_optimizer=True), [ddp])
        for sub in sub_optimizers(opt):
            sub._init_optimizer_states_with_dummy_values()
    return opt


def optimizer_request(opt, model_sd: dict) -> dict:
    """The optimizer part of Megatron-LM's load request: Megatron-Core's own
    `optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=True, metadata=...)` for
    the fully_reshardable type (what `load_checkpoint` asks for when the checkpoint's content
    metadata names it): per parameter `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`,
    the model request `replace`d with that key and fp32 data of the parameter's local shape
    (SwiGLU factories included), under `param_state`, next to the optimizer's own non-sharded
    state (`optimizer.param_groups`, `param_state_sharding_type`); `{0: dense, 1: experts}`
    for a ChainedOptimizer of two."""
    with _cpu_optimizer():
        return opt.sharded_state_dict(model_sd, is_loading=True, metadata=dict(OPTIMIZER_METADATA))


def _without_param_state(tree):
    """The non-sharded part of a loaded optimizer state dict (what the common state gave)."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _without_param_state(v) for k, v in tree.items() if k != "param_state"}
    return {k: v for k, v in out.items() if v != {}}


class _keep_torch_adam_step:
    """Megatron-Core 0.16.1's `_set_main_param_and_optimizer_states` copies every entry of the
    inner optimizer's per-parameter state from the loaded tensors, and torch's AdamW (the inner
    optimizer without TE or Apex) keeps a `step` there, which
    `load_parameter_state_from_fully_reshardable` does not pass (the step lives in the param
    groups; TE's FusedAdam has no per-parameter step): KeyError. During the restore each
    parameter's step is passed through unchanged."""

    def __init__(self, opt):
        self.subs = sub_optimizers(opt)

    def __enter__(self):
        for sub in self.subs:
            def set_states(model_param, tensors, sub=sub, original=sub._set_main_param_and_optimizer_states):
                group, order = sub.model_param_group_index_map[model_param]
                state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
                if "step" in state and "step" not in tensors:
                    tensors = {**tensors, "step": state["step"]}
                return original(model_param, tensors)
            sub._set_main_param_and_optimizer_states = set_states
        return self

    def __exit__(self, *exc):
        for sub in self.subs:
            del sub._set_main_param_and_optimizer_states


def restore_optimizer(opt, request: dict, loaded: dict) -> tuple[str, list[str]]:
    """`optimizer.load_state_dict(loaded)`, as Megatron-LM's `load_checkpoint` does after the
    load: the distributed optimizer matches the checkpoint's param groups to its own by their
    settings, then flattens each loaded parameter state and keeps its data-parallel range
    (`load_parameter_state_from_fully_reshardable`). The param groups come from the checkpoint's
    common state (`optimizer` in common.pt); a checkpoint without one (written with
    `no_save_optim`: Megatron-LM would not load its optimizer) gets the job's own, the request's
    non-sharded part. Returns where the groups came from and the problems."""
    from_checkpoint = bool(_without_param_state(loaded))
    if not from_checkpoint:
        subs = sorted(k for k in request if isinstance(k, int))
        pairs = [(request[i], loaded.setdefault(i, {})) for i in subs] if subs else [(request, loaded)]
        for req, got in pairs:
            got.update({k: v for k, v in req.items() if k != "param_state"})
    try:
        with _cpu_optimizer(), _keep_torch_adam_step(opt):
            opt.load_state_dict(loaded)
    except Exception as e:
        return "checkpoint" if from_checkpoint else "job", [
            f"optimizer.load_state_dict failed: {type(e).__name__}: {e}"[:2000]]
    return "checkpoint" if from_checkpoint else "job", []


def check_optimizer_state(opt, expected: dict, kinds: dict) -> tuple[int, list[str]]:
    """After `restore_optimizer`: for every parameter range this rank's distributed optimizers
    own, the fp32 master and both moments the optimizer now holds
    (`_get_main_param_and_optimizer_states`) equal that range of the expected local tensor,
    flattened (`expected`, `kinds`: by request path, as check_load builds them). Parameters are
    numbered as `sharded_param_state_fully_reshardable` numbers them (buffers in order, each
    buffer's `param_index_map`), the order its load counterpart relies on."""
    from collections import ChainMap

    from harness import describe_mismatch

    subs = sub_optimizers(opt)
    problems: list[str] = []
    checked = 0
    for i, sub in enumerate(subs):
        base = ("optimizer", i, "param_state") if len(subs) > 1 else ("optimizer", "param_state")
        idx = -1
        for gbuf_idx, range_maps in enumerate(sub.gbuf_ranges):
            for buckets in range_maps.values():
                owned = ChainMap(*(b["param_map"] for b in buckets))
                for param in sub.buffers[gbuf_idx].param_index_map:
                    idx += 1
                    if param not in owned:
                        continue
                    r = owned[param]["param"]
                    state = sub._get_main_param_and_optimizer_states(param)
                    for name in ("param",) + MOMENTS:
                        path = base + (idx, name)
                        want = expected.get(path)
                        if want is None:
                            continue  # not expected (reported when the expectation was built)
                        want = want.flatten()[r.start:r.end]
                        kind = kinds[path]
                        key = kind[0].key if isinstance(kind, tuple) else kind.key
                        label = (f"{key} (in DistributedOptimizer {i} after load_state_dict: elements "
                                 f"{r.start}:{r.end} of the flattened local parameter)")
                        got = state.get(name)
                        checked += 1
                        if not isinstance(got, torch.Tensor):
                            problems.append(f"{label}: the optimizer holds no {name!r}")
                        elif not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
                            problems.append(describe_mismatch(label, got, want))
    return checked, problems


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
    """`layer 1, expert 3, offsets (1, 48, 0)` for a ShardedTensor or ShardedObject request: the
    prepended axes are the layer axis of a stacked key (`…layers.<sub>`, no index) and the expert
    axis of `experts.experts.` keys, in that order."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    off = tuple(st.global_offset)
    if isinstance(st, ShardedObject):
        return f"object offsets {off}"
    axes = []
    if re.search(r"layers\.(?!\d)", st.key):
        axes.append("layer")
    if "experts.experts." in st.key:
        axes.append("expert")
    parts = [f"{name} {o}" for name, o in zip(axes[: st.prepend_axis_num], off)]
    parts.append(f"offsets {off} of {tuple(st.global_shape)}")
    return ", ".join(parts)


class _Expectation:
    def __init__(self, globals_: dict[str, torch.Tensor], problems: list[str]):
        self.globals = globals_
        self.problems = problems
        self.used: set[str] = set()

    def local(self, st) -> torch.Tensor | None:
        """The slice of the expected global tensor that request `st` names, in its dtype. An
        optimizer request `optimizer.state.<state>.<model key>` expects the model tensor for the
        master (`param`, or `fp32_param`) and zeros for the moments: the optimizer state the
        suite's sources carry is `convert --optimizer-state`'s (the release's weights, zero
        moments)."""
        opt = _OPT_STATE.fullmatch(st.key)
        key = opt.group(2) if opt else st.key
        want = self.globals.get(key)
        if want is None:
            self.problems.append(f"{st.key}: requested by Megatron-Core ({_where(st)}) but the "
                                 f"reference has no such tensor")
            return None
        self.used.add(key)
        if tuple(want.shape) != tuple(st.global_shape):
            self.problems.append(f"{st.key}: Megatron-Core requests global shape {tuple(st.global_shape)}, "
                                 f"the reference has {tuple(want.shape)}")
            return None
        if opt and opt.group(1) in MOMENTS:
            return torch.zeros(st.local_shape, dtype=st.dtype)
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
    factories_checked: int = 0        # factory requests (SwiGLU, GDN split) compared, over all ranks
    objects_loaded: int = 0           # ShardedObject requests loaded, over all ranks
    keys: dict = field(default_factory=dict)   # torch_dist key -> [global shape, on-disk dtype]
    extra_keys: list = field(default_factory=list)  # stored, not requested
    common: dict = field(default_factory=dict)
    forward_checked: int = 0          # ranks whose loaded model's logits were compared with HF's
    optimizer_shards_checked: int = 0  # of the tensors and factories: optimizer.state.* requests
    optimizer_states_checked: int = 0  # (param | exp_avg | exp_avg_sq) ranges held by the restored optimizers
    optimizer_param_groups: str | None = None  # "checkpoint" | "job" (the common state had none)
    optimizer_count: int = 0          # DistributedOptimizers in the job's ChainedOptimizer (2: dense, experts)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return (f"tp={self.tp} ep={self.ep} etp={self.etp} on {self.world} gloo processes: "
                f"{len(self.keys)} keys requested; {self.tensors_checked} tensor shards, "
                f"{self.factories_checked} factory shards (SwiGLU / GDN split), "
                f"{self.objects_loaded} extra-state objects "
                f"loaded" + (f"; logits equal HF's on {self.forward_checked} ranks" if self.forward_checked else "")
                + (f"; of them {self.optimizer_shards_checked} optimizer shards, then "
                   f"{self.optimizer_states_checked} master / moment ranges in the restored distributed "
                   f"optimizers (param groups from the {self.optimizer_param_groups})"
                   if self.optimizer_shards_checked else "")
                + f"; {len(self.problems)} problems")


def _stored_metadata(ckpt_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt_dir)).read_metadata()


def _te_extra_state_requests(sd: dict) -> None:
    """The `_extra_state` ShardedObjects a TE-spec model requests and the local spec has not:
    TEDotProductAttention's, one per attention that has a `linear_proj` (GQA and MLA, in the
    decoder and in MTP layers; GDN has none). Each is its attention's `linear_proj._extra_state`
    request (which the local linear makes, `make_sharded_object_for_checkpoint` with the layer
    offset when stacked) with the module name changed: same layer axis, offsets and replica."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    linear, core = "self_attention.linear_proj._extra_state", "self_attention.core_attention._extra_state"
    for name, leaf in list(sd.items()):
        if isinstance(leaf, ShardedObject) and leaf.key.endswith(linear) and name.endswith(linear):
            sd[name[: -len(linear)] + core] = replace(leaf, key=leaf.key[: -len(linear)] + core, data=None)


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
               te_extra_state: bool = False, forward: bool = False, optimizer: bool = False) -> dict:
    """On every rank of an initialised gloo world: build the model at (tp, ep, etp) (with
    `optimizer`, also Megatron-Core's distributed optimizer around it, whose fully_reshardable
    request joins the model's under `optimizer`, as Megatron-LM's load_checkpoint asks), load
    the checkpoint with Megatron-Core, compare; with `optimizer`, then restore the optimizer from
    what was loaded and compare what it holds. Returns this rank's partial report (a dict)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import (
        ShardedBase, ShardedObject, ShardedTensor, ShardedTensorFactory,
    )

    init_model_parallel(tp, ep, etp)
    model = build_model(hf_dir, arch, tp, ep, etp)
    opt = build_optimizer(model, ep) if optimizer else None
    sd = sharded_request(model)
    if te_extra_state:
        _te_extra_state_requests(sd)
    request = dict(sd)
    if opt is not None:
        request["optimizer"] = optimizer_request(opt, sd)
    # The sharded requests (the optimizer's also holds its own plain state: param groups, ...).
    sharded = [(path, leaf) for path, leaf in _leaves(request) if isinstance(leaf, ShardedBase)]
    problems: list[str] = []
    expect = _Expectation(expected_globals(hf_dir, tp, etp), problems)

    # Expected local values, computed before the load (the load fills the request tensors).
    expected: dict[tuple, object] = {}
    kinds: dict[tuple, object] = {}
    for path, leaf in sharded:
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
        for path, leaf in sharded:
            if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and leaf.data.is_floating_point():
                leaf.data.fill_(float("nan"))

    requested = {}
    for path, leaf in sharded:
        pieces = kinds[path][1] if isinstance(kinds[path], tuple) else [leaf]
        for st in pieces:
            if isinstance(st, ShardedTensor):
                requested[st.key] = [list(st.global_shape), str(st.dtype).replace("torch.", "")]
            elif isinstance(st, ShardedObject):
                requested[st.key + "/object"] = [list(st.global_shape), "object"]

    tensors = factories = objects = optimizer_shards = optimizer_states = 0
    optimizer_groups = None
    common: dict = {}
    try:
        loaded = dist_checkpointing.load(request, str(ckpt_dir))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        problems.append(f"Megatron-Core dist_checkpointing.load failed: {_describe_load_error(e)}"[:4000])
        loaded = None

    if loaded is not None:
        from harness import describe_mismatch

        for path, leaf in sharded:
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
                kind = "SwiGLU factory" if len({st.key for st in pieces}) == 1 else "split factory"
                label = f"{fac.key} ({kind}, " + "; ".join(_where(st) for st in pieces) + ")"
            else:
                tensors += 1
                label = f"{leaf.key} ({_where(leaf)})"
            optimizer_shards += path[0] == "optimizer"
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
        if opt is not None:
            common["optimizer"] = _without_param_state(loaded.get("optimizer", {}))
            sharding = (loaded.get("content_metadata") or {}).get("distrib_optim_sharding_type")
            if sharding not in (None, "fully_reshardable"):
                problems.append(f"content_metadata: distrib_optim_sharding_type is {sharding!r}: Megatron-LM "
                                f"would request that layout, not the fully_reshardable one loaded here")
            optimizer_groups, restore_problems = restore_optimizer(opt, request["optimizer"],
                                                                   loaded.setdefault("optimizer", {}))
            problems += restore_problems
            if not restore_problems:
                optimizer_states, state_problems = check_optimizer_state(opt, expected, kinds)
                problems += state_problems

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
                requested=requested, common=common, forward=forward_done, optimizer_shards=optimizer_shards,
                optimizer_states=optimizer_states, optimizer_groups=optimizer_groups,
                optimizer_count=len(sub_optimizers(opt)) if opt is not None else 0)


def _finish_report(ckpt_dir: Path, hf_dir, tp: int, ep: int, etp: int, world: int, parts: list[dict]) -> LoadReport:
    rep = LoadReport(tp=tp, ep=ep, etp=etp, world=world)
    requested: dict = {}
    for rank, part in enumerate(parts):
        rep.problems += [f"[rank {rank}] {p}" for p in part["problems"]]
        rep.tensors_checked += part["tensors"]
        rep.factories_checked += part["factories"]
        rep.objects_loaded += part["objects"]
        rep.forward_checked += bool(part.get("forward"))
        rep.optimizer_shards_checked += part.get("optimizer_shards", 0)
        rep.optimizer_states_checked += part.get("optimizer_states", 0)
        rep.optimizer_param_groups = rep.optimizer_param_groups or part.get("optimizer_groups")
        rep.optimizer_count = max(rep.optimizer_count, part.get("optimizer_count", 0))
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
    optimizer: bool = False


def _worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    quiet_megatron()
    init_gloo(rank, world, port)
    try:
        results = []
        for ckpt_dir, hf_dir, arch, tp, ep, etp, te, fwd, opt in jobs:
            results.append(check_load(Path(ckpt_dir), hf_dir, arch, tp, ep, etp, te, fwd, opt))
        with open(Path(out_dir) / f"rank{rank}.json", "w") as f:
            json.dump(results, f, default=str)
        torch.distributed.barrier()
    finally:
        leave_gloo()


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
                         bool(j.te_extra_state), bool(j.forward), bool(j.optimizer)))
    world = max(world_size_for(tp, ep, etp) for _, _, _, tp, ep, etp, *_ in resolved)
    for _, _, _, tp, ep, etp, *_ in resolved:
        if world % tp or world % (ep * etp):
            raise ValueError(f"mesh tp={tp} ep={ep} etp={etp} does not divide the world size {world}")
    with tempfile.TemporaryDirectory(prefix="megatron_load.") as out:
        mp.spawn(_worker, args=(world, free_port(), resolved, out), nprocs=world, join=True)
        parts = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
    return [_finish_report(Path(ckpt), hf, tp, ep, etp, world, [p[i] for p in parts])
            for i, (ckpt, hf, _, tp, ep, etp, *_) in enumerate(resolved)]


def run(ckpt, hf_dir, arch: str | None = None, meshes=((1, 1, None),), te_extra_state: bool = False,
        forward: bool = False, optimizer: bool = False) -> list[LoadReport]:
    """Load `ckpt` once per mesh `(tp, ep, etp)` (etp None = tp); one report per mesh."""
    return run_jobs([Job(str(ckpt), str(hf_dir), arch, tp, ep, etp, te_extra_state, forward, optimizer)
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
    p.add_argument("--optimizer", action="store_true",
                   help="also load the fully_reshardable distributed-optimizer state with Megatron-Core's "
                        "DistributedOptimizer and check it (the master = the release's weights, zero moments)")
    p.add_argument("--json", type=Path, help="write the reports (keys, shapes, problems) here")
    p.add_argument("-v", "--verbose", action="store_true", help="print the requested keys and shapes")
    a = p.parse_args(argv)
    try:
        reports = run(a.ckpt, a.hf, a.arch, [(a.tp, a.ep, a.etp)], a.te_extra_state, a.forward, a.optimizer)
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
