"""The building blocks models are written in: linear layers, norms, rotary embeddings, the
attention call. Each layer picks its kernel once, at load (`pick_kernels`), from its
weights' device and dtype and what `kernels/` built: the C kernels for bf16 on a CPU, the
fused Triton chains on CUDA (norms with the residual add, rope with the KV store, the gated
activation: `use_triton`), PyTorch otherwise; quantised linear layers plug in here as further
`Linear` kernels.
Attention is the exception: its kernels are chosen per engine by the engine's attention
backend (`engine/attention.py`), since they read the engine's pages.
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
    """On a CPU, compile at once the C libraries this model's layers will load (the general
    kernels; the quantised kernels or the dense bf16 panels, and the layer stack that chains
    them), so that a cold start waits for the longest build, not each in turn."""
    weights = next(model.parameters(), None)
    if weights is None or weights.device.type != "cpu":
        return
    flags = quant_kernels.QUANT_FLAGS
    sources = [(cpu_kernels.SOURCE, cpu_kernels.FLAGS)]
    if quantized_weights(model):
        sources += [(quant_kernels.SOURCE, flags), (quant_kernels.Q8_SOURCE, flags), (stack_kernels.SOURCE, flags)]
    elif weights.dtype == torch.bfloat16 and cpu_kernels.native_bf16():  # panels, chained by the stack
        sources += [(quant_kernels.BF16_SOURCE, flags), (stack_kernels.SOURCE, flags)]
    elif weights.dtype == torch.bfloat16:  # bf16 layers on AVX2 (built where the CPU has it)
        sources += [(avx2.SOURCE, avx2.AVX2_FLAGS)]
    cpu_kernels.prebuild(sources)


def pick_kernels(model: nn.Module) -> None:
    """Let every layer of a loaded model (weights in place, on their device) choose its kernel.

    Called once by `models.loader.load_model` (safetensors and GGUF alike) after the weights
    are assigned and the rope tables built. Every module with a `pick_kernel()` method gets it
    called, submodules before the module holding them (so a model's tied LM head follows the
    layout its embedding table chose); the model's own `pick_kernel` covers what is not a
    submodule: its rotary tables (plain attributes) and the tied LM head's matmul (the
    embedding table is no `Linear`).
    """
    prebuild_kernels(model)
    with weights_in_huge_pages():  # the weights the kernels lay out, in one run of 2 MiB pages
        for module in reversed(list(model.modules())):  # pre-order reversed: every module after its submodules
            pick = getattr(module, "pick_kernel", None)
            if pick is not None:
                pick()
