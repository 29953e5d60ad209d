"""Regenerates the torch-written fixtures for the DCP and torch.save readers' unit tests.

Run from any directory with a Python that has torch (these files came from torch 2.15.0, CPU,
Python 3.11); it rewrites the files next to this script. No process group is needed: dcp.save
runs single-process.

  ckpt/.metadata, ckpt/__0_0.distcp   dcp.save of a small state dict (tensors and bytes items)
  view.pt                             torch.save of a view: storage offset 2 into a 10-element storage
  transposed.pt                       torch.save of a transposed (non-contiguous) tensor
"""

import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

here = os.path.dirname(os.path.abspath(__file__))
os.chdir(here)
shutil.rmtree("ckpt", ignore_errors=True)

state_dict = {
    "model": {
        "w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "f8": torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn),
    },
    "step": torch.tensor(2.5),
    "lr": 0.1,
    "iteration": 7,
}
dcp.save(state_dict, checkpoint_id="ckpt")

torch.save(torch.arange(10, dtype=torch.float32)[2:5], "view.pt")
torch.save(torch.arange(12, dtype=torch.int16).reshape(3, 4).t(), "transposed.pt")
