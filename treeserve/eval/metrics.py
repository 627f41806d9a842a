"""search-and-learn's metrics (`sal/utils/score.py`): step-score aggregation, selection (naive, weighted,
majority) on the first n = 1, 2, 4, ... <= N completions, pass@N, Wilson intervals. A completion with no
answer does not vote; equivalence comes from outside (`ScoredCompletion.group`); nothing here grades."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

AGGREGATIONS = ("last", "min", "prod")
SELECTIONS = ("naive", "weighted", "majority")

# the rule that picks each strategy's final answer unless the user names another (`--select`)
DEFAULT_SELECTION = {
    "best_of_n": "naive",
    "weighted_best_of_n": "weighted",
    "majority": "majority",
    "beam_search": "weighted",
    "dvts": "weighted",
    "rebase": "weighted",
    "particle_filtering": "weighted",
    "mcts": "weighted",
}


@dataclass
class ScoredCompletion:
    text: str
    answer: str | None
    step_scores: list[float]
    correct: bool
    group: int | None = None  # id of its class of equivalent answers within the problem; None: by string


@dataclass
class ProblemOutcome:
    """A problem with its graded completions and the final answer the search chose (`pred`)."""

    unique_id: str
    level: int | None
    problem: str
    answer: str
    completions: list[ScoredCompletion] = field(default_factory=list)
    pred: str | None = None
    correct: bool = False


def aggregate_scores(step_scores: Sequence[float], agg: str) -> float:
    """One score per completion from its step scores: `last`, `min` or `prod` (0.0 when there are none)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if not step_scores:
        return 0.0
    if agg == "last":
        return float(step_scores[-1])
    if agg == "min":
        return float(min(step_scores))
    return float(math.prod(step_scores))


def group_ids(keys: Sequence[Hashable | None]) -> list[int | None]:
    """Number equal keys by first appearance: ["b", "a", "b", None] -> [0, 1, 0, None]."""
    ids: dict[Hashable, int] = {}
    return [None if key is None else ids.setdefault(key, len(ids)) for key in keys]


def _vote_keys(completions: Sequence[ScoredCompletion]) -> list[Hashable | None]:
    """What a completion votes for: its group id when set, else its stripped answer; None: no vote."""
    keys: list[Hashable | None] = []
    for c in completions:
        if c.answer is None:
            keys.append(None)
        elif c.group is not None:
            keys.append(("group", c.group))
        else:
            keys.append(("text", c.answer.strip()))
    return keys


def naive_pick(scores: Sequence[float]) -> int | None:
    """Index of the highest score (the first one on ties); None when there are no scores."""
    if not scores:
        return None
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def weighted_pick(keys: Sequence[Hashable | None], scores: Sequence[float]) -> int | None:
    """Index of the first member of the key with the largest summed score (None keys do not vote)."""
    totals: dict[Hashable, float] = {}
    first: dict[Hashable, int] = {}
    for i, (key, score) in enumerate(zip(keys, scores, strict=True)):
        if key is not None:
            totals[key] = totals.get(key, 0.0) + score
            first.setdefault(key, i)
    if not totals:
        return None
    best = max(totals.values())
    return next(first[key] for key, total in totals.items() if total == best)


def majority_pick(keys: Sequence[Hashable | None]) -> int | None:
    """Index of the first member of the most frequent key (ties: the key seen first; None keys do not vote)."""
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, key in enumerate(keys):
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts.values())
    return next(first[key] for key, count in counts.items() if count == best)


def select(completions: Sequence[ScoredCompletion], method: str, agg: str = "last", n: int | None = None) -> int | None:
    """Index of the completion `method` picks among the first `n` completions (all when n is None)."""
    if method not in SELECTIONS:
        raise ValueError(f"selection method must be one of {SELECTIONS}, got {method!r}")
    subset = completions if n is None else completions[:n]
    if method == "majority":
        return majority_pick(_vote_keys(subset))
    scores = [aggregate_scores(c.step_scores, agg) for c in subset]
    if method == "naive":
        return naive_pick(scores)
    return weighted_pick(_vote_keys(subset), scores)


def subsample_sizes(num_completions: int) -> list[int]:
    """n = 1, 2, 4, ... <= N, and N itself when it is not a power of two ([] for N = 0)."""
    sizes = [2**i for i in range(num_completions.bit_length()) if 2**i <= num_completions]
    if num_completions > 0 and sizes[-1] != num_completions:
        sizes.append(num_completions)
    return sizes


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `total` trials ((0, 0) for none)."""
    if total == 0:
        return (0.0, 0.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return centre - half, centre + half


def _mean(values: Sequence[bool]) -> float:
    return sum(values) / len(values) if values else 0.0


def accuracy_at_n(problems: Sequence[ProblemOutcome], method: str, agg: str = "last") -> dict[int, float]:
    """{n: accuracy of `method` on each problem's first n completions} for n in subsample_sizes(max N)."""
    num = max((len(p.completions) for p in problems), default=0)
    table: dict[int, float] = {}
    for n in subsample_sizes(num):
        hits = []
        for p in problems:
            i = select(p.completions, method, agg, n)
            hits.append(i is not None and p.completions[i].correct)
        table[n] = _mean(hits)
    return table


def pass_at_n(problems: Sequence[ProblemOutcome]) -> dict[int, float]:
    """{n: share of problems with a correct completion among the first n} for n in subsample_sizes(N)."""
    num = max((len(p.completions) for p in problems), default=0)
    return {n: _mean([any(c.correct for c in p.completions[:n]) for p in problems]) for n in subsample_sizes(num)}


def accuracy(problems: Sequence[ProblemOutcome]) -> float:
    return _mean([p.correct for p in problems])


def accuracy_by_level(problems: Sequence[ProblemOutcome]) -> dict[str, float]:
    """{level: accuracy} with levels as strings in ascending order (`"none"` for problems without one)."""
    by_level: dict[int | None, list[bool]] = {}
    for p in problems:
        by_level.setdefault(p.level, []).append(p.correct)
    order = sorted(by_level, key=lambda lv: (lv is None, lv if lv is not None else 0))
    return {("none" if lv is None else str(lv)): _mean(by_level[lv]) for lv in order}


def summarize(problems: Sequence[ProblemOutcome], agg: str = "last", rule: str | None = None) -> dict:
    """The quality half of a results summary (JSON-ready; `rule` chose each problem's answer, None if unknown)."""
    if rule is not None and rule not in SELECTIONS:
        raise ValueError(f"accuracy rule must be one of {SELECTIONS}, got {rule!r}")
    num = max((len(p.completions) for p in problems), default=0)
    summary: dict = {
        "num_problems": len(problems),
        "accuracy": accuracy(problems),
        "accuracy_rule": rule,
        "accuracy_by_level": accuracy_by_level(problems),
        "agg": agg,
        "N": num,
    }
    for method in SELECTIONS:
        summary[f"{method}@n"] = {str(n): acc for n, acc in accuracy_at_n(problems, method, agg).items()}
    passes = pass_at_n(problems)
    summary["pass@n"] = {str(n): value for n, value in passes.items()}
    summary["pass@N"] = passes.get(num, 0.0)
    by_rule = {method: summary[f"{method}@n"].get(str(num), 0.0) for method in SELECTIONS}
    summary["accuracy_by_rule"] = by_rule | {"pass@N": summary["pass@N"]}
    return summary


def describe_accuracy(summary: dict) -> str:
    """`accuracy 0.600 (weighted@16; naive 0.525, majority 0.600, pass@16 0.625)`: headline rule first."""
    rule, num, by_rule = summary.get("accuracy_rule"), summary.get("N"), summary.get("accuracy_by_rule")
    head = f"accuracy {summary['accuracy']:.3f}"
    if by_rule is None:
        return f"{head} (rule not recorded)"
    others = [f"{m} {by_rule[m]:.3f}" for m in SELECTIONS if m != rule and m in by_rule]
    others.append(f"pass@{num} {by_rule['pass@N']:.3f}")
    return f"{head} ({f'{rule}@{num}' if rule else 'rule not recorded'}; {', '.join(others)})"
