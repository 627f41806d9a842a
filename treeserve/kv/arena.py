"""The page arena: one preallocated KV buffer, cut into pages of `block_size` tokens.

A page holds K and V of `block_size` tokens for every layer of one model and is contiguous
in memory (layout [page, layer, k/v, token, kv_head, head_dim]), so a page is the unit that
the block manager hands out, copies (copy-on-write) and evicts. Each layer sees the arena
through strided views. This module owns the bytes; which page belongs to whom is the
block manager's business.
"""

from __future__ import annotations

import torch


def available_memory(device: torch.device) -> int:
    """Bytes the device can still give us (free memory, not counting reclaimable caches twice)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemFree"])


class KVArena:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_blocks < 1:
            raise ValueError("the KV memory budget is smaller than one page")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def page_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.buffer[:, index, 0], self.buffer[:, index, 1]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.buffer.device)
            dst = torch.tensor([d for _, d in copies], device=self.buffer.device)
            self.buffer[dst] = self.buffer[src]
