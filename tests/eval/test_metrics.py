"""Metrics on hand-built problems whose naive, weighted and majority answers are known and differ."""

from __future__ import annotations

import math

import pytest

from treeserve.eval.metrics import (
    ProblemOutcome,
    ScoredCompletion,
    accuracy_at_n,
    accuracy_by_level,
    aggregate_scores,
    group_ids,
    majority_pick,
    naive_pick,
    pass_at_n,
    select,
    subsample_sizes,
    summarize,
    weighted_pick,
)


def completion(answer: str | None, scores: list[float], correct: bool, group: int | None = None) -> ScoredCompletion:
    return ScoredCompletion(
        text=f"... \\boxed{{{answer}}}", answer=answer, step_scores=scores, correct=correct, group=group
    )


def three_way_problem() -> ProblemOutcome:
    """naive -> A (one high score, wrong); weighted -> B (two medium scores, right); majority -> C (three, wrong)."""
    completions = [
        completion("A", [0.2, 0.9], False),
        completion("B", [0.5], True),
        completion("B", [0.5], True),
        completion("C", [0.3], False),
        completion("C", [0.3], False),
        completion("C", [0.2], False),
    ]
    return ProblemOutcome(unique_id="p", level=3, problem="?", answer="B", completions=completions)


def test_aggregations():
    scores = [0.9, 0.2, 0.8]
    assert aggregate_scores(scores, "last") == 0.8
    assert aggregate_scores(scores, "min") == 0.2
    assert math.isclose(aggregate_scores(scores, "prod"), 0.144)
    assert aggregate_scores([], "min") == 0.0
    with pytest.raises(ValueError, match="agg must be"):
        aggregate_scores(scores, "mean")


def test_agg_changes_the_naive_pick():
    problem = [
        completion("W", [0.2, 1.0], False),  # last 1.0, min 0.2, prod 0.2
        completion("X", [0.5, 0.5, 0.5], False),  # last 0.5, min 0.5, prod 0.125
        completion("Y", [0.9, 0.9, 0.4], True),  # last 0.4, min 0.4, prod 0.324
    ]
    assert select(problem, "naive", "last") == 0
    assert select(problem, "naive", "min") == 1
    assert select(problem, "naive", "prod") == 2


def test_naive_weighted_majority_differ():
    p = three_way_problem()
    assert select(p.completions, "naive") == 0
    assert select(p.completions, "weighted") == 1
    assert select(p.completions, "majority") == 3
    assert accuracy_at_n([p], "naive") == {1: 0.0, 2: 0.0, 4: 0.0, 6: 0.0}
    # n=2: A 0.9 beats B 0.5; n=4: B 1.0 beats A 0.9 and C 0.3.
    assert accuracy_at_n([p], "weighted") == {1: 0.0, 2: 0.0, 4: 1.0, 6: 1.0}
    # n=2: A and B tie, A seen first; n=4: B has two votes; n=6: C has three.
    assert accuracy_at_n([p], "majority") == {1: 0.0, 2: 0.0, 4: 1.0, 6: 0.0}
    assert pass_at_n([p]) == {1: 0.0, 2: 1.0, 4: 1.0, 6: 1.0}


def test_picks_and_ties():
    assert naive_pick([0.1, 0.7, 0.7]) == 1 and naive_pick([]) is None
    assert weighted_pick(["a", "b", "a"], [0.25, 0.75, 0.25]) == 1  # b: 0.75 beats a: 0.5
    assert weighted_pick(["a", "b", "a"], [0.25, 0.75, 0.75]) == 0  # a: 1.0 beats b: 0.75
    assert weighted_pick(["a", "b", "a"], [0.25, 0.5, 0.25]) == 0  # tie 0.5 vs 0.5: the answer seen first
    assert majority_pick(["b", "a", "a", "b"]) == 0  # tie: first seen wins
    assert majority_pick([None, None, "5"]) == 2  # no answer, no vote
    assert majority_pick([None]) is None and weighted_pick([None], [1.0]) is None


def test_groups_merge_equivalent_answers():
    keys = ["expr:1/2", "expr:1/3", "expr:1/2", None]
    assert group_ids(keys) == [0, 1, 0, None]
    problem = [
        completion("\\frac12", [0.4], True, group=0),
        completion("\\frac13", [0.6], False, group=1),
        completion("0.5", [0.4], True, group=0),
    ]
    assert select(problem, "weighted") == 0 and select(problem, "majority") == 0
    ungrouped = [completion(c.answer, c.step_scores, c.correct) for c in problem]
    assert select(ungrouped, "weighted") == 1  # as strings the three answers differ


def test_subsample_sizes():
    assert subsample_sizes(0) == []
    assert subsample_sizes(1) == [1]
    assert subsample_sizes(8) == [1, 2, 4, 8]
    assert subsample_sizes(12) == [1, 2, 4, 8, 12]


def test_summary_and_levels():
    right = ProblemOutcome("a", 1, "?", "1", [completion("1", [0.9], True)], pred="1", correct=True)
    wrong = ProblemOutcome("b", 1, "?", "2", [completion("3", [0.9], False)], pred="3", correct=False)
    no_level = ProblemOutcome("c", None, "?", "4", [completion("4", [0.1], True)], pred="4", correct=True)
    problems = [three_way_problem(), right, wrong, no_level]
    problems[0].correct = False
    assert accuracy_by_level(problems) == {"1": 0.5, "3": 0.0, "none": 1.0}
    summary = summarize(problems, agg="last")
    assert summary["num_problems"] == 4 and summary["accuracy"] == 0.5 and summary["N"] == 6
    assert summary["weighted@n"]["6"] == 0.75 and summary["naive@n"]["6"] == 0.5
    assert summary["majority@n"] == {"1": 0.5, "2": 0.5, "4": 0.75, "6": 0.5}
    assert summary["pass@N"] == 0.75
    with pytest.raises(ValueError, match="selection method"):
        select(problems[0].completions, "best")


def test_wilson_interval():
    from treeserve.eval.metrics import wilson_interval

    assert wilson_interval(0, 0) == (0.0, 0.0)
    lo, hi = wilson_interval(5, 10)
    assert abs((lo + hi) / 2 - 0.5) < 1e-12 and 0 < lo < 0.5 < hi < 1
    lo, hi = wilson_interval(10, 40)  # 25% of 40: the interval BENCHMARKS.md reports
    assert round(lo, 3) == 0.142 and round(hi, 3) == 0.402
