"""Load converted DCP checkpoints with an old torch (run by .venv-torch25's interpreter).

usage: old_torch_load.py SPEC.json OUT.pt
SPEC.json: [{"label": str, "ckpt": dir, "tensors": {key: [shape, dtype name]}}, ...]
OUT.pt:    torch.save({"torch": version, "jobs": {label: {"meta": {key: [size, dtype]},
                                                            "tensors": {key: tensor}, "error": str|None}}})
Only torch is needed here; the comparison with the reference happens in the main suite.
"""

import json
import sys
import traceback
import warnings

import torch
import torch.distributed.checkpoint as dcp


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"torch": torch.__version__, "jobs": {}}
    for job in spec:
        entry = {"meta": {}, "tensors": {}, "error": None}
        result["jobs"][job["label"]] = entry
        try:
            md = dcp.FileSystemReader(job["ckpt"]).read_metadata()
            for key, m in md.state_dict_metadata.items():
                if hasattr(m, "size"):
                    entry["meta"][key] = [list(m.size), str(m.properties.dtype).removeprefix("torch.")]
            state = {key: torch.full(tuple(shape), float("nan"), dtype=getattr(torch, dtype))
                     for key, (shape, dtype) in job["tensors"].items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=dcp.FileSystemReader(job["ckpt"]))
            entry["tensors"] = state
        except BaseException:  # CheckpointException is a BaseException
            entry["error"] = traceback.format_exc()
    torch.save(result, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
