"""The seeded sampler's plain draw: an inverse-CDF lookup in softmax(row), the vocabulary split across programs.

scaled_logits [B, V] (fp32 or bf16, already divided by the temperature), uniforms [B]
(float64, one per row, from (seed, completion index, position)). The row is cut into
cdiv(V, CHUNK) chunks of CHUNK entries, read in blocks of BLOCK; all arithmetic is fp32.
1. `_chunk_stats`, one program per (row, chunk): the chunk's max and its sum of
   exp(x - chunk max), kept per lane (rescaled when a lane's max grows) and combined across
   lanes at the end, into [B, chunks] buffers. A whole row no longer waits on one program
   (at batch 1 that was one SM reading Llama 3's 128256 logits twice).
2. `_draw_row`, one program per row: the row max, each chunk's weight (its sum rescaled to
   the row max), their inclusive prefix sums (one cumsum; the total is its last entry) and
   target = u * total. The chosen chunk is the first of nonzero weight whose prefix sum
   exceeds the target; only it is read again, a running sum of exp(x - row max) from the
   prefix before it, and the token is the first index whose sum exceeds the target: the
   `torch.searchsorted(cdf, u * cdf[-1], right=True)` of `sampler._draw`, up to float
   rounding at a bucket edge. Rounding has two ways to miss, both taken to a bucket edge
   the target is within rounding of: a scan that ends in its chunk without exceeding the
   target takes the chunk's last token of nonzero probability, and a target that no prefix
   sum exceeds (u * total rounded up to the total) takes the last token of nonzero
   probability in the row (as the C kernel does). A masked (-inf) token is never taken.
The chunking depends only on V, each program's order of operations is fixed, and no
program reads another row, so a row's token never depends on the batch (batch invariance).
Launch grids come from shapes only: no host sync, safe inside a CUDA graph or stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries per step of either pass
CHUNK = 2048  # vocabulary entries per program of pass 1, and what pass 2 reads again; a multiple of BLOCK
NUM_WARPS = 4


@triton.jit
def _chunk_stats(logits_ptr, stride, max_ptr, sum_ptr, vocab, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride + chunk * CHUNK
    end = vocab - chunk * CHUNK  # entries of the row left from this chunk's start
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
    ids = tl.arange(0, CHUNKS)  # CHUNKS: chunks rounded up to a power of two, at least 2
    stats = row.to(tl.int64) * chunks + ids
    chunk_max = tl.load(max_ptr + stats, mask=ids < chunks, other=float("-inf"))
    chunk_sum = tl.load(sum_ptr + stats, mask=ids < chunks, other=0.0)
    row_max = tl.max(chunk_max, 0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row of only masked tokens: no nan
    weight = chunk_sum * tl.exp(chunk_max - row_max)
    upper = tl.cumsum(weight, 0)  # upper[c]: the cdf at the end of chunk c
    total = tl.sum(tl.where(ids == chunks - 1, upper, 0.0), 0)
    target = (tl.load(uniforms_ptr + row) * total.to(tl.float64)).to(tl.float32)

    first = tl.min(tl.where((upper > target) & (weight > 0.0) & (ids < chunks), ids, CHUNKS), 0)
    heavy = tl.max(tl.where(weight > 0.0, ids, 0), 0)  # the last chunk of nonzero weight
    found = first < CHUNKS
    chunk = tl.where(found, first, heavy)
    running = tl.sum(tl.where(ids == chunk - 1, upper, 0.0), 0)  # the cdf before the chunk
    target = tl.where(found, target, float("inf"))  # not found: the chunk's last token of nonzero probability

    offsets = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    crossed = end  # first index whose cdf exceeds the target; end until found
    last = -1 + 0 * row  # last index of nonzero probability seen so far
    live = -1 + 0 * row  # last index with a finite logit, should exp(x - max) round a chunk's max to 0
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
    """[B, V] logits and [B] float64 uniforms in [0, 1) on one device -> [B] int64 token ids."""
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
