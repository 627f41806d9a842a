"""Overlapped steps (`async_scheduling`) change no output: random mixes of requests, on and off.

Each example runs one mix of requests through an engine that overlaps its steps (the host
schedules step t+1 while a worker thread runs step t; tokens are read back one step late, and
a sequence found finished has one more token in flight, which is discarded) and through one
that does not. The mixes hold stop strings, `n_stop_occurrences` 1-3, `max_tokens` 1-3, EOS,
n > 1, logprobs, structured outputs, penalties, and requests aborted between steps; the page
budget is small enough that sequences are preempted and recomputed. Every request that was not
aborted must get the same tokens, text, finish reason, stop reason and stop offsets, and after
every example every page is free or held by the prefix cache.

Logprobs are compared to 1e-5: the tiny fp32 model's prefill attention runs on PyTorch's SDPA,
whose last bits depend on the longest context batched with a chunk (its padded key length), and
overlapped steps batch differently (invariant 4 holds to that tolerance on this path too). The
examples are derandomised, so a run is reproducible.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.test_preemption import PROMPTS
from treeserve import LLM, SamplingParams, StructuredOutputsParams

STOPS = ["e", " t", "o", "\n", "an"]
CONSTRAINTS = [StructuredOutputsParams(regex="[a-z ]{1,12}"), StructuredOutputsParams(choice=["yes", "no", "maybe"])]
PAGE = 2 * 2 * 4 * 2 * 16 * 4  # layers * k/v * block * kv_heads * head_dim * fp32 bytes (tiny llama, 4-token pages)


@pytest.fixture(scope="module")
def engines(llama_dir):
    """(overlapped, plain) engines on 24 pages of 4 tokens: a mix of requests preempts."""
    made = [
        LLM(
            llama_dir,
            dtype="float32",
            page_size=4,
            kv_cache_memory=24 * PAGE,
            max_model_len=72,
            async_scheduling=overlap,
        )
        for overlap in (True, False)
    ]
    assert made[0].engine.async_scheduling and not made[1].engine.async_scheduling
    return made


@st.composite
def request_params(draw: st.DrawFn) -> SamplingParams:
    if draw(st.integers(0, 3)) == 0:  # long and wide: these fill the pages, so others are preempted
        return SamplingParams(
            n=3, temperature=0.8, seed=draw(st.integers(0, 1000)), max_tokens=draw(st.integers(30, 40)), ignore_eos=True
        )
    short = draw(st.booleans())
    stops = draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True))
    constrained = draw(st.integers(0, 7)) == 0  # rare: a step holding one is not overlapped
    return SamplingParams(
        n=draw(st.integers(1, 3)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.2])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        seed=draw(st.integers(0, 1000)),
        max_tokens=draw(st.integers(1, 3)) if short else draw(st.integers(4, 40)),
        stop=stops or None,
        n_stop_occurrences=draw(st.integers(1, 3)) if stops else 1,
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()) and not constrained,
        logprobs=draw(st.sampled_from([None, None, 2])),
        repetition_penalty=draw(st.sampled_from([1.0] * 7 + [1.3])),
        structured_outputs=draw(st.sampled_from(CONSTRAINTS)) if constrained else None,
    )


@st.composite
def mixes(draw: st.DrawFn) -> list[tuple[str, SamplingParams, int | None]]:
    """(prompt, params, the step before which it is aborted, or None) per request."""
    count = draw(st.integers(1, 7))
    return [
        (draw(st.sampled_from(PROMPTS)), draw(request_params()), draw(st.sampled_from([None, None, None, 1, 3, 6])))
        for _ in range(count)
    ]


def run(llm: LLM, mix: list[tuple[str, SamplingParams, int | None]]) -> dict[str, list]:
    engine = llm.engine
    for i, (prompt, params, _) in enumerate(mix):
        engine.add_request(f"r{i}", prompt, params)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for i, (_, _, abort_at) in enumerate(mix):
            if abort_at == step:
                engine.abort(f"r{i}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
        step += 1
    engine.check_pages_idle()
    return {rid: out for rid, out in done.items() if mix[int(rid[1:])][2] is None}


def assert_same(got: dict[str, list], want: dict[str, list]) -> None:
    assert set(got) == set(want)
    for rid, completions in want.items():
        for a, b in zip(got[rid], completions, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason, a.stop_offsets) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
                b.stop_offsets,
            ), rid
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                assert math.isclose(a.cumulative_logprob, b.cumulative_logprob, rel_tol=1e-5, abs_tol=1e-5)
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert [(t, v.rank, v.decoded_token) for t, v in x.items()] == [
                        (t, v.rank, v.decoded_token) for t, v in y.items()
                    ]
                    assert all(math.isclose(x[t].logprob, y[t].logprob, rel_tol=1e-5, abs_tol=1e-5) for t in x)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes())
def test_overlapped_steps_give_the_same_outputs(engines, mix):
    overlapped, plain = engines
    want = run(plain, mix)
    assert_same(run(overlapped, mix), want)
    assert set(want) == {f"r{i}" for i, (_, _, abort_at) in enumerate(mix) if abort_at is None}


def test_preemption_and_overlap_happen(engines):
    """The mixes above exercise what they claim: overlapped steps launched ahead of their read-back,
    preemption (which waits for the step in flight), and discarded in-flight tokens."""
    overlapped, plain = engines
    engine = overlapped.engine
    preempted = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True, n=3)
    mix = [(p, params, None) for p in PROMPTS]
    assert_same(run(overlapped, mix), run(plain, mix))
    assert engine.scheduler.num_preemptions > preempted


def test_tokens_filled_on_the_device(llama_dir, make_llm):
    """CUDA's path: the previous step's samples are written into the next step's inputs on the
    device, without the host reading them (and without looking for twins). Run here on CPU tensors."""
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, n=2, ignore_eos=True) for s in range(4)]
    want = make_llm(llama_dir, async_scheduling=False).generate(PROMPTS[:4], params)
    llm = make_llm(llama_dir, async_scheduling=True)
    llm.engine.runner.fill_on_device = True
    got = llm.generate(PROMPTS[:4], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
