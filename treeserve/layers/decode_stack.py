"""A decode step through all decoder layers in one C call (`kernels/cpu/decode_stack.c`).

At one row a Gemma 3 270M layer is ~20 kernel calls and PyTorch ops whose Python, dispatch
and ctypes overhead (~0.3 ms a layer) costs more than their arithmetic. Where a model's
decoder (Gemma 3, or the Llama family: Llama, Mistral, Qwen2) runs on the CPU kernels anyway
(bf16, every matmul on one C kernel: quantised, a GGUF file or `quantization="int8"`, with
8-bit activations or bf16 tiles, or dense bf16 panels; the C norms, rope),
`DecodeStack.build` reads its layers into the C structs once; the model's forward then hands
a step to it when the engine says the step is plain decodes in row order
(`Attention.decode_pages`). The C chain calls the same kernels on the same inputs and does
PyTorch's roundings in between (act(gate) * up by `kernels.cpu.gated_act_bf16` from the table
PyTorch fills, as the per-layer path does), so a row gets the per-layer path's bits at every
batch size: that path stays the reference (tests compare).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import decode_stack as kernels
from treeserve.layers.attention import Attention
from treeserve.layers.norm import GemmaRMSNorm, RMSNorm
from treeserve.layers.quant import QuantTensor
from treeserve.layers.rotary import RotaryEmbedding


def _weights(layer: nn.Module, local_rope: bool) -> kernels.LayerWeights | None:
    """One decoder layer's plans and norms (Gemma 3's, or the Llama family's), None where a piece is
    not on the C kernels."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(not isinstance(lin.weight, QuantTensor) or lin.weight.plan.call is None or lin.weight.dtype != torch.bfloat16
           for lin in linears):  # fmt: skip
        return None
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: every norm
        norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)  # fmt: skip
    else:  # Llama: a norm before attention and one before the MLP
        norms = (layer.input_layernorm, None, None, None, layer.post_attention_layernorm, None)
    tensors = []
    for norm in norms:
        if norm is None:
            tensors.append(None)
        elif isinstance(norm, GemmaRMSNorm) and norm.use_c:
            tensors.append(norm.gain())
        elif isinstance(norm, RMSNorm) and norm.use_c:
            tensors.append(norm.weight.detach())
        else:
            return None
    plans = [lin.weight.plan for lin in linears]
    biases = tuple(None if lin.bias is None else lin.bias.detach().float().contiguous() for lin in linears)
    return kernels.LayerWeights(*plans, tuple(tensors), biases, attn.window, local_rope)


class DecodeStack:
    """Runs a step's decoder layers in one C call; `__call__` says whether it took the step."""

    def __init__(self, stack: kernels.Stack, ropes: tuple[RotaryEmbedding, RotaryEmbedding]):
        self.stack = stack
        self.ropes = ropes

    @staticmethod
    def build(
        layers: Sequence[nn.Module],
        ropes: tuple[RotaryEmbedding, RotaryEmbedding],
        act: Callable[[torch.Tensor], torch.Tensor],
        intermediate: int,
        eps: float,
    ) -> DecodeStack | None:
        """For Gemma 3 or Llama-family decoder layers (`ropes`: the global layers' table, then the
        sliding-window layers'; `act` the MLP's activation): None unless every layer runs on the
        C kernels (picked already), the activation's rows are whole vectors, and the library built."""
        if not all(rope.use_c for rope in ropes) or intermediate % 64:
            return None
        weights = [_weights(layer, layer.self_attn.window is not None) for layer in layers]
        if not weights or any(w is None for w in weights) or not kernels.available():  # built only when used
            return None
        q_heads, kv_heads, head_dim = layers[0].self_attn.shape
        hidden = layers[0].input_layernorm.weight.shape[0]
        shapes = dict(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate)
        return DecodeStack(kernels.Stack(shapes, eps, cpu_kernels.act_table(act), weights), ropes)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attn: Attention) -> bool:
        """Run every layer over x [T, hidden] in place, where the step allows; False: it did not."""
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            return False
        pages = attn.decode_pages()
        if pages is None or pages.k_cache.dtype != torch.bfloat16:
            return False
        rows = [rope.lookup(positions, torch.bfloat16) for rope in self.ropes]
        scale = pages.scale or self.stack.shapes["head_dim"] ** -0.5
        self.stack.run(x, rows, pages.slot_pages, pages.slot_offsets, pages.tables, pages.context_lens,
                       pages.k_cache, pages.layer_stride, pages.v_offset, scale)  # fmt: skip
        return True
