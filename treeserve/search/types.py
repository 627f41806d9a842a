"""The values search strategies pass around: a problem, a beam (a partial solution), a leftover.

Owns `Problem` (a question and its prompt's token ids), `Beam` (one partial solution: its steps
as text and token ids, their PRM scores, its lineage `path`, and what decode-ahead
expansion decoded past its last step: the request still running (`pending`) or the tokens it
produced (`leftover`)), `Leftover` (tokens decoded past a step boundary, cut into steps as a
fresh request would) and `aggregate` (step scores to one value). Data and pure functions only:
the primitives that make and score beams are `context.py`'s, the record of them `trace.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treeserve.runtime.runtime import DecodeAhead

STEP_STOP = "\n\n"  # what ends a step


@dataclass
class Problem:
    uid: str
    question: str
    prompt_ids: list[int]
    # what its search spent: tokens the generator sampled (kept or pruned, rollouts too) and
    # tokens of every PRM input built for it (cached or not)
    generated_tokens: int = 0
    prm_tokens: int = 0
    # adaptive search: where it stopped and why, the widths it used, its certainty by iteration
    stop: dict | None = None
    # beams dropped because their PRM input outgrew the PRM's context, and the latest such error
    # (raised by a strategy that has nothing else left to return)
    too_long: int = 0
    too_long_error: ValueError | None = None
    # paced adaptive search: the tokens one beam of its widths cost so far (what a run's picked budget
    # is made of), and its spend when that was counted
    beam_tokens: float = 0.0
    counted_tokens: int = 0

    @property
    def spent_tokens(self) -> int:
        """Tokens sampled and fed to the PRM for it (its part of `SearchContext.spent_tokens`)."""
        return self.generated_tokens + self.prm_tokens

    def count_beam_tokens(self, width: int, cumulative: bool) -> None:
        """Update `beam_tokens` after a decision at `width`: the `width` beams of an iteration share
        what it spent (beam search); a `cumulative` width (sampling rounds, DVTS waves) counts every
        beam so far, which share all of it."""
        if cumulative:
            self.beam_tokens = self.spent_tokens / width
        else:
            self.beam_tokens += (self.spent_tokens - self.counted_tokens) / width
        self.counted_tokens = self.spent_tokens

    @property
    def spent(self) -> dict[str, int]:
        """What results report of its spend (eval's problem records, /v1/search's `spent`)."""
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
    # decode-ahead: the request still decoding past this beam's last step, or
    # the tokens it decoded there. Only copy 0 inherits them (it continues the same seed).
    pending: DecodeAhead | None = None
    leftover: Leftover | None = None
    # for traces, of this beam's newest step (not inherited): decoded past the previous boundary;
    # where its scores came from ("prm", "cache", "shared"; "" before any)
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
        """What search ranks the beam by: its step scores, continued by its rollout's, aggregated."""
        return aggregate(self.scores + self.lookahead_scores, agg)

    @property
    def text(self) -> str:
        return "".join(STEP_STOP + s if i else s for i, s in enumerate(self.steps))


@dataclass
class Leftover:
    """Tokens decoded past a step boundary, with the (relative) token offsets of later stops."""

    tokens: list[int]
    stops: list[int]
    ended_by_eos: bool

    def next_step(self, max_tokens: int) -> tuple[list[int], bool, Leftover | None] | None:
        """(step tokens, step ends the solution, what is left) exactly as a fresh request with the
        same seed would produce, or None when the leftover cannot tell."""
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
