"""What the PRM sees of a reasoning chain (`SearchConfig.reasoning`): steps without think tags.
A step that is only tags is hidden and takes the last shown step's score (1.0 before any)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from treeserve.engine.thinking import THINK_END, THINK_START, tags_in_text

if TYPE_CHECKING:
    from treeserve.models.tokenizer import Tokenizer

TAGS = re.compile(rf"\s*(?:{re.escape(THINK_START)}|{re.escape(THINK_END)})\s*")
UNJUDGED = 1.0  # a hidden step's score before any shown step


def visible(step: str) -> str:
    """`step` with its think tags (and the blanks around them) removed; unchanged without tags."""
    if THINK_START not in step and THINK_END not in step:
        return step
    return TAGS.sub("\n", step).strip()


def prm_view(steps: list[str]) -> tuple[list[str], list[int]]:
    """The steps the PRM is shown, and for each of `steps` the index of the shown step whose score
    it takes (its own, or the last before it; -1: none)."""
    shown: list[str] = []
    owner: list[int] = []
    for step in steps:
        text = visible(step)
        if text or text == step:  # hidden only when tags were all it had (an empty step is shown, as without)
            shown.append(text)
        owner.append(len(shown) - 1)
    return shown, owner


def spread(scores: list[float], owner: list[int]) -> list[float]:
    """One score per step from the shown steps' `scores` (`prm_view`'s `owner`)."""
    return [scores[i] if i >= 0 else UNJUDGED for i in owner]


def check_generator(tokenizer: Tokenizer, name: str = "the generator") -> None:
    """ValueError unless `<think>` and `</think>` are tokens that decoding keeps as text."""
    problem = tags_in_text(tokenizer)
    if problem == "missing":
        raise ValueError(
            f"reasoning search needs a generator that writes {THINK_START}...{THINK_END}, but "
            f"{name}'s tokenizer has no {THINK_START} and {THINK_END} tokens"
        )
    if problem == "special":
        raise ValueError(
            f"reasoning search: {name}'s {THINK_START}/{THINK_END} are special tokens, which decoded "
            "steps leave out, so the think block cannot be found"
        )
