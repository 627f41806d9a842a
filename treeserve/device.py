"""How much memory a device has, has free, and this process holds on it.

Plain queries used by the engine (its own KV budget) and the runtime's memory planner. CPU
numbers come from /proc and sysconf; CUDA numbers from the CUDA allocator (that branch is not
exercised on the CPU-only machines this project is tested on).
"""

from __future__ import annotations

import os

import torch


def available_memory(device: torch.device) -> int:
    """Bytes the device can still give us (free memory, not counting reclaimable caches twice)."""
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
    """Bytes this process holds on `device` now (resident set on CPU, allocator reserve on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
