"""Where a sequence's tokens live in one layer's paged cache view: shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_rows(
    tables_ptr,
    seq,
    tables_stride,
    pos,
    valid,
    kv_head,
    cache_stride_page,
    cache_stride_slot,
    cache_stride_h,
    PAGE: tl.constexpr,
):
    """Element offsets of head `kv_head` of tokens `pos` (where `valid`) of sequence `seq`: token
    t sits in page tables[seq, t // PAGE] at slot t % PAGE."""
    page = tl.load(tables_ptr + seq * tables_stride + pos // PAGE, mask=valid, other=0).to(tl.int64)
    return page * cache_stride_page + (pos % PAGE) * cache_stride_slot + kv_head * cache_stride_h
