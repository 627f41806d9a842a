"""The building blocks models are written in. Each layer picks its kernel once at load
(`pick_kernels`): C on a CPU, fused Triton on CUDA, else PyTorch. Attention's kernels are the
engine's attention backend's (they read the engine's pages).
"""

from __future__ import annotations

import torch
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import avx2
from treeserve.kernels.cpu import layer_stack as stack_kernels
from treeserve.kernels.cpu import quant as quant_kernels
from treeserve.kernels.cpu.memory import weights_in_huge_pages
from treeserve.layers.quant import quantized_weights


def prebuild_kernels(model: nn.Module) -> None:
    """On a CPU, build this model's C libraries in parallel: a cold start waits for the longest only."""
    weights = next(model.parameters(), None)
    if weights is None or weights.device.type != "cpu":
        return
    flags = quant_kernels.QUANT_FLAGS
    sources = [(cpu_kernels.SOURCE, cpu_kernels.FLAGS)]
    if not cpu_kernels.native_bf16():  # prefill attention on AVX2
        sources += [(cpu_kernels.PREFILL_AVX2, cpu_kernels.ORDERED_FLAGS)]
    if quantized_weights(model):
        sources += [(quant_kernels.SOURCE, flags), (quant_kernels.Q8_SOURCE, flags), (stack_kernels.SOURCE, flags)]
    elif weights.dtype == torch.bfloat16 and cpu_kernels.native_bf16():
        sources += [(quant_kernels.BF16_SOURCE, flags), (stack_kernels.SOURCE, flags)]
    elif weights.dtype == torch.bfloat16:
        sources += [(avx2.SOURCE, cpu_kernels.ORDERED_FLAGS)]
    cpu_kernels.prebuild(sources)


def pick_kernels(model: nn.Module) -> None:
    """Call every module's `pick_kernel()` once the weights are on their device, submodules first
    (a tied LM head follows the layout its embedding table chose)."""
    prebuild_kernels(model)
    with weights_in_huge_pages():  # laid-out weights in one run of 2 MiB pages
        for module in reversed(list(model.modules())):  # submodules first
            pick = getattr(module, "pick_kernel", None)
            if pick is not None:
                pick()
