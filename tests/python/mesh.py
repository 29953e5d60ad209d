"""A device mesh and a free port: what the training checkpoint writer needs from the suite's
helpers, kept free of torch and safetensors so that torch 2.5's venv can import it."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    tp: int
    cp: int
    dp: int
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = the converter's default (tp)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def id(self) -> str:
        return f"tp{self.tp}-cp{self.cp}-dp{self.dp}-ep{self.ep}" + ("" if self.etp is None else f"-etp{self.etp}")

    def cli_args(self) -> list[str]:
        args = ["--tp", str(self.tp), "--dp", str(self.dp)]
        if self.cp != 1:
            args += ["--cp", str(self.cp)]
        if self.ep != 1:
            args += ["--ep", str(self.ep)]
        if self.etp is not None:
            args += ["--etp", str(self.etp)]
        return args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_gloo() -> None:
    """Leaves the process group after every rank got this far (at most 60 s), so that no rank
    tears its connections down while a peer is still in its last collective: gloo then aborts the
    peer ("terminate called without an active exception"), which once failed a 4-rank load on a
    loaded machine. A rank that raised gets here too, so the wait is short unless a rank died, and
    then the spawner has already seen it."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - a peer gone; the spawner reports it
        pass
    dist.destroy_process_group()
