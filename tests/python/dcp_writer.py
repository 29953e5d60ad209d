"""Writes a DCP checkpoint with torch's own `dcp.save` from several gloo ranks: DTensors sharded
unevenly (rows, columns, a 2-D mesh, a rank holding an empty shard), replicated tensors, a 0-d
one, and bytes items. Self-contained so that either venv runs it (torch 2.15 and torch 2.5):

    python dcp_writer.py OUT_DIR
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from mesh import leave_gloo

WORLD = 4


def global_tensors() -> dict[str, torch.Tensor]:
    """The same values on every rank (and in the test that checks them)."""
    g = torch.Generator().manual_seed(29)
    return {
        "rows": torch.randn(10, 6, generator=g),  # Shard(0) over 4: 3, 3, 3, 1 rows
        "cols": torch.randn(5, 7, generator=g).to(torch.bfloat16),  # Shard(1): 2, 2, 2, 1 columns
        "grid": torch.randn(9, 5, generator=g).to(torch.float16),  # 2x2 mesh: rows 5, 4; columns 3, 2
        "odd": torch.randn(3, 4, 5, generator=g).to(torch.float64),  # Shard(2): 2, 2, 1, 0 (an empty shard)
        "ids": torch.randint(-(2**40), 2**40, (7,), generator=g),  # replicated int64
        "flags": torch.randint(0, 2, (4,), generator=g).bool(),
        "scalar": torch.tensor(3.25),
    }


def bytes_items() -> dict:
    return {"step": 5, "args": argparse.Namespace(lr=0.1, name="run-7", layers=[1, 2])}


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        line = init_device_mesh("cpu", (WORLD,))
        square = init_device_mesh("cpu", (2, 2))
        t = global_tensors()
        state = {
            "rows": distribute_tensor(t["rows"], line, [Shard(0)]),
            "cols": distribute_tensor(t["cols"], line, [Shard(1)]),
            "grid": distribute_tensor(t["grid"], square, [Shard(0), Shard(1)]),
            "odd": distribute_tensor(t["odd"], line, [Shard(2)]),
            "ids": distribute_tensor(t["ids"], line, [Replicate()]),
            "flags": t["flags"],
            "scalar": t["scalar"],
            **bytes_items(),
        }
        dcp.save(state, checkpoint_id=out)
    except BaseException:
        raise RuntimeError(f"rank {rank}/{WORLD} failed:\n{traceback.format_exc()}") from None
    finally:
        leave_gloo()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, sys.argv[1]), nprocs=WORLD, join=True, start_method="spawn")
    print(torch.__version__)


if __name__ == "__main__":
    main()
