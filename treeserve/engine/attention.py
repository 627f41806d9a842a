"""The portable paged-attention backend: PyTorch SDPA over pages gathered by block table.

Per layer, the new tokens' K/V are written into their pages (slot = page, offset), then
queries attend to the pages of their own sequence. Sequences are split in two groups so
neither pays for the other's shape: decodes (one query each) and prefill chunks (many
queries each, padded to the longest chunk of this step only). Masks are built once per
step and window, not per layer. Runs on any device PyTorch runs on. On a CPU, C kernels
read the pages in place instead of gathering them, when they could be built: decodes go
through `cpu_kernels.paged_decode`, and bf16 prefill chunks through `cpu_kernels.paged_prefill`
(no padding, no mask). SDPA remains the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kv.arena import KVArena


@dataclass
class SeqGroup:
    """Sequences of one shape class; tensors index the step's flat token batch."""

    block_tables: torch.Tensor  # [B, max_pages]
    context_lens: torch.Tensor  # [B]: tokens visible to the last query (cached + new)
    query_index: torch.Tensor  # [B, Q]: flat token index of each query (padding repeats the last)
    query_pos: torch.Tensor  # [B, Q]: absolute position of each query
    query_valid: torch.Tensor  # [B, Q]: False for padding
    query_start: torch.Tensor  # [B]: flat token index of each sequence's first query
    query_len: torch.Tensor  # [B]: queries of each sequence
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            keys = torch.arange(self.block_tables.shape[1] * block_size, device=self.query_pos.device)
            qpos = self.query_pos[:, :, None]
            allowed = keys[None, None, :] <= qpos
            if window is not None:
                allowed &= keys[None, None, :] > qpos - window
            self.masks[window] = allowed[:, None]  # [B, 1, Q, K]
        return self.masks[window]


@dataclass
class AttentionBatch:
    """Everything attention needs for one step; passed explicitly to the model."""

    arena: KVArena
    slot_pages: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    groups: list[SeqGroup]
    scale: float | None = None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        k_cache, v_cache = self.arena.layer(layer)
        k_cache[self.slot_pages, self.slot_offsets] = k
        v_cache[self.slot_pages, self.slot_offsets] = v
        out = torch.empty_like(q)
        scale = self.scale or q.shape[-1] ** -0.5
        for group in self.groups:
            if group.query_index.shape[1] == 1 and cpu_kernels.supports(q):
                index = group.query_index[:, 0]
                out[index] = cpu_kernels.paged_decode(
                    q[index], k_cache, v_cache, group.block_tables, group.context_lens, scale, window
                )
            elif cpu_kernels.prefill_supports(q):
                cpu_kernels.paged_prefill(
                    q, k_cache, v_cache, group.block_tables, group.query_start, group.query_len,
                    group.context_lens, scale, window, out,
                )  # fmt: skip
            else:
                out[group.query_index[group.query_valid]] = self._attend(group, q, k_cache, v_cache, window)
        return out

    def _attend(
        self, group: SeqGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        batch, pages = group.block_tables.shape
        block_size, kv_heads, head_dim = k_cache.shape[1:]
        tables = group.block_tables.flatten()  # index_select copies pages ~3x faster than [] indexing on CPU
        keys = k_cache.index_select(0, tables).view(batch, pages * block_size, kv_heads, head_dim)
        values = v_cache.index_select(0, tables).view(batch, pages * block_size, kv_heads, head_dim)
        queries = q[group.query_index].transpose(1, 2)  # [B, Hq, Q, D]
        out = F.scaled_dot_product_attention(
            queries,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.mask(window, block_size),
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)[group.query_valid]  # [valid queries, Hq, D]
