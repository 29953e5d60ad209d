"""Shardline from Python: HF releases to training-ready distributed checkpoints, and a lazy
reader for any PyTorch DCP checkpoint.

    import shardline
    shardline.convert("Qwen3-8B/", "ckpt/", tp=2, dp=4)      # the CLI's `convert`, from Python
    assert shardline.validate("ckpt/", against="Qwen3-8B/")  # every byte checked
    with shardline.open("ckpt/") as f:          # no process group, nothing loaded yet
        w = f.get_slice("model.module.embedding.word_embeddings.weight")[1000:1010]

The `shardline` command-line tool is installed with this package.
"""

from ._native import (
    PickledObject,
    ShardlineError,
    ValidationReport,
    __version__,
    convert,
    export,
    plan,
    reshard,
    validate,
)
from ._reader import Chunk, CheckpointReader, TensorMetadata, TensorSlice, open

__all__ = [
    "CheckpointReader",
    "Chunk",
    "PickledObject",
    "ShardlineError",
    "TensorMetadata",
    "TensorSlice",
    "ValidationReport",
    "__version__",
    "convert",
    "export",
    "open",
    "plan",
    "reshard",
    "validate",
]
