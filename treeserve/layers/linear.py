"""`Linear` (nn.Linear, same checkpoint names) calls a kernel picked at load, so a row's bits
never depend on the batch:
- bf16 on AVX512-BF16: weights laid out once as 16-channel panels (`dense_panels`, no second
  copy), on AMX tiles where present, else `bf16_panels.c`; the layer stack chains them;
- bf16 without bf16 products: the AVX2 kernel (fp32 sums in one order), else widened to fp32;
- `QuantTensor`: `quant_linear`; fp32 on a CPU: `row_invariant_linear`; else F.linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import avx2
from treeserve.layers.group_quant import Fp8Weight, GroupQuantWeight, checkpoint_linear
from treeserve.layers.quant import QuantTensor, dense_panels, dense_panels_supported, quant_linear, set_quantized

LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# Below 16 rows MKL's fp32 GEMM switches kernels and summation order, so a row's bits would
# depend on the batch; from 16 rows on they do not.
MIN_GEMM_ROWS = 16


def widens(weight: torch.Tensor | QuantTensor) -> bool:
    """A bf16 CPU matrix with neither bf16 products nor the AVX2 kernel: widened to fp32 at load."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not cpu_kernels.native_bf16()
        and not avx2.supports(weight)
    )


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 rows times a widened fp32 weight, the product rounded to bf16 once."""
    return row_invariant_linear(x.float(), weight, bias).to(torch.bfloat16)


def linear_kernel(weight: torch.Tensor | QuantTensor | GroupQuantWeight | Fp8Weight) -> LinearKernel:
    """F.linear for `weight`'s format, device and dtype."""
    if isinstance(weight, QuantTensor):
        return quant_linear
    if isinstance(weight, GroupQuantWeight | Fp8Weight):  # on CUDA
        return checkpoint_linear
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_kernels.bf16_built():
        return cpu_kernels.linear
    if avx2.supports(weight):
        return avx2.linear
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return row_invariant_linear
    return F.linear


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 F.linear whose rows' bits do not depend on the batch: pads to MIN_GEMM_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_GEMM_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = F.linear(F.pad(flat, (0, 0, 0, MIN_GEMM_ROWS - rows)), weight, bias)[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.kernel: LinearKernel = F.linear  # until `pick_kernel`

    def pick_kernel(self) -> None:
        if widens(self.weight):
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.float(), requires_grad=False)
            self.kernel = widened_linear
            return
        if dense_panels_supported(self.weight):
            set_quantized(self, "weight", dense_panels(self.weight))
        if isinstance(self.weight, QuantTensor):
            self.weight = self.weight.in_panels()
        self.kernel = linear_kernel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)
