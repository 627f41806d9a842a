"""Identical decode rows computed once: the beams of a search often hold the very same tokens.

Beam search copies each surviving beam several times and the copies, sampling with different
seeds from a confident model, often write the same first tokens of a step (on the arithmetic
world's beam search, 72% of the generator's decode rows had a twin with equal token ids). Two
sequences with equal token ids have equal hidden states and equal K/V at every position, so a
step computes each such token once: one representative row runs through the model, its
hidden state serves every twin (each still samples with its own seeded uniform, so outputs do
not change), and the K/V it wrote is copied into each twin's own slots. Decode rows of generation requests take
part (one new token, or one and the same drafted tokens when speculating); equality of the
whole token history and draft is checked, a hash only finds the candidates.
"""

from __future__ import annotations

import torch

from treeserve.engine.model_runner import ScheduledSeq
from treeserve.kv.arena import KVArena


def split_twins(batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[int]]:
    """The items to compute, and for each batch item the index of the computed item whose rows
    it takes (itself, or its representative twin)."""
    computed: list[ScheduledSeq] = []
    source: list[int] = []
    seen: dict[tuple, list[int]] = {}  # (history key, draft) -> computed items with that key
    for item in batch:
        seq = item.seq
        if item.num_tokens == 1 + len(item.draft) and seq.request.params is not None:
            key = (seq.history_key(), tuple(item.draft))
            for index in seen.get(key, ()):
                if computed[index].seq.token_ids == seq.token_ids:  # the key holds the draft itself
                    source.append(index)
                    break
            else:
                seen.setdefault(key, []).append(len(computed))
                source.append(len(computed))
                computed.append(item)
            continue
        source.append(len(computed))
        computed.append(item)
    return computed, source


def expand(batch: list[ScheduledSeq], computed: list[ScheduledSeq], source: list[int], hidden: torch.Tensor,
           arena: KVArena) -> torch.Tensor:  # fmt: skip
    """The hidden rows of every batch item (twins share their representative's) after copying
    the representative's new K/V into each twin's slot."""
    offsets, at = [], 0
    for item in computed:
        offsets.append(at)
        at += item.num_tokens
    rows: list[int] = []
    src_slots, dst_slots = [], []
    block_size = arena.block_size
    for item, index in zip(batch, source, strict=True):
        rep = computed[index]
        rows.extend(range(offsets[index], offsets[index] + item.num_tokens))
        if rep is not item:
            for position in range(item.start, item.end):
                src_slots.append((rep.seq.block_table[position // block_size], position % block_size))
                dst_slots.append((item.seq.block_table[position // block_size], position % block_size))
    arena.copy_slots(src_slots, dst_slots)
    index = torch.tensor(rows, device=hidden.device)
    return hidden.index_select(0, index)
