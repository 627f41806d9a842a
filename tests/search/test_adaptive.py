"""Adaptive search (`SearchConfig.adaptive`): the certainty rules, stopping once settled,
widths growing from `first_width`, decisions that read only the problem's own tree, what the
results and traces record, bad values refused, no page left behind."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from treeserve.config import DeviceConfig
from treeserve.eval.arith import arith_dataset
from treeserve.eval.grading import extract_answer
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.runtime import Runtime
from treeserve.search.certainty import reward_certainty, vote_certainty
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.dvts import waves
from treeserve.search.prm import load_prm
from treeserve.search.run import search_problems
from treeserve.search.types import Problem

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
    ctx = SearchContext(
        SearchConfig(seed=1, **config), runtime, "generator", load_prm(runtime, "prm", None), answer_of=boxed
    )
    ctx.traces.on_iteration = on_iteration
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


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"certainty": 2}, "certainty must be in"),
        ({"certainty": 0}, "certainty must be in"),
        ({"first_width": 0}, "first_width must be"),
        ({"adaptive": True, "first_width": 6, "beam_width": 4}, "must be a multiple of beam_width"),
        ({"adaptive": True, "budget_tokens": -5}, "budget_tokens must be a positive"),
        ({"budget_tokens": 1000}, "needs adaptive=True"),
        ({"adaptive": True, "budget_fraction": 1.5}, "budget_fraction must be in"),
        ({"adaptive": True, "budget_fraction": -0.1}, "budget_fraction must be in"),
        ({"budget_fraction": "0.3"}, "budget_fraction must be in"),
    ],
)
def test_bad_values_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**bad)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"strategy": "rebase"}, "adaptive search is"),
        ({"strategy": "mcts"}, "adaptive search is"),
        ({"strategy": "dvts", "first_width": 6}, "must be a multiple of beam_width"),
        ({"certainty": 1.5}, "certainty must be in"),
        ({"budget_tokens": 0}, "budget_tokens must be a positive"),
    ],
)
def test_adaptive_with_its_picked_budget_refuses_what_it_refused(config, message):
    """The default budget (picked by the run) changes no check: adaptive alone, with the default
    budget_fraction, refuses what it refused before; budget_fraction alone is no error."""
    assert SearchConfig(adaptive=True).budget_fraction is not None
    with pytest.raises(ValueError, match=message):
        SearchConfig(adaptive=True, **config)
    SearchConfig(budget_fraction=0.5)  # read only by adaptive search, like certainty


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
    results, ctx = search(
        runtime, easy, strategy="dvts", n=16, num_iterations=6, max_tokens=48, adaptive=True, certainty=0.8
    )
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
    sampled fewer tokens than the fixed search; the record says where and why (no budget: one
    narrows them, below)."""
    steps = strategy in ("beam_search", "dvts")  # max_tokens: per step, else per whole solution
    kwargs = {"strategy": strategy, "n": 16, "beam_width": 4, "num_iterations": 6, "max_tokens": 48 if steps else 256}
    fixed, _ = search(runtime, PROBLEMS, **kwargs)
    adaptive, _ = search(runtime, PROBLEMS, adaptive=True, certainty=0.6, budget_fraction=None, **kwargs)
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
    """Alone or beside other problems: the same beams, the same stop (without a budget: the one the
    run picks reads the problems that ended before)."""
    kwargs = {
        "adaptive": True,
        "certainty": 0.7,
        "n": 16,
        "num_iterations": 6,
        "max_tokens": 48,
        "budget_fraction": None,
    }
    together, _ = search(runtime, PROBLEMS, **kwargs)
    for problem, result in zip(PROBLEMS, together, strict=True):
        [alone], _ = search(runtime, [problem], **kwargs)
        assert alone.stop == result.stop
        assert signature(alone) == signature(result)


def test_a_warm_runtime_searches_as_a_fresh_one():
    """The score cache off, the same search twice on one fresh runtime: the second reads the
    PRM's inputs from its prefix cache, the first computed them (the first of four equal beams
    whole, the others after a hit), and both get the same scores to the bit, so the same
    survivors and beams (before: beam 0 scored 1.2e-7 lower cold and lost its tie)."""
    runtime = Runtime.for_search(DEFAULT_GENERATOR, DEFAULT_PRM, 32 << 20, device_config=DeviceConfig(dtype="float32"))
    kwargs = {"n": 16, "num_iterations": 3, "max_tokens": 48, "adaptive": True, "certainty": 0.6}
    kwargs |= {"budget_fraction": None, "max_concurrent_problems": 1, "score_cache": False}
    cold, warm = (search(runtime, PROBLEMS[:1], **kwargs)[0] for _ in range(2))
    asyncio.run(runtime.close())
    assert [(b.text, b.scores) for b in cold[0].beams] == [(b.text, b.scores) for b in warm[0].beams]


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

    [result], _ = search(
        runtime, PROBLEMS[2:], record, n=16, adaptive=True, certainty=1.0, num_iterations=3, max_tokens=48
    )
    assert result.stop["widths"] == [4, 8, 16]
    assert [len(paths) for paths in seen] == [4, 8, 16]
    parents = [{path[:-2] for path in paths} for paths in seen]  # a scored beam: its parent's path, copy, sample
    assert [len(p) for p in parents] == [1, 2, 4]  # before: [1, 1, 2]


def test_a_trace_records_the_stop(runtime):
    [result], _ = search(
        runtime, PROBLEMS[:1], adaptive=True, certainty=0.6, n=8, num_iterations=6, max_tokens=48, trace=True
    )
    assert result.trace["stop"] == result.stop


@pytest.mark.parametrize("strategy", ["beam_search", "dvts"])
def test_optimised_equals_reference_with_stops(runtime, strategy):
    """Problems that settle and problems that do not: every optimisation on (caches, all problems
    in flight) against the plain reference path, the same stops and beams."""
    certainty = 0.6 if strategy == "beam_search" else 0.8  # DVTS: one subtree's vote alone is 0.75
    config = SearchConfig(
        strategy=strategy,
        n=16,
        num_iterations=6,
        max_tokens=48,
        adaptive=True,
        certainty=certainty,
        seed=1,
        budget_fraction=None,
    )
    problems = PROBLEMS + [(r["unique_id"], r["problem"]) for r in arith_dataset(size=2, seed=0, levels=(1,))]
    prm = load_prm(runtime, "prm", None)
    fast = asyncio.run(search_problems(SearchContext(config, runtime, "generator", prm, answer_of=boxed), problems))
    plain = asyncio.run(
        search_problems(SearchContext(config.reference(), runtime, "generator", prm, answer_of=boxed), problems)
    )
    assert {r.stop["reason"] for r in fast} == {"settled", "exhausted"}
    assert [decisions(r.stop) for r in fast] == [decisions(r.stop) for r in plain]
    assert [signature(r) for r in fast] == [signature(r) for r in plain]
    runtime.check_pages_idle()


def test_a_budget_is_paced_over_the_runs_problems():
    """Each problem gets an equal share of the budget: it widens while under it, narrows once
    over it (unless it is less settled than the median), goes back to the first width once the
    whole budget is spent, and the share a problem leaves unspent goes to the others."""
    config = SearchConfig(strategy="beam_search", n=16, adaptive=True, first_width=4, budget_tokens=1000)
    ctx = SearchContext(config, None, "generator", None, answer_of=boxed)
    ctx.budget.expect(4)
    ctx.budget.expect(1)  # a Ray worker: told the run's count, then one problem a call
    assert ctx.budget.share == 250
    widths = config.widths()
    a, b, c = (Problem(uid, uid, []) for uid in "abc")
    ctx.budget.certainties = {"a": 0.0, "b": 0.0, "c": 0.6}
    a.generated_tokens, b.generated_tokens, c.generated_tokens = 100, 300, 300
    ctx.generated_tokens = 700
    assert ctx.budget.next_width(a, 4, widths) == 8  # under its share: grows
    assert ctx.budget.next_width(b, 8, widths) == 4  # over it, as settled as the median: narrows
    assert ctx.budget.next_width(c, 16, widths) == 8
    ctx.budget.certainties |= {"a": 0.2, "d": 0.5}  # the median (0.2) above b's 0: b, less settled, keeps its width
    assert ctx.budget.next_width(b, 8, widths) == 8
    ctx.budget.certainties["a"] = 0.0
    ctx.generated_tokens = 1000  # all of it spent: back to the first width, never beyond it
    assert ctx.budget.next_width(b, 16, widths) == 4
    assert ctx.budget.next_width(a, 4, widths) == 4  # (a, under its share, neither grows nor narrows)
    ctx.generated_tokens = 700
    ctx.budget.decide(c, 3, 8, 0.95, exhausted=False, grows=False)  # c settles, 50 tokens short of its share
    assert ctx.budget.surplus == -50 and "c" not in ctx.budget.certainties
    assert "budget_tokens" not in c.stop  # given, not picked
    ctx.budget.ended, ctx.budget.ended_spent = 3, 150  # shares left unspent (600): split among the problems in flight
    assert not ctx.budget.over_pace(b)  # 300 < 250 + 600 / 3
    assert ctx.budget.next_width(b, 8, widths) == 16


def test_sampling_rounds_stop_for_the_budget(runtime):
    """Majority voting whose budget is spent: its problems stop growing (reason "budget"),
    the run spends less, and every problem leaves the budget's table."""
    kwargs = {
        "strategy": "majority",
        "n": 16,
        "num_iterations": 6,
        "max_tokens": 256,
        "adaptive": True,
        "certainty": 0.99,
    }
    free, free_ctx = search(runtime, PROBLEMS, budget_fraction=None, **kwargs)
    capped, ctx = search(runtime, PROBLEMS, budget_tokens=free_ctx.spent_tokens // 3, **kwargs)
    assert "budget" in {r.stop["reason"] for r in capped}
    assert ctx.spent_tokens < free_ctx.spent_tokens
    assert not ctx.budget.certainties
    for result in capped:
        assert result.stop["widths"] == sorted(result.stop["widths"])


def test_beam_search_narrows_for_the_budget_and_starves_no_problem(runtime):
    """Beam search under a budget a third of what it spends free, one problem at a time (the run
    the budget starved before it was paced: the first problem spent it all and the last stopped
    at its first decision): problems grow, narrow again once over their share or at the first
    width once the budget is spent, and every one runs to its end, settled or exhausted."""
    kwargs = {
        "strategy": "beam_search",
        "n": 16,
        "num_iterations": 6,
        "max_tokens": 48,
        "adaptive": True,
        "certainty": 0.99,
        "max_concurrent_problems": 1,
    }
    free, free_ctx = search(runtime, PROBLEMS, budget_fraction=None, **kwargs)
    capped, ctx = search(runtime, PROBLEMS, budget_tokens=free_ctx.spent_tokens // 3, **kwargs)
    assert ctx.spent_tokens < free_ctx.spent_tokens
    assert not ctx.budget.certainties
    assert {r.stop["reason"] for r in capped} <= {"settled", "exhausted"}
    assert any(r.stop["widths"] != sorted(r.stop["widths"]) for r in capped)  # some problem narrowed
    assert len(capped[-1].stop["widths"]) > 1  # the last problem ran on past its first decision


def test_the_run_picks_its_budget_from_the_problems_that_ended():
    """Adaptive alone over a run's problems: no budget until a problem ends; then the problems x
    the mean width first_width + budget_fraction x (n - first_width) x the tokens a beam's search
    cost, on average over the problems ended (beam search: each iteration's spend over its width;
    sampling rounds: all of it over the samples), recorded in each stop as it stood then."""
    config = SearchConfig(n=16, adaptive=True, first_width=4, budget_fraction=0.25)
    ctx = SearchContext(config, None, "generator", None, answer_of=boxed)
    assert not ctx.budget.paced and ctx.budget.limit is None  # one search (/v1/search): no problem set to pick it from
    ctx.budget.expect(10)
    widths = config.widths()
    a, b = Problem("a", "a", []), Problem("b", "b", [])
    a.generated_tokens = 400
    assert ctx.budget.decide(a, 0, 4, 0.0, exhausted=False, grows=False) == ""
    assert (
        ctx.budget.paced
        and ctx.budget.limit is None
        and ctx.budget.may_widen(a)
        and ctx.budget.next_width(a, 4, widths) == 8
    )
    a.generated_tokens, a.prm_tokens = 1200, 800  # 1,600 more over 8 beams
    assert ctx.budget.decide(a, 1, 8, 0.95, exhausted=False, grows=False) == "settled"
    assert a.beam_tokens == 400 / 4 + 1600 / 8 == 300
    assert ctx.budget.limit == 10 * (4 + 0.25 * 12) * 300 == 21000 and ctx.budget.share == 2100
    assert a.stop["budget_tokens"] == 21000
    b.generated_tokens = 2500
    ctx.budget.decide(b, 0, 4, 0.0, exhausted=False, grows=False)
    assert ctx.budget.over_pace(b) and ctx.budget.next_width(b, 8, widths) == 4  # past its share: narrows
    sampling = SearchContext(replace(config, strategy="majority"), None, "generator", None, answer_of=boxed)
    sampling.budget.expect(2)
    c = Problem("c", "c", [], generated_tokens=800)
    sampling.budget.decide(c, 0, 4, 0.5, exhausted=False, grows=True)
    c.generated_tokens = 2000
    assert sampling.budget.decide(c, 1, 8, 0.9, exhausted=False, grows=True) == "settled"
    assert sampling.budget.limit == 2 * 7 * 2000 / 8
    off = SearchContext(replace(config, budget_fraction=None), None, "generator", None, answer_of=boxed)
    off.budget.expect(10)
    assert not off.budget.paced and off.budget.limit is None


def test_adaptive_alone_paces_a_run_by_the_budget_it_picks(runtime):
    """Beam search over a run with no flag but adaptive: the first problem runs free (no problem
    has ended), the later ones within the budget picked from it; the run spends less than with
    the budget off, every problem runs to its end, and no page is left behind (`search`)."""
    kwargs = {
        "n": 16,
        "num_iterations": 6,
        "max_tokens": 48,
        "adaptive": True,
        "certainty": 0.99,
        "max_concurrent_problems": 1,
    }
    free, free_ctx = search(runtime, PROBLEMS, budget_fraction=None, **kwargs)
    paced, ctx = search(runtime, PROBLEMS, budget_fraction=0.0, **kwargs)
    assert ctx.spent_tokens < free_ctx.spent_tokens
    assert paced[0].stop == free[0].stop | {"budget_tokens": paced[0].stop["budget_tokens"]}
    assert {r.stop["reason"] for r in paced} <= {"settled", "exhausted"} and not ctx.budget.certainties
    assert ctx.budget.ended == len(PROBLEMS)
    assert paced[-1].stop["budget_tokens"] == round(ctx.budget.limit) == round(4 * ctx.budget.ended_beam_tokens)
    assert "budget_tokens" not in free[0].stop


def test_the_picked_budget_is_the_same_run_twice():
    """Every optimisation on and all problems in flight, each run on a fresh runtime: the picked
    budget, the stops and the beams are the same run after run. What a problem gets reads the
    problems that ended before it, in the order the engines' batches end them (which follows
    what their prefix caches hold): another batch of problems, a warm runtime or the reference
    (one problem at a time) is another run (docs/adaptive.md)."""
    config = SearchConfig(
        n=16, num_iterations=6, max_tokens=48, adaptive=True, certainty=0.6, seed=1, budget_fraction=0.0
    )
    problems = PROBLEMS + [(r["unique_id"], r["problem"]) for r in arith_dataset(size=2, seed=0, levels=(1,))]

    def run() -> list:
        runtime = Runtime.for_search(
            DEFAULT_GENERATOR, DEFAULT_PRM, 32 << 20, device_config=DeviceConfig(dtype="float32")
        )
        ctx = SearchContext(config, runtime, "generator", load_prm(runtime, "prm", None), answer_of=boxed)
        results = asyncio.run(search_problems(ctx, problems))
        asyncio.run(runtime.close())
        runtime.check_pages_idle()
        return results

    first, second = run(), run()
    assert [decisions(r.stop) for r in first] == [decisions(r.stop) for r in second]
    assert [signature(r) for r in first] == [signature(r) for r in second]
    assert all("budget_tokens" in r.stop for r in first)
    assert any(r.stop["widths"] != sorted(r.stop["widths"]) for r in first)  # the budget narrowed a problem
