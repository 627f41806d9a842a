"""Lookahead search (`lookahead=K`): a greedy rollout of K more steps, scored, then discarded.

On the step world of `step_world.py` (fp32): the optimised search still equals the
reference with lookahead on (beam search with speculation, DVTS); a rollout is greedy,
deterministic, scored after the beam's own steps, never becomes part of the beam, and
beams with the same tokens share one; lookahead changes which beams survive; the extra
tokens are counted; strategies without steps refuse it before any model loads.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from tests.search.step_world import build_step_world
from treeserve.cli import main
from treeserve.eval.runner import EvalSettings, build_runtime, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.types import Beam, Problem

QUESTIONS = ["Compute 1+2.", "Compute 3*4-5.", "Compute (6+7)*8."]
RECORDS = [
    {"problem": q, "answer": "3", "unique_id": f"q{i}", "level": 1, "grader": "arith"} for i, q in enumerate(QUESTIONS)
]
BEAM = SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=5, max_tokens=24, lookahead=1)
DVTS = SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=5, max_tokens=24, lookahead=1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_step_world(str(tmp_path_factory.mktemp("lookahead_world")))


def settings(world, reference: bool = False) -> EvalSettings:
    generator, prm = world
    return EvalSettings(
        generator=ModelSettings(generator),
        prm=ModelSettings(prm),
        reference=reference,
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )


def run(world, config: SearchConfig, reference: bool = False) -> dict:
    return run_eval(settings(world, reference), config, inline=[dict(r) for r in RECORDS])  # checks pages idle


def signature(doc: dict) -> list:
    return [
        (p["unique_id"], p["pred"], [(c["text"], [round(s, 5) for s in c["step_scores"]]) for c in p["completions"]])
        for p in doc["problems"]
    ]


@pytest.mark.parametrize(
    "config",
    [replace(BEAM, decode_ahead=2), replace(BEAM, lookahead=2, agg="min"), DVTS, replace(DVTS, lookahead=2)],
    ids=["beam-k1-speculative", "beam-k2-min", "dvts-k1", "dvts-k2"],
)
def test_optimised_equals_reference(world, config):
    fast = run(world, config)
    plain = run(world, config, reference=True)
    assert signature(fast) == signature(plain)
    assert fast["summary"]["lookahead_prm_tokens"] == plain["summary"]["lookahead_prm_tokens"] > 0
    assert 0 < fast["summary"]["lookahead_generated_tokens"] <= plain["summary"]["lookahead_generated_tokens"]
    assert fast["summary"]["generated_tokens"] > fast["summary"]["lookahead_generated_tokens"]
    assert fast["summary"]["prm_tokens_prefilled"] < plain["summary"]["prm_tokens_prefilled"]
    lengths = [len(c["step_scores"]) for p in fast["problems"] for c in p["completions"]]
    assert max(lengths) >= 3  # the search really ran several iterations


@pytest.mark.parametrize("base", [BEAM, DVTS], ids=["beam_search", "dvts"])
def test_lookahead_changes_the_search(world, base):
    """K=0 is the search without lookahead (no rollout, nothing counted); K=2 ranks by
    other scores, so other beams survive; on one iteration nothing is ranked, so K is moot."""
    without = run(world, replace(base, lookahead=0))
    assert without["summary"]["lookahead_generated_tokens"] == without["summary"]["lookahead_prm_tokens"] == 0
    assert signature(run(world, replace(base, lookahead=2))) != signature(without)
    one = replace(base, num_iterations=1)
    assert signature(run(world, replace(one, lookahead=2))) == signature(run(world, replace(one, lookahead=0)))


def search_context(world, config: SearchConfig) -> SearchContext:
    runtime = build_runtime(settings(world), config)
    return SearchContext(config, runtime, "generator", load_prm(runtime, "prm", None))


async def first_beams(ctx: SearchContext) -> tuple[Problem, list[Beam]]:
    """The first question and its four root beams, each after its first step."""
    problem = ctx.problem("q0", QUESTIONS[0])
    return problem, [(await ctx.expand(problem, Beam(path=(j,))))[0] for j in range(4)]


def test_rollout_is_greedy_scored_and_discarded(world):
    ctx = search_context(world, replace(BEAM, lookahead=2))
    runtime = ctx.runtime

    async def go() -> None:
        problem, beams = await first_beams(ctx)
        rolled = 0
        for beam in beams:
            own = list(beam.steps)
            rollout = await ctx.rollout(problem, beam)
            assert rollout == await ctx.rollout(problem, beam)  # greedy: the same text every time
            assert len(rollout) <= 2 and (not beam.completed or rollout == [])
            before = ctx.lookahead_generated_tokens
            await ctx.score_beam(problem, beam, lookahead=True)
            assert ctx.lookahead_generated_tokens > before or not rollout
            assert beam.steps == own and len(beam.scores) == len(own)  # the rollout is not kept
            assert beam.scores + beam.lookahead_scores == await ctx.score(problem, own + rollout)
            assert beam.value("last") == (beam.lookahead_scores or beam.scores)[-1]  # the end of the rollout
            await ctx.score_beam(problem, beam, lookahead=False)
            assert beam.lookahead_scores == [] and beam.steps == own
            rolled += bool(rollout)
        assert rolled > 0
        beam = next(b for b in beams if not b.completed)
        copies = [beam.child(0), beam.child(1), beam.child(2)]
        before = ctx.lookahead_generated_tokens
        await asyncio.gather(*(ctx.score_beam(problem, b, lookahead=True) for b in copies))
        shared = ctx.lookahead_generated_tokens - before  # copies rolling out together share one rollout
        await ctx.score_beam(problem, copies[0], lookahead=True)
        assert shared == ctx.lookahead_generated_tokens - before - shared > 0 and not ctx.rollouts
        assert copies[0].lookahead_scores == copies[1].lookahead_scores == copies[2].lookahead_scores
        await runtime.close()

    asyncio.run(go())
    runtime.check_pages_idle()


@pytest.mark.parametrize("strategy", ["best_of_n", "weighted_best_of_n", "majority"])
def test_lookahead_needs_steps(strategy):
    with pytest.raises(ValueError, match="lookahead"):
        SearchConfig(strategy=strategy, lookahead=1)
    SearchConfig(strategy=strategy, lookahead=0)


def test_negative_lookahead_is_refused():
    with pytest.raises(ValueError, match="lookahead must be >= 0"):
        SearchConfig(strategy="beam_search", lookahead=-1)


@pytest.mark.parametrize("command", ["eval", "solve"])
def test_cli_refuses_lookahead_without_steps_before_loading(tmp_path, capsys, command):
    """The model paths do not exist: the error comes from the settings, before any model loads."""
    args = [command, "--strategy", "majority", "--lookahead", "1", "--generator", "/does/not/exist"]
    args += ["--output", str(tmp_path / "r.json")] if command == "eval" else ["Compute 1+2."]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lookahead" in err and "not found" not in err
    assert not (tmp_path / "r.json").exists()
