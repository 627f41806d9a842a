"""`Embedding` (nn.Embedding, same checkpoint name) looks rows up by a function picked at load:
F.embedding, or `quant_embedding` for a `QuantTensor` table (quantised, or bf16 panels where
AMX multiplies them, so a tied LM head shares them). Without bf16 products a bf16 table is
widened to fp32 like a `Linear`'s weight, its rows rounded back exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.layers.linear import widens
from treeserve.layers.quant import QuantTensor, dense_panels, dense_panels_supported, quant_embedding, set_quantized

if TYPE_CHECKING:
    from treeserve.distributed.groups import RankGroup


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.lookup: Callable[[torch.Tensor, torch.Tensor | QuantTensor], torch.Tensor] = F.embedding
        self.widened = False

    def pick_kernel(self) -> None:
        if widens(self.weight):
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
            self.lookup, self.widened = widened_embedding, True
            return
        if cpu_kernels.amx_supports(self.weight) and dense_panels_supported(self.weight):
            set_quantized(self, "weight", dense_panels(self.weight))
        if isinstance(self.weight, QuantTensor):
            self.weight = self.weight.in_panels(lookups=True)
            self.lookup = quant_embedding
        else:
            self.lookup = F.embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids, self.weight)


def widened_embedding(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, table).to(torch.bfloat16)


def vocab_parallel_lookup(lookup: Any, ids: torch.Tensor, table: Any, rows: int, tp: RankGroup) -> torch.Tensor:
    """Rows of a table split by vocabulary over ranks (`rows` here), summed over ranks."""
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = lookup(local.clamp(0, rows - 1), table)
    out[outside] = 0
    return tp.all_reduce(out)
