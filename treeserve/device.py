"""Which device and attention backend an engine runs on, and how much memory that device has.

`resolve_device` and `resolve_attention_backend` check the user's settings (or pick the
defaults) before any model loads. The memory queries read /proc and sysconf on a CPU,
`torch.cuda.mem_get_info` on CUDA.
"""

from __future__ import annotations

import ctypes
import os

import torch

ATTENTION_BACKENDS = ("triton", "sdpa", "cpu")


def resolve_device(device: str | None) -> str:
    """The device an engine runs on: `device`, checked, or "cuda" when torch sees a GPU, else "cpu"."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from None
    if parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"device={device!r} but torch.cuda.is_available() is False (torch {torch.__version__}, {build}): "
            "install a CUDA build of torch on a machine with an NVIDIA GPU, or use device='cpu'"
        )
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return str(parsed)


def resolve_attention_backend(backend: str | None, device: str) -> str:
    """`backend` checked against `device`, or the device's default ("triton" on CUDA, "cpu")."""
    kind = torch.device(device).type
    if backend is None:
        backend = "triton" if kind == "cuda" else "cpu"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "cpu" and kind != "cpu":
        raise ValueError(
            f"attention_backend='cpu' runs C kernels on host memory; device is {device!r}: use 'triton' or 'sdpa'"
        )
    if backend == "triton":
        from treeserve.kernels.triton import available

        reason = available(torch.device(device))
        if reason is not None:
            raise ValueError(f"attention_backend='triton' cannot run here: {reason}")
    return backend


def available_memory(device: torch.device) -> int:
    """Bytes the device can still give (free memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemFree"])


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_memory(device: torch.device) -> int:
    """Bytes in use on `device`: this process's resident set on a CPU; on CUDA total - free,
    which also counts the CUDA context and workspaces a load brings."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`, where there is one)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
