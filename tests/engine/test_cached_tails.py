"""A sequence's last page, part written, is keyed by its tokens when the sequence ends
(`PageManager.cache_tail`): a request continuing those tokens reads them instead of recomputing
them. A keyed page never changes: a request admitted over a cached tail copies it first."""

from __future__ import annotations

import pytest
import torch

from treeserve import SamplingParams, ScoreParams, StepFailed

TEXT = "Once upon a time, in a land far away, there lived a small model that liked to count to ten."
GREEDY = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)


def _generated_ids(llm) -> list[int]:
    first = llm.generate([TEXT], GREEDY)[0]
    ids = first.prompt_token_ids + first.outputs[0].token_ids
    assert (len(ids) - 1) % 16  # the last page computed is part written
    return ids


def test_a_continuation_reads_the_tail_with_a_cold_runs_bits(llama_dir, make_llm):
    """fp32 on the `cpu` backend, where a decode's KV has a full prefill's bits: the tokens a
    generation computed, sent again, compute only the last, with a cold engine's logits."""
    llm = make_llm(llama_dir)
    ids = _generated_ids(llm)
    params = ScoreParams(positions=[len(ids) - 1], token_ids=[5, 17, 42], return_hidden_states=True)
    before = llm.engine.num_computed_tokens
    warm = llm.score([ids], params)[0]
    cold = make_llm(llama_dir, enable_prefix_caching=False).score([ids], params)[0]
    assert warm.num_cached_tokens == len(ids) - 1 and llm.engine.num_computed_tokens - before == 1
    assert llm.engine.pages.stats.tail_hits == 1
    assert torch.equal(warm.hidden_states, cold.hidden_states) and torch.equal(warm.logprobs, cold.logprobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_continuations_sent_together_copy_the_tail(llama_dir, make_llm, overlap):
    """Three requests continue one cached tail with different tokens in the same step: each
    copies the page before writing it, and each gets a cold engine's tokens."""
    llm = make_llm(llama_dir, async_scheduling=overlap)
    ids = _generated_ids(llm)
    prompts = [{"prompt_token_ids": ids + [7 + k]} for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.engine.num_computed_tokens
    together = llm.generate(prompts, params)
    assert llm.engine.pages.stats.tail_hits == 3
    assert llm.engine.num_computed_tokens - before == 3 * (2 + 5)  # two prompt tokens each, then 5 decodes
    cold = make_llm(llama_dir, enable_prefix_caching=False).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in cold]


@pytest.mark.parametrize("end", ["failed step", "abort"])
def test_a_sequence_that_did_not_end_by_its_tokens_keys_no_tail(llama_dir, make_llm, end):
    """A sequence failed with its step, or aborted, may have steps in flight whose KV was never
    written: only its full pages keep their keys, none of its last page's tokens is cached."""
    llm = make_llm(llama_dir)
    engine = llm.engine
    engine.add_request("r", TEXT, GREEDY)
    for _ in range(6):
        engine.step()
    if end == "abort":
        engine.abort("r")
    else:
        engine.inject_failure()
        with pytest.raises(StepFailed):
            for _ in range(3):
                engine.step()
    engine.check_pages_idle()
    want = make_llm(llama_dir).generate([TEXT], GREEDY)[0]
    full_pages = set(engine.pages.chain_hashes(want.prompt_token_ids + want.outputs[0].token_ids))
    assert engine.pages.pool.hash_to_page and set(engine.pages.pool.hash_to_page) <= full_pages


def test_a_continuation_past_the_tail_keys_its_full_page(llama_dir, make_llm):
    """The copy a continuation writes is a page like any other: once full it is keyed, so the
    continuation's tokens sent again compute only their last."""
    llm = make_llm(llama_dir)
    ids = _generated_ids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    longer = ids + out.outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": longer}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert again.num_cached_tokens == len(longer) - 1 and llm.engine.pages.stats.tail_hits == 2
