"""Write the `torch_dist` checkpoints saved by Megatron-Core itself that the suite keeps as fixtures.

Regenerate both (from the repository root, after scripts/setup-python):

    .venv/bin/python tests/python/megatron_fixture.py
    .venv/bin/python tests/python/megatron_fixture.py --hf tests/fixtures/hf-tiny/qwen3_moe --tp 1 --ep 2 \
        --out tests/fixtures/torch-dist-qwen3_moe-tp1ep2

- tests/fixtures/torch-dist-llama-tp2: the tiny HF llama (2 layers, hidden 64, 8 heads / 2 query
  groups, head dim 8, SwiGLU 128, vocab 256, untied), 2 gloo processes at TP=2.
- tests/fixtures/torch-dist-qwen3_moe-tp1ep2: the tiny HF qwen3_moe (8 experts, top-2, expert
  SwiGLU 32, q/k norms), 2 gloo processes at TP=1, EP=2 (expert TP 1).

Both were written by megatron-core 0.16.1 (PyPI) on torch 2.15.0, CPU only, PP=1. Re-running
gives byte-identical `.distcp` files, `common.pt`, `metadata.json` and tracker; the `.metadata`
is equal as metadata (same tensors, chunks and storage entries) but its pickle differs: the order
of the storage entries (two writer threads), the save's uuid and `storage_meta.checkpoint_id`,
the absolute path it was saved to.

How it is made
--------------
1. Each process builds Megatron-Core's `GPTModel` for the HF release with the local layer spec,
   bf16 parameters on CPU (megatron_load.build_model, the same model the loader builds).
2. Its parameters are set from the HF tensors through the suite's independent mapping
   (reference.py, via megatron_load.expected_globals: QKV interleaved per query group, fc1 =
   [gate; up], experts stacked, vocabulary padded to 128·TP), each rank taking its part by
   Megatron's TP/EP rules (column-parallel: row chunk r; row-parallel: column chunk r; SwiGLU
   fc1: [gate_r; up_r]; norms and router replicated; EP rank p holds experts p·E/ep ..; expert
   weights split by expert TP). Nothing here uses Megatron-Core's checkpoint sharding to place
   values: where they land on disk is Megatron-Core's doing, which is what the loader checks.
3. The state dict is the one Megatron-LM's training loop saves without optimizer and RNG
   (`generate_state_dict`: `args`, `checkpoint_version` 3.0, `iteration`,
   `num_floating_point_operations_so_far`, `model` = `model.sharded_state_dict(metadata=…)`),
   saved with `dist_checkpointing.save` and the default `torch_dist` strategy wrapped in
   `FullyParallelSaveStrategyWrapper` (as Megatron-LM does), with the content metadata
   `{'singleton_local_shards': False, 'chained_optim_avoid_prefix': True}`.
   Megatron-Core's save makes two CUDA calls on CPU-only machines (`torch.cuda.synchronize()` in
   `FileSystemWriterAsync.preload_tensors`, `torch.cuda.current_device()` for the failure flag in
   `save_state_dict_async_finalize`); they are patched to no-op / 'cpu' in this process only.
4. The save root gets `latest_checkpointed_iteration.txt` = `release` and the checkpoint goes to
   `release/`: Megatron-LM's `read_metadata` asserts `iteration > 0 or release`, so a converted
   checkpoint at iteration 0 must be a release one (and a release load skips optimizer/RNG).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_load as ml  # noqa: E402
import reference as ref  # noqa: E402
import harness  # noqa: E402
from harness import FIXTURES, ROOT  # noqa: E402
from mesh import free_port  # noqa: E402

HF_DIR = FIXTURES / "llama"
OUT = ROOT / "tests" / "fixtures" / "torch-dist-llama-tp2"
TP = 2

# Local-spec parameter names -> the reference's (TE-spec) per-layer names (the MoE pre-MLP norm
# keeps its name: the reference, like the TE spec, has `pre_mlp_layernorm.weight` there).
_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


@dataclass
class Ranks:
    tp: int
    tp_rank: int
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    num_experts: int = 0


def local_part(name: str, param, glob: dict[str, torch.Tensor], r: Ranks) -> torch.Tensor:
    """The value this rank holds for parameter `name`, from the expected global tensors, by
    Megatron's TP/EP rules (independent of its checkpoint code)."""
    tp, rank = r.tp, r.tp_rank
    m = ml._LAYER.fullmatch(name)
    if m:
        i, sub = int(m.group(1)), m.group(2)
        e = _LOCAL_EXPERT.fullmatch(sub)
        if e:  # local expert j of EP rank p is global expert p * E/ep + j; sharded by expert TP
            g = r.ep_rank * (r.num_experts // r.ep) + int(e.group(1))
            full = glob[f"decoder.layers.mlp.experts.experts.{e.group(2)}"][i, g]
            tp, rank = r.etp, r.etp_rank
        else:
            renamed = f"decoder.layers.{_RENAMES.get(sub, sub)}"
            full = glob[renamed if renamed in glob else f"decoder.layers.{sub}"][i]
    else:
        full = glob[name]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, 0)[rank], torch.chunk(up, tp, 0)[rank]], dim=0)
    return torch.chunk(full, tp, dim=dim)[rank]


def _patch_cuda_for_cpu_save() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def mlm_args(hf_dir, tp: int, ep: int = 1, etp: int | None = None) -> Namespace:
    """The part of Megatron-LM's `args` its loaders read (brief torch-dist.md §1.4)."""
    cfg = ref.load_config(hf_dir)
    return Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts"),
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        group_query_attention=True, num_query_groups=cfg["num_key_value_heads"], kv_channels=ref._head_dim(cfg),
        qk_layernorm=ml.hf_arch(hf_dir) == "qwen3_moe",
        max_position_embeddings=cfg["max_position_embeddings"], position_embedding_type="rope",
        add_position_embedding=False, swiglu=True, normalization="RMSNorm", norm_epsilon=cfg["rms_norm_eps"],
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        disable_bias_linear=True, add_qkv_bias=False, make_vocab_size_divisible_by=ref.VOCAB_DIVISOR,
        padded_vocab_size=ref.padded_vocab_size(cfg["vocab_size"], tp), bf16=True, fp16=False,
        params_dtype=torch.bfloat16, ckpt_format="torch_dist", use_distributed_optimizer=False,
        no_save_optim=True, no_save_rng=True, iteration=0, consumed_train_samples=0,
        skipped_train_samples=0, consumed_valid_samples=0, transformer_impl="local")


def rng_state_list(tp_rank: int) -> list[dict]:
    """What Megatron-LM's `get_rng_state` returns for one rank (`data_parallel_random_init` off):
    a one-element list of the rank's states, here made deterministic per TP rank
    (training_ckpt.rng_entry: python, numpy, torch, the CUDA state and the three trackers)."""
    import training_ckpt as tc

    return [tc.rng_entry(tp_rank)]


def _worker(rank: int, world: int, port: int, out: str, hf_dir: str, arch: str, tp: int, ep: int,
            etp: int, iteration: int, rng: bool) -> None:
    ml.quiet_megatron()
    ml.init_gloo(rank, world, port)
    try:
        _patch_cuda_for_cpu_save()
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        ml.init_model_parallel(tp, ep, etp)
        model = ml.build_model(hf_dir, arch, tp, ep, etp)
        glob = ml.expected_globals(hf_dir, tp, etp)
        ranks = Ranks(tp, ps.get_tensor_model_parallel_rank(), ep, ps.get_expert_model_parallel_rank(),
                      etp, ps.get_expert_tensor_parallel_rank(), model.config.num_moe_experts or 0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                value = local_part(name, param, glob, ranks)
                if value.shape != param.shape or value.dtype != param.dtype:
                    raise AssertionError(f"{name}: mapped {tuple(value.shape)} {value.dtype}, "
                                         f"parameter {tuple(param.shape)} {param.dtype}")
                param.copy_(value)
        args = mlm_args(hf_dir, tp, ep, etp)
        args.iteration, args.no_save_rng = iteration, not rng
        state_dict = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "num_floating_point_operations_so_far": 0,
            "model": ml.sharded_request(model),
        }
        if rng:
            # Megatron-LM's `get_rng_state` for torch_dist (checkpointing.py): a ShardedObject of
            # global shape (PP, TP) at (pp_rank, tp_rank), replicated over data-parallel ranks.
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            tp_rank = ps.get_tensor_model_parallel_rank()
            state_dict["rng_state"] = ShardedObject(
                "rng_state", rng_state_list(tp_rank), (1, tp), (0, tp_rank),
                replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"), ps.get_data_parallel_group(with_context_parallel=True))
        ckpt_dir = Path(out) / (f"iter_{iteration:07d}" if iteration else "release")
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=False)
        torch.distributed.barrier()
        dist_checkpointing.save(state_dict, str(ckpt_dir), sharded_strategy=strategy,
                                content_metadata=dict(ml.CONTENT_METADATA))
        torch.distributed.barrier()
        if rank == 0:
            (Path(out) / ml.TRACKER).write_text(str(iteration) if iteration else "release")
    finally:
        harness.leave_gloo()


def write_fixture(out: Path, hf_dir=HF_DIR, arch: str | None = None, tp: int = TP, ep: int = 1,
                  etp: int | None = None, iteration: int = 0, rng: bool = False) -> Path:
    """Megatron-Core saves the release at (tp, ep, etp) into the save root `out` (replaced); with
    an `iteration`, as `iter_NNNNNNN/`, and with `rng`, each rank's RNG states too."""
    import torch.multiprocessing as mp

    out = Path(out)
    arch = arch or ml.hf_arch(hf_dir)
    etp = etp or tp
    world = ml.world_size_for(tp, ep, etp)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    mp.spawn(_worker, args=(world, free_port(), str(out), str(hf_dir), arch, tp, ep, etp, iteration, rng),
             nprocs=world, join=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--hf", type=Path, default=HF_DIR, help="HF release (default: the tiny llama)")
    p.add_argument("--arch", choices=ml.ARCHS, default=None)
    p.add_argument("--tp", type=int, default=TP)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    a = p.parse_args(argv)
    out = write_fixture(a.out, a.hf, a.arch, a.tp, a.ep, a.etp)
    ml.quiet_megatron()
    import megatron.core
    files = sorted(f for f in out.rglob("*") if f.is_file())
    for f in files:
        print(f"{f.relative_to(out)}  {f.stat().st_size} bytes")
    print(f"wrote {out} with megatron-core {megatron.core.__version__}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
