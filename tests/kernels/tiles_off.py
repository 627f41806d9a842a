"""Run a products function in a child process that may not use AMX (TREESERVE_AMX=0), so a test
can compare the tiles' bits with the VNNI path's in one machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

_CHILD = """
import importlib, sys, torch
from treeserve.kernels import cpu as cpu_kernels
assert cpu_kernels.load_amx() is None
module, name = sys.argv[1].split(":")
products = getattr(importlib.import_module(module), name)
torch.save(products(torch.load(sys.argv[2])), sys.argv[3])
"""


def products_without_tiles(products: str, x: torch.Tensor, tmp_path: Path) -> dict[str, torch.Tensor]:
    """`products` ("module:function", taking x, returning named tensors) of x with TREESERVE_AMX=0."""
    torch.save(x, tmp_path / "x.pt")
    subprocess.run(
        [sys.executable, "-c", _CHILD, products, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
        env={**os.environ, "TREESERVE_AMX": "0"},
        check=True,
        cwd=Path(__file__).parents[2],
    )
    return torch.load(tmp_path / "out.pt")
