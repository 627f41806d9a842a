"""A step through all decoder layers in one C call (`kernels/cpu/layer_stack.c`).

At a few rows a Gemma 3 270M layer is ~20 kernel calls and PyTorch ops whose Python, dispatch
and ctypes overhead (~0.3 ms a layer) costs more than their arithmetic: a decode step, and a
PRM's scoring step of a few short chunks. Where a model's decoder (Gemma 3, or the Llama
family: Llama, Mistral, Qwen2) runs on the CPU kernels anyway (bf16, every matmul on one C
kernel: quantised, a GGUF file or `quantization="int8"`, with 8-bit activations or bf16 tiles,
or dense bf16 panels, on AMX tiles or AVX512-BF16 dot products; the C norms, rope),
`LayerStack.build` reads its layers into the C structs once; the model's forward then hands a
step to it when the engine gives the step's pages and groups (`Attention.stack_pages`: decodes,
and prefill chunks where the per-layer path runs them on the C prefill kernel too). The C chain
calls the same kernels on the same inputs and does PyTorch's roundings in between (act(gate) *
up by `kernels.cpu.gated_act_bf16` from the table PyTorch fills, as the per-layer path does), so
a row gets the per-layer path's bits at every batch size: that path stays the reference (tests
compare).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import layer_stack as kernels
from treeserve.kernels.cpu import quant as quant_kernels
from treeserve.layers.attention import Attention
from treeserve.layers.embedding import Embedding
from treeserve.layers.norm import GemmaRMSNorm, RMSNorm
from treeserve.layers.quant import QuantTensor, quant_embedding
from treeserve.layers.rotary import RotaryEmbedding


def _weights(layer: nn.Module, local_rope: bool) -> kernels.LayerWeights | None:
    """One decoder layer's plans and norms (Gemma 3's, or the Llama family's), None where a piece is
    not on the C kernels."""
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):  # routed experts (Qwen3-MoE): the per-layer path
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(_chainable(lin.weight) for lin in linears):
        return None
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: every norm
        norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)  # fmt: skip
    else:  # Llama: a norm before attention and one before the MLP (and Qwen3's on q and k)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        norms = (layer.input_layernorm, q_norm, k_norm, None, layer.post_attention_layernorm, None)
    tensors = []
    for norm in norms:
        tensor = None if norm is None else _norm_tensor(norm)
        if norm is not None and tensor is None:
            return None
        tensors.append(tensor)
    plans = [lin.weight.plan for lin in linears]
    biases = tuple(None if lin.bias is None else lin.bias.detach().float().contiguous() for lin in linears)
    return kernels.LayerWeights(*plans, tuple(tensors), biases, attn.window, local_rope)


def _chainable(weight: object) -> bool:
    """A bf16 quantised matrix the C stack multiplies (act-order matrices gather their inputs first: not)."""
    return (isinstance(weight, QuantTensor) and weight.plan.call is not None and weight.dtype == torch.bfloat16
            and weight.input_order is None)


def _norm_tensor(norm: nn.Module) -> torch.Tensor | None:
    """What the C norm reads of a norm on the C kernels: Gemma's fp32 gain or Llama's bf16 weight;
    None where the norm is not on them."""
    if isinstance(norm, GemmaRMSNorm) and norm.use_c:
        return norm.gain()
    if isinstance(norm, RMSNorm) and norm.use_c:
        return norm.weight.detach()
    return None


class LayerStack:
    """Runs a step's decoder layers and the final norm in one C call; `__call__` gives the normed
    hidden states, or None where it did not take the step."""

    def __init__(self, stack: kernels.Stack):
        self.stack = stack

    @staticmethod
    def build(
        layers: Sequence[nn.Module],
        final_norm: nn.Module,
        ropes: tuple[RotaryEmbedding, RotaryEmbedding],
        act: Callable[[torch.Tensor], torch.Tensor],
        intermediate: int,
        eps: float,
        embedding: Embedding | None = None,
        embed_scale: torch.Tensor | None = None,
    ) -> LayerStack | None:
        """For Gemma 3 or Llama-family decoder layers and the model's final norm (`ropes`: the
        global layers' table, then the sliding-window layers'; `act` the MLP's activation): None
        unless every layer and the final norm run on the C kernels (picked already), the
        activation's rows are whole vectors, and the library built. `embedding`, the model's table
        (and `embed_scale`, the bf16 0-dim tensor its rows are multiplied by, Gemma's): looked up
        in the same call where it is Q8_0 or dense bf16 laid out as panels."""
        if not all(rope.use_c for rope in ropes) or intermediate % 64:
            return None
        weights = [_weights(layer, layer.self_attn.window is not None) for layer in layers]
        final = _norm_tensor(final_norm)
        if not weights or any(w is None for w in weights) or final is None or final_norm.eps != eps:
            return None
        matmuls = [plan.function for w in weights for plan in (w.qkv, w.o, w.gate_up, w.down)]
        if any(matmul is not matmuls[0] for matmul in matmuls):
            return None  # the C chain calls one matmul (dense panels: off AMX tiles where k % 32 != 0)
        if not kernels.available():  # built only when used
            return None
        q_heads, kv_heads, head_dim = layers[0].self_attn.shape
        hidden = layers[0].input_layernorm.weight.shape[0]
        shapes = dict(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate)
        tables = (ropes[0].cos, ropes[0].sin, ropes[1].cos, ropes[1].sin)
        table = _table(embedding, embed_scale, hidden)
        return LayerStack(kernels.Stack(shapes, eps, cpu_kernels.act_table(act), weights, final, tables, table))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention,
                 embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:  # fmt: skip
        """The rows of `input_ids` (looked up here, or by `embed`, the model's), every layer and the
        final norm, where the step allows: the normed rows; None: it did not take the step."""
        if positions.dtype != torch.int64 or input_ids.dtype != torch.int64:
            return None
        pages = attn.stack_pages()
        if pages is None or pages.k_cache.dtype != torch.bfloat16:
            return None
        scale = pages.scale or self.stack.shapes["head_dim"] ** -0.5
        if self.stack.embeds:
            return self.stack.run_ids(input_ids.contiguous(), positions.contiguous(), pages, scale)
        x = embed(input_ids)
        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            return None  # (not for a bf16 model: the forward then looks the rows up again)
        return self.stack.run(x, positions.contiguous(), pages, scale)


def _table(embedding: Embedding | None, scale: torch.Tensor | None, hidden: int) -> kernels.EmbeddingTable | None:
    """The embedding as the stack reads it: a bf16 model's one-part table of Q8_0 or dense bf16 laid
    out as panels (`quant_embedding`'s lookups), else None (the model looks its rows up)."""
    weight = None if embedding is None else embedding.weight
    if not isinstance(weight, QuantTensor) or embedding.lookup is not quant_embedding or len(weight.parts) != 1:
        return None
    part = weight.parts[0]
    q8 = part.qtype == quant_kernels.PANELS + quant_kernels.QTYPES["Q8_0"] and quant_kernels.q8_available()
    dense = part.qtype == quant_kernels.BF16_PANELS  # (a table of them exists only where the kernel was built)
    if not (q8 or dense) or weight.dtype != torch.bfloat16 or weight.cols != hidden:
        return None
    assert scale is None or scale.dtype == torch.bfloat16
    return kernels.EmbeddingTable(part.data, part.rows, None if scale is None else float(scale), dense)
