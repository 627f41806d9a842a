"""Identical decode rows computed once: the beams of a search often hold the very same tokens.

Items with equal histories and first input tokens have equal hidden states and K/V: one
representative runs through the model, serves every twin (each samples with its own uniform),
and its new K/V is copied into the twins' slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from treeserve.engine.forward_batch import ForwardBatch
from treeserve.kv.arena import KVArena


def representatives(groups: np.ndarray, first_tokens: np.ndarray) -> np.ndarray:
    """Per item, the first item of its group (`groups`, -1: none) with its first token (or itself)."""
    items = np.arange(groups.shape[0])
    candidates = np.flatnonzero(groups >= 0)
    key = groups[candidates] * (int(first_tokens.max()) + 1) + first_tokens[candidates]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)  # first: lowest index per key
    rep = items.copy()
    rep[candidates] = candidates[first[inverse.reshape(-1)]]
    return rep


@dataclass
class Twins:
    """A batch with its twin items dropped, and how to give the twins their rows back."""

    computed: ForwardBatch  # representatives and every item without a twin, in batch order
    rows: np.ndarray  # [T] for each row of the whole batch, its row in `computed`
    src_pages: np.ndarray  # K/V slots (page, offset) to copy into the twins' own after the forward
    src_offsets: np.ndarray
    dst_pages: np.ndarray
    dst_offsets: np.ndarray

    @classmethod
    def find(cls, batch: ForwardBatch, groups: np.ndarray, page_size: int) -> Twins | None:
        """The twins of `batch` (items of one group with equal first tokens), or None."""
        rep = representatives(groups, batch.token_ids[batch.offsets])
        items = np.arange(rep.shape[0])
        twin = rep != items
        if not twin.any():
            return None
        kept = np.flatnonzero(~twin)
        position_in_kept = np.full_like(rep, -1)
        position_in_kept[kept] = np.arange(kept.shape[0])
        computed = batch.take(kept)
        item_of = np.repeat(items, batch.lens)
        within = np.arange(item_of.shape[0]) - batch.offsets[item_of]
        rows = computed.offsets[position_in_kept[rep[item_of]]] + within
        copy = twin[item_of]  # a twin has its representative's length and positions
        positions = (batch.starts[item_of] + within)[copy]
        pages = positions // page_size
        return cls(
            computed,
            rows,
            batch.tables[rep[item_of][copy], pages],
            positions % page_size,
            batch.tables[item_of[copy], pages],
            positions % page_size,
        )

    def expand(
        self, hidden: torch.Tensor, arena: KVArena, to_device: Callable[..., list[torch.Tensor]]
    ) -> torch.Tensor:
        """The hidden rows of the whole batch, after copying each representative's new K/V into its twins'."""
        slots = (self.src_pages, self.src_offsets, self.dst_pages, self.dst_offsets, self.rows)
        *pairs, rows = to_device(*(torch.from_numpy(t) for t in slots))
        arena.copy_slots(*pairs)
        return hidden.index_select(0, rows)
