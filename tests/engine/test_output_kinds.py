"""A stream's outputs as `output_kind` says: the whole so far, what is new, or the end only.

DELTA outputs put together give exactly the cumulative stream's last output (text, tokens,
logprobs, finish), whatever the stop strings, `n`, overlapped steps or speculation; text once given is never
taken back (the characters a stop string may still cut wait); the prompt's logprobs come once.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from treeserve import RequestOutputKind, SamplingParams
from treeserve.config import DeviceConfig
from treeserve.outputs import CompletionOutput, RequestOutput, merged
from treeserve.runtime.runtime import ModelSpec, Runtime

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers 0 1 2 3"]
BASE = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=2)


def stream(engine, params: SamplingParams) -> dict[str, list[RequestOutput]]:  # noqa: ANN001 - an LLMEngine
    """Every output of every prompt's stream, stepping the engine by hand."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params, stream=True)
    outputs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def gathered(deltas: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """The completions the deltas give together, checking on the way that no text given is
    later taken back (each prefix is a prefix of the end's text)."""
    whole = merged(*deltas)
    for n in range(1, len(deltas) + 1):
        for c in merged(*deltas[:n]).outputs:
            assert whole.outputs[c.index].text.startswith(c.text)
    return {c.index: c for c in whole.outputs}


def same(a: CompletionOutput, b: CompletionOutput) -> None:
    assert (a.text, a.token_ids) == (b.text, b.token_ids)
    assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
    assert a.logprobs == b.logprobs and a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
    assert a.stop_offsets == b.stop_offsets


ENGINES = {
    "plain": {},
    "overlapped": {"async_scheduling": True},
    "speculative": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},  # several tokens a step
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("n", [1, 2])
def test_deltas_give_the_cumulative_stream(llama_dir, make_llm, engine, n):
    llm = make_llm(llama_dir, **ENGINES[engine])
    # greedy, drafts are accepted here: steps that add several tokens
    base = replace(BASE, temperature=0.0, max_tokens=40) if engine == "speculative" else BASE
    # a stop string from the middle of a completion's text, so that it spans tokens and cuts
    text = llm.generate(PROMPTS[0], replace(base, n=1))[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    sizes = set()
    for params in (
        replace(base, n=n),
        replace(base, n=n, stop=[stop]),
        replace(base, n=n, stop=[stop], include_stop_str_in_output=True),
    ):
        whole = stream(llm.engine, params)
        deltas = stream(llm.engine, replace(params, output_kind=RequestOutputKind.DELTA))
        for request_id, outputs in whole.items():
            got = gathered(deltas[request_id])
            assert sorted(got) == list(range(n))
            for c in outputs[-1].outputs:
                same(got[c.index], c)
            assert [o.finished for o in deltas[request_id]] == [False] * (len(deltas[request_id]) - 1) + [True]
            assert all(c.token_ids or c.text or c.finished() for o in deltas[request_id] for c in o.outputs)
            sizes |= {len(c.token_ids) for o in deltas[request_id] for c in o.outputs}
    assert any(c.stop_reason == stop for o in whole.values() for c in o[-1].outputs)  # the stop string cut one
    assert (max(sizes) > 1) == (engine == "speculative")


def test_held_back_text_waits_for_the_stop_string(llama_dir, make_llm):
    """With a stop string of k characters, the text given before the end leaves out the last
    k - 1 characters the engine had at that token, and the end gives the rest."""
    llm = make_llm(llama_dir)
    stop = "\x00never"  # never occurs: every delta but the last holds back len(stop) - 1 characters
    params = replace(BASE, max_tokens=12, stop=[stop], logprobs=None)
    text_at = {len(o.outputs[0].token_ids): o.outputs[0].text for o in stream(llm.engine, params)["r0"]}
    deltas = stream(llm.engine, replace(params, output_kind=RequestOutputKind.DELTA))["r0"]
    given, tokens = "", 0
    for out in deltas:
        given, tokens = given + out.outputs[0].text, tokens + len(out.outputs[0].token_ids)
        held = 0 if out.finished else len(stop) - 1
        assert given == text_at[tokens][: max(len(text_at[tokens]) - held, 0)]
    assert len(deltas) == 12 and given == text_at[12] and len(given) > len(stop)


def test_prompt_logprobs_come_with_the_first_delta(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    params = replace(BASE, prompt_logprobs=1)
    whole = stream(llm.engine, params)["r1"]
    deltas = stream(llm.engine, replace(params, output_kind=RequestOutputKind.DELTA))["r1"]
    assert deltas[0].prompt_logprobs == whole[-1].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in deltas[1:])
    assert merged(deltas[0], deltas[1]).prompt_logprobs == whole[-1].prompt_logprobs


def test_final_only_streams_one_output(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    whole = stream(llm.engine, BASE)
    final = stream(llm.engine, replace(BASE, output_kind=RequestOutputKind.FINAL_ONLY))
    for request_id, outputs in final.items():
        assert len(outputs) == 1 and outputs[0].finished
        same(outputs[0].outputs[0], whole[request_id][-1].outputs[0])


def test_a_consumer_that_falls_behind_gets_the_deltas_merged(llama_dir, make_llm):
    want = make_llm(llama_dir).generate(PROMPTS, BASE)
    runtime = Runtime.load([ModelSpec("gen", llama_dir)], 16 << 20, device_config=DeviceConfig(dtype="float32"))
    params = replace(BASE, output_kind=RequestOutputKind.DELTA)

    async def consume(prompt: str, pause: float) -> list[RequestOutput]:
        outputs = []
        async for out in runtime.generate_stream("gen", prompt, params):
            outputs.append(out)
            await asyncio.sleep(pause)  # the engine steps on: the next output merges several
        return outputs

    async def main() -> list[list[RequestOutput]]:
        results = await asyncio.gather(consume(PROMPTS[0], 0.0), consume(PROMPTS[1], 0.02), consume(PROMPTS[2], 0.0))
        await runtime.close()
        return results

    results = asyncio.run(main())
    steps = runtime.steps["gen"]
    runtime.check_pages_idle()
    assert len(results[1]) < steps  # the slow one had fewer outputs than there were steps
    for outputs, expected in zip(results, want, strict=True):
        same(gathered(outputs)[0], expected.outputs[0])


def test_bad_output_kind():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
