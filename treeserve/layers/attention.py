"""The attention call models make: paged attention for one batch, supplied by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from treeserve.layers.rotary import RotaryEmbedding


@dataclass
class DecodePages:
    """A decode step's KV pages, for kernels that run every layer in one call
    (`layers/decode_stack.py`): row t of the step is the one query of sequence t."""

    k_cache: torch.Tensor  # layer 0's K pages [pages, block_size, kv_heads, head_dim]
    layer_stride: int  # elements from one layer's K pages to the next layer's
    v_offset: int  # elements from a layer's K pages to its V pages
    tables: torch.Tensor  # [T, max_pages] int64 block tables
    context_lens: torch.Tensor  # [T] int64: tokens each query sees (cached + itself)
    slot_pages: torch.Tensor  # [T] int64: where each row's K/V go
    slot_offsets: torch.Tensor  # [T] int64
    scale: float | None  # softmax scale; None: head_dim ** -0.5


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

    def decode_pages(self) -> DecodePages | None:
        """The step's pages where a fused CPU decode may read them in place (every row a decode,
        in row order, on the C kernels' backend); None otherwise (then call per layer)."""
        ...
