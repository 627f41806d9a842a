"""Triton kernels: the KV store, paged decode and prefill attention, the sampler's draw, and
the layers' fused chains.

One file per kernel family (`kv_store`, `decode_attention`, `prefill_attention`,
`sampling`), each taking the same arguments as its C counterpart in `kernels/cpu`, so the
engine's attention backends swap families without reshaping anything. The fused chains
(`norm`: the residual add and RMS norm; `rope_kv`: rope and the KV store; `activation`:
act(gate) * up) replace runs of PyTorch ops in the model's forward, cutting a decode step's
launches on a GPU; layers pick them at load where `fused_layers` says yes. They run on CUDA
tensors, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` set before
triton is imported), which is how the test suite proves them on machines without a GPU.
Importing this package never imports triton (a CPU install has none): the kernel modules
do, and callers import them only after `available` said yes.
"""

from __future__ import annotations

import os

import torch


def _import_error() -> str | None:
    """Why triton cannot be imported, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def available(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else the reason, naming the fix."""
    error = _import_error()
    if error is not None:
        return f"triton is not importable ({error}): pip install 'treeserve[gpu]' (or pip install triton)"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "set TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors (the interpreter; for tests), "
            "or use attention_backend='cpu'/'sdpa'"
        )
    if device.type not in ("cpu", "cuda"):
        return f"the Triton kernels run on CUDA tensors (or CPU tensors in the interpreter), not {device.type!r} ones"
    return None


def fused_layers(device: torch.device) -> bool:
    """Whether layers on `device` use the fused chains (`norm`, `rope_kv`, `activation`): CUDA
    tensors with triton importable. Never CPU tensors, whose interpreter is for tests (they set
    the layers' `use_triton` flags by hand)."""
    return device.type == "cuda" and _import_error() is None
