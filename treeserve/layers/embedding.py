"""The token embedding table, with its lookup picked at load like `Linear`'s matmul.

`Embedding` is `nn.Embedding` (same parameter, same checkpoint name) whose forward calls
`self.lookup`: F.embedding for a dense table, `quant_embedding` when the loader replaced the
table by a `QuantTensor` (GGUF's Q8_0 table, an int8 one). A tied LM head multiplies by the
same table (`linear_kernel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.layers.quant import QuantTensor, quant_embedding


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.lookup: Callable[[torch.Tensor, torch.Tensor | QuantTensor], torch.Tensor] = F.embedding

    def pick_kernel(self) -> None:
        self.lookup = quant_embedding if isinstance(self.weight, QuantTensor) else F.embedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids, self.weight)
