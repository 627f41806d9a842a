"""The attention call models make: paged attention for one batch, supplied by the engine."""

from __future__ import annotations

from typing import Protocol

import torch


class Attention(Protocol):
    """q [T, Hq, D] and k/v [T, Hkv, D] of layer `layer` -> [T, Hq, D]; the engine stores k/v in its pages."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor: ...
