"""Adaptive search (`SearchConfig.adaptive`): the certainty rules, stopping once settled,
widths growing from `first_width`, decisions that read only the problem's own tree, what the
results and traces record, bad values refused, no page left behind."""

from __future__ import annotations

import asyncio
import math

import pytest

from treeserve.eval.arith import arith_dataset
from treeserve.eval.grading import extract_answer
from treeserve.runtime.runtime import Runtime
from treeserve.search.certainty import reward_certainty, vote_certainty
from treeserve.search.context import SearchConfig, SearchContext
from treeserve.search.dvts import waves
from treeserve.search.prm import load_prm
from treeserve.search.run import search_problems

PROBLEMS = [("a", "Compute (12 + 7) * 3."), ("b", "Compute 45 - 17 + 8."), ("c", "Compute (6 * 7 - 5) * (3 + 4).")]


def boxed(problem, text):  # noqa: ANN001, ANN201
    return extract_answer(text)


def decisions(stop: dict) -> dict:
    """A stop record, its certainties to 3 digits (PRM scores' last bits follow its prefix cache)."""
    return stop | {"certainty": [round(c, 3) for c in stop["certainty"]]}


def signature(result) -> list:  # noqa: ANN001
    """Beams' text and step scores (to 5 digits: the PRM's last bits follow what its prefix cache held)."""
    return [(b.text, [round(s, 5) for s in b.scores]) for b in result.beams]


def search(runtime: Runtime, problems: list, on_iteration=None, **config: object) -> tuple[list, SearchContext]:  # noqa: ANN001
    ctx = SearchContext(SearchConfig(seed=1, **config), runtime, "generator", load_prm(runtime, "prm", None),
                        answer_of=boxed)  # fmt: skip
    ctx.on_iteration = on_iteration
    results = asyncio.run(search_problems(ctx, problems))
    runtime.check_pages_idle()
    return results, ctx


def test_vote_certainty_is_adaptive_consistencys_beta_rule():
    assert vote_certainty([]) == vote_certainty([None, None]) == 0.0
    assert vote_certainty(["7"]) == 0.75  # P(p > 1/2), p ~ Beta(2, 1)
    assert vote_certainty(["7", "7", "7"]) == 15 / 16  # Beta(4, 1)
    assert vote_certainty(["7", "8"]) == 0.5  # a tie is a coin toss
    assert vote_certainty(["7", "7", "8", None]) == 11 / 16  # Beta(3, 2); no answer does not vote
    # the runner-up alone matters: a third answer does not lower the leader's certainty
    assert vote_certainty(["7"] * 4 + ["8", "9"]) == vote_certainty(["7"] * 4 + ["8"])
    assert vote_certainty(["7"] * 6 + ["8"] * 2) == sum(math.comb(9, k) for k in range(7)) / 2**9  # Beta(7, 3)


def test_reward_certainty_weighs_answers_by_the_prm():
    assert reward_certainty([None, None], [0.9, 0.9]) == 0.0
    assert reward_certainty(["7", "7"], [1.0, 1.0]) == reward_certainty(["7", "7"], [0.5, 0.5]) == 1.0
    assert reward_certainty(["7", "8", "7"], [0.6, 0.3, 0.1]) == pytest.approx(0.7)
    assert reward_certainty(["7", "8"], [0.2, 0.6]) == pytest.approx(0.75)  # the PRM's favourite leads
    assert reward_certainty(["7", None], [0.8, 0.8]) == 0.5  # an unfinished beam holds weight
    assert reward_certainty(["7", "8"], [1.7, -3.0]) == 1.0  # values clipped to [0, 1]


@pytest.mark.parametrize("bad, message", [
    ({"certainty": 2}, "certainty must be in"), ({"certainty": 0}, "certainty must be in"),
    ({"first_width": 0}, "first_width must be"),
    ({"adaptive": True, "first_width": 6, "beam_width": 4}, "must be a multiple of beam_width"),
    ({"adaptive": True, "budget_tokens": -5}, "budget_tokens must be a positive"),
    ({"budget_tokens": 1000}, "needs adaptive=True"),
])  # fmt: skip
def test_bad_values_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**bad)


def test_adaptive_search_needs_an_answer_rule(runtime):
    with pytest.raises(ValueError, match="needs an answer rule"):
        SearchContext(SearchConfig(adaptive=True), runtime, "generator", None)


def test_widths_double_from_the_first_up_to_n():
    assert SearchConfig(n=16).widths() == [16]
    assert SearchConfig(n=16, adaptive=True).widths() == [4, 8, 16]
    assert SearchConfig(n=12, adaptive=True, beam_width=2, first_width=2).widths() == [2, 4, 8, 12]


def test_dvts_waves_add_one_subtree_at_a_time():
    assert waves(SearchConfig(strategy="dvts", n=16)) == [16]
    assert waves(SearchConfig(strategy="dvts", n=16, adaptive=True)) == [4, 8, 12, 16]
    assert waves(SearchConfig(strategy="dvts", n=16, adaptive=True, first_width=8)) == [8, 12, 16]
    assert waves(SearchConfig(strategy="dvts", n=4, adaptive=True, first_width=8)) == [4]


def test_dvts_counts_one_vote_a_subtree(runtime):
    """A subtree's candidates are siblings: one subtree is one vote (certainty 0.75), never enough
    for 0.8, however many of its candidates agree; a problem that settles has subtrees agreeing."""
    easy = [(r["unique_id"], r["problem"]) for r in arith_dataset(size=4, seed=0, levels=(1, 2, 3))]
    results, ctx = search(runtime, easy, strategy="dvts", n=16, num_iterations=6, max_tokens=48, adaptive=True,
                          certainty=0.8)  # fmt: skip
    for result in results:
        stop = result.stop
        assert (
            stop["certainty"][0] <= 0.75
            and stop["widths"][: len(stop["certainty"])] == [4, 8, 12, 16][: len(stop["certainty"])]
        )
        if stop["reason"] == "settled":
            kept = [
                max(tree, key=lambda b: b.value("last"))
                for tree in (result.beams[i : i + 4] for i in range(0, len(result.beams), 4))
            ]
            answers = ctx.answers(None, kept)
            assert vote_certainty(answers) == stop["certainty"][-1] >= 0.8
    assert any(r.stop["reason"] == "settled" and len(r.stop["widths"]) >= 2 for r in results)


@pytest.mark.parametrize("strategy", ["beam_search", "dvts", "majority", "best_of_n"])
def test_a_settled_problem_stops_early_and_spends_less(runtime, strategy):
    """A low threshold: every problem stops before its full width or its last iteration, having
    sampled fewer tokens than the fixed search; the record says where and why."""
    steps = strategy in ("beam_search", "dvts")  # max_tokens: per step, else per whole solution
    kwargs = {"strategy": strategy, "n": 16, "beam_width": 4, "num_iterations": 6, "max_tokens": 48 if steps else 256}
    fixed, _ = search(runtime, PROBLEMS, **kwargs)
    adaptive, _ = search(runtime, PROBLEMS, adaptive=True, certainty=0.6, **kwargs)
    for before, after in zip(fixed, adaptive, strict=True):
        assert before.stop is None and after.stop is not None
        stop = after.stop
        assert stop["reason"] in ("settled", "exhausted") and len(stop["widths"]) == len(stop["certainty"])
        assert stop["widths"][0] == 4 and stop["widths"] == sorted(stop["widths"])
        if stop["reason"] == "settled":
            assert stop["certainty"][-1] >= 0.6 > max(stop["certainty"][:-1], default=0.0)
    assert sum(r.spent["generated_tokens"] for r in adaptive) < sum(r.spent["generated_tokens"] for r in fixed)
    assert any(r.stop["reason"] == "settled" for r in adaptive)


def test_a_problems_decisions_read_only_its_own_tree(runtime):
    """Alone or beside other problems: the same beams, the same stop."""
    kwargs = {"adaptive": True, "certainty": 0.7, "n": 16, "num_iterations": 6, "max_tokens": 48}
    together, _ = search(runtime, PROBLEMS, **kwargs)
    for problem, result in zip(PROBLEMS, together, strict=True):
        [alone], _ = search(runtime, [problem], **kwargs)
        assert alone.stop == result.stop
        assert signature(alone) == signature(result)


def test_the_first_round_is_the_fixed_searchs_first_samples(runtime):
    """Adaptive majority voting that never settles: its first 4 completions are the fixed run's
    first 4 (the same seed and indices), the rest come from later rounds."""
    kwargs = {"strategy": "majority", "n": 8, "max_tokens": 96}
    [fixed], _ = search(runtime, PROBLEMS[:1], **kwargs)
    [adaptive], _ = search(runtime, PROBLEMS[:1], adaptive=True, certainty=1.0, **kwargs)
    assert adaptive.stop["widths"] == [4, 8] and adaptive.stop["reason"] == "exhausted"
    assert [b.text for b in adaptive.beams[:4]] == [b.text for b in fixed.beams[:4]]
    assert len(adaptive.beams) == 8


def test_beam_search_keeps_survivors_for_the_width_it_grows_to(runtime):
    """Widening 4 -> 8 -> 16, each iteration keeps width / beam_width survivors of the width the
    next one runs (one survivor copied 8 times cost adaptive N=8 six points on held-out problems)."""
    seen: list[list[tuple[int, ...]]] = []

    def record(iteration: int, beams: list) -> None:
        seen.append([b.path for b in beams])

    [result], _ = search(runtime, PROBLEMS[2:], record, n=16, adaptive=True, certainty=1.0, num_iterations=3,
                         max_tokens=48)  # fmt: skip
    assert result.stop["widths"] == [4, 8, 16]
    assert [len(paths) for paths in seen] == [4, 8, 16]
    parents = [{path[:-2] for path in paths} for paths in seen]  # a scored beam: its parent's path, copy, sample
    assert [len(p) for p in parents] == [1, 2, 4]  # before: [1, 1, 2]


def test_a_trace_records_the_stop(runtime):
    [result], _ = search(runtime, PROBLEMS[:1], adaptive=True, certainty=0.6, n=8, num_iterations=6, max_tokens=48,
                         trace=True)  # fmt: skip
    assert result.trace["stop"] == result.stop


@pytest.mark.parametrize("strategy", ["beam_search", "dvts"])
def test_optimised_equals_reference_with_stops(runtime, strategy):
    """Problems that settle and problems that do not: every optimisation on (caches, all problems
    in flight) against the plain reference path, the same stops and beams."""
    certainty = 0.6 if strategy == "beam_search" else 0.8  # DVTS: one subtree's vote alone is 0.75
    config = SearchConfig(strategy=strategy, n=16, num_iterations=6, max_tokens=48, adaptive=True,
                          certainty=certainty, seed=1)  # fmt: skip
    problems = PROBLEMS + [(r["unique_id"], r["problem"]) for r in arith_dataset(size=2, seed=0, levels=(1,))]
    prm = load_prm(runtime, "prm", None)
    fast = asyncio.run(search_problems(SearchContext(config, runtime, "generator", prm, answer_of=boxed), problems))
    plain = asyncio.run(search_problems(SearchContext(config.reference(), runtime, "generator", prm, answer_of=boxed),
                                        problems))  # fmt: skip
    assert {r.stop["reason"] for r in fast} == {"settled", "exhausted"}
    assert [decisions(r.stop) for r in fast] == [decisions(r.stop) for r in plain]
    assert [signature(r) for r in fast] == [signature(r) for r in plain]
    runtime.check_pages_idle()


@pytest.mark.parametrize("strategy", ["beam_search", "majority"])
def test_a_spent_budget_stops_every_problem(runtime, strategy):
    """A budget far below what the fixed search spends: problems stop with reason "budget", the
    run spends about the budget (plus what was in flight when it ran out), no page is left."""
    steps = strategy == "beam_search"
    kwargs = {"strategy": strategy, "n": 16, "num_iterations": 6, "max_tokens": 48 if steps else 256,
              "adaptive": True, "certainty": 0.99}  # fmt: skip
    free, free_ctx = search(runtime, PROBLEMS, **kwargs)
    budget = free_ctx.spent_tokens // 3
    capped, ctx = search(runtime, PROBLEMS, budget_tokens=budget, **kwargs)
    assert "budget" in {r.stop["reason"] for r in capped}
    assert ctx.spent_tokens < free_ctx.spent_tokens
    assert not ctx.certainties  # every problem ended and left the budget's table
    for result in capped:
        assert result.stop["widths"] == sorted(result.stop["widths"])
