"""torchtitan's own HF → native conversion, as the reference for `convert --target torchtitan`.

The state-dict adapters of torchtitan 0.3.0 (installed by scripts/setup-python) run on the tiny
releases: `from_hf` on the release's tensors gives the native state dict torchtitan builds its
seed from (`scripts/checkpoint_conversion/convert_from_hf.py` does the same on a full model).
The adapters read only a few numbers of the model config, given here as plain objects, so no
torchtitan model (and no GPU) is built. What `from_hf` does not produce, the model's own
buffers, is added as torchtitan's initialisation makes it: the load-balancing bias of routed
experts, `expert_bias_E`, zeros in fp32 (torchtitan/models/common/moe.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

import reference as ref


def adapter_for(release: Path):
    """torchtitan's adapter for the release's model, configured from its config.json."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
        from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    cfg = json.loads((release / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type == "llama":
        adapter_cls, rope_cls = Llama3StateDictAdapter, ComplexRoPE.Config
    elif model_type in ("qwen3", "qwen3_moe"):
        adapter_cls, rope_cls = Qwen3StateDictAdapter, CosSinRoPE.Config
    elif model_type in ("deepseek_v3", "kimi_k2"):
        # torchtitan's kimi_k2_7 adapter (main, newer than the installed release) subclasses the
        # DeepSeek-V3 one and, for a model without a vision encoder, hands it every key
        # (torchtitan/models/kimi_k2_7/state_dict_adapter.py, `from_hf`).
        adapter_cls, rope_cls = DeepSeekV3StateDictAdapter, ComplexRoPE.Config
    elif model_type == "gpt_oss":
        adapter_cls, rope_cls = GptOssStateDictAdapter, CosSinRoPE.Config
    else:
        raise ValueError(f"no torchtitan adapter for {model_type}")
    heads = cfg["num_attention_heads"]
    attention = SimpleNamespace(
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        # The adapters check the RoPE flavour their permutation assumes; its fields are unused.
        rope=object.__new__(rope_cls),
        q_lora_rank=cfg.get("q_lora_rank") or 0,
    )
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    moe = SimpleNamespace(num_experts=experts) if experts else None
    layers = [SimpleNamespace(attention=attention, moe=moe) for _ in range(cfg["num_hidden_layers"])]
    config = SimpleNamespace(
        layers=layers, dim=cfg["hidden_size"], enable_weight_tying=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=[None] * (cfg.get("num_nextn_predict_layers") or 0),
    )
    return adapter_cls(config, None), cfg


def _hf_tensors(release: Path, cfg: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The release's tensors as torchtitan reads them: a block-FP8 release through torch's
    `QuantizedHuggingFaceStorageReader` (what torchtitan's DeepSeek-V3 adapter hands DCP), into
    `dtype`, scales applied and not kept; an MXFP4 one (gpt-oss) dequantized as its spec says; any
    other as stored."""
    hf = ref.load_hf_tensors(release)
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") not in ("fp8", "mxfp4"):
        return hf
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    if quant["quant_method"] == "mxfp4":
        # gpt-oss's experts by the MXFP4 spec (reference.dequantize_mxfp4), in `dtype`: torch's
        # `QuantizedHuggingFaceStorageReader`, which torchtitan's adapter would hand DCP, returns
        # other values on this torch (2.15, CPU) — elements out of order in bfloat16, mostly zeros
        # in float32 — so the spec is the reference here.
        out = {k: v for k, v in hf.items() if not k.endswith(("_blocks", "_scales"))}
        for k in (k for k in hf if k.endswith("_blocks")):
            out[k] = ref.dequantize_mxfp4(hf[k], hf[k.removesuffix("_blocks") + "_scales"]).to(dtype)
        return out
    block = quant["weight_block_size"][0]
    state = {k: torch.empty(v.shape, dtype=dtype if v.dtype == torch.float8_e4m3fn else v.dtype)
             for k, v in hf.items() if not k.endswith("_scale_inv")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(release), target_dtype=dtype,
                                                                         block_size=block))
    return state


# torchtitan 0.3.0's gpt-oss adapter names the routed experts' tensors without the shape suffixes
# its model's `GptOssGroupedExperts` gives them (gpt_oss/moe.py): the model's names, which a seed
# must hold for DCP to load it.
GPT_OSS_MODEL_NAMES = {".mlp1_weight": ".mlp1_weight_EGD", ".mlp1_bias": ".mlp1_bias_EG",
                       ".mlp2_weight": ".mlp2_weight_EDF", ".mlp2_bias": ".mlp2_bias_ED"}


def torchtitan_seed(release: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The native state dict of torchtitan's seed from `release`, in `dtype`."""
    adapter, cfg = adapter_for(release)
    hf = _hf_tensors(release, cfg, dtype)
    # An MTP layer's copies of the embedding and output projection: torchtitan's MTP shares the
    # model's, its state dict has no key for them, so its loader never reads them.
    main = cfg["num_hidden_layers"]
    mtp_copies = {f"model.layers.{main + i}.{rest}" for i in range(cfg.get("num_nextn_predict_layers") or 0)
                  for rest in ("embed_tokens.weight", "shared_head.head.weight")}
    native = adapter.from_hf({k: v for k, v in hf.items() if k not in mtp_copies})
    if cfg["model_type"] == "gpt_oss":
        def model_name(key: str) -> str:
            for a, b in GPT_OSS_MODEL_NAMES.items():
                if key.endswith(a):
                    return key[: -len(a)] + b
            return key
        native = {model_name(k): v for k, v in native.items()}
    # torchtitan keeps the load-balancing bias in fp32 whatever the parameters' dtype.
    out = {k: v.to(torch.float32 if k.endswith("expert_bias_E") else dtype).contiguous() for k, v in native.items()}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        for layer in range(main):
            key = f"layers.{layer}.moe.expert_bias_E"
            router = (f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.router.weight")
            if any(r in hf for r in router) and key not in out:
                out[key] = torch.zeros(experts, dtype=torch.float32)
    return out
