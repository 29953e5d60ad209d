"""Types of the Rust half of `shardline` (`shardline._native`)."""

from os import PathLike
from typing import Any, Callable, Optional, Union

_Path = Union[str, PathLike[str]]
_Progress = Optional[Callable[[int, int], object]]

__version__: str

class ShardlineError(Exception):
    """An error Shardline reports: the CLI's message, whole."""

class PickledObject:
    """What a pickled bytes item would construct, described, never built."""

    callable: str
    args: Any
    kwargs: Any
    state: Any
    items: Optional[list[Any]]
    dict_items: Optional[dict[Any, Any]]

class ValidationReport:
    ok: bool
    tensors: int
    items: int
    bytes_checked: int
    findings: list[tuple[str, str]]
    findings_not_listed: int
    def __bool__(self) -> bool: ...

class Checkpoint:
    def __init__(self, path: _Path) -> None: ...
    @property
    def dir(self) -> str: ...
    @property
    def format(self) -> str: ...
    def tensor_keys(self) -> list[str]: ...
    def object_keys(self) -> list[str]: ...
    def tensor(self, key: str) -> tuple[str, list[int], list[tuple[list[int], list[int], str, int, int]]]: ...
    def read(self, key: str, offsets: list[int], sizes: list[int]) -> tuple[bytearray, dict[str, int]]: ...
    def object_bytes(self, key: str) -> bytes: ...
    def object(self, key: str) -> Any: ...

def convert(
    release: _Path,
    out: _Path,
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    target: str = "fsdp_dtensor",
    format: str = "dcp",
    prefix: Optional[str] = None,
    vocab_divisible_by: int = 128,
    optimizer_state: bool = False,
    overwrite: bool = False,
    threads: Optional[int] = None,
    torchtitan_version: Optional[str] = None,
    dtype: Optional[str] = None,
    zip_crc32: bool = False,
    progress: _Progress = None,
) -> dict[str, Any]:
    """Converts an HF release into a checkpoint for a mesh (the CLI's `convert`)."""

def plan(
    release: _Path,
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    target: str = "fsdp_dtensor",
    prefix: Optional[str] = None,
    vocab_divisible_by: int = 128,
    optimizer_state: bool = False,
    torchtitan_version: Optional[str] = None,
    dtype: Optional[str] = None,
) -> dict[str, Any]:
    """What `convert` would write, without writing (the CLI's `convert --dry-run --json`)."""

def validate(
    ckpt: _Path,
    against: _Path,
    *,
    prefix: Optional[str] = None,
    etp: int = 1,
    progress: _Progress = None,
) -> ValidationReport:
    """Checks a checkpoint against the release it came from, every byte (the CLI's `validate`)."""

def reshard(
    ckpt: _Path,
    out: Optional[_Path] = None,
    *,
    tp: int = 1,
    cp: int = 1,
    dp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    target: Optional[str] = None,
    from_mesh: Optional[str] = None,
    rng: str = "from-rank0",
    vocab_size: Optional[int] = None,
    vocab_divisible_by: Optional[int] = None,
    overwrite: bool = False,
    threads: Optional[int] = None,
    dry_run: bool = False,
    progress: _Progress = None,
) -> dict[str, Any]:
    """Reshards a training checkpoint for another mesh, or translates its dialect (the CLI's `reshard`)."""

def export(
    ckpt: _Path,
    out: _Path,
    *,
    like: Optional[_Path] = None,
    prefix: str = "model.module.",
    etp: Optional[int] = None,
    max_file_size: int = 5_000_000_000,
    overwrite: bool = False,
    threads: Optional[int] = None,
    progress: _Progress = None,
) -> dict[str, Any]:
    """Writes a checkpoint's model weights back as the HF release `like` (the CLI's `export`);
    without `like`, a NeMo Automodel save as the release its `model/.hf_metadata/` describes."""
