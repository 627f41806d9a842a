"""Paged decode attention, flash-decoding style: one query per sequence over its pages.

q [B, Hq, D]; k/v_cache [pages, page_size, Hkv, D]; page_tables [B, max_pages]; context_lens
[B] (keys visible, the query included); `window`: keys at positions > query - window.
Pass 1 (`_partial`): a program per (sequence, KV head, split) takes the KV head's q group as the
rows of one tile (padded to 16, `tl.dot`'s least), walks its partition's keys in BLOCK_N tiles
with an fp32 online softmax; an empty partition writes max -inf, sum 0. Pass 2 (`_reduce`): a
program per (sequence, q head) rescales the partitions to a common max and divides; one split
writes the output in pass 1.

Batch invariance: a sequence's partitions depend on its own view only, L_b =
roundup(max(ceil(in view / MAX_SPLITS), MIN_PARTITION), BLOCK_N), so its bits are the same in any
batch or CUDA graph bucket; the grid's split count (`split_count`) depends on shapes only.
Precision: bf16/fp16 on tensor cores with fp32 sums, probabilities rounded to the cache dtype
(as FlashAttention); fp32 caches use "ieee" products. Under the interpreter (`UPCAST`) operands
are upcast, its bf16 `tl.dot` being wrong. FP8 caches: e4m3 read as q's dtype, k_scale joins the
softmax scale, v_scale the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.fp8 import fp8_operands, from_e4m3
from treeserve.kernels.triton.pages import token_rows

BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
MAX_SPLITS = 32
MIN_PARTITION = 1024  # keys: views are cut into partitions of at least this many
PARTITION_SIZE = 512  # the previous rule: one split per 512 keys of table width


@triton.jit
def _partial(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    lens_ptr,
    max_ptr,
    sum_ptr,
    acc_ptr,
    scales_ptr,
    q_stride_b,
    q_stride_h,
    tables_stride,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    scale,
    window,
    num_splits,
    parts,
    min_length,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    FINAL: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Partials into [B, Hq, splits] (max, sum) and [B, Hq, splits, D]; FINAL: the output itself."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context = tl.load(lens_ptr + b).to(tl.int32)
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    length = tl.cdiv(tl.maximum(tl.cdiv(context - first, parts), min_length), BLOCK_N) * BLOCK_N  # whole tiles
    lo = first + part * length
    hi = tl.minimum(lo + length, context)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=q_mask, other=0.0)
    if KV_FP8:
        scale = scale * tl.load(scales_ptr)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = token_rows(
            tables_ptr,
            b,
            tables_stride,
            pos,
            valid,
            kv_head,
            cache_stride_page,
            cache_stride_slot,
            cache_stride_h,
            PAGE,
        )
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = from_e4m3(k).to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N] in fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = from_e4m3(v).to(q_ptr.dtype.element_ty)
            p = p.to(q_ptr.dtype.element_ty)
        else:
            p = p.to(v_cache_ptr.dtype.element_ty)  # as on tensor cores
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = (b * tl.num_programs(1) * GROUP + heads) * num_splits + part
    if KV_FP8:
        acc = acc * tl.load(scales_ptr + 1)
    if FINAL:
        acc = acc / l_i[:, None]
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc.to(acc_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(max_ptr + out, m_i, mask=g < GROUP)
        tl.store(sum_ptr + out, l_i, mask=g < GROUP)
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=q_mask)


@triton.jit
def _reduce(
    max_ptr,
    sum_ptr,
    acc_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    num_parts,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + h) * num_parts
    in_range = parts < num_parts
    m = tl.load(max_ptr + base + parts, mask=in_range, other=float("-inf"))
    m_all = tl.max(m, 0)
    weight = tl.where(in_range, tl.exp(m - m_all), 0.0)  # empty partitions weigh 0
    total = tl.sum(tl.load(sum_ptr + base + parts, mask=in_range, other=0.0) * weight, 0)
    acc_mask = in_range[:, None] & (d[None, :] < D)
    acc = tl.load(acc_ptr + (base + parts)[:, None] * D + d[None, :], mask=acc_mask, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def split_count(table_keys: int, window: int | None) -> int:
    """Partitions per (sequence, KV head) in the grid, from shapes only: what the longest view the
    page table allows needs, at most MAX_SPLITS; a sequence uses its own share."""
    view = min(table_keys, window) if window else table_keys
    return max(1, min(MAX_SPLITS, -(-view // MIN_PARTITION)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    partition_size: int | None = None,
    *,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. `num_splits` forces the split count (tests, benchmarks);
    `partition_size` is the previous rule. FP8 caches need the layer's `kv_scales`."""
    batch, q_heads, dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q_heads % kv_heads == 0
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    tables = tables.contiguous()
    context_lens = context_lens.contiguous()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_cache, v_cache, kv_scales = fp8_operands(k_cache, v_cache, kv_scales)
    table_keys = tables.shape[1] * page_size
    if partition_size is not None:
        block_n = min(block_n, partition_size)
        num_splits = num_splits or -(-table_keys // partition_size)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "a tile is a power of two of at least 16 keys"
    splits = num_splits or split_count(table_keys, window)
    # batch-invariant partitions; a forced count cuts every view into that many
    parts, min_length = (num_splits, 0) if num_splits else (MAX_SPLITS, MIN_PARTITION)
    group = q_heads // kv_heads
    block_d = max(triton.next_power_of_2(dim), 16)
    final = splits == 1
    if final:  # pass 1 writes the output
        maxes = sums = accs = out
    else:
        maxes = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
        accs = torch.empty(batch, q_heads, splits, dim, dtype=torch.float32, device=q.device)
    _partial[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        context_lens,
        maxes,
        sums,
        accs,
        kv_scales,
        q.stride(0),
        q.stride(1),
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale,
        window or 0,
        splits,
        parts,
        min_length,
        GROUP=group,
        D=dim,
        BLOCK_G=max(triton.next_power_of_2(group), 16),
        BLOCK_D=block_d,
        PAGE=page_size,
        BLOCK_N=block_n,
        UPCAST=q.device.type == "cpu",
        FINAL=final,
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not final:
        _reduce[(batch, q_heads)](
            maxes,
            sums,
            accs,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            D=dim,
            BLOCK_P=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )
    return out
