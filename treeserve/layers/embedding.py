"""The token embedding table, with its lookup picked at load like `Linear`'s matmul.

`Embedding` is `nn.Embedding` (same parameter, same checkpoint name) whose forward calls
`self.lookup`: F.embedding for a dense table, `quant_embedding` when the table is a
`QuantTensor`: the loader replaced it (GGUF's Q8_0 table, an int8 one), or a bf16 table was laid
out as dense panels where AMX tiles multiply them (as a bf16 `Linear` lays out its weight: a
tied LM head then multiplies on the tiles, and the table has no second copy). A tied LM head
multiplies by the same table (the model's `pick_kernel`). On a CPU that does not multiply bf16
itself, a bf16 table is widened to fp32 like a `Linear`'s weight (`linear.widens`; its rows looked
up are rounded back to bf16, exactly), and a tied LM head multiplies by it in fp32.
`vocab_parallel_lookup` looks rows up in a table split by vocabulary over tensor-parallel ranks.
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
        self.widened = False  # a bf16 table held in fp32 (`linear.widens`)

    def pick_kernel(self) -> None:
        if widens(self.weight):
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
            self.lookup, self.widened = widened_embedding, True
            return
        if cpu_kernels.amx_supports(self.weight) and dense_panels_supported(self.weight):
            set_quantized(self, "weight", dense_panels(self.weight))  # rows looked up exactly
        if isinstance(self.weight, QuantTensor):
            self.weight = self.weight.in_panels(lookups=True)  # a tied LM head multiplies the same panels
            self.lookup = quant_embedding
        else:
            self.lookup = F.embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids, self.weight)


def widened_embedding(input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of a bf16 table held in fp32, back in bf16 (exactly their values)."""
    return F.embedding(input_ids, table).to(torch.bfloat16)


def vocab_parallel_lookup(lookup: Any, ids: torch.Tensor, table: Any, rows: int, tp: RankGroup) -> torch.Tensor:
    """Rows of a table split by vocabulary (`rows` of them here): this rank's rows, zeros
    elsewhere, summed over ranks."""
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = lookup(local.clamp(0, rows - 1), table)
    out[outside] = 0
    return tp.all_reduce(out)
