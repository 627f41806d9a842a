"""A draft model for speculative decoding: a smaller model of the same vocabulary proposes k tokens greedily.

Its KV lives in the target's arena and page pool (its own view of the pages and its own page
tables). Each step a drafting sequence catches the draft up on the tokens it has not seen, which
yields the first drafted token, then runs k - 1 single-token forwards. Drafting never preempts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treeserve.engine.attention import AttentionBackend
from treeserve.engine.forward_batch import ForwardBatch
from treeserve.engine.model_runner import ModelRunner
from treeserve.engine.request import Sequence
from treeserve.kv.arena import KVArena, KVLayout, PageArena
from treeserve.kv.page_manager import PageManager
from treeserve.kv.page_pool import PagePool
from treeserve.models.loader import load_model


@dataclass
class DraftSeq:
    """What the draft's runner reads of a sequence: its tokens (with the drafted ones) and pages."""

    token_ids: list[int]
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    synced: int = 0  # tokens known equal to the target's (the draft's own come after)


class DraftModel:
    def __init__(self, path: str, dtype: torch.dtype, device: torch.device, vocab_size: int):
        loaded = load_model(path, dtype, device)
        if not loaded.config.has_lm_head:
            raise ValueError(f"draft model {path!r} has no LM head: it cannot propose tokens")
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {path!r} has a vocabulary of {loaded.config.vocab_size} tokens, the target "
                f"{vocab_size}: a draft must share the target's tokenizer"
            )
        self.model = loaded.model
        self.path = path
        cfg = loaded.config
        self.layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.attn_scale = cfg.attn_scale
        self.device = device
        self.states: dict[int, DraftSeq] = {}

    def attach(self, pages: PageArena, pool: PagePool, backend: AttentionBackend, model_id: str) -> None:
        page_size = pages.page_bytes // self.layout.token_bytes
        if page_size < 1:
            raise ValueError(f"draft model {self.path!r} needs more KV bytes per token than a page holds")
        layout = self.layout
        arena = KVArena(
            pages.num_pages,
            layout.num_layers,
            page_size,
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
            self.device,
            pages=pages,
        )
        self.pages = PageManager(pages.num_pages, page_size, "draft:" + model_id, True, pool=pool)
        self.runner = ModelRunner(self.model, arena, self.device, self.attn_scale, backend)

    @torch.inference_mode()
    def propose(self, wanting: list[tuple[Sequence, int]]) -> None:
        """Set `seq.draft` (k greedy tokens) for each (sequence, k) the pool has pages for."""
        items: list[tuple[DraftSeq, int, int]] = []  # (draft cache, first position, tokens to compute)
        ends: dict[int, int] = {}
        for seq, k in wanting:
            draft = self._sync(seq)
            start, end = draft.num_computed_tokens, len(seq.token_ids) + k - 1  # catch up, then k - 1 drafted
            if self.pages.pages_to_grow(draft.page_table, start, end) > self.pages.num_free_pages:
                continue
            self.runner.copy_pages(self.pages.grow(draft.page_table, start, end))
            items.append((draft, start, len(seq.token_ids) - start))
            ends[id(draft)] = len(seq.token_ids) + k
        while items:
            batch = ForwardBatch.of([(d.token_ids[start : start + n], start, d.page_table) for d, start, n in items])
            hidden = self.runner.forward(batch)
            last = torch.from_numpy(np.cumsum(batch.lens) - 1)
            tokens = self.model.compute_logits(hidden[last.to(hidden.device)]).float().argmax(dim=-1).tolist()
            going = []
            for (draft, start, n), token in zip(items, tokens, strict=True):
                draft.num_computed_tokens = start + n
                draft.token_ids.append(token)
                if len(draft.token_ids) < ends[id(draft)]:
                    going.append((draft, start + n, 1))
            items = going
        for seq, _ in wanting:
            seq.draft = self.states[seq.seq_id].token_ids[len(seq.token_ids) :]

    def _sync(self, seq: Sequence) -> DraftSeq:
        """The draft cache of `seq`, cut back to the prefix it shares with the target's tokens,
        leaving the last token to compute (its logits give the first drafted token)."""
        draft = self.states.get(seq.seq_id)
        if draft is None:
            draft = self.states[seq.seq_id] = DraftSeq(list(seq.token_ids))
            hit = self.pages.find_prefix(draft.token_ids, len(draft.token_ids) - 1)
            if self.pages.pages_to_acquire(hit) <= self.pages.num_free_pages:
                self.pages.acquire_prefix(hit)
                draft.page_table, draft.page_hashes = list(hit.pages), list(hit.hashes)
                draft.num_computed_tokens = hit.num_tokens(self.pages.page_size)
        target, mine = seq.token_ids, draft.token_ids
        valid = draft.synced = min(draft.synced, draft.num_computed_tokens)
        end = min(draft.num_computed_tokens, len(target) - 1)
        while valid < end and mine[valid] == target[valid]:
            valid += 1
        draft.num_computed_tokens = draft.synced = valid
        draft.token_ids = list(target)
        self.pages.commit_full_pages(draft.page_table, draft.page_hashes, draft.token_ids, valid)
        self.pages.truncate(draft.page_table, valid)
        return draft

    def release(self, seq: Sequence) -> None:
        draft = self.states.pop(seq.seq_id, None)
        if draft is not None:
            self.pages.release(draft.page_table)
