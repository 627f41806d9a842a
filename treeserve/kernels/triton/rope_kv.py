"""Rotary embedding fused with the KV store, one program a token: q rotated into a new contiguous
[T, Hq, D]; k rotated and v written to their slots (`kv_store`'s layout and FP8 rule; page -1 is
a CUDA graph's padding row). Neox style, rounded as `RotaryEmbedding.__call__`'s three eager ops
with FMA contraction off: PyTorch's bits in fp32 and bf16, in the interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.fp8 import FP8, fp8_operands, inverse, to_e4m3
from treeserve.kernels.triton.rounding import round_to


@triton.jit
def _rotate(x_ptr, x1_offsets, mask, cos, sin, HALF: tl.constexpr, dtype: tl.constexpr):
    """The rotated halves of the rows at `x_ptr + x1_offsets` (first halves; second halves HALF on)."""
    x1 = tl.load(x_ptr + x1_offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x1_offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    first = round_to(round_to(x1 * cos, dtype) - round_to(x2 * sin, dtype), dtype)  # x*cos + (-x2)*sin
    second = round_to(round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype), dtype)
    return first.to(dtype), second.to(dtype)


@triton.jit
def _rope_store(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pages_ptr,
    offsets_ptr,
    scales_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    table_stride,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, BLOCK_HALF)[None, :]
    row = tl.load(positions_ptr + t).to(tl.int64) * table_stride
    cos = round_to(tl.load(cos_ptr + row + i, mask=i < HALF, other=0.0), dtype)
    sin = round_to(tl.load(sin_ptr + row + i, mask=i < HALF, other=0.0), dtype)

    h = tl.arange(0, BLOCK_Q)[:, None]
    mask = (h < Q_HEADS) & (i < HALF)
    first, second = _rotate(q_ptr, t * q_stride_t + h * q_stride_h + i, mask, cos, sin, HALF, dtype)
    out = q_out_ptr + (t * Q_HEADS + h) * D + i
    tl.store(out, first, mask=mask)
    tl.store(out + HALF, second, mask=mask)

    page = tl.load(pages_ptr + t).to(tl.int64)
    slot = page * cache_stride_page + tl.load(offsets_ptr + t).to(tl.int64) * cache_stride_slot
    h = tl.arange(0, BLOCK_KV)[:, None]
    stored = (h < KV_HEADS) & (h * 0 + page >= 0)  # page -1: a CUDA graph's padding row, stored nowhere
    mask = stored & (i < HALF)
    first, second = _rotate(k_ptr, t * k_stride_t + h * k_stride_h + i, mask, cos, sin, HALF, dtype)
    if KV_FP8:
        k_inverse = inverse(tl.load(scales_ptr))
        first = to_e4m3(first.to(tl.float32) * k_inverse)
        second = to_e4m3(second.to(tl.float32) * k_inverse)
    out = k_cache_ptr + slot + h * cache_stride_h + i
    tl.store(out, first, mask=mask)
    tl.store(out + HALF, second, mask=mask)

    d = tl.arange(0, BLOCK_D)[None, :]
    mask = stored & (d < D)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    if KV_FP8:
        v = to_e4m3(v.to(tl.float32) * inverse(tl.load(scales_ptr + 1)))
    tl.store(v_cache_ptr + slot + h * cache_stride_h + d, v, mask=mask)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated q [T, Hq, D]; rotated k and v stored in their slots (FP8 with `kv_scales`)."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    assert dim % 2 == 0 and k.shape == v.shape == (tokens, kv_heads, dim) and cos.shape == sin.shape
    assert cos.shape[1] == dim and cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride()
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    fp8 = k_cache.dtype == FP8
    assert q.dtype == k.dtype == v.dtype and v_cache.dtype == k_cache.dtype and (fp8 or k.dtype == k_cache.dtype)
    k_cache, v_cache, kv_scales = fp8_operands(k_cache, v_cache, kv_scales)
    _rope_store[(tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        positions.contiguous(),
        out,
        k_cache,
        v_cache,
        slot_pages.contiguous(),
        slot_offsets.contiguous(),
        kv_scales,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        Q_HEADS=q_heads,
        KV_HEADS=kv_heads,
        D=dim,
        BLOCK_Q=triton.next_power_of_2(q_heads),
        BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(dim // 2),
        BLOCK_D=triton.next_power_of_2(dim),
        KV_FP8=fp8,
        enable_fp_fusion=False,
    )
    return out
