"""The KV store: write a step's new K and V rows into their (page, offset) slots of the cache.

k, v [T, Hkv, D] (views of the fused q/k/v projection are fine: their strides are passed)
go to k_cache[slot_pages[t], slot_offsets[t]] and v_cache likewise; the caches are one
layer's strided views of the shared page arena ([pages, page_size, Hkv, D], page stride
the arena's, V at its own offset from K). One program per token writes every head of it
and touches no other byte of the arena. An FP8 cache (torch.float8_e4m3fn) gets
e4m3(k * (1 / k_scale)) and e4m3(v * (1 / v_scale)), the layer's scales read from `kv_scales`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.fp8 import FP8, fp8_operands, inverse, to_e4m3


@triton.jit
def _store_kv(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pages_ptr,
    offsets_ptr,
    scales_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    page = tl.load(pages_ptr + t).to(tl.int64)
    offset = tl.load(offsets_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HEADS) & (d < D) & (h * 0 + page >= 0)  # page -1: a CUDA graph's padding row, stored nowhere
    slot = page * cache_stride_page + offset * cache_stride_slot + h * cache_stride_h + d
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    if KV_FP8:
        k = to_e4m3(k.to(tl.float32) * inverse(tl.load(scales_ptr)))
        v = to_e4m3(v.to(tl.float32) * inverse(tl.load(scales_ptr + 1)))
    tl.store(k_cache_ptr + slot, k, mask=mask)
    tl.store(v_cache_ptr + slot, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """k_cache[slot_pages[t], slot_offsets[t]] = k[t] and v_cache[...] = v[t] for every token t
    whose slot page is not -1 (a CUDA graph's padding rows: `engine/cuda_graphs.py`); an FP8
    cache's values scaled by the layer's fp32 `kv_scales` (k_scale, v_scale) first."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    fp8 = k_cache.dtype == FP8
    assert k.dtype == v.dtype and v_cache.dtype == k_cache.dtype and (fp8 or k.dtype == k_cache.dtype)
    k_cache, v_cache, kv_scales = fp8_operands(k_cache, v_cache, kv_scales)
    _store_kv[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_pages.contiguous(),
        slot_offsets.contiguous(),
        kv_scales,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEADS=heads,
        D=dim,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
        KV_FP8=fp8,
    )
