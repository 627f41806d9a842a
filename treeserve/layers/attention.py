"""The attention call models make: paged attention for one batch, supplied by the engine."""

from __future__ import annotations

from typing import Protocol

import torch

from treeserve.kernels.cpu.layer_stack import StackPages
from treeserve.layers.rotary import RotaryEmbedding


class Attention(Protocol):
    """q [T, Hq, D] and k/v [T, Hkv, D] of layer `layer` -> [T, Hq, D]; the engine stores k/v in its pages.
    With `rope` (the layer's table, the tokens' positions), q and k come unrotated and the engine
    rotates them as it stores k (one launch on the Triton backend, `kernels/triton/rope_kv.py`)."""

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
        """The step's pages and groups where a fused CPU step may read them in place (on the C
        kernels' backend, each group on the C kernel the per-layer path would call for it); None
        otherwise (then call per layer)."""
        ...
