"""Paged decode attention, flash-decoding style: one query per sequence over its pages, in place.

q [B, Hq, D]; k_cache/v_cache [pages, block_size, Hkv, D] (one layer's views of the arena);
block_tables [B, max_pages]; context_lens [B] (keys visible to the query, itself included,
so the query sits at position context_len - 1); `window`: keys at positions > query - window.

Pass 1 (`_partial`): one program per (sequence, KV head, partition of `partition_size`
keys) takes all q heads of that KV head's group at once (GQA: each K/V row is read once
per group), walks the partition's keys in tiles of BLOCK_N through the block table, and
keeps an online-softmax running max, sum and weighted value sum in fp32. Partitions wholly
outside the window or past the context do nothing. Pass 2 (`_reduce`): one program per
(sequence, q head) rescales the partitions' partial results to a common max and divides.

All math is fp32: bf16 K/V rows are upcast as they are loaded (decode is memory-bound, so
tensor cores would gain nothing, and Triton's interpreter computes bf16 `tl.dot` wrongly).
The output has q's dtype. Refused: K and V caches with different strides, a head_dim or
page that is not contiguous, Hq not a multiple of Hkv, a partition_size not a multiple of
BLOCK_N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.pages import token_rows

PARTITION_SIZE = 512  # keys per pass-1 program: long contexts spread over many programs
BLOCK_N = 16  # keys per tile (also the smallest tl.dot dimension on a GPU)


@triton.jit
def _partial(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, max_ptr, sum_ptr, acc_ptr,
    q_stride_b, q_stride_h, tables_stride, cache_stride_page, cache_stride_slot, cache_stride_h,
    scale, window, num_parts,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context = tl.load(lens_ptr + b).to(tl.int32)
    first = part * PARTITION
    hi = tl.minimum(first + PARTITION, context)
    lo = tl.maximum(first, tl.where(window > 0, context - window, 0))  # in view: positions >= context - window
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = token_rows(tables_ptr, b, tables_stride, pos, valid, kv_head, cache_stride_page, cache_stride_slot,
                          cache_stride_h, PAGE)  # fmt: skip
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = (b * tl.num_programs(1) * GROUP + heads) * num_parts + part  # index into [B, Hq, parts]
    tl.store(max_ptr + out, m_i, mask=g < GROUP)
    tl.store(sum_ptr + out, l_i, mask=g < GROUP)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=q_mask)


@triton.jit
def _reduce(
    max_ptr, sum_ptr, acc_ptr, out_ptr, out_stride_b, out_stride_h, num_parts,
    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    base = (b * tl.num_programs(1) + h) * num_parts
    in_range = parts < num_parts
    m = tl.load(max_ptr + base + parts, mask=in_range, other=float("-inf"))
    m_all = tl.max(m, 0)
    weight = tl.where(in_range, tl.exp(m - m_all), 0.0)  # empty partitions (max -inf) weigh 0
    total = tl.sum(tl.load(sum_ptr + base + parts, mask=in_range, other=0.0) * weight, 0)
    acc_mask = in_range[:, None] & (d[None, :] < D)
    acc = tl.load(acc_ptr + (base + parts)[:, None] * D + d[None, :], mask=acc_mask, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    partition_size: int = PARTITION_SIZE,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; see the module docstring."""
    batch, q_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert partition_size % BLOCK_N == 0 and q_heads % kv_heads == 0
    out = torch.empty_like(q)
    if batch == 0:
        return out
    tables = tables.contiguous()
    context_lens = context_lens.contiguous()
    num_parts = -(-tables.shape[1] * block_size // partition_size)
    group = q_heads // kv_heads
    maxes = torch.empty(batch, q_heads, num_parts, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    accs = torch.empty(batch, q_heads, num_parts, dim, dtype=torch.float32, device=q.device)
    block_d = max(triton.next_power_of_2(dim), 16)
    _partial[(batch, kv_heads, num_parts)](
        q, k_cache, v_cache, tables, context_lens, maxes, sums, accs,
        q.stride(0), q.stride(1), tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale, window or 0, num_parts,
        GROUP=group, D=dim, BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_D=block_d,
        PAGE=block_size, PARTITION=partition_size, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    _reduce[(batch, q_heads)](
        maxes, sums, accs, out, out.stride(0), out.stride(1), num_parts,
        D=dim, BLOCK_P=triton.next_power_of_2(num_parts), BLOCK_D=block_d,
    )  # fmt: skip
    return out
