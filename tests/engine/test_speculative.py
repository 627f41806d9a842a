"""Speculative decoding changes no output: token for token, greedy and sampled, stops included.

Every drafted position is sampled with its own seeded uniform and a drafted token is kept only
when it equals that sample, so outputs with speculation must be identical to outputs without
(fp32, to the bit: log-probabilities included). Random tiny models loop at low temperatures
(drafts get accepted) and wander at high ones (drafts get rejected), so both paths run. Pages
are checked after every example.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams
from treeserve.config import EngineConfig, SpeculativeConfig
from treeserve.engine.speculative.prompt_lookup import SEPARATOR, propose_lookup
from treeserve.runtime.runtime import Runtime

WORDS = ["The quick brown fox", "Numbers 0 1 2 3", "def f(x):", "Once upon a time", "Compute (12 + 7)", "the the"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir) -> str:
    """A one-layer model with the target's tokenizer, embeddings and first layer (same seed)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("draft")), "llama", num_hidden_layers=1)


def spec_config(method: str, k: int, draft: str) -> dict:
    if method == "model":
        return {"model": draft, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


requests = st.lists(
    st.tuples(
        st.sampled_from(WORDS),
        st.sampled_from([0.0, 0.0, 0.3, 1.0]),  # temperature
        st.integers(1, 60),  # max_tokens
        st.sampled_from([None, ["the"], [" 1", "x"], ["e"]]),  # stop strings
        st.integers(1, 3),  # n_stop_occurrences
        st.integers(1, 3),  # n
        st.integers(0, 1000),  # seed
        st.sampled_from([None, 2]),  # logprobs
    ),
    min_size=1,
    max_size=4,
)


def params_of(request: tuple) -> SamplingParams:
    _, temperature, max_tokens, stop, occurrences, n, seed, logprobs = request
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        stop=stop,
        n_stop_occurrences=occurrences,
        n=n,
        seed=seed,
        logprobs=logprobs,
        include_stop_str_in_output=seed % 2 == 0,
        top_p=0.9 if seed % 3 == 0 else 1.0,
    )


@pytest.mark.parametrize("method", ["ngram", "tree", "model"])
def test_outputs_identical_with_speculation(llama_dir, draft_dir, make_llm, method):
    plain = make_llm(llama_dir)
    # draft models: the one-layer model (it rarely agrees) and the target itself (its greedy drafts
    # agree unless the target samples something else)
    drafts = {1: llama_dir, 3: draft_dir, 8: llama_dir}
    engines = {k: make_llm(llama_dir, speculative_config=spec_config(method, k, drafts[k])) for k in drafts}

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(requests, st.sampled_from([1, 3, 8]))
    def check(batch, k):
        prompts, params = [r[0] for r in batch], [params_of(r) for r in batch]
        expected = plain.generate(prompts, params)
        got = engines[k].generate(prompts, params)
        for a, b in zip(expected, got, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert x.token_ids == y.token_ids and x.text == y.text
                assert (x.finish_reason, x.stop_reason, x.stop_offsets) == (
                    y.finish_reason,
                    y.stop_reason,
                    y.stop_offsets,
                )
                # every bit: a rounding difference that only rarely flips a token still is one
                assert x.logprobs == y.logprobs and x.cumulative_logprob == y.cumulative_logprob
        engines[k].engine.check_pages_idle()

    check()
    stats = [e.engine.speculator.stats for e in engines.values()]
    assert sum(s.num_accepted_tokens for s in stats) > 0  # drafts were accepted ...
    assert sum(s.num_draft_tokens - s.num_accepted_tokens for s in stats) > 0  # ... and rejected


def test_a_sampled_token_at_a_cdf_boundary_survives_speculation(llama_dir, make_llm):
    """Regression: fp32 matmuls of fewer than 16 rows ran other MKL kernels (another summation
    order), so plain decoding (3 rows a step) and verification (4 rows) gave completion 2 other
    last bits, and it sampled token 265 where plain decoding sampled 264 (its 18th token, at a
    CDF boundary). Row counts must not move a bit: log-probabilities are compared exactly."""
    params = SamplingParams(temperature=0.3, max_tokens=20, n=3, seed=77, logprobs=2)
    expected = make_llm(llama_dir).generate(["Compute (12 + 7)"], params)[0]
    spec = make_llm(llama_dir, speculative_config=spec_config("ngram", 3, llama_dir))
    got = spec.generate(["Compute (12 + 7)"], params)[0]
    assert spec.engine.speculator.stats.num_draft_tokens > 0  # verified (and rejected): only the row count differs
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    assert [(c.logprobs, c.cumulative_logprob) for c in got.outputs] == [
        (c.logprobs, c.cumulative_logprob) for c in expected.outputs
    ]


def test_prefix_cache_never_holds_a_rejected_token(llama_dir, make_llm):
    """Pages a speculating engine cached must hold exactly the accepted tokens' KV: a prompt that
    reuses them continues exactly as on an engine that never speculated."""
    config = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1}
    spec = make_llm(llama_dir, speculative_config=config)
    plain = make_llm(llama_dir)
    params = SamplingParams(temperature=0.2, seed=1, max_tokens=120, ignore_eos=True, n=4)
    first = spec.generate(["the the the"], params)[0]
    stats = spec.engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    follow = SamplingParams(temperature=0.0, max_tokens=20)
    for completion in first.outputs:
        ids = first.prompt_token_ids + completion.token_ids
        again = spec.generate({"prompt_token_ids": ids}, follow)[0]
        assert again.num_cached_tokens >= 100
        expected = plain.generate({"prompt_token_ids": ids}, follow)[0]
        assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_tree_drafts_from_the_other_requests_of_its_group(llama_dir, make_llm):
    """A request of a draft group copies what an earlier request of the group wrote; alone
    (ngram), it has only its own text. Outputs are the same either way."""
    outputs, accepted = {}, {}
    for method in ("ngram", "tree"):
        llm = make_llm(llama_dir, speculative_config={"method": method, "num_speculative_tokens": 6})
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        engine.add_request("lead", "Numbers 0 1 2 3", params, draft_group="problem")
        for _ in range(30):
            engine.step()
        engine.add_request("follow", "Numbers 0 1 2 3", params, draft_group="problem")
        before = engine.speculator.stats.num_accepted_tokens
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        outputs[method] = [done[r].outputs[0].token_ids for r in ("lead", "follow")]
        accepted[method] = engine.speculator.stats.num_accepted_tokens - before
        engine.speculator.forget_group("problem")
    assert outputs["ngram"] == outputs["tree"]
    assert accepted["tree"] > accepted["ngram"]


def test_lookup_takes_the_longest_suffix_match_with_a_continuation():
    def text(tokens):
        return "".join(map(chr, tokens))

    tokens = text([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert propose_lookup(tokens, len(tokens), tokens, 3, 1, 3) == [9, 2, 6]  # latest match of (6, 7)
    tokens = text([1, 2, 3, 4, 9, 9, 2, 3])
    assert propose_lookup(tokens, len(tokens), tokens, 2, 1, 3) == [4, 9]
    assert propose_lookup(tokens, len(tokens), tokens, 2, 3, 3) == []  # no 3-gram match
    assert propose_lookup(text([7, 7]), 2, text([7, 7]), 4, 1, 1) == [7]
    # a group: another member's continuation, never across the separator, never the own suffix
    mine, other = text([4, 5, 6]), text([5, 6, 0xD800, 262143])  # surrogate and large ids are tokens too
    corpus = other + SEPARATOR + mine + SEPARATOR
    assert propose_lookup(corpus, len(other) + 1 + len(mine), mine, 4, 1, 2) == [0xD800, 262143]
    assert propose_lookup(other + SEPARATOR + mine, len(corpus) - 1, mine, 4, 1, 2) == [0xD800, 262143]
    assert propose_lookup(mine + SEPARATOR + mine, 7, mine, 4, 1, 2) == []


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
        ({"method": "model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_configs_are_refused_before_loading(llama_dir, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(model=llama_dir, speculative_config=value)


def test_draft_model_must_share_the_vocabulary(llama_dir, tmp_path):
    other = build_checkpoint(str(tmp_path / "other"), "llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary"):
        EngineConfig.from_kwargs(model=llama_dir, speculative_config={"model": other, "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError, match="draft model"):
        SpeculativeConfig.parse({"model": str(tmp_path / "missing"), "num_speculative_tokens": 2})


def test_no_speculation_on_a_prm(llama_dir):
    with pytest.raises(ValueError, match="speculative decoding is for the generator"):
        Runtime.for_search(
            llama_dir,
            llama_dir,
            8 << 20,
            engine_args={"prm": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}},
        )


def test_counters_reach_metrics_and_llm(llama_dir, make_llm):
    llm: LLM = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.generate(["the the the the"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stats = llm.engine.speculator.stats.as_dict()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_accepted_tokens"] > 0
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_drafts"]


# triton: ~24 s in the interpreter, so in the slow step
@pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=pytest.mark.slow)])
def test_every_attention_backend_verifies_exactly(llama_dir, make_llm, backend):
    """Verification rows run through each backend's decode path (Triton under the interpreter)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    config = {"model": llama_dir, "num_speculative_tokens": 3}
    expected = make_llm(llama_dir, attention_backend=backend).generate(["the the the"], params)[0]
    llm = make_llm(llama_dir, attention_backend=backend, speculative_config=config)
    got = llm.generate(["the the the"], params)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_no_drafts_in_batches_larger_than_disable_by_batch_size(llama_dir, make_llm):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
    llm = make_llm(llama_dir, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(["the the the"] * 3, params)  # three running: never drafts
    assert llm.engine.speculator.stats.num_drafts == 0
    llm.generate(["the the the"] * 2, params)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
