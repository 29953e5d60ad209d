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
