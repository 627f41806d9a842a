"""Turn one scheduled batch into flat tensors and run one forward pass.

Input: the sequences of this step, each with the range of tokens to compute. Output: the
final hidden state of every computed token, flat ([T, hidden]); the engine picks the
rows it samples from or scores. No padding to the longest prompt: tokens are
concatenated; only the attention of prefill chunks pads, and only within its group.
Index tensors are built from per-sequence lists, never per token in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.engine.attention import AttentionBatch, SeqGroup
from treeserve.engine.request import Sequence
from treeserve.kv.arena import KVArena


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already computed (cached) before this step
    num_tokens: int  # tokens computed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, arena: KVArena, device: torch.device, scale: float | None = None):
        self.model = model
        self.arena = arena
        self.block_size = arena.block_size
        self.device = device
        self.scale = scale

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        input_ids: list[int] = []
        for item in batch:
            input_ids.extend(item.seq.token_ids[item.start : item.end])
        tokens = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        starts = torch.tensor([b.start for b in batch], device=self.device)
        lens = torch.tensor([b.num_tokens for b in batch], device=self.device)
        offsets = torch.cumsum(lens, 0) - lens
        seq_of_token = torch.repeat_interleave(torch.arange(len(batch), device=self.device), lens)
        positions = starts[seq_of_token] + torch.arange(len(input_ids), device=self.device) - offsets[seq_of_token]
        tables = self._block_tables([b.seq.block_table for b in batch])
        slot_pages = tables[seq_of_token, positions // self.block_size]
        groups = [
            self._group(batch, tables, starts, lens, offsets, [i for i, b in enumerate(batch) if b.num_tokens == 1]),
            self._group(batch, tables, starts, lens, offsets, [i for i, b in enumerate(batch) if b.num_tokens > 1]),
        ]
        attn = AttentionBatch(
            arena=self.arena,
            slot_pages=slot_pages,
            slot_offsets=positions % self.block_size,
            groups=[g for g in groups if g is not None],
            scale=self.scale,
        )
        return self.model(tokens, positions, attn)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _group(
        self,
        batch: list[ScheduledSeq],
        tables: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        offsets: torch.Tensor,
        members: list[int],
    ) -> SeqGroup | None:
        if not members:
            return None
        index = torch.tensor(members, device=self.device)
        pages = -(-max(batch[i].end for i in members) // self.block_size)
        width = max(batch[i].num_tokens for i in members)
        step = torch.arange(width, device=self.device)[None, :]
        last = lens[index][:, None] - 1
        clamped = torch.minimum(step, last)
        return SeqGroup(
            block_tables=tables[index, :pages],
            context_lens=starts[index] + lens[index],
            query_index=offsets[index][:, None] + clamped,
            query_pos=starts[index][:, None] + clamped,
            query_valid=step <= last,
            query_start=offsets[index],
            query_len=lens[index],
        )
