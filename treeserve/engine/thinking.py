"""The thinking budget (`SamplingParams.max_thinking_tokens`): where a sequence is in its think block.

Owns the think tokens of a tokenizer (`<think>` and `</think>`, each one token) and one sequence's
place among them (`ThinkState`): whether a think block is open and how many generated tokens it
holds. A block is open after the last `<think>` of the prompt or the output that no `</think>`
follows (a chat template that puts `<think>` at the end of the prompt opens it before the first
token). When an open block holds K generated tokens, the sequence's next token is forced to be
`</think>` (`forced_token`), which the input batch draws under a mask that allows that token alone
(`forced_masks`), the path structured outputs take. It never reads the tokenizer's text.
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
        """The tokenizer's `<think>` and `</think>` ids; None unless it has both as tokens."""
        start, end = tokenizer.hf.token_to_id(THINK_START), tokenizer.hf.token_to_id(THINK_END)
        return None if start is None or end is None else cls(start, end)


def tags_in_text(tokenizer: Tokenizer) -> str | None:
    """Why text the tokenizer decodes cannot hold the think tags (what a parser of its text
    needs): "missing" (not both tokens), "special" (decoding leaves special tokens out); None
    when it can."""
    if ThinkTokens.of(tokenizer) is None:
        return "missing"
    special = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special}
    return "special" if special & {THINK_START, THINK_END} else None


@dataclass(slots=True)
class ThinkState:
    """One sequence's think block after its first `seen` tokens: open or not, and how many
    generated tokens the open one holds (its `<think>` not counted)."""

    open: bool
    count: int
    seen: int

    @classmethod
    def of_prompt(cls, prompt: list[int], think: ThinkTokens) -> ThinkState:
        return cls(_last(prompt, think.start) > _last(prompt, think.end), 0, len(prompt))

    def advance(self, token_ids: list[int], think: ThinkTokens) -> None:
        """Read the tokens from `seen` on."""
        for token in token_ids[self.seen :]:
            if token == think.start:
                self.open, self.count = True, 0
            elif token == think.end:
                self.open = False
            elif self.open:
                self.count += 1
        self.seen = len(token_ids)


def forced_token(seq: Sequence, budget: int, think: ThinkTokens) -> int | None:
    """`</think>` when `seq`'s open think block holds `budget` generated tokens, else None.
    Reads `seq.token_ids`, so every token it sampled must be on the host (a step with such a row
    is not overlapped). A fork starts with no state and reads its own tokens."""
    state = seq.thinking
    if state is None:
        state = seq.thinking = ThinkState.of_prompt(seq.request.prompt_token_ids, think)
    state.advance(seq.token_ids, think)
    return think.end if state.open and state.count >= budget else None


def forced_masks(rows: list[int], forced: dict[int, int], guided: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[len(rows), ceil(vocab / 32)] int32 bitmasks (guided.py's layout) for a step's masked sample
    rows `rows`: a forced row's allows its one token, the others' are `guided`'s rows in order."""
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
    """The index of the last `token` in `ids`, -1 if none."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1
