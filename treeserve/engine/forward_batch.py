"""A step's flat token batch: items of consecutive tokens, and the forward's inputs built from it.

Item i computes `lens[i]` tokens from position `starts[i]` of one sequence, whose KV pages are
row i of `tables`; the items' tokens are concatenated (no padding). `attention_inputs` derives
what attention needs: every token's position and KV slot, and the rows of the two attention
groups (decodes, one query each; prefill chunks, many), all with a fixed number of tensor
operations whatever the batch size (built on the host, then sent in one staged copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine.attention import SeqGroup


@dataclass
class ForwardBatch:
    """The items of a flat token batch (host int64 tensors): item i computes `lens[i]` tokens
    from position `starts[i]`, its KV pages in row i of `tables`."""

    token_ids: torch.Tensor  # [T]
    starts: torch.Tensor  # [B]
    lens: torch.Tensor  # [B]
    spec: torch.Tensor  # [B] bool: a speculating decode (each of its positions is a decode row of its own)
    tables: torch.Tensor  # [B, W]

    @classmethod
    def of(cls, items: list[tuple[list[int], int, list[int]]]) -> ForwardBatch:
        """From (token ids to compute, first position, block table) per item (no speculation)."""
        width = max(len(table) for _, _, table in items)
        tables = torch.zeros(len(items), width, dtype=torch.long)
        for i, (_, _, table) in enumerate(items):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        return cls(
            torch.tensor([t for ids, _, _ in items for t in ids], dtype=torch.long),
            torch.tensor([start for _, start, _ in items], dtype=torch.long),
            torch.tensor([len(ids) for ids, _, _ in items], dtype=torch.long),
            torch.zeros(len(items), dtype=torch.bool),
            tables,
        )

    @property
    def offsets(self) -> torch.Tensor:
        """Each item's first row in the flat batch."""
        return torch.cumsum(self.lens, 0) - self.lens

    def take(self, items: torch.Tensor) -> ForwardBatch:
        """The batch of these items only (their rows, in this order)."""
        lens = self.lens[items]
        starts_of_rows = torch.repeat_interleave(self.offsets[items], lens)
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return ForwardBatch(self.token_ids[starts_of_rows + within], self.starts[items], lens, self.spec[items],
                            self.tables[items])  # fmt: skip


def attention_inputs(batch: ForwardBatch, block_size: int) -> tuple[torch.Tensor, ...]:
    """(positions, slot pages, slot offsets, attention groups) of `batch`, on the host: a decode
    group (one query a row) and a prefill group (chunks of queries); a speculating item's
    positions are decode rows of their own, so each drafted position's hidden state is computed
    exactly as plain decoding computes it."""
    lens, starts, tables = batch.lens, batch.starts, batch.tables
    items = torch.arange(lens.shape[0])
    offsets = batch.offsets
    item_of = torch.repeat_interleave(items, lens)
    positions = starts[item_of] + torch.arange(item_of.shape[0]) - offsets[item_of]
    slot_pages = tables[item_of, positions // block_size]
    rows_per_item = torch.where(batch.spec, lens, 1)
    row_item = torch.repeat_interleave(items, rows_per_item)
    within = torch.arange(row_item.shape[0]) - (torch.cumsum(rows_per_item, 0) - rows_per_item)[row_item]
    spec = batch.spec[row_item]
    row_start = starts[row_item] + torch.where(spec, within, 0)
    row_len = torch.where(spec, 1, lens[row_item])
    row_offset = offsets[row_item] + torch.where(spec, within, 0)
    decode = row_len == 1
    groups = []
    for members in (decode, ~decode):
        if bool(members.any()):
            groups.append(_group(tables[row_item[members]], row_offset[members], row_start[members],
                                 row_len[members], block_size))  # fmt: skip
    return positions, slot_pages, positions % block_size, groups


def _group(tables: torch.Tensor, offset: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
           block_size: int) -> SeqGroup:  # fmt: skip
    pages = -(-int((start + length).max()) // block_size)
    step = torch.arange(int(length.max()))[None, :]
    clamped = torch.minimum(step, length[:, None] - 1)
    return SeqGroup(
        block_tables=tables[:, :pages].contiguous(),
        context_lens=start + length,
        query_index=offset[:, None] + clamped,
        query_pos=start[:, None] + clamped,
        query_start=offset,
        query_len=length,
    )
