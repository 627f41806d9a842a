"""A step's flat token batch: items of consecutive tokens, and the forward's inputs built from it.

Item i computes `lens[i]` tokens from position `starts[i]`, its KV pages in row i of `tables`;
the items' tokens are concatenated (no padding). `attention_inputs` derives every token's
position and KV slot and the two attention groups' rows in a fixed number of numpy operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardBatch:
    """The items of a flat token batch (host int64 arrays): token_ids [T]; starts, lens, drafted
    (bool: a speculating decode) [B]; tables [B, W]."""

    token_ids: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    drafted: np.ndarray
    tables: np.ndarray

    @classmethod
    def of(cls, items: list[tuple[list[int], int, list[int]]]) -> ForwardBatch:
        """From (token ids to compute, first position, page table) per item (no speculation)."""
        tables = np.zeros((len(items), max(len(table) for _, _, table in items)), dtype=np.int64)
        for i, (_, _, table) in enumerate(items):
            tables[i, : len(table)] = table
        return cls(
            np.array([t for ids, _, _ in items for t in ids], dtype=np.int64),
            np.array([start for _, start, _ in items], dtype=np.int64),
            np.array([len(ids) for ids, _, _ in items], dtype=np.int64),
            np.zeros(len(items), dtype=bool),
            tables,
        )

    @property
    def offsets(self) -> np.ndarray:
        """Each item's first row in the flat batch."""
        return np.cumsum(self.lens) - self.lens

    def take(self, items: np.ndarray) -> ForwardBatch:
        """The batch of these items only (their rows, in this order)."""
        return ForwardBatch(
            self.token_ids[rows_of(self.offsets[items], self.lens[items])],
            self.starts[items],
            self.lens[items],
            self.drafted[items],
            self.tables[items],
        )


def micro_batches(batch: ForwardBatch, parts: int) -> list[np.ndarray]:
    """`batch`'s items in up to `parts` contiguous runs of about equal tokens (pipeline micro-batches)."""
    ends = np.cumsum(batch.lens)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = sorted({0, *cuts.tolist(), len(ends)})
    return [np.arange(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def rows_of(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenated ranges [starts[i], starts[i] + lens[i])."""
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + within


@dataclass
class GroupLayout:
    """The rows of one attention group (`attention.SeqGroup`'s fields and shapes, as host arrays)."""

    page_tables: np.ndarray
    context_lens: np.ndarray
    query_index: np.ndarray
    query_pos: np.ndarray
    query_start: np.ndarray
    query_len: np.ndarray


def attention_inputs(batch: ForwardBatch, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """(positions, slot pages, slot offsets, [decode group, prefill group]) of `batch`; a speculating
    item's positions are decode rows of their own, computed exactly as plain decoding computes them."""
    lens, starts, tables, drafted = batch.lens, batch.starts, batch.tables, batch.drafted
    items = np.arange(lens.shape[0])
    if lens.shape[0] == batch.token_ids.shape[0] and not drafted.any():  # plain decodes: one row each
        pages = -(-int(starts.max() + 1) // page_size)
        group = GroupLayout(
            np.ascontiguousarray(tables[:, :pages]), starts + 1, items[:, None], starts[:, None], items, lens
        )
        return starts, tables[items, starts // page_size], starts % page_size, [group]
    offsets = batch.offsets
    item_of = np.repeat(items, lens)
    positions = starts[item_of] + np.arange(item_of.shape[0]) - offsets[item_of]
    slot_pages = tables[item_of, positions // page_size]
    rows_per_item = np.where(drafted, lens, 1)
    row_item = np.repeat(items, rows_per_item)
    within = np.arange(row_item.shape[0]) - (np.cumsum(rows_per_item) - rows_per_item)[row_item]
    row_drafted = drafted[row_item]
    row_start = starts[row_item] + np.where(row_drafted, within, 0)
    row_len = np.where(row_drafted, 1, lens[row_item])
    row_offset = offsets[row_item] + np.where(row_drafted, within, 0)
    decode = row_len == 1
    groups = []
    for members in (decode, ~decode):
        if members.any():
            groups.append(
                _group(tables[row_item[members]], row_offset[members], row_start[members], row_len[members], page_size)
            )
    return positions, slot_pages, positions % page_size, groups


def _group(
    tables: np.ndarray, offset: np.ndarray, start: np.ndarray, length: np.ndarray, page_size: int
) -> GroupLayout:
    pages = -(-int((start + length).max()) // page_size)
    clamped = np.minimum(np.arange(int(length.max()))[None, :], length[:, None] - 1)
    return GroupLayout(
        np.ascontiguousarray(tables[:, :pages]),
        start + length,
        offset[:, None] + clamped,
        start[:, None] + clamped,
        offset,
        length,
    )
