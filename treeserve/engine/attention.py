"""Paged attention for one step: the step's metadata and the three backends that run it.

Per layer the new tokens' K/V are written into their pages, then queries attend to their own
sequence's pages, in two groups: decodes (one query each) and prefill chunks (many). Backends:
`sdpa` (PyTorch, any device: the reference), `cpu` (the C kernels of `kernels/cpu`), `triton`
(`kernels/triton`). An FP8 arena stores e4m3(x / scale) and reads e4m3 * scale, per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu.layer_stack import DecodeGroup, PrefillGroup, StackPages
from treeserve.kv.arena import FP8, KVArena
from treeserve.layers.rotary import RotaryEmbedding


@dataclass
class SeqGroup:
    """Sequences of one shape class; tensors index the step's flat token batch."""

    page_tables: torch.Tensor  # [B, max_pages]
    context_lens: torch.Tensor  # [B]: tokens visible to the last query (cached + new)
    query_index: torch.Tensor  # [B, Q]: flat token index of each query (padding repeats the last)
    query_pos: torch.Tensor  # [B, Q]: absolute position of each query
    query_start: torch.Tensor  # [B]: flat token index of each sequence's first query
    query_len: torch.Tensor  # [B]: queries of each sequence
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.query_index.shape[1] == 1

    @cached_property
    def leads(self) -> bool:
        """Decodes whose queries are the step's first rows, in order (q[index] is q[:B]); the `cpu`
        backend's question, so read on the host (numpy: 2 us, where torch's compare took 6)."""
        rows = self.query_index.numpy()[:, 0]
        return self.is_decode and bool((rows == np.arange(rows.shape[0])).all())

    @property
    def query_valid(self) -> torch.Tensor:
        """[B, Q]: False for padding."""
        width = self.query_index.shape[1]
        return torch.arange(width, device=self.query_len.device)[None, :] < self.query_len[:, None]

    def mask(self, window: int | None, page_size: int) -> torch.Tensor:
        if window not in self.masks:
            keys = torch.arange(self.page_tables.shape[1] * page_size, device=self.query_pos.device)
            qpos = self.query_pos[:, :, None]
            allowed = keys[None, None, :] <= qpos
            if window is not None:
                allowed &= keys[None, None, :] > qpos - window
            self.masks[window] = allowed[:, None]  # [B, 1, Q, K]
        return self.masks[window]


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache stores for `x`: e4m3 of x * (1 / scale) in fp32 (nearest even, saturated at +-448)."""
    return (x.float() * (1 / scale)).to(FP8)


def from_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an FP8 cache's `x` reads as: e4m3 -> fp32, times `scale`, as `dtype`."""
    return (x.float() * scale).to(dtype)


class SdpaBackend:
    """The portable reference: gathered pages, SDPA with masks."""

    name = "sdpa"

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        offsets: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """`kv_scales`: an FP8 cache's (k_scale, v_scale) for this layer (None: the cache has k's dtype)."""
        if pages.device.type == "cpu" and bool((pages < 0).any()):  # padding rows (tests of cuda_graphs.py)
            keep = pages >= 0
            k, v, pages, offsets = k[keep], v[keep], pages[keep], offsets[keep]
        if kv_scales is not None:
            k, v = to_fp8(k, kv_scales[0]), to_fp8(v, kv_scales[1])
        k_cache[pages, offsets] = k
        v_cache[pages, offsets] = v

    def attend(
        self,
        group: SeqGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float | None,
        window: int | None,
        out: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Attention of `group`'s queries (rows of q) into the same rows of `out` (scale None: head_dim**-0.5)."""
        batch, pages = group.page_tables.shape
        page_size, kv_heads, head_dim = k_cache.shape[1:]
        tables = group.page_tables.flatten()
        keys = k_cache.index_select(0, tables).view(batch, pages * page_size, kv_heads, head_dim)
        values = v_cache.index_select(0, tables).view(batch, pages * page_size, kv_heads, head_dim)
        if kv_scales is not None:
            keys, values = from_fp8(keys, kv_scales[0], q.dtype), from_fp8(values, kv_scales[1], q.dtype)
        queries = q[group.query_index].transpose(1, 2)  # [B, Hq, Q, D]
        attended = F.scaled_dot_product_attention(
            queries,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.mask(window, page_size),
            scale=scale,
            enable_gqa=True,
        )
        valid = group.query_valid
        out[group.query_index[valid]] = attended.transpose(1, 2)[valid]


class CpuBackend(SdpaBackend):
    """C kernels where they apply (see `kernels/cpu`), SDPA elsewhere."""

    name = "cpu"

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        offsets: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        if not cpu_kernels.store_kv(k, v, k_cache, v_cache, pages, offsets, kv_scales):
            super().store(k, v, k_cache, v_cache, pages, offsets, kv_scales)

    def attend(
        self,
        group: SeqGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float | None,
        window: int | None,
        out: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        kernel_scale = scale or q.shape[-1] ** -0.5
        if group.is_decode and cpu_kernels.supports(q):
            args = (k_cache, v_cache, group.page_tables, group.context_lens, kernel_scale, window)
            if group.leads:  # no gather, no scatter: the kernel writes the rows in place
                rows = group.query_index.shape[0]
                cpu_kernels.paged_decode(q[:rows], *args, out=out[:rows], kv_scales=kv_scales)
            else:
                index = group.query_index[:, 0]
                out[index] = cpu_kernels.paged_decode(q[index], *args, kv_scales=kv_scales)
        elif cpu_kernels.prefill_supports(q, k_cache.dtype):
            cpu_kernels.paged_prefill(
                q,
                k_cache,
                v_cache,
                group.page_tables,
                group.query_start,
                group.query_len,
                group.context_lens,
                kernel_scale,
                window,
                out,
                kv_scales,
            )
        elif cpu_kernels.supports(q):
            out_rows, tables, lens = queries_as_decodes(group)
            out[out_rows] = cpu_kernels.paged_decode(
                q[out_rows], k_cache, v_cache, tables, lens, kernel_scale, window, kv_scales=kv_scales
            )
        else:
            super().attend(group, q, k_cache, v_cache, scale, window, out, kv_scales)


def queries_as_decodes(group: SeqGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill chunk as decodes, one a query: (rows, page tables, context lengths); a row's bits
    then never depend on the queries beside it, which SDPA's fp32 rows on a CPU do."""
    valid = group.query_valid
    seqs = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)[valid]
    return group.query_index[valid], group.page_tables[seqs], group.query_pos[valid] + 1


class TritonBackend:
    """The Triton kernels (`kernels/triton`): the KV store, flash-decoding, chunked prefill."""

    name = "triton"

    def __init__(self) -> None:
        from treeserve.kernels.triton import decode_attention, kv_store, prefill_attention, rope_kv

        self.store = kv_store.store_kv
        self.rope_store = rope_kv.rope_store_kv
        self._decode = decode_attention.paged_decode
        self._prefill = prefill_attention.paged_prefill

    def attend(
        self,
        group: SeqGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float | None,
        window: int | None,
        out: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        scale = scale or q.shape[-1] ** -0.5
        if group.is_decode:
            index = group.query_index[:, 0]
            tables, lens = group.page_tables, group.context_lens
            out[index] = self._decode(q[index], k_cache, v_cache, tables, lens, scale, window, kv_scales=kv_scales)
        else:
            self._prefill(
                q,
                k_cache,
                v_cache,
                group.page_tables,
                group.query_start,
                group.query_len,
                group.context_lens,
                scale,
                window,
                out,
                group.query_index.shape[1],
                kv_scales=kv_scales,
            )


AttentionBackend = SdpaBackend | CpuBackend | TritonBackend
BACKENDS: dict[str, type[AttentionBackend]] = {"sdpa": SdpaBackend, "cpu": CpuBackend, "triton": TritonBackend}


@dataclass
class AttentionBatch:
    """Everything attention needs for one step; passed explicitly to the model."""

    arena: KVArena
    slot_pages: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    groups: list[SeqGroup]
    backend: AttentionBackend
    scale: float | None = None

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        rope: tuple[RotaryEmbedding, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.arena.layer(layer)
        kv_scales = self.arena.layer_scales(layer)
        if rope is not None and self.backend.name == "triton":  # rotated as stored: one launch
            table, positions = rope
            q = self.backend.rope_store(
                q,
                k,
                v,
                table.cos,
                table.sin,
                positions,
                k_cache,
                v_cache,
                self.slot_pages,
                self.slot_offsets,
                kv_scales,
            )
        else:
            if rope is not None:
                q, k = rope[0](q, k, rope[1])
            self.backend.store(k, v, k_cache, v_cache, self.slot_pages, self.slot_offsets, kv_scales)
            q = q.contiguous()
        out = torch.empty_like(q)
        for group in self.groups:
            self.backend.attend(group, q, k_cache, v_cache, self.scale, window, out, kv_scales)
        return out

    def stack_pages(self) -> StackPages | None:
        """The pages and groups for `layers/layer_stack.py` on the `cpu` backend (None: layer by layer,
        as on an FP8 arena); prefill chunks only where `CpuBackend` runs them on the C kernel too."""
        if self.backend.name != "cpu" or self.arena.fp8:
            return None
        k_cache, _ = self.arena.layer(0)
        decodes = chunks = None
        for group in self.groups:
            if group.is_decode:
                rows = None if group.leads else group.query_index[:, 0].contiguous()
                decodes = DecodeGroup(group.page_tables, group.context_lens, rows)
            elif cpu_kernels.prefill_fits(k_cache.dtype, k_cache.shape[-1]):
                chunks = PrefillGroup(group.page_tables, group.query_start, group.query_len, group.context_lens)
            else:
                return None
        tensors = [self.slot_pages, self.slot_offsets]
        for group in (decodes, chunks):
            tensors += [] if group is None else [t for t in vars(group).values() if t is not None]
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors):
            return None
        buffer = self.arena.buffer  # [pages, layers, 2 (K, V), page_size, kv_heads, head_dim]
        return StackPages(
            k_cache, buffer.stride(1), buffer.stride(2), self.slot_pages, self.slot_offsets, decodes, chunks, self.scale
        )
