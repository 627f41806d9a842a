"""Speculative decoding: which sequences draft, how many tokens, and from where (docs/speculative-decoding.md).

The target samples every drafted position with that position's own seeded uniform and keeps
drafted tokens while they equal its samples, so outputs equal plain decoding's. Drafts come
from prompt lookup (`ngram`), a draft group's text (`tree`) or a draft model (`model`); a
sequence's draft length adapts, pausing after repeated rejections.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treeserve.config import SpeculativeConfig
from treeserve.engine.speculative.prompt_lookup import SEPARATOR, DraftState, propose_lookup

if TYPE_CHECKING:
    from treeserve.engine.request import Sequence
    from treeserve.engine.speculative.draft_model import DraftModel

GROUPS_KEPT = 4096  # draft groups remembered (least recently used dropped)
FINISHED_KEPT = 64  # finished sequences of a group still searched for drafts


@dataclass
class DraftStats:
    method: str
    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


class DraftGroups:
    def __init__(self) -> None:
        self.groups: OrderedDict[str, Group] = OrderedDict()

    def join(self, key: str) -> Group:
        group = self.groups.pop(key, None) or Group()
        self.groups[key] = group
        while len(self.groups) > GROUPS_KEPT:
            self.groups.popitem(last=False)
        return group

    def get(self, key: str | None) -> Group | None:
        return self.groups.get(key)

    def forget(self, key: str) -> None:
        self.groups.pop(key, None)


@dataclass
class Group:
    live: dict[int, Sequence] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    corpus: str = ""
    corpus_step: int = -1
    offsets: dict[int, int] = field(default_factory=dict)  # seq_id -> end of its tokens in corpus

    def build(self, step: int) -> None:
        """The group's text as one corpus (finished members, then live ones), once per engine step."""
        if self.corpus_step == step:
            return
        for seq_id, seq in list(self.live.items()):
            if seq.is_finished:
                del self.live[seq_id]
                self.finished = [*self.finished[-(FINISHED_KEPT - 1) :], seq.drafting.sync(seq.token_ids)]
        parts = [p + SEPARATOR for p in self.finished]
        at = sum(len(p) for p in parts)
        offsets = {}
        for seq_id, seq in self.live.items():
            text = seq.drafting.sync(seq.token_ids)
            parts.append(text + SEPARATOR)
            offsets[seq_id] = at + len(text)
            at += len(text) + 1
        self.corpus, self.offsets, self.corpus_step = "".join(parts), offsets, step


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft_model: DraftModel | None = None):
        self.config = config
        self.stats = DraftStats(config.method)
        self.groups = DraftGroups()
        self.draft_model = draft_model
        self.step = 0

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set `seq.draft` of every running sequence ([] where it drafts nothing this step)."""
        self.step += 1
        c = self.config
        wanting: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft = []
        if c.disable_by_batch_size is not None and len(running) > c.disable_by_batch_size:
            return
        for seq in running:
            room = self._room(seq, max_model_len)
            if room > 0:
                state = seq.drafting or self._start(seq)
                if state.paused_until <= self.step:
                    wanting.append((seq, min(state.k, room)))
        if self.draft_model is not None:
            self.draft_model.propose(wanting)
            return
        for seq, k in wanting:
            tokens = seq.drafting.sync(seq.token_ids)
            group = self.groups.get(seq.request.draft_group) if c.method == "tree" else None
            if group is not None and seq.seq_id in group.live:
                group.build(self.step)
                corpus, own_end = group.corpus, group.offsets[seq.seq_id]
            else:
                corpus, own_end = tokens, len(tokens)
            seq.draft = propose_lookup(corpus, own_end, tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += drafted
        self.stats.num_accepted_tokens += accepted
        seq.drafting.adapt(drafted, accepted, self.config.num_speculative_tokens, self.step)

    def release(self, seq: Sequence) -> None:
        if self.draft_model is not None:
            self.draft_model.release(seq)

    def forget_group(self, key: str) -> None:
        self.groups.forget(key)

    def _start(self, seq: Sequence) -> DraftState:
        seq.drafting = DraftState(k=self.config.num_speculative_tokens)
        key = seq.request.draft_group
        if self.config.method == "tree" and key is not None:
            self.groups.join(key).live[seq.seq_id] = seq
        return seq.drafting

    @staticmethod
    def _room(seq: Sequence, max_model_len: int) -> int:
        """How many tokens `seq` may draft now (0 with logit edits, a constraint or a thinking budget)."""
        params = seq.request.params
        if params is None or seq.num_uncomputed != 1 or seq.pending_forks or seq.num_output_tokens == 0:
            return 0
        if params.structured_outputs is not None or params.adjusts_logits or params.max_thinking_tokens is not None:
            return 0
        room = max_model_len - 1 - len(seq.token_ids)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return room
