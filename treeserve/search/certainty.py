"""How settled a problem's answer is, as its search runs: the signals adaptive search stops on.

Pure functions over a problem's own beams (never another problem's), so a stopping decision
is the same for the problem alone or in any batch. Two published rules:

* `vote_certainty` (best-of-N, majority, and DVTS with one vote a subtree; Adaptive-Consistency,
  Aggarwal et al. 2023, the Beta criterion): with `a` votes for the leading answer and `b` for
  the runner-up, the posterior probability that the leader's share beats the runner-up's,
  P(p > 1/2) for p ~ Beta(a + 1, b + 1). Exact for integer counts:
  P(Binomial(a + b + 1, 1/2) <= a). Completions without an answer do not vote.
* `reward_certainty` (beam search; after Dynasor's reward-based Certaindex, Fu et al.
  2025, which reads a search's certainty from its reward model's scores): the beams'
  answers weighted by their PRM value, the share of the weight on the leading answer.
  Beams without an answer yet (unfinished steps) hold weight on no answer: a problem settles
  only once most of the PRM's belief sits on one finished answer. (Scaling the share by the
  answer's mean reward, as a stricter rule would, kept every problem of the arithmetic
  world unsettled: its PRM rates even unanimous right answers about 0.5.)

Both lie in [0, 1]; a problem is settled when its certainty reaches the threshold
(`SearchConfig.certainty`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def vote_certainty(answers: Sequence[Hashable | None]) -> float:
    """P(the leading answer's share > the runner-up's) under Adaptive-Consistency's Beta rule;
    0.0 when no completion has an answer."""
    counts: dict[Hashable, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return 0.0
    top = sorted(counts.values(), reverse=True) + [0]
    a, b = top[0], top[1]
    trials = a + b + 1  # P(p > 1/2), p ~ Beta(a + 1, b + 1) = P(Binomial(a + b + 1, 1/2) <= a)
    return sum(math.comb(trials, k) for k in range(a + 1)) / 2**trials


def reward_certainty(answers: Sequence[Hashable | None], values: Sequence[float]) -> float:
    """The leading answer's share of the beams' PRM weight (values clipped to [0, 1]); 0.0 when
    no beam has an answer or every weight is 0."""
    weights = [min(max(v, 0.0), 1.0) for v in values]
    total = sum(weights)
    by_answer: dict[Hashable, list[float]] = {}
    for answer, weight in zip(answers, weights, strict=True):
        if answer is not None:
            by_answer.setdefault(answer, []).append(weight)
    if not by_answer or total <= 0.0:
        return 0.0
    return max(sum(weights) for weights in by_answer.values()) / total
