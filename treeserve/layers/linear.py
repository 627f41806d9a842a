"""Linear layers and the LM head's matmul, with the kernel picked at load.

`Linear` is `nn.Linear` (same parameters, same checkpoint names) whose forward calls
`self.kernel`. On a CPU with AVX512-BF16 (every CPU with AMX has it), a bf16 `Linear` lays its
weight out once as panels of 16 output channels (`dense_panels`: a `QuantTensor` of one dense
part, the same size, no second copy), multiplied by one kernel for every batch size, so a row's
bits never depend on the batch: AMX tiles where the CPU has them (the panels are TDPBF16PS's B
tiles as they lie: `amx_linear.c`), else `bf16_panels.c`'s dot products (at peak bf16
dot-product rate from 16 rows on and at memory bandwidth at one row, 1.0-2.5x the
GEMV-below-4-rows / oneDNN-above pair it replaced, AMD Zen 4). Either way the layer stack
(`layers/layer_stack.py`) chains it like a quantised matrix. Where AMX multiplies them, a bf16
embedding table is laid out as the same panels and a tied LM head multiplies it there
(`layers/embedding.py`); without AMX the table stays a plain matrix, and the tied head goes
through `kernels.cpu.linear` (a GEMV that streams the weights for up to 4 rows, oneDNN with rows
padded to a bucket above that). For a `QuantTensor` (the loader replaced the parameter by
quantised bytes), `quant_linear`; for fp32 weights on a CPU, `row_invariant_linear` (F.linear
with at least MIN_GEMM_ROWS rows); F.linear everywhere else (cuBLAS on a GPU).

On a CPU that does not multiply bf16 itself (neither AVX512-BF16 nor AMX: PyTorch emulates the
products, 3-7x slower than fp32 on an AVX2 AMD EPYC) but has AVX2 and FMA, a bf16 `Linear` keeps
its weight in bf16 and `kernels/cpu/avx2.py` multiplies it, widening in registers and summing in
fp32 in one fixed order (batch invariant), the product rounded to bf16 once. Without AVX2 (or
its build), the weight is widened to fp32 at load (`widens`; exact: every bf16 is an fp32) and
`widened_linear` multiplies the bf16 inputs in fp32, row-invariant as an fp32 layer, rounding the
product to bf16 once; the weights then take twice the memory.
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

# MKL's fp32 GEMM multiplies fewer rows than this with other kernels (a GEMV at one row,
# small-matrix kernels up to 15 rows for k >= 512, up to 5 at k = 128) that sum each dot
# product in another order, so a row's last bits depended on how many rows shared its matmul
# (from 16 rows on, every row count gave the same bits: 16-2048 rows, k 64-4096, tested).
MIN_GEMM_ROWS = 16


def widens(weight: torch.Tensor | QuantTensor) -> bool:
    """A dense bf16 matrix on a CPU that does not multiply bf16 itself (so it has no AMX tiles
    either) and has no AVX2 kernel for it (`kernels/cpu/avx2.py`): widened to fp32 at load
    (`widened_linear`)."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not cpu_kernels.native_bf16()
        and not avx2.supports(weight)
    )


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 layer whose weight (and bias) were widened to fp32 at load: bf16 rows x multiplied in
    fp32, the product rounded to bf16 once."""
    return row_invariant_linear(x.float(), weight, bias).to(torch.bfloat16)


def linear_kernel(weight: torch.Tensor | QuantTensor | GroupQuantWeight | Fp8Weight) -> LinearKernel:
    """The matmul with F.linear's semantics that suits `weight`'s format, device and dtype."""
    if isinstance(weight, QuantTensor):
        return quant_linear
    if isinstance(weight, GroupQuantWeight | Fp8Weight):  # a quantised checkpoint's, on CUDA
        return checkpoint_linear
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_kernels.bf16_built():
        return cpu_kernels.linear
    if avx2.supports(weight):  # (built only where the CPU has no bf16 products)
        return avx2.linear
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return row_invariant_linear
    return F.linear


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows' bits do not depend on how many rows are multiplied together (fp32
    on a CPU): fewer than MIN_GEMM_ROWS rows are padded with zero rows. Without it a decode step
    of 3 sequences and a speculating one of 4 rows computed the same token's logits in other
    last bits, and a sampled token at a CDF boundary changed: speculation changed an output."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_GEMM_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = F.linear(F.pad(flat, (0, 0, 0, MIN_GEMM_ROWS - rows)), weight, bias)[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.kernel: LinearKernel = F.linear  # until `pick_kernel` (a model built for training keeps PyTorch)

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
