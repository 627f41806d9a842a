"""act(gate) * up of the fused gate/up projection [T, 2I] -> [T, I] in one launch: "silu" or
"gelu_pytorch_tanh" (PyTorch's formula, 1 + tanh kept for its cancellation), rounded as PyTorch's
two eager ops. exp/tanh differ from PyTorch's in the last bit or two: fp32 within ~1e-6, bf16
within one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.rounding import round_to

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
BLOCK = 1024  # columns per program at most


@triton.jit
def _tanh(y):
    """Cephes' fp32 tanhf, within ~2 ulp: Triton has no tanh its interpreter runs."""
    z = y * y
    small = (
        (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
        - 3.33332819422e-1
    ) * z * y + y
    e = tl.exp(2.0 * tl.minimum(tl.abs(y), 20.0))  # tanh(20) rounds to 1 in fp32; no overflow
    large = 1.0 - tl.div_rn(tl.full(y.shape, 2.0, tl.float32), e + 1.0)
    return tl.where(tl.abs(y) < 0.625, small, tl.where(y < 0, -large, large))


@triton.jit
def _gated(
    gate_up_ptr,
    out_ptr,
    in_stride,
    out_stride,
    INTER: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype: tl.constexpr = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + t * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * in_stride + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))  # sqrt(2/pi) (g + k g^3)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    out = round_to(round_to(act, dtype) * up, dtype)
    tl.store(out_ptr + t * out_stride + cols, out.to(dtype), mask=mask)


def gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(-1) == 1, "gate_up must be [T, 2I] with contiguous rows"
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), BLOCK)
    _gated[(tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTER=inter,
        ACT=ACTIVATIONS[act],
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
