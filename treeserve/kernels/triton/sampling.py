"""The seeded sampler's plain draw: an inverse-CDF lookup in softmax(row), one program per row.

scaled_logits [B, V] (fp32 or bf16, already divided by the temperature), uniforms [B]
(float64, one per row, from (seed, completion index, position)). Two passes over the row
in blocks of BLOCK, all in fp32:
1. the max and the sum of exp(x - max), kept per lane (rescaled when a lane's max grows)
   and combined across lanes at the end;
2. a running sum of exp(x - max) until it first exceeds target = u * sum; the token is that
   index: `torch.searchsorted(cdf, u * cdf[-1], right=True)` in `sampler._draw`, up to float
   rounding at a bucket edge. Should rounding leave the target past the last bucket, the
   last token of nonzero probability is taken (as the C kernel does), never a masked one.
Each row is one program with a fixed order of operations, so a row's token never depends
on the other rows of the batch (batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries per step of a pass


@triton.jit
def _sample_row(logits_ptr, stride, uniforms_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    offsets = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + offsets, mask=start + offsets < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that has seen only padding
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    total = tl.sum(lane_sum * tl.exp(lane_max - row_max), 0)
    target = (tl.load(uniforms_ptr + row) * total.to(tl.float64)).to(tl.float32)

    running = total * 0.0
    crossed = vocab + 0 * row  # first index whose cdf exceeds the target; vocab until found
    last = -1 + 0 * row  # last index of nonzero probability seen so far
    start = 0 * row
    while (crossed == vocab) & (start < vocab):
        index = start + offsets
        x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - row_max)
        cdf = running + tl.cumsum(p, 0)
        crossed = tl.min(tl.where((cdf > target) & (p > 0.0), index, vocab), 0)
        last = tl.maximum(last, tl.max(tl.where(p > 0.0, index, -1), 0))
        running += tl.sum(p, 0)
        start += BLOCK
    tl.store(out_ptr + row, tl.where(crossed < vocab, crossed, last).to(tl.int64))


def sample_rows(scaled_logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B, V] logits and [B] float64 uniforms in [0, 1) on one device -> [B] int64 token ids."""
    rows, vocab = scaled_logits.shape
    assert scaled_logits.stride(-1) == 1 and uniforms.shape == (rows,) and uniforms.dtype == torch.float64
    out = torch.empty(rows, dtype=torch.int64, device=scaled_logits.device)
    if rows:
        _sample_row[(rows,)](scaled_logits, scaled_logits.stride(0), uniforms, out, vocab, BLOCK=BLOCK)
    return out
