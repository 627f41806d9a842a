"""The runtime: two engines behind one async API, bad input, cancellation, speculation."""

from __future__ import annotations

import asyncio
import gc

import pytest

from treeserve import SamplingParams, ScoreParams
from treeserve.config import DeviceConfig
from treeserve.runtime.runtime import SERVING_GC_THRESHOLD, ModelSpec, Runtime, thaw_heap


@pytest.fixture(params=[None, 0.5], ids=["shared-arena", "static-split"])
def runtime(request, llama_dir, qwen2_dir):
    share = request.param
    specs = [ModelSpec("gen", llama_dir, share), ModelSpec("prm", qwen2_dir, share)]
    rt = Runtime.load(specs, 16 << 20, device_config=DeviceConfig(dtype="float32"))
    yield rt
    rt.check_pages_idle()


def test_concurrent_generate_and_score(runtime, make_llm, llama_dir):
    async def main():
        async def one(i):
            out = await runtime.generate("gen", f"prompt {i}", SamplingParams(max_tokens=6, seed=i, ignore_eos=True))
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            scored = await runtime.score("prm", ids, ScoreParams(positions=[len(ids) - 1], token_ids=[3, 4]))
            return out.outputs[0].token_ids, scored.logprobs.shape

        results = await asyncio.gather(*(one(i) for i in range(12)))
        await runtime.close()
        return results

    results = asyncio.run(main())
    assert all(shape == (1, 2) for _, shape in results)
    assert runtime.steps["gen"] >= 6 and runtime.steps["prm"] >= 1
    # same tokens as the offline API with the same seeds (batch invariance across the runtime)
    alone = make_llm(llama_dir).generate("prompt 3", SamplingParams(max_tokens=6, seed=3, ignore_eos=True))
    assert results[3][0] == alone[0].outputs[0].token_ids


def test_bad_input_raises_in_caller(runtime):
    async def main():
        with pytest.raises(ValueError, match="unknown model"):
            await runtime.generate("nope", "x", SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await runtime.generate("gen", "", SamplingParams())
        ok = await runtime.generate("gen", "fine", SamplingParams(max_tokens=2))
        await runtime.close()
        return ok

    assert asyncio.run(main()).finished


def test_cancel_and_speculation_release_pages(runtime):
    async def main():
        task = asyncio.ensure_future(
            runtime.generate("gen", "long one", SamplingParams(max_tokens=200, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        params = SamplingParams(max_tokens=100, ignore_eos=True, stop=["e"], n_stop_occurrences=50)
        ahead = await runtime.generate_ahead("gen", "speculate", params)
        first = await asyncio.wait_for(ahead.first, 30)
        ahead.cancel()
        await runtime.close()
        return first

    first = asyncio.run(main())
    assert first.outputs[0].stop_offsets or first.finished


def test_a_loaded_runtime_keeps_the_collector_out_of_its_steps(llama_dir):
    """Loading freezes the heap and makes young collections rare (`freeze_heap`); closing undoes both."""
    thaw_heap()  # what an earlier test's runtime, never closed, left
    before = gc.get_threshold()[0]
    rt = Runtime.load([ModelSpec("gen", llama_dir)], 16 << 20, device_config=DeviceConfig(dtype="float32"))
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == max(before, SERVING_GC_THRESHOLD)
    asyncio.run(rt.close())
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold()[0] == before
