"""RMS norm over the last dim, alone or fused with the residual add before it (vLLM's
`fused_add_rms_norm`).

x [T, H] or [T, heads, H] (rows may be strided, each row contiguous: q/k heads of the fused
projection are fine). With a `residual` of x's shape: residual = x + residual, written into
`residual` in place, and the output is the norm of that sum: a decoder layer's
`x = x + sublayer(...)` and the norm after it in one launch instead of ~9 PyTorch ops. The
output is a new contiguous tensor. One program per row holds the whole row (BLOCK = H rounded
up to a power of two, masked), so `x` may alias `residual` (every load precedes every store),
and a row's result never depends on the other rows (batch invariance).

Computed as the PyTorch lines of `layers/norm.py` compute it:
* the add in the activation dtype (fp32 sum rounded once, as PyTorch's eager bf16 add);
* the mean of squares in fp32, plus eps, 1 / sqrt (correctly rounded, `div_rn` and `sqrt_rn`,
  as PyTorch's CPU `rsqrt` is 1 / sqrt);
* Llama (`fp32_weight=False`): x * r rounded to x's dtype, then times the weight, rounded to
  the promoted dtype (`self.weight * F.rms_norm(x.float(), ...).to(x.dtype)`);
* Gemma (`fp32_weight=True`, `weight` the fp32 gain 1 + w): x * r * gain in fp32, rounded
  once (`F.rms_norm(x.float(), ..., gain, eps).to(x.dtype)`).
Only the order of the sum of squares differs from PyTorch's (a tree over the lanes here, its
vectorised accumulators on a CPU), so fp32 agrees within a few ulp, and bf16 is PyTorch's bits
except where that difference crosses a rounding boundary (then one bf16 ulp). The launch
disables FMA contraction, so a GPU rounds each step as the interpreter and PyTorch do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.rounding import round_to


@triton.jit
def _rms_norm(
    x_ptr, residual_ptr, weight_ptr, out_ptr, eps,
    x_stride_t, x_stride_h, residual_stride_t, residual_stride_h, out_stride_t, out_stride_h,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, FP32_WEIGHT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * x_stride_t + h * x_stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        residual = residual_ptr + t * residual_stride_t + h * residual_stride_h + cols
        x = round_to(x + tl.load(residual, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual, x.to(dtype), mask=mask)
    mean = tl.div_rn(tl.sum(x * x, 0), tl.full([], HIDDEN, tl.float32))
    r = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * r * weight if FP32_WEIGHT else weight * round_to(x * r, dtype)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + cols, round_to(out, out_dtype).to(out_dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    fp32_weight: bool = False,
) -> torch.Tensor:
    """norm(x); with `residual`: residual += x in place, then norm(residual). See the module docstring."""
    hidden = x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (hidden,) and weight.is_contiguous()
    dtype = x.dtype if fp32_weight or weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    rows = residual if residual is not None else x  # any strides will do when there is no residual

    def strides(t: torch.Tensor) -> tuple[int, int]:
        return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)

    block = triton.next_power_of_2(hidden)
    _rms_norm[(x.shape[0], x.shape[1] if x.dim() == 3 else 1)](
        x, rows, weight, out, eps, *strides(x), *strides(rows), *strides(out),
        HIDDEN=hidden, BLOCK=block, ADD=residual is not None, FP32_WEIGHT=fp32_weight,
        num_warps=min(max(block // 256, 1), 16), enable_fp_fusion=False,
    )  # fmt: skip
    return out
