"""The thinking budget (`SamplingParams.max_thinking_tokens`): where a sequence is in its think block.

A block is open after the last `<think>` of the prompt or output that no `</think>` follows. When
it holds K generated tokens the next token is forced to `</think>` (`forced_token`), drawn under a
one-token mask (`forced_masks`), the path structured outputs take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from treeserve.engine.request import Sequence
    from treeserve.models.tokenizer import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    start: int
    end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ThinkTokens | None:
        start, end = tokenizer.hf.token_to_id(THINK_START), tokenizer.hf.token_to_id(THINK_END)
        return None if start is None or end is None else cls(start, end)


def tags_in_text(tokenizer: Tokenizer) -> str | None:
    """Why decoded text cannot hold the think tags: "missing" (not both tokens), "special"; None: it can."""
    if ThinkTokens.of(tokenizer) is None:
        return "missing"
    special = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special}
    return "special" if special & {THINK_START, THINK_END} else None


@dataclass(slots=True)
class ThinkState:
    """One sequence's think block after its first `seen` tokens: open or not, and its generated tokens."""

    open: bool
    count: int
    seen: int

    @classmethod
    def of_prompt(cls, prompt: list[int], think: ThinkTokens) -> ThinkState:
        return cls(_last(prompt, think.start) > _last(prompt, think.end), 0, len(prompt))

    def advance(self, token_ids: list[int], think: ThinkTokens) -> None:
        for token in token_ids[self.seen :]:
            if token == think.start:
                self.open, self.count = True, 0
            elif token == think.end:
                self.open = False
            elif self.open:
                self.count += 1
        self.seen = len(token_ids)


def forced_token(seq: Sequence, budget: int, think: ThinkTokens) -> int | None:
    """`</think>` when `seq`'s open think block holds `budget` tokens (read on the host), else None."""
    state = seq.thinking
    if state is None:
        state = seq.thinking = ThinkState.of_prompt(seq.request.prompt_token_ids, think)
    state.advance(seq.token_ids, think)
    return think.end if state.open and state.count >= budget else None


def forced_masks(rows: list[int], forced: dict[int, int], guided: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[len(rows), ceil(vocab / 32)] int32 bitmasks: a forced row's one token, else `guided`'s in order."""
    masks = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    others = [j for j, row in enumerate(rows) if row not in forced]
    if others:
        masks[others] = guided
    for j, row in enumerate(rows):
        if row in forced:
            token = forced[row]
            bit = token % 32
            masks[j, token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31: the int32's sign
    return masks


def _last(ids: list[int], token: int) -> int:
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1
