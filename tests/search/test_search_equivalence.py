"""Invariant 5: the optimised search selects the same beams and answers as the plain reference.

Runs every strategy twice on the shipped arithmetic models (fp32): once with every
optimisation on (prefix cache, score cache, many problems in flight, speculative tree
expansion for beam search), once with `reference=True` (none of them), and compares
completions, step scores and chosen answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings, run_eval
from treeserve.search.context import SearchConfig

pytestmark = pytest.mark.skipif(
    not Path(DEFAULT_GENERATOR, "config.json").exists() or not Path(DEFAULT_PRM, "config.json").exists(),
    reason="shipped arithmetic models not present",
)

DATASET = "arith:level=3,4,size=4,seed=11"


def run(config: SearchConfig, reference: bool) -> dict:
    settings = EvalSettings(dataset=DATASET, dtype="float32", kv_cache_memory=64 << 20, reference=reference,
                            progress=False)  # fmt: skip
    return run_eval(settings, config)


def signature(doc: dict) -> list:
    return [
        (p["unique_id"], p["pred"], [(c["text"], [round(s, 4) for s in c["step_scores"]]) for c in p["completions"]])
        for p in doc["problems"]
    ]


@pytest.mark.parametrize(
    "config",
    [
        SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=8, max_tokens=48, speculative_steps=2),
        SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=3, max_tokens=48, filter_duplicates=1),
        SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=8, max_tokens=48),
        SearchConfig(strategy="best_of_n", n=4, max_tokens=200),
        SearchConfig(strategy="weighted_best_of_n", n=4, max_tokens=200, agg="min"),
        SearchConfig(strategy="majority", n=4, max_tokens=200),
    ],
    ids=["beam_spec", "beam_dedup_short", "dvts", "best_of_n", "weighted", "majority"],
)
def test_optimised_equals_reference(config):
    fast = run(config, reference=False)
    plain = run(config, reference=True)
    assert signature(fast) == signature(plain)
    assert fast["summary"]["accuracy"] == plain["summary"]["accuracy"]
    if config.strategy != "majority":
        assert fast["summary"]["prm_tokens_prefilled"] < plain["summary"]["prm_tokens_prefilled"]
