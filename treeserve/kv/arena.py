"""The page arena: one preallocated buffer of equal-sized pages, viewed by each model in its own shape.

`PageArena` owns the bytes: `num_pages` pages of `page_bytes` each, one buffer per device.
`KVArena` is one model's view of it: a page holds K and V of `block_size` tokens for every
layer of that model, contiguous (layout [page, layer, k/v, token, kv_head, head_dim]), so a
page is the unit the block manager hands out, copies (copy-on-write) and evicts, whichever
model it goes to. When a model's page content is smaller than `page_bytes` (see
`shared_block_sizes`), the rest of each page is unused by it. Which page belongs to whom is
the page pool's business (`page_pool.py`).

An FP8 arena (dtype torch.float8_e4m3fn, `kv_cache_dtype="fp8_e4m3"`) holds one byte a value,
so the same bytes hold twice the tokens of a bf16 one; `KVArena.scales` holds each layer's
(k_scale, v_scale): a stored value is round(x / scale) in e4m3, read back as e4m3 * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu.memory import huge_pages

PAGE_ALIGN = 64  # bytes: a page starts on a cache line and is a whole number of elements of any dtype
FP8 = torch.float8_e4m3fn  # the one-byte KV dtype the attention kernels read and write


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV cache per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def page_bytes(self, block_size: int) -> int:
        return -(-self.token_bytes * block_size // PAGE_ALIGN) * PAGE_ALIGN


def shared_block_sizes(layouts: list[KVLayout], preferred: list[int]) -> tuple[int, list[int]]:
    """Page bytes and per-model block sizes for models sharing one arena.

    The rule: the page is the smallest of the models' preferred pages (preferred block size x
    token bytes), but at least one token of the largest model; each model then gets as many
    tokens per page as fit. Models with equal token bytes get equal block sizes and use whole
    pages; otherwise a model uses `block_size x token_bytes` of each page and the rest is idle.
    """
    page = min(layout.page_bytes(bs) for layout, bs in zip(layouts, preferred, strict=True))
    page = max(page, max(layout.page_bytes(1) for layout in layouts))
    return page, [page // layout.token_bytes for layout in layouts]


class PageArena:
    def __init__(self, num_pages: int, page_bytes: int, device: torch.device | str):
        if num_pages < 1:
            raise ValueError(f"the KV budget is smaller than one page ({page_bytes} bytes)")
        if page_bytes % PAGE_ALIGN:
            raise ValueError(f"page_bytes must be a multiple of {PAGE_ALIGN}, got {page_bytes}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        nbytes = num_pages * page_bytes
        if torch.device(device).type == "cpu":  # in 2 MiB pages where Linux gives them
            self.buffer = huge_pages(nbytes)
        else:
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class KVArena:
    """One model's view of a `PageArena` (its own arena when none is given)."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pages: PageArena | None = None,
        scales: torch.Tensor | None = None,
    ):
        """`scales`: fp32 [num_layers, 2], each layer's (k_scale, v_scale) for an FP8 arena (None:
        1.0, what vLLM uses when a checkpoint ships none); a loader sets a checkpoint's own there."""
        layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype)
        if pages is None:
            pages = PageArena(num_blocks, layout.page_bytes(block_size), device)
        if layout.token_bytes * block_size > pages.page_bytes:
            raise ValueError(
                f"{block_size} tokens of {layout.token_bytes} bytes do not fit a {pages.page_bytes}-byte page"
            )
        self.pages = pages
        self.num_blocks = pages.num_pages
        self.block_size = block_size
        token = num_kv_heads * head_dim
        shape = (pages.num_pages, num_layers, 2, block_size, num_kv_heads, head_dim)
        strides = (pages.page_bytes // dtype.itemsize, 2 * block_size * token, block_size * token, token, head_dim, 1)
        self.buffer = pages.buffer.view(dtype).as_strided(shape, strides)
        self.fp8 = dtype == FP8
        if scales is None:
            scales = torch.ones(num_layers, 2, dtype=torch.float32, device=pages.buffer.device)
        if scales.shape != (num_layers, 2) or scales.dtype != torch.float32:
            raise ValueError(f"KV scales must be fp32 [{num_layers}, 2] (k_scale, v_scale a layer), got "
                             f"{scales.dtype} {list(scales.shape)}")
        self.scales = scales

    @staticmethod
    def page_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return KVLayout(num_layers, num_kv_heads, head_dim, dtype).page_bytes(block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each [num_blocks, block_size, kv_heads, head_dim]."""
        return self.buffer[:, index, 0], self.buffer[:, index, 1]

    def layer_scales(self, index: int) -> torch.Tensor | None:
        """Layer `index`'s fp32 (k_scale, v_scale) on the arena's device for an FP8 arena; None otherwise."""
        return self.scales[index] if self.fp8 else None

    def copy_slots(self, src_pages: torch.Tensor, src_offsets: torch.Tensor, dst_pages: torch.Tensor,
                   dst_offsets: torch.Tensor) -> None:  # fmt: skip
        """Copy single tokens' K/V, every layer: slot (page, offset) i of `src` to slot i of `dst` (no
        slot both: twins' new slots); in one C call on a CPU."""
        copied = cpu_kernels.copy_slots(self.buffer, src_pages, src_offsets, dst_pages, dst_offsets)
        if src_pages.numel() and not copied:
            self.buffer[dst_pages, :, :, dst_offsets] = self.buffer[src_pages, :, :, src_offsets]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages, every layer: page src[i] onto page dst[i] (index tensors on the arena's device)."""
        if src.numel():
            self.buffer[dst] = self.buffer[src]
