"""Invariant 4: chunked prefill and prefix-cache hits read the same logits as one full prefill."""

from __future__ import annotations

import pytest
import torch

from treeserve import ScoreParams

TEXT = (
    "Once upon a time, in a land far away, there lived a small model that liked to count. "
    "The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000"
)


def read_all(llm, ids):
    params = ScoreParams(positions=list(range(len(ids))), token_ids=[5, 17, 42], return_hidden_states=True)
    return llm.score([ids], params)[0]


def test_chunked_prefill_matches_full(llama_dir, make_llm):
    full = make_llm(llama_dir, enable_prefix_caching=False)
    ids = full.get_tokenizer().encode(TEXT)
    assert len(ids) > 40
    ref = read_all(full, ids)
    for chunk in (1, 7, 16):
        chunked = make_llm(llama_dir, enable_prefix_caching=False, max_num_batched_tokens=chunk)
        got = read_all(chunked, ids)
        torch.testing.assert_close(got.hidden_states, ref.hidden_states, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)


def test_prefix_hit_matches_full(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode(TEXT)
    ref = read_all(make_llm(llama_dir, enable_prefix_caching=False), ids)
    # warm the cache with the first 35 tokens, then read only the tail positions
    read_all(llm, ids[:35])
    tail = list(range(33, len(ids)))
    out = llm.score([ids], ScoreParams(positions=tail, token_ids=[5, 17, 42], return_hidden_states=True))[0]
    assert out.num_cached_tokens == 32  # two full 16-token pages came from the cache
    torch.testing.assert_close(out.hidden_states, ref.hidden_states[33:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logprobs, ref.logprobs[33:], atol=1e-5, rtol=1e-5)
    assert llm.engine.pages.stats.hits == 2


def test_prefix_hit_and_chunks_read_the_full_prefills_bits(llama_dir, make_llm):
    """fp32 on the `cpu` backend: a position read after a prefix-cache hit, or in a small chunk,
    has the bits of one full prefill (SDPA's rows changed their last bits with the rows beside
    them: a PRM score after a hit differed from the cold one, and search broke ties by it)."""
    ids = make_llm(llama_dir).get_tokenizer().encode(TEXT)
    ref = read_all(make_llm(llama_dir, enable_prefix_caching=False), ids)
    llm = make_llm(llama_dir)
    read_all(llm, ids[:35])
    tail = list(range(33, len(ids)))
    out = llm.score([ids], ScoreParams(positions=tail, token_ids=[5, 17, 42], return_hidden_states=True))[0]
    assert out.num_cached_tokens == 32
    assert torch.equal(out.hidden_states, ref.hidden_states[33:]) and torch.equal(out.logprobs, ref.logprobs[33:])
    for chunk in (1, 2, 3, 7):
        chunked = read_all(make_llm(llama_dir, enable_prefix_caching=False, max_num_batched_tokens=chunk), ids)
        assert torch.equal(chunked.hidden_states, ref.hidden_states), chunk


def test_prefix_hit_never_skips_a_requested_position(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode(TEXT)
    read_all(llm, ids)
    out = read_all(llm, ids)  # everything cached, but position 0 must still be computed
    assert out.num_cached_tokens == 0
    assert out.hidden_states.shape[0] == len(ids)


def test_generation_after_prefix_hit_matches(llama_dir, make_llm):
    from treeserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cold = make_llm(llama_dir, enable_prefix_caching=False).generate([TEXT], params)[0]
    warm_llm = make_llm(llama_dir, max_num_batched_tokens=9)
    warm_llm.generate([TEXT], params)
    warm = warm_llm.generate([TEXT], params)[0]
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_requests_sent_together_compute_a_shared_prefix_once(llama_dir, make_llm):
    """Beams send the same prompt at the same moment: the first computes the shared pages, the
    others wait for the prefix cache instead of computing them again; outputs are unchanged."""
    from treeserve import SamplingParams

    llm = make_llm(llama_dir)
    ids = llm.get_tokenizer().encode(TEXT)
    shared = ids[:48]  # three full pages
    prompts = [{"prompt_token_ids": shared + [7 + k, 9]} for k in range(6)]
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=3)
    together = llm.generate(prompts, params)
    assert llm.engine.num_computed_tokens == 48 + 6 * 2 + 6 * 3  # prefix once, tails, decodes
    assert llm.engine.pages.stats.hits == 5 * 3
    alone = [make_llm(llama_dir).generate([p], params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("overlap", [False, True])
def test_every_page_a_generation_computed_is_cached(llama_dir, make_llm, overlap):
    """Every page of prompt and output a generation computed gets its prefix-cache key, full pages
    as they fill and the last, part written, when the generation ends, with a chunked prefill and
    with overlapped steps: the same tokens sent again compute only their last token."""
    from treeserve import SamplingParams

    llm = make_llm(llama_dir, max_num_batched_tokens=9, async_scheduling=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    first = llm.generate([TEXT], params)[0]
    ids = first.prompt_token_ids + first.outputs[0].token_ids
    before = llm.engine.num_computed_tokens
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    computed = len(ids) - 1  # the last sampled token was never an input
    assert computed % 16 and again.num_cached_tokens == computed
    assert llm.engine.num_computed_tokens - before == 1
    assert llm.engine.pages.stats.tail_hits == 1
