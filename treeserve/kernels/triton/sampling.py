"""The seeded sampler's plain draw: inverse-CDF in softmax(row), the vocabulary split over programs.

scaled_logits [B, V] (temperature applied), uniforms [B] float64; fp32 arithmetic.
1. `_chunk_stats`, a program per (row, CHUNK): the chunk's max and sum of exp(x - max).
2. `_draw_row`, a program per row: chunk weights at the row max, their prefix sums, target =
   u * total; only the chosen chunk is read again, and the token is the first index whose sum
   exceeds the target (`sampler._draw`'s searchsorted up to rounding at a bucket edge; a miss
   takes the last token of nonzero probability, as the C kernel). Masked tokens are never taken.
Chunking depends on V only and no program reads another row: batch invariant, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries per step of either pass
CHUNK = 2048  # a multiple of BLOCK; what pass 2 reads again
NUM_WARPS = 4


@triton.jit
def _chunk_stats(logits_ptr, stride, max_ptr, sum_ptr, vocab, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride + chunk * CHUNK
    end = vocab - chunk * CHUNK
    offsets = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, CHUNK, BLOCK):
        x = tl.load(base + start + offsets, mask=start + offsets < end, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that has seen only padding
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    chunk_max = tl.max(lane_max, 0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)  # a chunk of only masked tokens sums to 0
    stat = row.to(tl.int64) * chunks + chunk
    tl.store(max_ptr + stat, chunk_max)
    tl.store(sum_ptr + stat, tl.sum(lane_sum * tl.exp(lane_max - shift), 0))


@triton.jit
def _draw_row(
    logits_ptr,
    stride,
    max_ptr,
    sum_ptr,
    uniforms_ptr,
    out_ptr,
    vocab,
    chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    ids = tl.arange(0, CHUNKS)  # rounded up to a power of two, at least 2
    stats = row.to(tl.int64) * chunks + ids
    chunk_max = tl.load(max_ptr + stats, mask=ids < chunks, other=float("-inf"))
    chunk_sum = tl.load(sum_ptr + stats, mask=ids < chunks, other=0.0)
    row_max = tl.max(chunk_max, 0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row of only masked tokens: no nan
    weight = chunk_sum * tl.exp(chunk_max - row_max)
    upper = tl.cumsum(weight, 0)
    total = tl.sum(tl.where(ids == chunks - 1, upper, 0.0), 0)
    target = (tl.load(uniforms_ptr + row) * total.to(tl.float64)).to(tl.float32)

    first = tl.min(tl.where((upper > target) & (weight > 0.0) & (ids < chunks), ids, CHUNKS), 0)
    heavy = tl.max(tl.where(weight > 0.0, ids, 0), 0)
    found = first < CHUNKS
    chunk = tl.where(found, first, heavy)
    running = tl.sum(tl.where(ids == chunk - 1, upper, 0.0), 0)  # the cdf before the chunk
    target = tl.where(found, target, float("inf"))  # not found: the chunk's last token of nonzero probability

    offsets = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    crossed = end
    last = -1 + 0 * row
    live = -1 + 0 * row  # last finite logit, should exp round a chunk's max to 0
    while (crossed == end) & (start < end):
        index = start + offsets
        x = tl.load(base + index, mask=index < end, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - row_max)
        cdf = running + tl.cumsum(p, 0)
        crossed = tl.min(tl.where((cdf > target) & (p > 0.0), index, end), 0)
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, index, -1), 0))
        live = tl.maximum(live, tl.max(tl.where(x > float("-inf"), index, -1), 0))
        running += tl.sum(p, 0)
        start += BLOCK
    fallback = tl.where(last >= 0, last, live)
    tl.store(out_ptr + row, tl.where(crossed < end, crossed, fallback).to(tl.int64))


def sample_rows(scaled_logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = scaled_logits.shape
    assert scaled_logits.stride(-1) == 1 and uniforms.shape == (rows,) and uniforms.dtype == torch.float64
    assert CHUNK % BLOCK == 0
    out = torch.empty(rows, dtype=torch.int64, device=scaled_logits.device)
    if not rows:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=scaled_logits.device)
    sums = torch.empty_like(maxes)
    stride = scaled_logits.stride(0)
    _chunk_stats[(rows, chunks)](
        scaled_logits, stride, maxes, sums, vocab, chunks, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS
    )
    _draw_row[(rows,)](
        scaled_logits,
        stride,
        maxes,
        sums,
        uniforms,
        out,
        vocab,
        chunks,
        CHUNK=CHUNK,
        BLOCK=BLOCK,
        CHUNKS=max(2, triton.next_power_of_2(chunks)),
        num_warps=NUM_WARPS,
    )
    return out
