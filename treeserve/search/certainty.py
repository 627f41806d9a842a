"""How settled a problem's answer is, in [0, 1], from its own beams only: the signals adaptive
search stops on (Adaptive-Consistency's Beta rule; Dynasor's reward-based Certaindex)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def vote_certainty(answers: Sequence[Hashable | None]) -> float:
    """P(p > 1/2) for p ~ Beta(a + 1, b + 1), a and b the votes of the leading answers; 0.0 without one."""
    counts: dict[Hashable, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return 0.0
    top = sorted(counts.values(), reverse=True) + [0]
    a, b = top[0], top[1]
    trials = a + b + 1  # = P(Binomial(a + b + 1, 1/2) <= a)
    return sum(math.comb(trials, k) for k in range(a + 1)) / 2**trials


def reward_certainty(answers: Sequence[Hashable | None], values: Sequence[float]) -> float:
    """The leading answer's share of the PRM weight (clipped to [0, 1]), some on no answer."""
    weights = [min(max(v, 0.0), 1.0) for v in values]
    total = sum(weights)
    by_answer: dict[Hashable, list[float]] = {}
    for answer, weight in zip(answers, weights, strict=True):
        if answer is not None:
            by_answer.setdefault(answer, []).append(weight)
    if not by_answer or total <= 0.0:
        return 0.0
    return max(sum(weights) for weights in by_answer.values()) / total
