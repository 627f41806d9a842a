"""fp32 rounded to a dtype as PyTorch does (nearest, ties to even), returned in fp32. bf16 is
rounded on the bits: Triton's interpreter truncates its fp32 -> bf16 cast. NaN payloads are lost.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
