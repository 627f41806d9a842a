"""Qwen3-MoE (`model_type: qwen3_moe`, e.g. Qwen3-30B-A3B): the Qwen3 decoder with routed experts.

Owns the sparse MLP. A router (`mlp.gate`, hidden -> experts) scores each token; softmax in fp32
over all experts, the top k kept (renormalised to sum 1 where `norm_topk_prob`), cast back to the
model's dtype. Tokens are then grouped by expert: each expert that any token chose runs once on
the rows gathered for it (never a dense loop over all experts), its output scaled by the rows'
weights and added into the result in ascending expert order, as transformers adds them. Each
expert is a gated MLP on the same `Linear` kernels as a dense layer, so a row's result does not
depend on the other rows of the step. With tensor parallelism every expert holds its share of
intermediate rows and the weighted sum is all-reduced once. Layers listed in `mlp_only_layers`
(or off `decoder_sparse_step`) keep a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from treeserve.distributed.groups import RankGroup
from treeserve.layers.linear import Linear
from treeserve.models.config import ModelConfig
from treeserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class SparseMoE(nn.Module):
    tp: RankGroup | None = None  # with tensor parallelism: the experts' partial sums are all-reduced once

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(cfg, moe.intermediate_size) for _ in range(moe.num_experts))
        self.act = self.experts[0].act

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts [T, k] and their weights [T, k] in x's dtype."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            start += count
            rows = picks // self.top_k
            y = self.experts[expert].partial(x[rows]) * weights.flatten()[picks, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out if self.tp is None else self.tp.all_reduce(out)


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
