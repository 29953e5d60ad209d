"""RNG states of a `torch_dist` checkpoint Megatron-Core saved itself, translated both ways.

The checkpoint is written at test time by Megatron-Core's own `dist_checkpointing.save` (2 gloo
processes on CPU, megatron_fixture.py with `rng=True`), each rank's states as Megatron-LM's
`get_rng_state` makes them.
"""

from __future__ import annotations

import torch

import harness
import rng_check
from harness import Mesh

RESHARD_TIMEOUT_S = 120


def test_megatron_written_rng_states_translate_both_ways_and_megatron_core_restores_them(shardline, tmp_path):
    """A torch_dist checkpoint Megatron-Core saved itself with RNG states, made as Megatron-LM's
    `get_rng_state` makes them (a ShardedObject per TP rank, megatron_fixture.py --rng) →
    fsdp_dtensor: each TP rank's states under `rng_state.(0, t)`, as Megatron-FSDP keeps them,
    equal to what was saved; → torch_dist again: Megatron-Core loads them and random / numpy /
    torch take them back, equal."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import megatron_fixture as mf

    tp, iteration = 2, 7
    saved = mf.write_fixture(tmp_path / "mcore", tp=tp, iteration=iteration, rng=True)
    mesh = Mesh(tp, 1, 1, 1)
    fsdp, back = tmp_path / "fsdp", tmp_path / "back"
    for src, out, target in ((saved, fsdp, "fsdp_dtensor"), (fsdp, back, "torch_dist")):
        proc = harness.run_cli(["reshard", str(src), "--to", str(out), *mesh.cli_args(), "--target", target],
                               timeout=RESHARD_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "RNG" not in proc.stderr, proc.stderr
    dcp_to_torch_save(fsdp, tmp_path / "fsdp.pt")
    state = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert sorted(state["rng_state"]) == [f"(0, {t})" for t in range(tp)]
    for t in range(tp):
        rng_check.assert_same_rng(state["rng_state"][f"(0, {t})"], mf.rng_state_list(t))
    loaded = rng_check.megatron_rng(back / f"iter_{iteration:07d}", tp, tmp_path)
    for t in range(tp):
        rng_check.assert_same_rng(loaded[t], mf.rng_state_list(t))
