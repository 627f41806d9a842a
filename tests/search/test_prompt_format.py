"""A base generator's plain prompt and stop strings (`SearchConfig.prompt_format`, `SearchConfig.stop`):
the prompt is the format with the question in it, a stop string ends a solution wherever it appears
(whole completions and steps alike), bad values are refused, no page is left behind."""

from __future__ import annotations

import asyncio

import pytest

from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.run import search_problems

PROBLEMS = [("a", "Compute (12 + 7) * 3."), ("b", "Compute 45 - 17 + 8.")]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_format": "Q: no question here"}, "must be text containing '{question}'"),
        ({"prompt_format": "Q: {question}", "system_prompt": "Be brief."}, "replaces the chat template"),
        ({"stop": ["ok", ""]}, "stop must be a list of non-empty strings"),
        ({"stop": [7]}, "stop must be a list of non-empty strings"),
        ({"stop": ["Question:"], "decode_ahead": 1}, "use them apart"),
    ],
)
def test_bad_values_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**bad)


def test_one_stop_string_may_be_given_alone():
    assert SearchConfig(stop="Question:").stop == ["Question:"]


def test_prompt_format_is_the_prompt_as_plain_text(runtime):
    question = "Compute 3 + 4."
    ctx = SearchContext(SearchConfig(prompt_format="Q: {question}\nA:"), runtime, "generator", None)
    problem = ctx.problem("a", question)
    tokenizer = runtime.tokenizer("generator")
    assert problem.prompt_ids == tokenizer.encode(f"Q: {question}\nA:", add_special_tokens=True)
    templated = SearchContext(SearchConfig(), runtime, "generator", None).problem("a", question)
    assert problem.prompt_ids != templated.prompt_ids  # not the chat template's
    with pytest.raises(ValueError, match="takes a question, not a conversation"):
        ctx.problem("a", question, messages=[{"role": "user", "content": question}])


@pytest.mark.parametrize("strategy", ["majority", "beam_search"])
def test_a_stop_string_ends_every_solution(runtime, strategy):
    """Every solution of the shipped generator writes '=' in its first step: with stop ['='] each ends
    there (a step search's beams after one step), and without it they go on."""
    prm = load_prm(runtime, "prm", None) if strategy == "beam_search" else None
    kwargs = {"strategy": strategy, "n": 4, "beam_width": 4, "num_iterations": 4, "max_tokens": 64, "seed": 1}

    def solutions(**config: object) -> list:
        ctx = SearchContext(SearchConfig(**kwargs, **config), runtime, "generator", prm)
        results = asyncio.run(search_problems(ctx, PROBLEMS))
        runtime.check_pages_idle()
        return [beam for result in results for beam in result.beams]

    stopped, free = solutions(stop=["="]), solutions()
    assert stopped and all(b.text.endswith("=") and b.text.count("=") == 1 and len(b.steps) == 1 for b in stopped)
    assert all(b.text.count("=") > 1 for b in free)
