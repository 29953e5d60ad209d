"""Long-lived torch loader for the mutation test (test_mutations.py).

Started as `python mutation_worker.py SPEC.json`, where SPEC lists what to request: tensor keys with
their global shape and dtype, and bytes keys, all taken from the UNMUTATED checkpoint so that a
mutated .metadata cannot change what is asked for. Then, one JSON request per stdin line,
{"ckpt": DIR}, answered by one JSON line: {"ok": true, "digests": {key: sha256}} or
{"ok": false, "error_type": ..., "error": ...}.

It runs in its own process so that a torch crash or hang on a mutant costs the test one restart,
not the pytest session. The reply channel is a private copy of fd 1; fd 1 itself is pointed at
stderr so that anything torch or C code prints cannot corrupt the protocol.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import traceback
import warnings


def _protocol_channel():
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return reply


def _target_state(spec: dict):
    import torch

    state = {}
    for key, (shape, dtype) in spec["tensors"].items():
        dt = getattr(torch, dtype)
        # NaN (or an unlikely integer) marks regions dcp.load never wrote: they then differ from the baseline.
        fill = float("nan") if dt.is_floating_point else -7
        state[key] = torch.full(tuple(shape), fill, dtype=dt)
    for key in spec["bytes"]:
        state[key] = io.BytesIO()
    return state


def _digest(value) -> str:
    import torch

    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        h.update(str(value.dtype).encode())
        h.update(repr(tuple(value.shape)).encode())
        h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, io.BytesIO):
        h.update(value.getvalue())
    else:  # bytes items come back as whatever torch.load made of them
        h.update(repr(value).encode())
    return h.hexdigest()


def _describe(e: BaseException) -> tuple[str, str]:
    """Exception type and one-paragraph message; a CheckpointException is unwrapped to the rank's error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            e = inner
    message = "".join(traceback.format_exception_only(type(e), e)).strip()
    return type(e).__name__, message[:600]


def load_once(spec: dict, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp

    state = _target_state(spec)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt))
    except BaseException as e:  # noqa: BLE001  CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        kind, message = _describe(e)
        return {"ok": False, "error_type": kind, "error": message}
    return {"ok": True, "digests": {k: _digest(v) for k, v in state.items()}}


def main() -> None:
    reply = _protocol_channel()
    import torch

    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    reply.write(json.dumps({"ready": True, "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply.write(json.dumps(load_once(spec, request["ckpt"])) + "\n")


if __name__ == "__main__":
    main()
