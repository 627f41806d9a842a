"""The page arena: one buffer of equal-sized pages (`PageArena`), viewed by each model in its
own shape (`KVArena`): a page is [layer, k/v, token, kv_head, head_dim] of `page_size` tokens,
the rest of the page idle when smaller. FP8 arenas store round(x / scale) in e4m3 with one
(k_scale, v_scale) a layer. Ownership of pages is `page_pool.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu.memory import huge_pages

PAGE_ALIGN = 64  # bytes: a cache line, and whole elements of any dtype
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def page_bytes(self, page_size: int) -> int:
        return -(-self.token_bytes * page_size // PAGE_ALIGN) * PAGE_ALIGN


def shared_page_sizes(layouts: list[KVLayout], preferred: list[int]) -> tuple[int, list[int]]:
    """Page bytes and per-model page sizes: the smallest preferred page, at least one token of
    the largest model; each model fits as many tokens as it can."""
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
    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pages: PageArena | None = None,
        scales: torch.Tensor | None = None,
    ):
        """`scales`: fp32 [num_layers, 2] (k_scale, v_scale) for FP8; None is 1.0, as vLLM."""
        layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype)
        if pages is None:
            pages = PageArena(num_pages, layout.page_bytes(page_size), device)
        if layout.token_bytes * page_size > pages.page_bytes:
            raise ValueError(
                f"{page_size} tokens of {layout.token_bytes} bytes do not fit a {pages.page_bytes}-byte page"
            )
        self.pages = pages
        self.num_pages = pages.num_pages
        self.page_size = page_size
        token = num_kv_heads * head_dim
        shape = (pages.num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        strides = (pages.page_bytes // dtype.itemsize, 2 * page_size * token, page_size * token, token, head_dim, 1)
        self.buffer = pages.buffer.view(dtype).as_strided(shape, strides)
        self._layers = [(self.buffer[:, i, 0], self.buffer[:, i, 1]) for i in range(num_layers)]  # views made once
        self.fp8 = dtype == FP8
        if scales is None:
            scales = torch.ones(num_layers, 2, dtype=torch.float32, device=pages.buffer.device)
        if scales.shape != (num_layers, 2) or scales.dtype != torch.float32:
            raise ValueError(
                f"KV scales must be fp32 [{num_layers}, 2] (k_scale, v_scale a layer), got "
                f"{scales.dtype} {list(scales.shape)}"
            )
        self.scales = scales

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return KVLayout(num_layers, num_kv_heads, head_dim, dtype).page_bytes(page_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each [num_pages, page_size, kv_heads, head_dim]."""
        return self._layers[index]

    def layer_scales(self, index: int) -> torch.Tensor | None:
        return self.scales[index] if self.fp8 else None

    def copy_slots(
        self, src_pages: torch.Tensor, src_offsets: torch.Tensor, dst_pages: torch.Tensor, dst_offsets: torch.Tensor
    ) -> None:
        """Copy slot (page, offset) i of `src` to slot i of `dst`, every layer; no slot is both."""
        copied = cpu_kernels.copy_slots(self.buffer, src_pages, src_offsets, dst_pages, dst_offsets)
        if src_pages.numel() and not copied:
            self.buffer[dst_pages, :, :, dst_offsets] = self.buffer[src_pages, :, :, src_offsets]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy page src[i] to page dst[i], every layer."""
        if not src.numel():
            return
        if self.buffer.device.type == "cpu":  # a copy a page: 3.6 us against indexing's 16.5 (one page)
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                self.buffer[d].copy_(self.buffer[s])
        else:
            self.buffer[dst] = self.buffer[src]
