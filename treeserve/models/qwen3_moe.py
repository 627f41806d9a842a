"""Qwen3-MoE (`model_type: qwen3_moe`): the Qwen3 decoder with routed experts. The router's fp32
softmax picks the top k (renormalised where `norm_topk_prob`); each chosen expert runs once on
its rows, outputs added in ascending expert order as transformers does, on the dense `Linear`
kernels (batch invariant). Under TP experts hold their share of rows, all-reduced once. On CUDA
the experts' weights are stacked once (the `Linear`s become views) for `kernels/triton/moe.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from treeserve.distributed.groups import RankGroup
from treeserve.kernels import triton as triton_kernels
from treeserve.layers.linear import Linear
from treeserve.models.config import ModelConfig
from treeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class SparseMoE(nn.Module):
    tp: RankGroup | None = None  # the experts' partial sums are all-reduced once

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(cfg, moe.intermediate_size) for _ in range(moe.num_experts))
        self.act = self.experts[0].act
        self.use_triton = False
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def pick_kernel(self) -> None:
        if triton_kernels.fused_layers(self.gate.weight.device):
            self.use_triton = self.stack_experts()

    def stack_experts(self) -> bool:
        """Stack the experts' weights (each becoming views); False unless all are plain, one dtype, no bias."""
        linears = [proj for expert in self.experts for proj in (expert.gate_up_proj, expert.down_proj)]
        dtype = linears[0].weight.dtype
        if not all(isinstance(p.weight, torch.Tensor) and p.weight.dtype == dtype and p.bias is None for p in linears):
            return False
        stacks = []
        for name in ("gate_up_proj", "down_proj"):
            stack = torch.stack([getattr(expert, name).weight.detach() for expert in self.experts])
            for expert, weight in zip(self.experts, stack, strict=True):
                getattr(expert, name).weight = nn.Parameter(weight, requires_grad=False)
            stacks.append(stack)
        self.stacked = (stacks[0], stacks[1])
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [T, k] and their weights [T, k] in x's dtype."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if self.use_triton:
            from treeserve.kernels.triton.moe import fused_moe

            out = fused_moe(x, *self.stacked, experts, weights, self.experts[0].hidden_act)
        else:
            out = self.grouped(x, experts.flatten(), weights.flatten())
        return out if self.tp is None else self.tp.all_reduce(out)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once on its rows (`experts`, `weights`: [T * k], row-major)."""
        order = torch.argsort(experts, stable=True)  # grouped by expert, rows ascending
        counts = torch.bincount(experts, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            start += count
            rows = picks // self.top_k
            y = self.experts[expert].partial(x[rows]) * weights[picks, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        if cfg.moe.sparse_layers[cfg.first_layer + layer]:
            self.mlp = SparseMoE(cfg)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose sparse layers route tokens to experts (`SparseMoE`)."""

    decoder_layer = Qwen3MoeDecoderLayer

    def attach(self, tp: RankGroup) -> None:
        super().attach(tp)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.tp = tp
