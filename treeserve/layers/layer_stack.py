"""All decoder layers of a step in one C call (`kernels/cpu/layer_stack.c`), where every matmul,
norm and rope of a Gemma 3 or Llama-family model is on the CPU kernels. The chain calls the same
kernels with PyTorch's roundings between them, so a row gets the per-layer path's bits at every
batch size; that path stays the reference.
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
    """A decoder layer's plans and norms, None where a piece is not on the C kernels."""
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):  # routed experts (Qwen3-MoE)
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(_chainable(lin.weight) for lin in linears):
        return None
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3
        norms = (
            layer.input_layernorm,
            attn.q_norm,
            attn.k_norm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        )
    else:  # Llama family (Qwen3 adds q and k norms)
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
    return (
        isinstance(weight, QuantTensor)
        and weight.plan.call is not None
        and weight.dtype == torch.bfloat16
        and weight.input_order is None
    )


def _norm_tensor(norm: nn.Module) -> torch.Tensor | None:
    """Gemma's fp32 gain or Llama's bf16 weight; None where the norm is not on the C kernels."""
    if isinstance(norm, GemmaRMSNorm) and norm.use_c:
        return norm.gain()
    if isinstance(norm, RMSNorm) and norm.use_c:
        return norm.weight.detach()
    return None


class LayerStack:
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
        """None unless every layer and the final norm are on the C kernels. `ropes`: (global,
        sliding-window); `embedding` (times Gemma's `embed_scale`) is looked up in the call where it
        is Q8_0 or bf16 panels."""
        if not all(rope.use_c for rope in ropes) or intermediate % 64:
            return None
        weights = [_weights(layer, layer.self_attn.window is not None) for layer in layers]
        final = _norm_tensor(final_norm)
        if not weights or any(w is None for w in weights) or final is None or final_norm.eps != eps:
            return None
        matmuls = [plan.function for w in weights for plan in (w.qkv, w.o, w.gate_up, w.down)]
        if any(matmul is not matmuls[0] for matmul in matmuls):
            return None  # the C chain calls one matmul
        if not kernels.available():
            return None
        q_heads, kv_heads, head_dim = layers[0].self_attn.shape
        hidden = layers[0].input_layernorm.weight.shape[0]
        shapes = dict(hidden=hidden, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate)
        tables = (ropes[0].cos, ropes[0].sin, ropes[1].cos, ropes[1].sin)
        table = _table(embedding, embed_scale, hidden)
        return LayerStack(kernels.Stack(shapes, eps, cpu_kernels.act_table(act), weights, final, tables, table))

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Attention,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """The normed hidden rows after every layer, or None where the stack does not take the step."""
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
            return None
        return self.stack.run(x, positions.contiguous(), pages, scale)


def _table(embedding: Embedding | None, scale: torch.Tensor | None, hidden: int) -> kernels.EmbeddingTable | None:
    """A bf16 model's one-part Q8_0 or bf16-panel table, else None (the model looks rows up)."""
    weight = None if embedding is None else embedding.weight
    if not isinstance(weight, QuantTensor) or embedding.lookup is not quant_embedding or len(weight.parts) != 1:
        return None
    part = weight.parts[0]
    q8 = part.qtype == quant_kernels.PANELS + quant_kernels.QTYPES["Q8_0"] and quant_kernels.q8_available()
    dense = part.qtype == quant_kernels.BF16_PANELS
    if not (q8 or dense) or weight.dtype != torch.bfloat16 or weight.cols != hidden:
        return None
    assert scale is None or scale.dtype == torch.bfloat16
    return kernels.EmbeddingTable(part.data, part.rows, None if scale is None else float(scale), dense)
