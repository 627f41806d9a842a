"""Step-level search over a reasoning chain (`SearchConfig.reasoning`, `--reasoning`).

Over the reasoning step world (`step_world.py`, think=True: `<think>`/`</think>` are tokens of the
generator's and the PRM's tokenizers, and the random generator writes them inside steps and
around them). Proven here: the PRM is never shown a think tag, a step that is only tags is not
shown and takes the score of the shown step before it, PRM inputs stay token prefixes of each
other, answers are read after `</think>`, optimised == reference search, and a generator without
think tokens is refused before any weights load.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.search.step_world import build_step_world
from tests.search.test_search_equivalence import signature
from treeserve.config import DeviceConfig
from treeserve.eval.grading import Grader, extract_answer
from treeserve.eval.report import grade_problems
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import Runtime
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.reasoning import UNJUDGED, prm_view, spread, visible
from treeserve.search.run import search_problems

QUESTIONS = ["Compute 1+2.", "Compute 3*4-5.", "Compute (6+7)*8.", "Compute 9-1."]
RECORDS = [
    {"problem": q, "answer": "3", "unique_id": f"q{i}", "level": 1, "grader": "arith"} for i, q in enumerate(QUESTIONS)
]
TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def think_world(tmp_path_factory) -> tuple[str, str]:
    return build_step_world(str(tmp_path_factory.mktemp("think_world")), think=True)


@pytest.fixture(scope="module")
def plain_world(tmp_path_factory) -> tuple[str, str]:
    return build_step_world(str(tmp_path_factory.mktemp("plain_world")))


# ---- the PRM's view, on text ------------------------------------------------------------------
def test_the_prm_view_removes_tags_and_hides_tag_only_steps():
    steps = ["<think>", "<think>\nFirst, 1 + 2.", "So 3.\n</think>", "</think>", "", "The answer is 3."]
    shown, owner = prm_view(steps)
    assert shown == ["First, 1 + 2.", "So 3.", "", "The answer is 3."]
    assert owner == [-1, 0, 1, 1, 2, 3]  # a tag-only step takes the score before it; an empty step is shown
    assert spread([0.2, 0.4, 0.6, 0.8], owner) == [UNJUDGED, 0.2, 0.4, 0.4, 0.6, 0.8]
    assert visible("a\n</think>\nb") == "a\nb" and visible("  x y ") == "  x y "  # no tag: untouched
    for k in range(len(steps)):  # the view of k steps is a prefix of the view of k + 1
        assert prm_view(steps[: k + 1])[0][: len(prm_view(steps[:k])[0])] == prm_view(steps[:k])[0]


def test_answers_are_read_after_think():
    text = "<think>\nMaybe \\boxed{4}?\n\nNo: 3.\n</think>\n\nThe answer is \\boxed{3}."
    assert extract_answer(text, reasoning=True) == "3"
    assert extract_answer("<think>\nIt is \\boxed{5}\n</think>\n\nI am not sure.", reasoning=True) is None
    assert extract_answer("<think>\nstill thinking, \\boxed{7}", reasoning=True) == "7"  # no </think>: all of it
    assert extract_answer("<think>\\boxed{5}</think> done", reasoning=False) == "5"
    record = {"problem": "Compute 1+2.", "answer": "3", "unique_id": "a", "grader": "arith"}
    completions = [("<think>\\boxed{5}\n</think>\n\n\\boxed{3}", [0.9]), ("<think>\\boxed{3}</think>\n\nNone", [0.8])]
    with Grader() as grader:
        [think] = grade_problems([record], [completions], grader, selection="naive", reasoning=True)
        [plain] = grade_problems([record], [completions], grader, selection="naive")
    assert [c.answer for c in think.completions] == ["3", None] and think.correct
    assert [c.answer for c in plain.completions] == ["3", "3"]


# ---- searches ------------------------------------------------------------------------------------
def test_the_prm_never_sees_a_think_tag(think_world):
    generator, prm_dir = think_world
    runtime = Runtime.for_search(generator, prm_dir, 32 << 20, device_config=DeviceConfig(dtype="float32"))
    tags = {runtime.tokenizer("prm").hf.token_to_id(t) for t in TAGS}
    inputs: list[list[int]] = []

    async def main():
        try:
            prm = load_prm(runtime, "prm")
            config = SearchConfig(n=4, beam_width=2, num_iterations=5, max_tokens=24, seed=1, reasoning=True)
            ctx = SearchContext(config, runtime, "generator", prm)
            prm.on_input = lambda ids: inputs.append(list(ids))
            results = await search_problems(ctx, [(f"q{i}", q) for i, q in enumerate(QUESTIONS)])
            return prm, results
        finally:
            await runtime.close()

    prm, results = asyncio.run(main())
    runtime.check_pages_idle()
    beams = [b for r in results for b in r.beams]
    assert any(t in s for b in beams for s in b.steps for t in TAGS)  # the generator wrote tags: the test can fail
    assert inputs and not any(tags & set(ids) for ids in inputs)
    for beam in beams:
        _, owner = prm_view(beam.steps)
        assert len(beam.scores) == len(beam.steps)
        for i, j in enumerate(owner):  # a hidden step has the score of the shown step before it
            assert beam.scores[i] == (UNJUDGED if j < 0 else beam.scores[owner.index(j)])
    # the PRM's input for k shown steps is a token prefix of its input for k + 1
    longest = max(beams, key=lambda b: len(prm_view(b.steps)[0]))
    shown = prm_view(longest.steps)[0]
    for k in range(1, len(shown)):
        short, _ = prm.build(QUESTIONS[0], shown[:k])
        assert prm.build(QUESTIONS[0], shown[: k + 1])[0][: len(short)] == short


def run(world, config: SearchConfig, reference: bool) -> dict:
    generator, prm = world
    runtime = RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20)
    settings = EvalSettings(
        generator=ModelSettings(generator), prm=ModelSettings(prm), reference=reference, progress=False, runtime=runtime
    )
    return run_eval(settings, config, inline=[dict(r) for r in RECORDS])


@pytest.mark.parametrize(
    "config",
    [
        SearchConfig(n=8, beam_width=2, num_iterations=6, max_tokens=24, decode_ahead=2, reasoning=True),
        SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=5, max_tokens=24, lookahead=1, reasoning=True),
        SearchConfig(strategy="weighted_best_of_n", n=4, max_tokens=64, agg="min", reasoning=True),
    ],
    ids=["beam_spec", "dvts_lookahead", "weighted_min"],
)
def test_optimised_equals_reference_over_a_reasoning_chain(think_world, config):
    fast = run(think_world, config, reference=False)
    plain = run(think_world, config, reference=True)
    assert signature(fast) == signature(plain, approx=True)
    assert fast["summary"]["prm_tokens_prefilled"] < plain["summary"]["prm_tokens_prefilled"]
    assert fast["config"]["search"]["reasoning"] is True
    texts = [c["text"] for p in fast["problems"] for c in p["completions"]]
    assert any(t in text for text in texts for t in TAGS)


def test_a_generator_without_think_tokens_is_refused(plain_world, tmp_path):
    config = SearchConfig(n=4, beam_width=2, num_iterations=2, max_tokens=8, reasoning=True)
    with pytest.raises(ValueError, match="no <think> and </think> tokens"):
        run(plain_world, config, reference=False)  # before any weights load (no runtime to leak pages)
    runtime = Runtime.for_search(*plain_world, 8 << 20, device_config=DeviceConfig(dtype="float32"))
    try:
        with pytest.raises(ValueError, match="reasoning search needs a generator"):
            SearchContext(config, runtime, "generator", load_prm(runtime, "prm"))
    finally:
        asyncio.run(runtime.close())
    with pytest.raises(ValueError, match="reasoning must be True or False"):
        SearchConfig(reasoning="yes")
