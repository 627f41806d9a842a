"""Invariant 3 (batch invariance) and the sampler's filters and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from treeserve import SamplingParams
from treeserve.engine.sampler import SamplingBatch, sample, seeded_uniform, seeded_uniforms, stream_key

PROMPT = "Once upon a time, in a land far away"


def test_seeded_request_same_alone_and_in_batch_of_32(llama_dir, make_llm):
    target = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=1234, n=2, ignore_eos=True)
    alone = make_llm(llama_dir).generate([PROMPT], target)[0]

    prompts, params = [], []
    words = ["The quick brown fox", "Numbers 0 1 2 3", "def f(x):", "Unicode: café", "Compute (12 + 7)"]
    for i in range(31):
        prompts.append(words[i % len(words)] + " " * (i % 3))
        params.append(
            SamplingParams(
                temperature=[0.0, 0.7, 1.3][i % 3],
                top_k=[-1, 5, 50][i % 3],
                top_p=[1.0, 0.9][i % 2],
                min_p=[0.0, 0.05][i % 2],
                max_tokens=10 + i,
                n=1 + i % 3,
                seed=i if i % 2 else None,
                logprobs=2 if i % 4 == 0 else None,
            )
        )
    prompts.insert(13, PROMPT)
    params.insert(13, target)
    batched = make_llm(llama_dir, max_num_batched_tokens=64).generate(prompts, params)[13]
    for a, b in zip(alone.outputs, batched.outputs, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text


def test_seed_reproducible_and_seeds_differ(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    p = SamplingParams(temperature=1.0, max_tokens=30, seed=7, ignore_eos=True, n=3)
    a, b = llm.generate([PROMPT], p)[0], llm.generate([PROMPT], p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3  # the n completions differ
    other = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=30, seed=8, ignore_eos=True))[0]
    assert other.outputs[0].token_ids != a.outputs[0].token_ids


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    counts = [0, 0, 0, 0]
    for pos in range(4000):
        row = SamplingBatch.of(1.0, 1.0, -1, 0.0, seeded_uniform(3, 0, pos))
        counts[sample(logits, row).item()] += 1
    assert counts[3] == 0
    for got, want in zip(counts[:3], [0.5, 0.3, 0.2], strict=True):
        assert abs(got / 4000 - want) < 0.03


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(3, 1)
    # top-k 2, nucleus 0.65, min-p 0.6 * 0.4 = 0.24: each keeps tokens 0 and 1
    rows = lambda u: SamplingBatch.of(1.0, [1.0, 0.65, 1.0], [2, -1, -1], [0.0, 0.0, 0.6], u)  # noqa: E731
    seen = set()
    for i in range(200):
        seen |= {(r, t) for r, t in enumerate(sample(logits, rows(seeded_uniform(0, 0, i))).tolist())}
    assert seen == {(r, t) for r in range(3) for t in (0, 1)}


def test_logprobs_match_transformers(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[n - 1 + i]
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        total += row[token].item()
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)


def test_a_vanishing_temperature_is_greedy(llama_dir, make_llm):
    """Temperatures below 1e-5 sample greedily (vLLM's rule): 1e-75 is 0 in bf16, and dividing the
    hidden state by it used to produce NaN logits and an invalid token."""
    llm = make_llm(llama_dir, dtype="bfloat16")
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for t in (4e-75, 1e-30, 9e-6):
        params = SamplingParams(temperature=t, max_tokens=8, ignore_eos=True, seed=3)
        assert params.temperature == 0.0
        out = llm.generate([PROMPT], params)
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # the rule's edge: still sampled


@pytest.mark.parametrize("path", ["c", "torch"])
def test_greedy_argmax_over_a_wide_vocabulary_is_torchs_argmax(path, monkeypatch):
    """Both argmax paths (on a CPU the C kernel `argmax_rows`; elsewhere chunk maxima, then the
    first chunk holding the maximum) pick what torch.argmax picks: the first of tied maxima
    (-0.0 and 0.0 tie), the first NaN, +inf, 0 for a row of -inf; rows with a stride."""
    from treeserve.engine import sampler
    from treeserve.kernels import cpu as cpu_kernels

    if path == "c" and not cpu_kernels.supports(torch.zeros(1)):
        pytest.skip("the C kernels did not build here")
    if path == "torch":
        monkeypatch.setattr(sampler.cpu_kernels, "supports", lambda t: False)
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows, vocab = 1 + trial % 4, 16_384 + 997 * trial  # widths that do and do not fill the last chunk
        x = torch.randint(-5, 5, (rows, vocab), generator=g).float()  # many ties at the maximum
        if trial % 5 == 0:
            x[0, 3 * trial] = float("nan")
        if trial % 7 == 0:
            x[-1] = float("-inf")
        if trial % 6 == 1:
            x[-1, vocab // 2] = float("inf")
        if trial % 8 == 3:
            x[0] = -1.0
            x[0, 11], x[0, 5 * trial] = -0.0, 0.0
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(sampler._argmax(x.to(dtype), []), x.to(dtype).float().argmax(dim=-1)), (trial, dtype)
        strided = x[:, ::3]
        assert torch.equal(sampler._argmax(strided, []), strided.argmax(dim=-1)), trial


def test_seeded_uniforms_are_seeded_uniform_bit_for_bit():
    """The arrays the engine draws with (a completion's `stream_key`, kept while it runs, and the
    positions) equal the scalar definition: 64-bit seeds, negative ones too, completion indices,
    positions past 2**32."""
    import random

    import numpy as np

    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(500)] + [-1, -(2**63), 0, 2**64 - 1]
    index = [rng.randrange(0, 300) for _ in seeds]
    positions = [rng.randrange(0, 1 << 40) for _ in seeds]
    keys = np.array([stream_key(s, i) for s, i in zip(seeds, index, strict=True)], dtype=np.uint64)
    got = seeded_uniforms(keys, np.array(positions))
    assert got.tolist() == [seeded_uniform(s, i, p) for s, i, p in zip(seeds, index, positions, strict=True)]


def test_no_buffer_sized_max_num_seqs_by_vocab(llama_dir, make_llm):
    """The sampler's buffers are sized by a step's rows: an engine allowed 65,536 sequences
    allocates what one allowed 4 does, when it starts and in the same steps (none of it near
    max_num_seqs x vocab)."""
    from treeserve.runtime.planner import _allocations  # PyTorch's CPU allocations, from the profiler

    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=3, seed=1, logprobs=2)

    def largest_allocations(seqs: int) -> tuple[list[int], int]:
        made = []  # steps not overlapped: they run on this thread, where the profiler looks
        started = _allocations(lambda: made.append(make_llm(llama_dir, max_num_seqs=seqs, async_scheduling=False)))
        stepped = _allocations(lambda: made[0].generate(["a b", "c d", "e f g"], params))
        vocab = made[0].engine.model_config.vocab_size
        return [max(nbytes for _, nbytes in events) for events in (started, stepped)], vocab

    (few, vocab), (many, _) = largest_allocations(4), largest_allocations(1 << 16)
    assert many == few and max(many) < (1 << 16) * vocab
