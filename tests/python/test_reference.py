"""Self-checks of reference.py against the brief's golden numbers (layouts.md §2, §5 T6)."""

import pytest
import torch

import reference as ref
from conftest import FIXTURES, FIXTURE_NAMES

H = 3  # hidden size of the toy tensors; every row carries its HF row index in all H columns


def labelled(rows: int, base: int = 0) -> torch.Tensor:
    """[rows, H] float tensor whose row i is filled with base + i (so a row's origin is readable)."""
    return (torch.arange(rows, dtype=torch.float32) + base)[:, None].expand(rows, H).contiguous()


def origin(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t[:, 0]]


# ---- QKV interleave (layouts.md §5 T6) -------------------------------------------------------

def test_t6_qkv_interleave_golden():
    nh, ng, d = 4, 2, 2
    q, k, v = labelled(nh * d, 0), labelled(ng * d, 100), labelled(ng * d, 200)
    out = ref.interleave_qkv(q, k, v, nh, ng, d)
    assert out.shape == (16, H)
    # g0 = q0[0:2] q1[2:4] k0[4:6] v0[6:8]; g1 = q2[8:10] q3[10:12] k1[12:14] v1[14:16]
    assert origin(out) == [0, 1, 2, 3, 100, 101, 200, 201,
                           4, 5, 6, 7, 102, 103, 202, 203]
    # TP=2: rank 0 owns rows 0-7 (group 0), rank 1 rows 8-15 (group 1)
    r0, r1 = torch.chunk(out, 2, 0)
    assert origin(r0) == [0, 1, 2, 3, 100, 101, 200, 201]
    assert origin(r1) == [4, 5, 6, 7, 102, 103, 202, 203]


def test_t6_qkv_interleave_gated_golden():
    nh, ng, d = 4, 2, 2
    # HF gated q_proj: per head h rows [q_h (d); gate_h (d)] -> head h's q rows are 4h, 4h+1 and gate rows 4h+2, 4h+3
    q, k, v = labelled(2 * nh * d, 0), labelled(ng * d, 100), labelled(ng * d, 200)
    out = ref.interleave_qkv(q, k, v, nh, ng, d, gated=True)
    assert out.shape == (24, H)
    # g0 = q0,q1[0:4] gate0,gate1[4:8] k0[8:10] v0[10:12]; g1 = +12
    assert origin(out) == [0, 1, 4, 5, 2, 3, 6, 7, 100, 101, 200, 201,
                           8, 9, 12, 13, 10, 11, 14, 15, 102, 103, 202, 203]


@pytest.mark.parametrize("nh,ng,d,gated", [(8, 2, 8, False), (8, 2, 8, True), (6, 3, 4, False), (4, 4, 2, True)])
def test_qkv_row_formulas(nh, ng, d, gated):
    """Every row lands where layouts.md §2.1's closed-form row formulas say."""
    hpg = nh // ng
    G = (2 * hpg + 2) * d if gated else (hpg + 2) * d
    qrows = nh * d * (2 if gated else 1)
    q, k, v = labelled(qrows, 0), labelled(ng * d, 10_000), labelled(ng * d, 20_000)
    out = origin(ref.interleave_qkv(q, k, v, nh, ng, d, gated))
    assert len(out) == ng * G
    kv_off = 2 * hpg * d if gated else hpg * d
    for h in range(nh):
        g = h // hpg
        for i in range(d):
            hf_q = h * 2 * d + i if gated else h * d + i
            assert out[g * G + (h % hpg) * d + i] == hf_q
            if gated:
                assert out[g * G + hpg * d + (h % hpg) * d + i] == h * 2 * d + d + i
    for g in range(ng):
        for i in range(d):
            assert out[g * G + kv_off + i] == 10_000 + g * d + i
            assert out[g * G + kv_off + d + i] == 20_000 + g * d + i


def test_qkv_bias_is_1d_interleave():
    nh, ng, d = 4, 2, 2
    qb, kb, vb = torch.arange(8.0), torch.arange(4.0) + 100, torch.arange(4.0) + 200
    out = ref.interleave_qkv(qb, kb, vb, nh, ng, d)
    assert out.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_qkv_rejects_bad_shapes():
    with pytest.raises(ValueError):
        ref.interleave_qkv(labelled(8), labelled(4), labelled(4), 4, 2, 2, gated=True)
    with pytest.raises(ValueError):
        ref.interleave_qkv(labelled(8), labelled(4), labelled(4), 4, 3, 2)


# ---- GDN in_proj / conv1d (layouts.md §2.3, §2.4) -------------------------------------------

@pytest.mark.parametrize("nk,nv,dk,dv", [(2, 4, 16, 16), (2, 2, 3, 5), (1, 3, 2, 4), (4, 8, 2, 3)])
def test_gdn_qkvz_ba_row_formulas(nk, nv, dk, dv):
    m = nv // nk
    Gs = 2 * dk + 2 * m * dv
    qkvz, ba = labelled(nk * Gs), labelled(2 * nv, 50_000)
    p = ref.split_gdn_qkvz_ba(qkvz, ba, nk, nv, dk, dv)
    shapes = {n: tuple(t.shape) for n, t in p.items()}
    assert shapes == {"query": (nk * dk, H), "key": (nk * dk, H), "value": (nv * dv, H), "z": (nv * dv, H),
                      "beta": (nv, H), "alpha": (nv, H)}
    q, k, v, z, b, a = (origin(p[n]) for n in ("query", "key", "value", "z", "beta", "alpha"))
    for h in range(nk):
        for i in range(dk):
            assert q[h * dk + i] == h * Gs + i
            assert k[h * dk + i] == h * Gs + dk + i
        for jj in range(m):
            j = h * m + jj  # natural value-head index
            for i in range(dv):
                assert v[j * dv + i] == h * Gs + 2 * dk + jj * dv + i
                assert z[j * dv + i] == h * Gs + 2 * dk + m * dv + jj * dv + i
            assert b[j] == 50_000 + h * 2 * m + jj
            assert a[j] == 50_000 + h * 2 * m + m + jj
    # every HF row is used exactly once
    assert sorted(q + k + v + z) == list(range(nk * Gs))
    assert sorted(b + a) == [50_000 + i for i in range(2 * nv)]


def test_gdn_small_golden():
    """nk=1, nv=2, dk=1, dv=1: qkvz rows per key head are [q, k, v0, v1, z0, z1], ba rows [b0, b1, a0, a1]."""
    p = ref.split_gdn_qkvz_ba(labelled(6), labelled(4, 10), nk=1, nv=2, dk=1, dv=1)
    assert {n: origin(t) for n, t in p.items()} == {
        "query": [0], "key": [1], "value": [2, 3], "z": [4, 5], "beta": [10, 11], "alpha": [12, 13]}


def test_conv1d_split_is_row_slices():
    qk, v, K = 4, 8, 4
    conv = torch.arange((2 * qk + v) * K, dtype=torch.float32).reshape(2 * qk + v, 1, K)
    p = ref.split_rows(conv, [qk, qk, v], ["query", "key", "value"])
    assert torch.equal(p["query"], conv[0:qk])
    assert torch.equal(p["key"], conv[qk:2 * qk])
    assert torch.equal(p["value"], conv[2 * qk:])
    assert p["value"].shape == (v, 1, K)


# ---- vocab padding -------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,tp,expected", [(256, 1, 256), (256, 2, 256), (256, 4, 512), (256, 8, 1024),
                                               (255, 1, 256), (151936, 1, 151936), (151936, 8, 152576),
                                               (32000, 1, 32000), (32000, 2, 32000), (32001, 1, 32128)])
def test_padded_vocab(vocab, tp, expected):
    assert ref.padded_vocab_size(vocab, tp) == expected
    t = torch.ones(vocab, 2, dtype=torch.bfloat16)
    p = ref.pad_vocab(t, tp)
    assert p.shape == (expected, 2) and p.dtype == torch.bfloat16
    assert torch.equal(p[:vocab], t) and not p[vocab:].any()


# ---- whole-model mapping on the fixtures ----------------------------------------------------

def _names(sd):
    return {k.removeprefix(ref.DEFAULT_PREFIX) for k in sd}


def test_llama_keys_and_values():
    d = FIXTURES / "llama"
    hf = ref.load_hf_tensors(d)
    sd = ref.reference_state_dict(d, tp=1)
    assert all(k.startswith("model.module.") for k in sd)
    per_layer = {"self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight",
                 "self_attention.linear_proj.weight", "mlp.linear_fc1.weight_w", "mlp.linear_fc1.weight_v",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc2.weight"}
    expected = {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"}
    expected |= {f"decoder.layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert _names(sd) == expected
    p = "model.module.decoder.layers.1."
    assert torch.equal(sd[p + "mlp.linear_fc1.weight_w"], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(sd[p + "mlp.linear_fc1.weight_v"], hf["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(sd[p + "mlp.linear_fc1.layer_norm_weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(sd[p + "self_attention.linear_qkv.layer_norm_weight"], hf["model.layers.1.input_layernorm.weight"])
    qkv = sd[p + "self_attention.linear_qkv.weight"]
    assert qkv.shape == (2 * (4 + 2) * 8, 64)  # ng·(hpg+2)·d
    # group 1 starts at row 48: its 4 q heads are HF q heads 4..7, then k1, v1
    assert torch.equal(qkv[48:80], hf["model.layers.1.self_attn.q_proj.weight"][32:64])
    assert torch.equal(qkv[80:88], hf["model.layers.1.self_attn.k_proj.weight"][8:16])
    assert torch.equal(qkv[88:96], hf["model.layers.1.self_attn.v_proj.weight"][8:16])
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


@pytest.mark.parametrize("tp,rows", [(1, 256), (2, 256), (4, 512)])
def test_vocab_padding_on_fixture(tp, rows):
    d = FIXTURES / "llama"
    hf = ref.load_hf_tensors(d)
    sd = ref.reference_state_dict(d, tp=tp)
    for key, src in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                     ("output_layer.weight", "lm_head.weight")):
        t = sd["model.module." + key]
        assert t.shape == (rows, 64)
        assert torch.equal(t[:256], hf[src]) and not t[256:].any()


def test_qwen3_moe_keys():
    d = FIXTURES / "qwen3_moe"
    hf = ref.load_hf_tensors(d)
    names = _names(ref.reference_state_dict(d))
    for i in range(2):
        L = f"decoder.layers.{i}."
        assert L + "pre_mlp_layernorm.weight" in names
        assert L + "mlp.linear_fc1.layer_norm_weight" not in names
        assert L + "mlp.router.weight" in names
        assert {L + "self_attention.q_layernorm.weight", L + "self_attention.k_layernorm.weight"} <= names
        for g in range(8):
            assert {f"{L}mlp.experts.linear_fc1.weight{g}_w", f"{L}mlp.experts.linear_fc1.weight{g}_v",
                    f"{L}mlp.experts.linear_fc2.weight{g}"} <= names
    assert len(names) == 3 + 2 * (5 + 1 + 1 + 3 * 8)  # attn 5, router, pre_mlp, experts
    sd = ref.reference_state_dict(d)
    assert torch.equal(sd["model.module.decoder.layers.1.mlp.experts.linear_fc1.weight5_v"],
                       hf["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(sd["model.module.decoder.layers.1.mlp.experts.linear_fc2.weight5"],
                       hf["model.layers.1.mlp.experts.5.down_proj.weight"])


def test_qwen3_next_keys_and_transforms():
    d = FIXTURES / "qwen3_next"
    hf = ref.load_hf_tensors(d)
    sd = ref.reference_state_dict(d)
    names = _names(sd)
    gdn, attn = "decoder.layers.0.self_attention.", "decoder.layers.3.self_attention."
    assert gdn + "in_proj.layer_norm_weight" in names and gdn + "linear_qkv.layer_norm_weight" not in names
    assert attn + "linear_qkv.layer_norm_weight" in names and attn + "in_proj.layer_norm_weight" not in names
    for n in ("query", "key", "value", "z", "beta", "alpha"):
        assert gdn + f"in_proj.weight.{n}" in names
    for n in ("query", "key", "value"):
        assert gdn + f"conv1d.weight.{n}" in names
    assert {"decoder.layers.0.mlp.shared_experts.gate_weight", "decoder.layers.0.mlp.shared_experts.linear_fc1.weight_w",
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight_v",
            "decoder.layers.0.mlp.shared_experts.linear_fc2.weight"} <= names
    # out_norm = HF norm - 1, in bf16
    hf_norm = hf["model.layers.0.linear_attn.norm.weight"]
    out_norm = sd["model.module." + gdn + "out_norm.weight"]
    assert out_norm.dtype == torch.bfloat16
    assert torch.equal(out_norm, hf_norm - torch.ones_like(hf_norm))
    # gated attention on the full-attention layer: ng·(2·hpg+2)·d = 2·10·8
    qkv = sd["model.module." + attn + "linear_qkv.weight"]
    assert qkv.shape == (160, 64)
    q = hf["model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(qkv[0:8], q[0:8])      # q head 0
    assert torch.equal(qkv[8:16], q[16:24])   # q head 1
    assert torch.equal(qkv[32:40], q[8:16])   # gate head 0
    assert torch.equal(qkv[64:72], hf["model.layers.3.self_attn.k_proj.weight"][0:8])
    # GDN components: natural head order, concatenation is a permutation of the HF rows
    parts = [sd["model.module." + gdn + f"in_proj.weight.{n}"] for n in ("query", "key", "value", "z")]
    qkvz = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert sum(p.shape[0] for p in parts) == qkvz.shape[0]
    assert torch.equal(parts[0][16:32], qkvz[96:112])  # key head 1's q rows start at 1·Gs = 96


def test_qwen3_5_moe_vl_keys_and_vision_tower():
    """Megatron-Bridge qwen35_vl_bridge.py: language model under `language_model.`, Megatron's ViT
    under `vision_model.` (per-head qkv, fused layer norms, fc1 whole, merger `patch_norm`)."""
    d = FIXTURES / "qwen3_5_moe_vl"
    hf = ref.load_hf_tensors(d)
    sd = ref.reference_state_dict(d)
    names = _names(sd)
    assert all(n.startswith(("language_model.", "vision_model.")) for n in names)
    lm = "language_model.decoder.layers."
    assert {lm + "0.self_attention.in_proj.weight.alpha", lm + "1.self_attention.linear_qkv.weight",
            lm + "1.mlp.experts.linear_fc1.weight3_v", lm + "0.mlp.shared_experts.gate_weight",
            "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"} <= names
    v = "vision_model.decoder.layers.1."
    for n in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
              "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
              "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
              "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc1.layer_norm_weight",
              "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"):
        assert v + n in names, n
    assert not any(n.endswith(("_w", "_v")) for n in names if n.startswith("vision_model."))
    assert {"vision_model.merger.patch_norm.weight", "vision_model.merger.linear_fc1.weight",
            "vision_model.patch_embed.proj.weight", "vision_model.pos_embed.weight"} <= names
    # qkv: HF [q; k; v] of 16 rows each → per head [q_h; k_h; v_h], head_dim 16 / 2 = 8.
    qkv, src = sd["model.module." + v + "self_attention.linear_qkv.weight"], hf["model.visual.blocks.1.attn.qkv.weight"]
    for h in range(2):
        for part in range(3):
            assert torch.equal(qkv[24 * h + 8 * part:24 * h + 8 * part + 8], src[16 * part + 8 * h:16 * part + 8 * h + 8])
    assert torch.equal(sd["model.module." + v + "mlp.linear_fc1.layer_norm_bias"], hf["model.visual.blocks.1.norm2.bias"])


def test_qwen3_vl_moe_vision_tower_is_megatrons_vit():
    """Megatron-Bridge main qwen3_vl_bridge.py: Qwen3-VL's tower is Megatron's ViT as Qwen3.5's
    (per-head qkv, fc1 whole), its deepstack mergers under the ViT's `decoder.`."""
    d = FIXTURES / "qwen3_vl_moe"
    hf = ref.load_hf_tensors(d)
    sd = ref.reference_state_dict(d)
    names = _names(sd)
    assert all(n.startswith(("language_model.", "vision_model.")) for n in names)
    assert not any(n.startswith("vision_model.blocks.") or (n.startswith("vision_model.") and n.endswith(("_w", "_v")))
                   for n in names)
    v = "vision_model.decoder.layers.1."
    assert {v + "self_attention.linear_qkv.weight", v + "mlp.linear_fc1.weight", v + "mlp.linear_fc1.layer_norm_bias",
            "vision_model.merger.patch_norm.weight", "vision_model.patch_embed.proj.weight"} <= names
    ds = "vision_model.decoder.deepstack_merger_list.0."
    for n, h in (("patch_norm.weight", "norm.weight"), ("patch_norm.bias", "norm.bias"),
                 ("linear_fc1.weight", "linear_fc1.weight"), ("linear_fc2.bias", "linear_fc2.bias")):
        assert torch.equal(sd["model.module." + ds + n], hf["model.visual.deepstack_merger_list.0." + h]), n
    # qkv: HF [q; k; v] of 32 rows each → per head [q_h; k_h; v_h], head_dim 32 / 4 = 8.
    qkv, src = sd["model.module." + v + "self_attention.linear_qkv.weight"], hf["model.visual.blocks.1.attn.qkv.weight"]
    for h in range(4):
        for part in range(3):
            assert torch.equal(qkv[24 * h + 8 * part:24 * h + 8 * part + 8], src[32 * part + 8 * h:32 * part + 8 * h + 8])


def test_unmapped_hf_tensor_raises():
    d = FIXTURES / "llama"
    hf = dict(ref.load_hf_tensors(d))
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    with pytest.raises(ValueError, match="does not cover"):
        ref.megatron_state_dict(ref.load_config(d), hf)


def test_tied_embeddings_drop_output_layer():
    d = FIXTURES / "llama"
    cfg = ref.load_config(d) | {"tie_word_embeddings": True}
    hf = {k: v for k, v in ref.load_hf_tensors(d).items() if k != "lm_head.weight"}
    assert "output_layer.weight" not in ref.megatron_state_dict(cfg, hf)


def test_qwen2_bias_and_mixtral_names():
    """Synthetic qwen2 (qkv bias) and mixtral (block_sparse_moe w1/w3/w2) layers map as the brief says."""
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8, "head_dim": 2,
           "tie_word_embeddings": True, "_root": {}}
    t = lambda *s: torch.randn(*s).to(torch.bfloat16)  # noqa: E731
    hf = {"model.embed_tokens.weight": t(16, 8), "model.norm.weight": t(8),
          "model.layers.0.input_layernorm.weight": t(8), "model.layers.0.post_attention_layernorm.weight": t(8),
          "model.layers.0.self_attn.q_proj.weight": t(8, 8), "model.layers.0.self_attn.q_proj.bias": t(8),
          "model.layers.0.self_attn.k_proj.weight": t(4, 8), "model.layers.0.self_attn.k_proj.bias": t(4),
          "model.layers.0.self_attn.v_proj.weight": t(4, 8), "model.layers.0.self_attn.v_proj.bias": t(4),
          "model.layers.0.self_attn.o_proj.weight": t(8, 8),
          "model.layers.0.block_sparse_moe.gate.weight": t(2, 8)}
    for e in range(2):
        for w, s in (("w1", (6, 8)), ("w3", (6, 8)), ("w2", (8, 6))):
            hf[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] = t(*s)
    sd = ref.megatron_state_dict(cfg, hf)
    L = "decoder.layers.0."
    assert sd[L + "self_attention.linear_qkv.bias"].shape == (16,)
    assert torch.equal(sd[L + "self_attention.linear_qkv.bias"][4:6], hf["model.layers.0.self_attn.k_proj.bias"][0:2])
    assert torch.equal(sd[L + "mlp.experts.linear_fc1.weight1_w"], hf["model.layers.0.block_sparse_moe.experts.1.w1.weight"])
    assert torch.equal(sd[L + "mlp.experts.linear_fc1.weight1_v"], hf["model.layers.0.block_sparse_moe.experts.1.w3.weight"])
    assert torch.equal(sd[L + "mlp.experts.linear_fc2.weight1"], hf["model.layers.0.block_sparse_moe.experts.1.w2.weight"])
    assert L + "pre_mlp_layernorm.weight" in sd and "output_layer.weight" not in sd


def test_packed_experts_match_unpacked():
    """transformers v5 packed experts (gate_up_proj [E,2F,H], down_proj [E,H,F]) give the same keys and values."""
    d = FIXTURES / "qwen3_moe"
    cfg, hf = ref.load_config(d), ref.load_hf_tensors(d)
    packed = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    for i in range(2):
        e = f"model.layers.{i}.mlp.experts"
        packed[f"{e}.gate_up_proj"] = torch.stack(
            [torch.cat([hf[f"{e}.{g}.gate_proj.weight"], hf[f"{e}.{g}.up_proj.weight"]]) for g in range(8)])
        packed[f"{e}.down_proj"] = torch.stack([hf[f"{e}.{g}.down_proj.weight"] for g in range(8)])
    a, b = ref.megatron_state_dict(cfg, hf), ref.megatron_state_dict(cfg, packed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_reference_consumes_every_fixture_tensor(name):
    sd = ref.reference_state_dict(FIXTURES / name)
    assert sd and all(t.is_contiguous() for t in sd.values())


# ---- gpt-oss (archs-2025.md §3.4, §4.2) -----------------------------------------------------

def test_mxfp4_golden():
    """Low nibble first; FP4 E2M1 values; every element times 2^(scale - 127)."""
    blocks = torch.zeros(1, 1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x21  # elements 0, 1 = FP4[1] = 0.5, FP4[2] = 1.0
    blocks[0, 0, 0, 1] = 0xF8  # elements 2, 3 = FP4[8] = -0.0, FP4[15] = -6.0
    blocks[0, 0, 1, 0] = 0x7F  # elements 32, 33 = FP4[15] = -6.0, FP4[7] = 6.0
    scales = torch.tensor([[[128, 125]]], dtype=torch.uint8)  # x2 for block 0, x1/4 for block 1
    out = ref.dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 1, 64) and out.dtype == torch.bfloat16
    assert out[0, 0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert torch.signbit(out[0, 0, 2]).item(), "-0.0 keeps its sign"
    assert out[0, 0, 32:34].tolist() == [-1.5, 1.5]


def test_gpt_oss_fc1_layout_depends_on_etp():
    """Gate = even rows, up = odd rows; ETP rank r holds [gate_r; up_r] (not split into _w/_v)."""
    w = labelled(8)  # rows 0..7: gate rows 0,2,4,6 and up rows 1,3,5,7
    assert origin(ref._gpt_oss_fc1(w, 1)) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert origin(ref._gpt_oss_fc1(w, 2)) == [0, 2, 1, 3, 4, 6, 5, 7]
