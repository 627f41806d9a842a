"""Turn one scheduled batch into flat tensors and run one forward pass.

Input: the sequences of this step, each with the range of tokens to compute. Output: the
final hidden state of every computed token, flat ([T, hidden]); the engine picks the
rows it samples from or scores. No padding to the longest prompt: tokens are
concatenated; only the attention of prefill chunks pads, and only within its group.
Index tensors are built on the host from per-sequence lists (never per token in Python) and
reach the device in one staged copy (`staging.py`); the attention backend the engine chose
(`attention.py`) runs each layer's attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from treeserve.engine.attention import AttentionBackend, AttentionBatch, SdpaBackend, SeqGroup
from treeserve.engine.request import Sequence
from treeserve.engine.staging import Staging
from treeserve.kv.arena import KVArena


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already computed (cached) before this step
    num_tokens: int  # tokens computed this step (a speculating decode: its last token + the draft)
    draft: list[int] = field(default_factory=list)  # drafted tokens run after the sequence's own

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end - len(self.draft)] + self.draft

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        arena: KVArena,
        device: torch.device,
        scale: float | None = None,
        backend: AttentionBackend | None = None,
    ):
        self.model = model
        self.arena = arena
        self.block_size = arena.block_size
        self.device = device
        self.scale = scale
        self.backend = backend or SdpaBackend()
        self.staging = Staging(device)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Index tensors are built on the host and reach the device in one staged copy."""
        input_ids: list[int] = []
        for item in batch:
            input_ids.extend(item.token_ids)
        tokens = torch.tensor(input_ids, dtype=torch.long)
        starts = torch.tensor([b.start for b in batch])
        lens = torch.tensor([b.num_tokens for b in batch])
        offsets = torch.cumsum(lens, 0) - lens
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), lens)
        positions = starts[seq_of_token] + torch.arange(len(input_ids)) - offsets[seq_of_token]
        tables = self._block_tables([b.seq.block_table for b in batch])
        slot_pages = tables[seq_of_token, positions // self.block_size]
        rows = self._query_rows(batch)
        groups = [
            self._group(tables, rows, [i for i, r in enumerate(rows) if r[3] == 1]),
            self._group(tables, rows, [i for i, r in enumerate(rows) if r[3] > 1]),
        ]
        groups = [g for g in groups if g is not None]
        host = [tokens, positions, slot_pages, positions % self.block_size]
        host += [getattr(g, f.name) for g in groups for f in fields(SeqGroup) if f.name != "masks"]
        staged = iter(self.staging.to_device(*host))
        tokens, positions, slot_pages, slot_offsets = (next(staged) for _ in range(4))
        groups = [SeqGroup(*(next(staged) for f in fields(SeqGroup) if f.name != "masks")) for _ in groups]
        attn = AttentionBatch(self.arena, slot_pages, slot_offsets, groups, self.backend, self.scale)
        return self.model(tokens, positions, attn)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long)

    @staticmethod
    def _query_rows(batch: list[ScheduledSeq]) -> list[tuple[int, int, int, int]]:
        """(batch item, flat offset, first position, queries) of each attention row. A speculating
        decode's positions are decode rows of their own (context up to each position), so each
        drafted position's hidden state is computed exactly as plain decoding computes it."""
        rows = []
        offset = 0
        for i, b in enumerate(batch):
            if b.draft:
                rows += [(i, offset + j, b.start + j, 1) for j in range(b.num_tokens)]
            else:
                rows.append((i, offset, b.start, b.num_tokens))
            offset += b.num_tokens
        return rows

    def _group(
        self, tables: torch.Tensor, rows: list[tuple[int, int, int, int]], members: list[int]
    ) -> SeqGroup | None:
        if not members:
            return None
        item, offset, start, length = (torch.tensor(column) for column in zip(*(rows[i] for i in members), strict=True))
        pages = -(-int((start + length).max()) // self.block_size)
        width = int(length.max())
        step = torch.arange(width)[None, :]
        clamped = torch.minimum(step, length[:, None] - 1)
        return SeqGroup(
            block_tables=tables[item, :pages],
            context_lens=start + length,
            query_index=offset[:, None] + clamped,
            query_pos=start[:, None] + clamped,
            query_start=offset,
            query_len=length,
        )
