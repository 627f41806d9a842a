"""Linear layers and the LM head's matmul, with the kernel picked at load.

`Linear` is `nn.Linear` (same parameters, same checkpoint names) whose forward calls
`self.kernel`. `linear_kernel(weight)` picks it: for bf16 weights on a CPU where the
AVX512-BF16 kernels were built, `kernels.cpu.linear` (a GEMV that streams the weights for
up to 4 rows, oneDNN with rows padded to a bucket above that, PyTorch's bits); for a
`QuantTensor` (the loader replaced the parameter by quantised bytes), `quant_linear`;
F.linear everywhere else (cuBLAS on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.layers.quant import QuantTensor, quant_linear

LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear_kernel(weight: torch.Tensor | QuantTensor) -> LinearKernel:
    """The matmul with F.linear's semantics that suits `weight`'s format, device and dtype."""
    if isinstance(weight, QuantTensor):
        return quant_linear
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_kernels._bf16_built():
        return cpu_kernels.linear
    return F.linear


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        self.kernel: LinearKernel = F.linear  # until `pick_kernel` (a model built for training keeps PyTorch)

    def pick_kernel(self) -> None:
        self.kernel = linear_kernel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)
