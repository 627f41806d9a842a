"""Triton kernels, each taking its C counterpart's arguments (`kv_store`, `decode_attention`,
`prefill_attention`, `sampling`), and fused layer chains (`norm`, `rope_kv`, `activation`).
They run on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (how tests prove them).
Importing this package never imports triton; callers import a kernel module after `available`.
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
    """Layers on `device` use the fused chains: CUDA with triton (tests set `use_triton` by hand)."""
    return device.type == "cuda" and _import_error() is None
