"""The values strategies pass around: `Problem`, `Beam` (a partial solution), `Leftover`
(tokens decode-ahead decoded past a step boundary) and `aggregate`. Data and pure functions only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treeserve.runtime.runtime import DecodeAhead

STEP_STOP = "\n\n"


@dataclass
class Problem:
    uid: str
    question: str
    prompt_ids: list[int]
    # its spend: tokens sampled (kept or pruned, rollouts too), and of every PRM input built for it
    generated_tokens: int = 0
    prm_tokens: int = 0
    stop: dict | None = None  # where and why its search stopped (adaptive: widths, certainty)
    # beams dropped as too long for the PRM, and the latest error (raised when none is left)
    too_long: int = 0
    too_long_error: ValueError | None = None
    # paced search: what one beam of its widths cost so far, and its spend when that was counted
    beam_tokens: float = 0.0
    counted_tokens: int = 0

    @property
    def spent_tokens(self) -> int:
        return self.generated_tokens + self.prm_tokens

    def count_beam_tokens(self, width: int, cumulative: bool) -> None:
        """The `width` beams of an iteration share its spend; a `cumulative` width shares all of it."""
        if cumulative:
            self.beam_tokens = self.spent_tokens / width
        else:
            self.beam_tokens += (self.spent_tokens - self.counted_tokens) / width
        self.counted_tokens = self.spent_tokens

    @property
    def spent(self) -> dict[str, int]:
        return {"generated_tokens": self.generated_tokens, "prm_input_tokens": self.prm_tokens}


@dataclass
class Beam:
    path: tuple[int, ...]
    step_ids: list[list[int]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)  # decoded steps, separator removed
    scores: list[float] = field(default_factory=list)
    completed: bool = False
    generated_tokens: int = 0
    lookahead_scores: list[float] = field(default_factory=list)  # of this iteration's rollout (not inherited)
    # decode-ahead past the last step (a running request, or its tokens); only copy 0 inherits them
    pending: DecodeAhead | None = None
    leftover: Leftover | None = None
    # for traces, of the newest step: decoded ahead, and where its scores came from ("" before any)
    decoded_ahead: bool = False
    score_source: str = ""
    dropped: bool = False  # its PRM input outgrew the PRM's context: search neither extends nor returns it

    def child(self, copy: int) -> Beam:
        child = Beam(
            self.path + (copy,),
            list(self.step_ids),
            list(self.steps),
            list(self.scores),
            self.completed,
            self.generated_tokens,
        )
        if copy == 0:
            child.pending, child.leftover = self.pending, self.leftover
        return child

    def drop_decode_ahead(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
        self.pending = self.leftover = None

    def value(self, agg: str) -> float:
        return aggregate(self.scores + self.lookahead_scores, agg)

    @property
    def text(self) -> str:
        return "".join(STEP_STOP + s if i else s for i, s in enumerate(self.steps))


@dataclass
class Leftover:
    tokens: list[int]
    stops: list[int]  # offsets of later stops, relative to `tokens`
    ended_by_eos: bool

    def next_step(self, max_tokens: int) -> tuple[list[int], bool, Leftover | None] | None:
        """(step tokens, ends the solution, the rest) as a fresh request would produce, or None."""
        if self.stops and self.stops[0] <= max_tokens:
            cut = self.stops[0]
            rest = Leftover(self.tokens[cut:], [t - cut for t in self.stops[1:]], self.ended_by_eos)
            return self.tokens[:cut], False, rest
        if self.ended_by_eos and len(self.tokens) <= max_tokens:
            return self.tokens, True, None
        if len(self.tokens) >= max_tokens:
            return self.tokens[:max_tokens], True, None  # a fresh request would stop on length
        return None


def aggregate(scores: list[float], agg: str) -> float:
    if not scores:
        return 0.0
    if agg == "last":
        return scores[-1]
    if agg == "min":
        return min(scores)
    product = 1.0
    for s in scores:
        product *= s
    return product
