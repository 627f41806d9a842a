"""Paged prefill attention: each sequence's chunk of queries over its cached pages and itself
(prompt and chunked prefill, PRM scoring, speculative verification). q and out [T, Hq, D] are
the flat batch; sequence b's queries are rows q_starts[b] .. + q_lens[b] - 1, the last at position
context_lens[b] - 1, its own K/V already stored. Causal, with an optional sliding `window`.

FlashAttention-2 with the GQA group packed into the tile: a program per (BLOCK_Q query positions,
KV head, sequence); row r is position r // GROUP, q head kv_head * GROUP + r % GROUP, so each K/V
tile is loaded once for the group. fp32 online softmax in log2 units; only tiles at the diagonal
or the window's edge are masked. Precision and FP8 as in `decode_attention.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.fp8 import fp8_operands, from_e4m3
from treeserve.kernels.triton.pages import token_rows

# Launch defaults from an H100 sweep (bf16, head_dim 128, PRM steps); each is a keyword of `paged_prefill`.
BLOCK_M = 64  # rows per program: query positions x the GQA group's q heads
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
# Rows wider than 256 bytes: fewer keys a tile and stages, more warps (untuned).
WIDE_BLOCK_N = 32
WIDE_NUM_WARPS = 8
WIDE_NUM_STAGES = 2


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start,
    hi,
    window,
    d,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq,
    tables_stride,
    kv_head,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    qk_scale,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One key tile into the online softmax state (acc, m_i in log2 units, l_i); MASKED: causal/window."""
    pos = start + tl.arange(0, BLOCK_N)
    k_valid = pos < hi
    rows = token_rows(
        tables_ptr,
        seq,
        tables_stride,
        pos,
        k_valid,
        kv_head,
        cache_stride_page,
        cache_stride_slot,
        cache_stride_h,
        PAGE,
    )
    kv_mask = k_valid[:, None] & (d[None, :] < D)
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        k = from_e4m3(k).to(DTYPE)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
    if MASKED:
        seen = k_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        seen &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key in view yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        v = from_e4m3(v).to(DTYPE)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # bf16 caches: p rounded to bf16 for the second matmul, as on tensor cores
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    starts_ptr,
    lens_ptr,
    context_ptr,
    out_ptr,
    scales_ptr,
    q_stride_t,
    q_stride_h,
    tables_stride,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    scale,
    window,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    BLOCK_Q = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # a sequence's last tiles (the most keys) first
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    num_queries = tl.load(lens_ptr + b).to(tl.int32)
    if tile * BLOCK_Q < num_queries:
        first_row = tl.load(starts_ptr + b)
        context = tl.load(context_ptr + b).to(tl.int32)
        r = tl.arange(0, BLOCK_M)
        i = tile * BLOCK_Q + r // GROUP
        head = kv_head * GROUP + r % GROUP
        q_valid = (i < num_queries) & (r < BLOCK_Q * GROUP)
        q_pos = context - num_queries + i
        d = tl.arange(0, BLOCK_D)
        q_rows = (first_row + i) * q_stride_t + head * q_stride_h
        q_mask = q_valid[:, None] & (d[None, :] < D)
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        first = context - num_queries + tile * BLOCK_Q  # the tile's first and last query positions
        last = tl.minimum(first + BLOCK_Q, context) - 1
        hi = last + 1
        # masked [lo, whole_lo), unmasked [whole_lo, whole_hi), masked [whole_hi, hi); all tile-aligned
        lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0) // BLOCK_N * BLOCK_N
        whole_lo = tl.where(window > 0, tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N, 0)
        whole_hi = tl.maximum((first + 1) // BLOCK_N * BLOCK_N, whole_lo)

        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 in the softmax
        if KV_FP8:
            qk_scale = qk_scale * tl.load(scales_ptr)
        DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, whole_lo, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                start,
                hi,
                window,
                d,
                k_cache_ptr,
                v_cache_ptr,
                tables_ptr,
                b,
                tables_stride,
                kv_head,
                cache_stride_page,
                cache_stride_slot,
                cache_stride_h,
                qk_scale,
                D,
                PAGE,
                BLOCK_N,
                True,
                UPCAST,
                KV_FP8,
                DTYPE,
            )
        for start in range(whole_lo, whole_hi, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                start,
                hi,
                window,
                d,
                k_cache_ptr,
                v_cache_ptr,
                tables_ptr,
                b,
                tables_stride,
                kv_head,
                cache_stride_page,
                cache_stride_slot,
                cache_stride_h,
                qk_scale,
                D,
                PAGE,
                BLOCK_N,
                False,
                UPCAST,
                KV_FP8,
                DTYPE,
            )
        for start in range(whole_hi, hi, BLOCK_N):
            acc, m_i, l_i = _attend(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                start,
                hi,
                window,
                d,
                k_cache_ptr,
                v_cache_ptr,
                tables_ptr,
                b,
                tables_stride,
                kv_head,
                cache_stride_page,
                cache_stride_slot,
                cache_stride_h,
                qk_scale,
                D,
                PAGE,
                BLOCK_N,
                True,
                UPCAST,
                KV_FP8,
                DTYPE,
            )
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if KV_FP8:
            out = out * tl.load(scales_ptr + 1)
        tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    max_query_len: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Causal attention of each sequence's chunk into `out`. `max_query_len` spares a device read;
    block sizes, warps and stages override the defaults. FP8 caches need `kv_scales`."""
    assert q.is_contiguous() and out.is_contiguous() and q.shape == out.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _, q_heads, dim = q.shape
    batch = tables.shape[0]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q_heads % kv_heads == 0, f"{q_heads} q heads do not share {kv_heads} KV heads evenly"
    group = q_heads // kv_heads
    if batch == 0:
        return
    block_d = max(triton.next_power_of_2(dim), 16)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_cache, v_cache, kv_scales = fp8_operands(k_cache, v_cache, kv_scales)
    wide = block_d * (q.element_size() if fp8 else k_cache.element_size()) > 256  # FP8 is read as q's dtype
    block_m = max(block_m or BLOCK_M, triton.next_power_of_2(group), 16)  # tl.dot takes M >= 16
    block_n = block_n or (WIDE_BLOCK_N if wide else BLOCK_N)
    num_warps = num_warps or (WIDE_NUM_WARPS if wide else NUM_WARPS)
    num_stages = num_stages or (WIDE_NUM_STAGES if wide else NUM_STAGES)
    queries = max_query_len if max_query_len is not None else int(q_lens.max())
    tiles = -(-queries // (block_m // group))
    if tiles == 0:
        return
    tables, q_starts, q_lens, context_lens = (t.contiguous() for t in (tables, q_starts, q_lens, context_lens))
    _prefill[(tiles, kv_heads, batch)](
        q,
        k_cache,
        v_cache,
        tables,
        q_starts,
        q_lens,
        context_lens,
        out,
        kv_scales,
        q.stride(0),
        q.stride(1),
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale,
        window or 0,
        GROUP=group,
        D=dim,
        BLOCK_D=block_d,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=q.device.type == "cpu",
        KV_FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
