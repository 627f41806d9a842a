"""Invariant 5: the optimised search selects the same beams and answers as the plain reference.

Runs every strategy twice (fp32) on the step world of `step_world.py`: once with every
optimisation on (prefix cache, score cache, all problems in flight, speculative tree
expansion for beam search), once with `reference=True` (none of them), and compares
completions, step scores and chosen answers beam for beam.
"""

from __future__ import annotations

import pytest

from tests.search.step_world import build_step_world
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig

QUESTIONS = ["Compute 1+2.", "Compute 3*4-5.", "Compute (6+7)*8.", "Compute 9-1."]
RECORDS = [
    {"problem": q, "answer": "3", "unique_id": f"q{i}", "level": 1, "grader": "arith"} for i, q in enumerate(QUESTIONS)
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_step_world(str(tmp_path_factory.mktemp("step_world")))


def run(
    world,
    config: SearchConfig,
    reference: bool,
    kv_cache_memory: int = 64 << 20,
    prm_kv_fraction: float | None = None,
    speculative_config: dict | None = None,
) -> dict:
    generator, prm = world
    settings = EvalSettings(
        generator=ModelSettings(generator, speculative_config=speculative_config),
        prm=ModelSettings(prm, kv_fraction=prm_kv_fraction),
        reference=reference,
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=kv_cache_memory),
    )
    return run_eval(settings, config, inline=[dict(r) for r in RECORDS])


def signature(doc: dict, approx: bool = False) -> list:
    """Each problem's answer and completions: texts, and step scores to 5 digits, or with
    `approx` within 1e-5 (for one side of a comparison: a score's last bits follow what the
    PRM's prefix cache held, and 5-digit rounding can split two such values)."""

    def scores(values: list[float]) -> object:
        return pytest.approx(values, abs=1e-5) if approx else [round(s, 5) for s in values]

    return [
        (p["unique_id"], p["pred"], [(c["text"], scores(c["step_scores"])) for c in p["completions"]])
        for p in doc["problems"]
    ]


CONFIGS = {
    "beam_spec": SearchConfig(
        strategy="beam_search", n=8, beam_width=2, num_iterations=6, max_tokens=24, decode_ahead=2
    ),
    "beam_prod_dedup": SearchConfig(
        strategy="beam_search",
        n=4,
        beam_width=2,
        num_iterations=5,
        max_tokens=24,
        agg="prod",
        filter_duplicates=True,
        final_to_eos=True,
    ),
    "dvts": SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=5, max_tokens=24),
    "best_of_n": SearchConfig(strategy="best_of_n", n=4, max_tokens=64),
    "weighted_min": SearchConfig(strategy="weighted_best_of_n", n=4, max_tokens=64, agg="min"),
    "majority": SearchConfig(strategy="majority", n=4, max_tokens=64),
    "rebase": SearchConfig(strategy="rebase", n=6, num_iterations=5, max_tokens=24),
    "mcts": SearchConfig(strategy="mcts", n=4, beam_width=2, num_iterations=5, max_tokens=24),
    "mcts_rollouts": SearchConfig(
        strategy="mcts", n=4, beam_width=2, num_iterations=5, max_tokens=24, lookahead=1, exploration=0.5
    ),
    "particles_ess": SearchConfig(
        strategy="particle_filtering", n=4, num_iterations=5, max_tokens=24, resample_threshold=0.7
    ),
    # adaptive search: the same stops and beams with every optimisation on; without a budget a problem
    # reads only its own tree, so all problems may be in flight
    "beam_adaptive": SearchConfig(
        strategy="beam_search",
        n=8,
        beam_width=2,
        num_iterations=6,
        max_tokens=24,
        adaptive=True,
        certainty=0.7,
        first_width=2,
        budget_fraction=None,
    ),
    "majority_adaptive": SearchConfig(
        strategy="majority", n=8, max_tokens=64, adaptive=True, certainty=0.7, first_width=2, budget_fraction=None
    ),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "phi3"])
def test_optimised_equals_reference_for_each_family(tmp_path, family):
    """The 2026 families as the generator: beam search with every optimisation (speculative
    steps, prefix and score caches, twin rows) selects the reference search's beams."""
    generator_world = build_step_world(str(tmp_path), family=family)
    config = CONFIGS["beam_spec"]
    fast = run(generator_world, config, reference=False)
    plain = run(generator_world, config, reference=True)
    assert signature(fast) == signature(plain, approx=True)
    assert max(len(c["step_scores"]) for p in fast["problems"] for c in p["completions"]) >= 3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimised_equals_reference(world, name):
    config = CONFIGS[name]
    fast = run(world, config, reference=False)
    plain = run(world, config, reference=True)
    assert signature(fast) == signature(plain, approx=True)
    assert [p.get("stop") for p in fast["problems"]] == [p.get("stop") for p in plain["problems"]]
    assert fast["summary"]["accuracy"] == plain["summary"]["accuracy"]
    if config.strategy != "majority":
        assert fast["summary"]["prm_tokens_prefilled"] < plain["summary"]["prm_tokens_prefilled"]
    if config.strategy in ("beam_search", "dvts", "rebase", "particle_filtering", "mcts"):
        lengths = [len(c["step_scores"]) for p in fast["problems"] for c in p["completions"]]
        assert max(lengths) >= 3  # the search really ran several iterations


def test_speculation_reuses_text(world):
    config = CONFIGS["beam_spec"]
    spec = run(world, config, reference=False)
    assert spec["summary"]["generator_steps"] > 0
    plain = run(world, SearchConfig(**{**config.__dict__, "decode_ahead": 0}), reference=False)
    assert signature(spec) == signature(plain)


@pytest.mark.parametrize(
    "memory", [{"prm_kv_fraction": 0.3}, {"kv_cache_memory": 600 << 10}], ids=["static-split", "tight-shared-arena"]
)
def test_memory_layout_does_not_change_the_search(world, memory):
    """The shared arena (default), a static split and a shared arena so small that pages are
    evicted and sequences preempted all select the same beams as the reference."""
    config = CONFIGS["beam_spec"]
    plain = run(world, config, reference=True)
    other = run(world, config, reference=False, **memory)
    assert signature(other) == signature(plain)
    if "kv_cache_memory" in memory:
        assert other["summary"]["prm_evictions"] + other["summary"]["generator_evictions"] > 0


def test_fixed_steps_runs_every_iteration(world):
    """`fixed_steps` (random-weight benchmarks): no stop string and no EOS, so every beam
    runs all iterations of exactly `max_tokens` tokens, and the reference agrees."""
    config = SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=3, max_tokens=8, fixed_steps=True)
    fast = run(world, config, reference=False)
    assert signature(fast) == signature(run(world, config, reference=True))
    completions = [c for p in fast["problems"] for c in p["completions"]]
    assert {len(c["step_scores"]) for c in completions} == {3}
    assert fast["summary"]["generated_tokens"] == len(QUESTIONS) * 3 * 4 * 8
    with pytest.raises(ValueError, match="fixed_steps"):
        SearchConfig(strategy="beam_search", n=4, beam_width=2, fixed_steps=True, decode_ahead=1)


@pytest.mark.parametrize("method", ["ngram", "tree", "model"])
@pytest.mark.parametrize("name", ["beam_spec", "dvts", "best_of_n"])
def test_speculative_decoding_does_not_change_the_search(world, method, name):
    """Speculative decoding of the generator (each method; the generator drafting for itself as
    the draft model) under every search optimisation selects what the plain reference selects."""
    generator, _ = world
    speculative = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    if method == "model":
        speculative = {"model": generator, "num_speculative_tokens": 4}
    config = CONFIGS[name]
    fast = run(world, config, reference=False, speculative_config=speculative)
    assert signature(fast) == signature(run(world, config, reference=True))
    assert fast["summary"]["generator_spec_accepted_tokens"] > 0
    assert fast["config"]["generator"]["speculative_config"]["method"] == method
