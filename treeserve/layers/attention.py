"""The attention call models make: paged attention for one batch, supplied by the engine."""

from __future__ import annotations

from typing import Protocol

import torch

from treeserve.kernels.cpu.layer_stack import StackPages
from treeserve.layers.rotary import RotaryEmbedding


class Attention(Protocol):
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], k/v stored in the engine's pages. With `rope`
    (table, positions) q and k come unrotated and the engine rotates them as it stores k."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        rope: tuple[RotaryEmbedding, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def stack_pages(self) -> StackPages | None:
        """The step's pages and groups where the C layer stack may read them in place, else None."""
        ...
