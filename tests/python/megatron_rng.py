"""Load the RNG states of a Megatron `torch_dist` checkpoint with Megatron-Core itself, as
Megatron-LM's `load_checkpoint` does, and restore them.

Megatron-LM (megatron/training/checkpointing.py, `get_rng_state` and `load_checkpoint`) requests
`rng_state` as a `ShardedObject` of global shape `(PP, TP)` at `(pp_rank, tp_rank)`, replicated
over data-parallel ranks, loads it with `dist_checkpointing.load`, takes element 0 of the list
(element `dp_rank` with `--data-parallel-random-init`) and hands its fields to `random.setstate`,
`np.random.set_state`, `torch.set_rng_state` (and the CUDA calls, which need a GPU: their values
are returned instead). This script makes the requests of every TP rank of one pipeline stage in
one load, in one gloo process, restores each state on CPU (which fails on a value of the wrong kind) and
saves what was loaded with `torch.save` for the caller to compare.

Usage: python megatron_rng.py CHECKPOINT_DIR TP OUT.pt
"""

import random
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist


def main(ckpt: str, tp: int, out: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            # Every TP rank's request in one load: Megatron-Core checks that the requests of all
            # ranks together cover each ShardedObject's grid.
            request = {f"rng_{t}": ShardedObject("rng_state", None, (1, tp), (0, t), replica_id=0) for t in range(tp)}
            result = dist_checkpointing.load(request, ckpt)
            loaded = []
            for t in range(tp):
                state = result[f"rng_{t}"]
                first = state[0]
                random.setstate(first["random_rng_state"])
                np.random.set_state(first["np_rng_state"])
                torch.set_rng_state(first["torch_rng_state"])
                for name, tracker in first["rng_tracker_states"].items():
                    assert isinstance(tracker, torch.Tensor) and tracker.dtype == torch.uint8, name
                loaded.append(state)
            torch.save(loaded, out)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
