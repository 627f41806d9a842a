"""Paged prefill attention: each sequence's chunk of queries over its cached pages and itself.

q and out [T, Hq, D] are the step's flat batch; sequence b's queries are rows
q_starts[b] .. q_starts[b] + q_lens[b] - 1, the last at position context_lens[b] - 1, so
the keys before the chunk are cached pages (a prefix-cache hit or an earlier chunk) and
the chunk's own K/V were stored into the pages before the call. Causal, with an optional
sliding `window` (keys at positions > query - window). This is prompt prefill, chunked
prefill, PRM scoring and speculative verification alike.

One program per (sequence, q head, tile of BLOCK_M queries) walks the keys the tile can
see, in tiles of BLOCK_N read through the block table, with an online softmax in fp32
(flash attention). Key tiles wholly before the window of the tile's first query are skipped.
On CUDA, bf16 operands go to the tensor cores as they are; on CPU tensors (the interpreter)
they are upcast to fp32 first (`UPCAST`): the interpreter's bf16 `tl.dot` returns garbage
(triton 3.9), while products of bf16 values are exact in fp32, so only the order of the
fp32 sums can differ from a GPU. Refused: a non-contiguous q or out, K and V caches with
different strides or a non-contiguous head_dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.pages import token_rows

BLOCK_M = 16  # queries per program
BLOCK_N = 16  # keys per tile


@triton.jit
def _prefill(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, starts_ptr, lens_ptr, context_ptr, out_ptr,
    q_stride_t, q_stride_h, tables_stride, cache_stride_page, cache_stride_slot, cache_stride_h,
    scale, window,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    num_queries = tl.load(lens_ptr + b).to(tl.int32)
    if tile * BLOCK_M < num_queries:
        first_row = tl.load(starts_ptr + b)
        context = tl.load(context_ptr + b).to(tl.int32)
        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
        q_valid = i < num_queries
        q_pos = context - num_queries + i
        d = tl.arange(0, BLOCK_D)
        q_rows = (first_row + i) * q_stride_t + head * q_stride_h
        q_mask = q_valid[:, None] & (d[None, :] < D)
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        kv_head = head // GROUP
        hi = tl.minimum(context - num_queries + (tile + 1) * BLOCK_M, context)  # past the tile's last query
        lo = tl.where(window > 0, tl.maximum(context - num_queries + tile * BLOCK_M - window + 1, 0), 0)
        lo = lo // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k_valid = pos < hi
            rows = token_rows(tables_ptr, b, tables_stride, pos, k_valid, kv_head, cache_stride_page, cache_stride_slot,
                              cache_stride_h, PAGE)  # fmt: skip
            kv_mask = k_valid[:, None] & (d[None, :] < D)
            k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N] in fp32
            seen = k_valid[None, :] & (pos[None, :] <= q_pos[:, None])
            seen &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key in view yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            p = p.to(v.dtype)  # bf16 caches: p rounded to bf16 for the second matmul, as on tensor cores
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
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
) -> None:
    """Causal attention of each sequence's chunk of queries, written into `out` in place.
    `max_query_len` (the longest chunk, known to the caller) spares a device-to-host read."""
    assert q.is_contiguous() and out.is_contiguous() and q.shape == out.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _, q_heads, dim = q.shape
    batch = tables.shape[0]
    if batch == 0:
        return
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables, q_starts, q_lens, context_lens = (t.contiguous() for t in (tables, q_starts, q_lens, context_lens))
    tiles = -(-(max_query_len or int(q_lens.max())) // BLOCK_M)
    _prefill[(batch, q_heads, tiles)](
        q, k_cache, v_cache, tables, q_starts, q_lens, context_lens, out,
        q.stride(0), q.stride(1), tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale, window or 0,
        GROUP=q_heads // kv_heads, D=dim, BLOCK_D=max(triton.next_power_of_2(dim), 16), PAGE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=q.device.type == "cpu",
    )  # fmt: skip
