"""Independent reference mapping: HuggingFace safetensors -> Megatron `fsdp_dtensor` state dict.

Written from the project brief (mappings.md, layouts.md §2), in torch, without looking at the
converter. `reference_state_dict(hf_dir, tp)` returns `{"model.module.<megatron name>": tensor}`
holding the *global* (TP-, CP-, EP- and FSDP-invariant) tensors a Megatron-FSDP job with the
Transformer-Engine layer spec and grouped experts would save.

Layer handling is driven by which HF tensors exist, so one code path covers
llama / mistral / qwen2 / qwen3 (dense), qwen3_moe / mixtral (MoE), qwen3_next (GDN + gated
attention + MoE + shared expert), and from archs-2025.md §3.1/§3.3/§5 deepseek_v3 / kimi_k2 (MLA,
dense first layers, shared experts, float32 expert bias, MTP layers after the decoder) and glm4_moe;
qwen3_vl_moe (archs-2025.md §3.5; its vision tower as Megatron-Bridge 067f987d's
models/qwen_vl/qwen3_vl_bridge.py maps it) and multimodal qwen3_5 / qwen3_5_moe (Megatron-Bridge
067f987d, models/qwen_vl/qwen35_vl_bridge.py) with their vision towers.
Every HF tensor must be consumed exactly once; an unknown key raises, so the reference never
silently drops a weight.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

DEFAULT_PREFIX = "model.module."
VOCAB_DIVISOR = 128  # Megatron's --make-vocab-size-divisible-by default


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def load_config(hf_dir) -> dict:
    with open(Path(hf_dir) / "config.json") as f:
        cfg = json.load(f)
    # Multimodal releases nest the language model's config.
    return cfg.get("text_config", cfg) | {"_root": cfg}


def load_hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"{key} appears in more than one file of {hf_dir}")
                tensors[key] = f.get_tensor(key)
    return tensors


# --------------------------------------------------------------------------------------------
# Fused layouts (layouts.md §2)
# --------------------------------------------------------------------------------------------

def interleave_qkv(q, k, v, num_heads: int, num_groups: int, head_dim: int, gated: bool = False):
    """Megatron `linear_qkv` (weight [rows, H] or bias [rows]) from HF q/k/v (layouts.md §2.1).

    Per query group g: its hpg q heads, then (gated only) their hpg gate heads, then k_g, then v_g.
    For gated attention HF q_proj holds, per head h, `[q_h (d rows); gate_h (d rows)]`.
    """
    if num_heads % num_groups:
        raise ValueError(f"num_heads {num_heads} not divisible by num_query_groups {num_groups}")
    hpg = num_heads // num_groups
    d = head_dim
    rest = tuple(q.shape[1:])
    q_rows = num_heads * d * (2 if gated else 1)
    if q.shape[0] != q_rows:
        raise ValueError(f"q has {q.shape[0]} rows, expected {q_rows} (gated={gated})")
    if k.shape[0] != num_groups * d or v.shape[0] != num_groups * d:
        raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} rows, expected {num_groups * d}")

    if gated:
        per_head = q.reshape(num_heads, 2, d, *rest)
        q_heads, gate_heads = per_head[:, 0], per_head[:, 1]
    else:
        q_heads, gate_heads = q.reshape(num_heads, d, *rest), None
    k_heads = k.reshape(num_groups, d, *rest)
    v_heads = v.reshape(num_groups, d, *rest)

    parts = []
    for g in range(num_groups):
        heads = slice(g * hpg, (g + 1) * hpg)
        parts.append(q_heads[heads].reshape(hpg * d, *rest))
        if gated:
            parts.append(gate_heads[heads].reshape(hpg * d, *rest))
        parts.append(k_heads[g])
        parts.append(v_heads[g])
    return torch.cat(parts, dim=0).contiguous()


def split_gdn_qkvz_ba(qkvz, ba, nk: int, nv: int, dk: int, dv: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next head-grouped in_proj_qkvz / in_proj_ba -> natural-order components (§2.3).

    Per key head h: qkvz rows `[q_h (dk) | k_h (dk) | v (m·dv) | z (m·dv)]`, ba rows `[b (m) | a (m)]`,
    with m = nv / nk value heads per key head.
    """
    if nv % nk:
        raise ValueError(f"linear_num_value_heads {nv} not divisible by linear_num_key_heads {nk}")
    m = nv // nk
    group = 2 * dk + 2 * m * dv
    hidden = qkvz.shape[1]
    if qkvz.shape[0] != nk * group:
        raise ValueError(f"in_proj_qkvz has {qkvz.shape[0]} rows, expected {nk * group}")
    if ba.shape[0] != 2 * nv:
        raise ValueError(f"in_proj_ba has {ba.shape[0]} rows, expected {2 * nv}")
    g = qkvz.reshape(nk, group, hidden)
    b_a = ba.reshape(nk, 2 * m, hidden)
    o_k, o_v, o_z = dk, 2 * dk, 2 * dk + m * dv
    return {
        "query": g[:, 0:o_k].reshape(nk * dk, hidden).contiguous(),
        "key": g[:, o_k:o_v].reshape(nk * dk, hidden).contiguous(),
        "value": g[:, o_v:o_z].reshape(nv * dv, hidden).contiguous(),
        "z": g[:, o_z:].reshape(nv * dv, hidden).contiguous(),
        "beta": b_a[:, 0:m].reshape(nv, hidden).contiguous(),
        "alpha": b_a[:, m:].reshape(nv, hidden).contiguous(),
    }


def split_rows(t, sizes: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    if t.shape[0] != sum(sizes):
        raise ValueError(f"tensor of {t.shape[0]} rows cannot be split as {sizes}")
    return {n: p.contiguous() for n, p in zip(names, torch.split(t, sizes, dim=0))}


def pad_vocab(t, tp: int, divisor: int = VOCAB_DIVISOR):
    """Zero-pad dim 0 to a multiple of divisor·tp (Megatron's padded vocab)."""
    multiple = divisor * tp
    rows = t.shape[0]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return t.contiguous()
    out = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    out[:rows] = t
    return out


def padded_vocab_size(vocab: int, tp: int, divisor: int = VOCAB_DIVISOR) -> int:
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Model mapping
# --------------------------------------------------------------------------------------------

class _Source:
    """HF tensors with consumption tracking: every tensor must be used exactly once."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"HF checkpoint has no {key}")
        if key in self.used:
            raise KeyError(f"{key} consumed twice")
        self.used.add(key)
        return self.tensors[key]

    def skip(self, key: str) -> None:
        self.used.add(key)

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)


def _layer_indices(tensors, root: str) -> list[int]:
    pat = re.compile(re.escape(root) + r"\.layers\.(\d+)\.")
    return sorted({int(m.group(1)) for k in tensors if (m := pat.match(k))})


def _expert_indices(tensors, base: str) -> list[int]:
    pat = re.compile(re.escape(base) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for k in tensors if (m := pat.match(k))})


def _head_dim(cfg) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _map_attention(src: _Source, cfg, hf: str, mg: str, out: dict) -> None:
    nh = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    d = _head_dim(cfg)
    a = f"{hf}.self_attn"
    q = src.take(f"{a}.q_proj.weight")
    gated = q.shape[0] == 2 * nh * d  # qwen3_next / qwen3.5 full attention: output gate in q_proj
    out[f"{mg}.self_attention.linear_qkv.weight"] = interleave_qkv(
        q, src.take(f"{a}.k_proj.weight"), src.take(f"{a}.v_proj.weight"), nh, ng, d, gated)
    if src.has(f"{a}.q_proj.bias"):  # qwen2
        out[f"{mg}.self_attention.linear_qkv.bias"] = interleave_qkv(
            src.take(f"{a}.q_proj.bias"), src.take(f"{a}.k_proj.bias"), src.take(f"{a}.v_proj.bias"),
            nh, ng, d, gated)
    out[f"{mg}.self_attention.linear_proj.weight"] = src.take(f"{a}.o_proj.weight")
    if src.has(f"{a}.q_norm.weight"):  # qwen3 family
        out[f"{mg}.self_attention.q_layernorm.weight"] = src.take(f"{a}.q_norm.weight")
        out[f"{mg}.self_attention.k_layernorm.weight"] = src.take(f"{a}.k_norm.weight")
    out[f"{mg}.self_attention.linear_qkv.layer_norm_weight"] = src.take(f"{hf}.input_layernorm.weight")


def _map_gdn(src: _Source, cfg, hf: str, mg: str, out: dict) -> None:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qk, v = nk * dk, nv * dv
    la = f"{hf}.linear_attn"
    sa = f"{mg}.self_attention"
    if src.has(f"{la}.in_proj_qkvz.weight"):  # qwen3_next: head-grouped
        parts = split_gdn_qkvz_ba(src.take(f"{la}.in_proj_qkvz.weight"), src.take(f"{la}.in_proj_ba.weight"),
                                  nk, nv, dk, dv)
    else:  # qwen3.5: already flat
        parts = split_rows(src.take(f"{la}.in_proj_qkv.weight"), [qk, qk, v], ["query", "key", "value"])
        parts["z"] = src.take(f"{la}.in_proj_z.weight")
        parts["beta"] = src.take(f"{la}.in_proj_b.weight")
        parts["alpha"] = src.take(f"{la}.in_proj_a.weight")
    for name in ("query", "key", "value", "z", "beta", "alpha"):
        out[f"{sa}.in_proj.weight.{name}"] = parts[name]
    for kind in ("weight", "bias"):
        if src.has(f"{la}.conv1d.{kind}"):
            for name, t in split_rows(src.take(f"{la}.conv1d.{kind}"), [qk, qk, v],
                                      ["query", "key", "value"]).items():
                out[f"{sa}.conv1d.{kind}.{name}"] = t
    out[f"{sa}.A_log"] = src.take(f"{la}.A_log")
    out[f"{sa}.dt_bias"] = src.take(f"{la}.dt_bias")
    out[f"{sa}.out_proj.weight"] = src.take(f"{la}.out_proj.weight")
    # Zero-centred RMSNorm: Megatron weight = HF weight - 1, computed in the tensor's own dtype.
    out[f"{sa}.out_norm.weight"] = src.take(f"{la}.norm.weight") - 1
    out[f"{sa}.in_proj.layer_norm_weight"] = src.take(f"{hf}.input_layernorm.weight")


def _map_swiglu(src: _Source, hf_base: str, mg_base: str, out: dict, gate="gate_proj", up="up_proj",
                down="down_proj") -> None:
    out[f"{mg_base}.linear_fc1.weight_w"] = src.take(f"{hf_base}.{gate}.weight")
    out[f"{mg_base}.linear_fc1.weight_v"] = src.take(f"{hf_base}.{up}.weight")
    out[f"{mg_base}.linear_fc2.weight"] = src.take(f"{hf_base}.{down}.weight")


def _map_moe(src: _Source, hf: str, mg: str, out: dict) -> None:
    m = f"{mg}.mlp"
    if src.has(f"{hf}.block_sparse_moe.gate.weight"):  # mixtral: w1 = gate, w3 = up, w2 = down
        moe, names = f"{hf}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        moe, names = f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj")
    out[f"{m}.router.weight"] = src.take(f"{moe}.gate.weight")
    if src.has(f"{moe}.gate.e_score_correction_bias"):
        out[f"{m}.router.expert_bias"] = src.take(f"{moe}.gate.e_score_correction_bias")

    experts = f"{moe}.experts"
    if src.has(f"{experts}.gate_up_proj"):  # packed: gate_up [E, 2F, H] (gate = first F rows), down [E, H, F]
        gate_up = src.take(f"{experts}.gate_up_proj")
        down = src.take(f"{experts}.down_proj")
        if _RELEASE_EXPERT_LAYOUT:
            # Qwen3-VL-MoE releases store [E, H, 2F] and [E, F, H] (archs-2025.md §3.5): transposed.
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        f_dim = gate_up.shape[1] // 2
        for g in range(gate_up.shape[0]):
            out[f"{m}.experts.linear_fc1.weight{g}_w"] = gate_up[g, :f_dim].contiguous()
            out[f"{m}.experts.linear_fc1.weight{g}_v"] = gate_up[g, f_dim:].contiguous()
            out[f"{m}.experts.linear_fc2.weight{g}"] = down[g].contiguous()
    else:
        ids = _expert_indices(src.tensors, experts)
        if ids != list(range(len(ids))) or not ids:
            raise ValueError(f"{experts}: expert indices {ids} are not 0..E-1")
        gate, up, down = names
        for g in ids:
            e = f"{experts}.{g}"
            out[f"{m}.experts.linear_fc1.weight{g}_w"] = src.take(f"{e}.{gate}.weight")
            out[f"{m}.experts.linear_fc1.weight{g}_v"] = src.take(f"{e}.{up}.weight")
            out[f"{m}.experts.linear_fc2.weight{g}"] = src.take(f"{e}.{down}.weight")

    shared = next((s for s in (f"{moe}.shared_expert", f"{moe}.shared_experts")
                   if src.has(f"{s}.gate_proj.weight")), None)
    if shared is not None:
        _map_swiglu(src, shared, f"{m}.shared_experts", out)
    if src.has(f"{moe}.shared_expert_gate.weight"):
        out[f"{m}.shared_experts.gate_weight"] = src.take(f"{moe}.shared_expert_gate.weight")
    out[f"{mg}.pre_mlp_layernorm.weight"] = src.take(f"{hf}.post_attention_layernorm.weight")


def _map_mla(src: _Source, hf: str, mg: str, out: dict) -> None:
    """Multi-head latent attention (archs-2025.md §3.1): every projection copied under its
    Megatron name; the input norm stays a real `input_layernorm`."""
    a, sa = f"{hf}.self_attn", f"{mg}.self_attention"
    if src.has(f"{a}.q_a_proj.weight"):
        out[f"{sa}.linear_q_down_proj.weight"] = src.take(f"{a}.q_a_proj.weight")
        out[f"{sa}.linear_q_up_proj.layer_norm_weight"] = src.take(f"{a}.q_a_layernorm.weight")
        out[f"{sa}.linear_q_up_proj.weight"] = src.take(f"{a}.q_b_proj.weight")
    else:  # no q_lora_rank
        out[f"{sa}.linear_q_proj.weight"] = src.take(f"{a}.q_proj.weight")
    out[f"{sa}.linear_kv_down_proj.weight"] = src.take(f"{a}.kv_a_proj_with_mqa.weight")
    out[f"{sa}.linear_kv_up_proj.layer_norm_weight"] = src.take(f"{a}.kv_a_layernorm.weight")
    out[f"{sa}.linear_kv_up_proj.weight"] = src.take(f"{a}.kv_b_proj.weight")
    out[f"{sa}.linear_proj.weight"] = src.take(f"{a}.o_proj.weight")
    out[f"{mg}.input_layernorm.weight"] = src.take(f"{hf}.input_layernorm.weight")


def _map_mtp_after_decoder(src: _Source, cfg, hf: str, k: int, out: dict) -> None:
    """MTP layer k stored as HF decoder layer N+k (archs-2025.md §3.3, §5.1): its head tensors,
    its decoder sub-layer under `transformer_layer`, and no embedding or output layer of its own
    (Megatron's MTP shares the main ones)."""
    mg = f"mtp.layers.{k}"
    out[f"{mg}.enorm.weight"] = src.take(f"{hf}.enorm.weight")
    out[f"{mg}.hnorm.weight"] = src.take(f"{hf}.hnorm.weight")
    out[f"{mg}.eh_proj.weight"] = src.take(f"{hf}.eh_proj.weight")
    out[f"{mg}.final_layernorm.weight"] = src.take(f"{hf}.shared_head.norm.weight")
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):
        if src.has(f"{hf}.{copy}"):
            src.skip(f"{hf}.{copy}")
    _map_layer(src, cfg, hf, f"{mg}.transformer_layer", out)


# Families Megatron-Bridge loads into bf16 models: every parameter bf16 on disk, except the
# router's expert_bias, a float32 buffer (archs-2025.md §2, §5.2).
BF16_FAMILIES = {"deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss"}


# Expert-TP size of the layout being built (gpt-oss's fused fc1 depends on it).
_ETP = 1
# Whether packed experts are in the release layout [E, in, out] (Qwen3-VL-MoE).
_RELEASE_EXPERT_LAYOUT = False


def _map_vision_qwen3_vl(src: _Source, vision_cfg: dict, out: dict) -> None:
    """Megatron-Bridge 067f987d qwen3_vl_bridge.py `Qwen3VLMoEBridge.mapping_registry` (L284-399):
    the same Megatron ViT as Qwen3.5's (modelling_qwen3_vl/model.py L347-370, the vision lines
    L320-345 and L379-395 those of `_get_vision_mappings`), plus the deepstack mergers (L333-339):
    `model.visual.deepstack_merger_list.k.{norm,linear_fc1,linear_fc2}` are
    `vision_model.decoder.deepstack_merger_list.k.{patch_norm,linear_fc1,linear_fc2}`, copied.
    The ViT is GELU (`gated_linear_unit = False`), so its fc1 is not split into _w / _v (Megatron-
    Bridge 0.3.1 embedded the HF module instead and split it, archs-2025.md §3.5)."""
    deepstack = re.compile(r"model\.visual\.deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)$")
    for k in sorted(src.tensors):
        m = deepstack.fullmatch(k)
        if m:
            j, module, kind = m.groups()
            name = "patch_norm" if module == "norm" else module
            out[f"vision_model.decoder.deepstack_merger_list.{j}.{name}.{kind}"] = src.take(k)
    _map_vision_qwen35(src, vision_cfg, out)


def _map_vision_qwen35(src: _Source, vision_cfg: dict, out: dict) -> None:
    """Megatron-Bridge 067f987d qwen35_vl_bridge.py `_get_vision_mappings` (L71-142): Megatron's
    own ViT under `vision_model.`; `blocks.j` is `decoder.layers.j`, norm1 / norm2 are the fused
    layer norms of linear_qkv / linear_fc1, the merger's norm is `patch_norm`, and the fused qkv
    is re-ordered per head by `ConcatenatedQKVMapping` (split [q; k; v], then `merge_qkv_weights` /
    `merge_qkv_biases` with num_query_groups = num_heads). Every other tensor is copied. The MLP
    is GELU, so Megatron-Core does not split its fc1 into _w / _v on disk."""
    nh, hv = vision_cfg["num_heads"], vision_cfg["hidden_size"]
    d = hv // nh
    renames = {
        "attn.proj": "self_attention.linear_proj",
        "mlp.linear_fc1": "mlp.linear_fc1",
        "mlp.linear_fc2": "mlp.linear_fc2",
    }
    norms = {"norm1": "self_attention.linear_qkv.layer_norm", "norm2": "mlp.linear_fc1.layer_norm"}
    block = re.compile(r"model\.visual\.blocks\.(\d+)\.(.+)\.(weight|bias)$")
    for k in sorted(src.tensors):
        if not k.startswith("model.visual."):
            continue
        rest = k[len("model.visual."):]
        m = block.fullmatch(k)
        if m:
            j, module, kind = m.groups()
            mg = f"vision_model.decoder.layers.{j}"
            t = src.take(k)
            if module == "attn.qkv":
                q, kk, v = torch.split(t, [hv, hv, hv], dim=0)
                out[f"{mg}.self_attention.linear_qkv.{kind}"] = interleave_qkv(q, kk, v, nh, nh, d)
            elif module in norms:
                out[f"{mg}.{norms[module]}_{kind}"] = t
            else:
                out[f"{mg}.{renames[module]}.{kind}"] = t
        elif rest.startswith("merger.norm."):
            out["vision_model.merger.patch_norm." + rest[len("merger.norm."):]] = src.take(k)
        elif rest.split(".")[0] in ("merger", "patch_embed", "pos_embed"):
            out[f"vision_model.{rest}"] = src.take(k)


# FP4 E2M1 values by code (OCP Microscaling spec): sign, 2 exponent bits, 1 mantissa bit.
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """archs-2025.md §4.2: blocks u8 [E, R, C/32, 16], scales u8 [E, R, C/32] -> bf16 [E, R, C].
    Byte j of a block holds element 2j in its low nibble and 2j+1 in its high nibble; every
    element is scaled by 2^(scale - 127)."""
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    values = FP4_E2M1[codes] * torch.pow(2.0, scales.to(torch.float32) - 127)[..., None]
    return values.reshape(blocks.shape[0], blocks.shape[1], -1).to(torch.bfloat16)


def _gpt_oss_fc1(w: torch.Tensor, etp: int) -> torch.Tensor:
    """gpt-oss fc1 (archs-2025.md §3.4): gate = rows 0::2, up = rows 1::2, kept whole: ETP rank r
    holds [gate_r; up_r], so the global tensor is [gate_0; up_0; gate_1; up_1; ...]."""
    gate, up = w[0::2], w[1::2]
    parts = []
    for g, u in zip(torch.chunk(gate, etp, 0), torch.chunk(up, etp, 0)):
        parts += [g, u]
    return torch.cat(parts).contiguous()


def _map_gpt_oss_moe(src: _Source, hf: str, mg: str, out: dict) -> None:
    m, x = f"{mg}.mlp", f"{hf}.mlp.experts"
    out[f"{m}.router.weight"] = src.take(f"{hf}.mlp.router.weight")
    out[f"{m}.router.bias"] = src.take(f"{hf}.mlp.router.bias")
    out[f"{mg}.pre_mlp_layernorm.weight"] = src.take(f"{hf}.post_attention_layernorm.weight")
    if src.has(f"{x}.gate_up_proj_blocks"):
        # The MXFP4 release: dequantized [E, out, in] is already [out, in]; no transpose.
        gate_up = dequantize_mxfp4(src.take(f"{x}.gate_up_proj_blocks"), src.take(f"{x}.gate_up_proj_scales"))
        down = dequantize_mxfp4(src.take(f"{x}.down_proj_blocks"), src.take(f"{x}.down_proj_scales"))
    else:
        # The bf16 layout [E, in, out] (transformers' own): transposed per expert.
        gate_up = src.take(f"{x}.gate_up_proj").transpose(1, 2)
        down = src.take(f"{x}.down_proj").transpose(1, 2)
    gate_up_bias, down_bias = src.take(f"{x}.gate_up_proj_bias"), src.take(f"{x}.down_proj_bias")
    for g in range(gate_up.shape[0]):
        out[f"{m}.experts.linear_fc1.weight{g}"] = _gpt_oss_fc1(gate_up[g], _ETP)
        out[f"{m}.experts.linear_fc1.bias{g}"] = _gpt_oss_fc1(gate_up_bias[g], _ETP)
        out[f"{m}.experts.linear_fc2.weight{g}"] = down[g].contiguous()
        out[f"{m}.experts.linear_fc2.bias{g}"] = down_bias[g].contiguous()


def _map_layer(src: _Source, cfg, hf: str, mg: str, out: dict) -> None:
    if src.has(f"{hf}.self_attn.sinks"):  # gpt-oss: biased attention with sinks
        a = f"{hf}.self_attn"
        out[f"{mg}.self_attention.linear_proj.bias"] = src.take(f"{a}.o_proj.bias")
        out[f"{mg}.self_attention.core_attention.softmax_offset"] = src.take(f"{a}.sinks")
    if src.has(f"{hf}.self_attn.kv_a_proj_with_mqa.weight"):
        _map_mla(src, hf, mg, out)
    elif src.has(f"{hf}.self_attn.q_proj.weight"):
        _map_attention(src, cfg, hf, mg, out)
    elif src.has(f"{hf}.linear_attn.out_proj.weight"):
        _map_gdn(src, cfg, hf, mg, out)
    else:
        raise ValueError(f"{hf}: neither self_attn nor linear_attn")

    if src.has(f"{hf}.mlp.router.weight"):
        _map_gpt_oss_moe(src, hf, mg, out)
    elif src.has(f"{hf}.mlp.gate.weight") or src.has(f"{hf}.block_sparse_moe.gate.weight"):
        _map_moe(src, hf, mg, out)
    else:
        _map_swiglu(src, f"{hf}.mlp", f"{mg}.mlp", out)
        out[f"{mg}.mlp.linear_fc1.layer_norm_weight"] = src.take(f"{hf}.post_attention_layernorm.weight")


def dequantize_fp8_blocks(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block FP8 (archs-2025.md §4.1): every `W` with a float32 `W_scale_inv` becomes
    `bf16(fp32(W) * scale_inv[r // b0, c // b1])` (one float32 multiply, one rounding to bf16),
    and the scale is consumed; an FP8 tensor without one becomes `fp32 -> bf16`."""
    q = cfg.get("quantization_config") or cfg["_root"].get("quantization_config")
    if not q:
        return tensors
    if q.get("quant_method") == "mxfp4":
        return tensors  # gpt-oss experts: dequantized where they are mapped
    if q.get("quant_method") != "fp8":
        raise ValueError(f"unsupported quantization {q.get('quant_method')!r}")
    b0, b1 = q["weight_block_size"]
    out = {}
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        scale = tensors.get(k + "_scale_inv")
        if scale is not None:
            m, n = t.shape
            if tuple(scale.shape) != (-(-m // b0), -(-n // b1)) or scale.dtype != torch.float32:
                raise ValueError(f"{k}_scale_inv has {scale.dtype} {tuple(scale.shape)} for {tuple(t.shape)}")
            full = scale.repeat_interleave(b0, dim=0)[:m].repeat_interleave(b1, dim=1)[:, :n]
            out[k] = (t.to(torch.float32) * full).to(torch.bfloat16)
        elif t.dtype == torch.float8_e4m3fn:
            out[k] = t.to(torch.float32).to(torch.bfloat16)
        else:
            out[k] = t
    return out


def megatron_state_dict(cfg: dict, tensors: dict[str, torch.Tensor], tp: int = 1, etp: int | None = None
                        ) -> dict[str, torch.Tensor]:
    """Unprefixed Megatron names -> global tensors."""
    global _ETP, _RELEASE_EXPERT_LAYOUT
    _ETP = etp or tp
    qwen3_vl = cfg["_root"].get("model_type") == "qwen3_vl_moe"
    # Multimodal Qwen3.5 with its tower (a release without one is a plain GPT model).
    qwen35_vl = (cfg["_root"].get("model_type") in ("qwen3_5", "qwen3_5_moe")
                 and any(k.startswith("model.visual.") for k in tensors))
    _RELEASE_EXPERT_LAYOUT = qwen3_vl
    tensors = dequantize_fp8_blocks(cfg, tensors)
    src = _Source(tensors)
    root = "model.language_model" if src.has("model.language_model.embed_tokens.weight") else "model"
    out: dict[str, torch.Tensor] = {}

    out["embedding.word_embeddings.weight"] = pad_vocab(src.take(f"{root}.embed_tokens.weight"), tp)
    # Layers past num_hidden_layers are MTP layers (all decoder layers when it is not given).
    n_layers = cfg.get("num_hidden_layers", len(_layer_indices(tensors, root)))
    for i in _layer_indices(tensors, root):
        if i < n_layers:
            _map_layer(src, cfg, f"{root}.layers.{i}", f"decoder.layers.{i}", out)
        else:
            _map_mtp_after_decoder(src, cfg, f"{root}.layers.{i}", i - n_layers, out)
    out["decoder.final_layernorm.weight"] = src.take(f"{root}.norm.weight")

    # Multimodal releases say it at the top level (their text_config may say otherwise).
    root = cfg["_root"]
    tied = root.get("tie_word_embeddings", False) if "text_config" in root else cfg.get("tie_word_embeddings", False)
    if tied:
        if src.has("lm_head.weight"):
            src.skip("lm_head.weight")
    else:
        out["output_layer.weight"] = pad_vocab(src.take("lm_head.weight"), tp)

    if qwen3_vl or qwen35_vl:
        # The Megatron model wraps the decoder as `language_model` next to `vision_model`.
        out = {f"language_model.{k}": t for k, t in out.items()}
        if qwen3_vl:
            _map_vision_qwen3_vl(src, cfg["_root"]["vision_config"], out)
        else:
            _map_vision_qwen35(src, cfg["_root"]["vision_config"], out)
    left = src.unused()
    if left:
        raise ValueError(f"reference mapping does not cover {len(left)} HF tensors, e.g. {left[:5]}")
    if cfg.get("model_type") in BF16_FAMILIES:
        out = {k: t.to(torch.float32 if k.endswith(".router.expert_bias") else torch.bfloat16) for k, t in out.items()}
    return out


def reference_state_dict(hf_dir, tp: int = 1, prefix: str = DEFAULT_PREFIX, etp: int | None = None
                         ) -> dict[str, torch.Tensor]:
    """`{prefix + megatron name: global tensor}` for the HF checkpoint in hf_dir at tensor-parallel
    size tp (and expert-TP size etp, default tp)."""
    cfg = load_config(hf_dir)
    mapped = megatron_state_dict(cfg, load_hf_tensors(hf_dir), tp, etp or tp)
    return {prefix + k: t for k, t in mapped.items()}


def has_experts(hf_dir) -> bool:
    cfg = load_config(hf_dir)
    return any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
