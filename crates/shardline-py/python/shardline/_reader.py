"""`shardline.open`: a lazy reader for any DCP checkpoint, shaped like `safetensors.safe_open`.

Opening reads the checkpoint's index only (`.metadata`, or the safetensors headers). A tensor, or
a slice of one, is assembled from just the chunks that meet it, with positioned reads and no
process group; `last_read` says what that cost. Bytes items (`args`, `iteration`, ...) are
returned only when asked for, unpickled by a reader that never imports or calls what they name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterator

from ._native import Checkpoint

FRAMEWORKS = ("pt", "torch", "np", "numpy")


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a tensor: its box in the tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorMetadata:
    """A tensor's global shape, torch dtype name and stored chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def _numpy_dtype(name: str):
    import numpy as np

    plain = {"bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
             "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64}
    if name in plain:
        return np.dtype(plain[name])
    try:  # bfloat16 and float8 have no numpy dtype of their own; ml_dtypes provides them.
        import ml_dtypes
    except ImportError:
        raise TypeError(f"numpy has no {name}: install ml_dtypes, or read with framework='pt'") from None
    return np.dtype(getattr(ml_dtypes, name))


def _wrap(data: bytearray, dtype: str, shape: tuple[int, ...], framework: str):
    if framework in ("np", "numpy"):
        import numpy as np

        return np.frombuffer(data, dtype=_numpy_dtype(dtype)).reshape(shape)
    import torch

    torch_dtype = getattr(torch, dtype)
    if len(data) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(data, dtype=torch_dtype).reshape(shape)


def _box(index: Any, shape: tuple[int, ...]) -> tuple[list[int], list[int], tuple[Any, ...], tuple[int, ...]]:
    """The box of `shape` that `index` selects (ints, unit-or-larger-step slices, one
    Ellipsis), what to apply to the box once read (steps), and the result's shape."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1:]
    if len(items) > len(shape):
        raise IndexError(f"too many indices: {len(items)} for a tensor of {len(shape)} dimensions")
    items = items + (slice(None),) * (len(shape) - len(items))
    offsets, sizes, steps, result = [], [], [], []
    for d, (item, n) in enumerate(zip(items, shape)):
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step <= 0:
                raise ValueError(f"dimension {d}: a slice's step must be positive, not {step}")
            count = len(range(start, stop, step))
            offsets.append(start if count else 0)
            sizes.append((count - 1) * step + 1 if count else 0)
            steps.append(slice(None, None, step))
            result.append(count)
        else:
            try:
                i = operator.index(item)
            except TypeError:
                raise TypeError(f"dimension {d}: an index is an int or a slice, not {type(item).__name__}") from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for dimension {d} of size {n}")
            offsets.append(i % n)
            sizes.append(1)
            steps.append(0)
    return offsets, sizes, tuple(steps), tuple(result)


class TensorSlice:
    """`get_slice(key)`: indexing it reads only the selected box (`[rows, cols]`, `[..., 3]`)."""

    def __init__(self, reader: "CheckpointReader", key: str):
        self._reader, self._key = reader, key
        self._meta = reader.metadata(key)

    def get_shape(self) -> list[int]:
        return list(self._meta.shape)

    def get_dtype(self) -> str:
        return self._meta.dtype

    def __getitem__(self, index: Any):
        offsets, sizes, steps, result = _box(index, self._meta.shape)
        box = self._reader._read(self._key, self._meta.dtype, offsets, sizes)
        if any(isinstance(s, slice) and s.step != 1 for s in steps) or len(result) != len(sizes):
            box = box[steps]
            if self._reader._framework not in ("np", "numpy"):
                box = box.contiguous()
        return box


class CheckpointReader:
    """What `shardline.open` returns; use it as a context manager or on its own."""

    def __init__(self, path: str, framework: str = "pt"):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework {framework!r}: one of {', '.join(FRAMEWORKS)}")
        self._framework = framework
        self._ckpt = Checkpoint(str(path))
        self._keys = self._ckpt.tensor_keys()
        self.last_read: dict[str, int] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def path(self) -> str:
        """The directory the checkpoint's files are in."""
        return str(self._ckpt.dir)

    @property
    def format(self) -> str:
        return self._ckpt.format

    def keys(self) -> list[str]:
        """The tensors' keys, sorted."""
        return list(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys or key in self.object_keys()

    def object_keys(self) -> list[str]:
        """The bytes items' keys (`args`, `iteration`, ...)."""
        return self._ckpt.object_keys()

    def metadata(self, key: str) -> TensorMetadata:
        dtype, shape, chunks = self._ckpt.tensor(key)
        return TensorMetadata(dtype, tuple(shape), tuple(Chunk(tuple(o), tuple(s), f, a, n) for o, s, f, a, n in chunks))

    def get_tensor(self, key: str):
        """The whole tensor."""
        dtype, shape, _ = self._ckpt.tensor(key)
        return self._read(key, dtype, [0] * len(shape), list(shape))

    def get_slice(self, key: str) -> TensorSlice:
        return TensorSlice(self, key)

    def get_object(self, key: str) -> Any:
        """A bytes item, unpickled without running anything (see `PickledObject`)."""
        return self._ckpt.object(key)

    def get_object_bytes(self, key: str) -> bytes:
        """A bytes item's stored bytes (a `torch.save` archive), for `torch.load` if you trust it."""
        return self._ckpt.object_bytes(key)

    def _read(self, key: str, dtype: str, offsets: list[int], sizes: list[int]):
        data, self.last_read = self._ckpt.read(key, offsets, sizes)
        return _wrap(data, dtype, tuple(sizes), self._framework)


def open(path: str, framework: str = "pt") -> CheckpointReader:  # noqa: A001 (the name people know)
    """Opens a checkpoint for lazy reads: a DCP directory (Shardline's or torch's), a Megatron-LM
    save directory, a torchtitan folder, a NeMo Automodel save, or DCP-sharded safetensors.
    `framework`: "pt" for torch tensors, "np" for numpy arrays."""
    return CheckpointReader(path, framework)
