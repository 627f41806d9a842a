"""Atomic steps: a step that raises fails only the requests it was serving.

`LLMEngine.inject_failure` makes the next batch raise right after the model's forward (as a
failing kernel or an out-of-memory would). The batch's requests are aborted with their pages
released (`StepFailed` names them), every other request finishes exactly as it would have,
and the next step (and the next call) runs normally: outputs equal a run that never failed.
"""

from __future__ import annotations

import asyncio

import pytest

from treeserve import SamplingParams, StepFailed
from treeserve.config import DeviceConfig
from treeserve.runtime.runtime import ModelSpec, Runtime

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers 0 1 2 3", "A B C D"]
PARAMS = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_offline_call_fails_and_the_next_call_is_unaffected(llama_dir, make_llm):
    llm = make_llm(llama_dir)
    want = tokens(llm.generate(PROMPTS, PARAMS))
    llm.engine.inject_failure()
    with pytest.raises(StepFailed, match="injected step failure") as failure:
        llm.generate(PROMPTS, PARAMS)
    assert failure.value.request_ids  # the batch's requests, named
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_pages_idle()  # every page of the failed call is back
    assert tokens(llm.generate(PROMPTS, PARAMS)) == want


def test_only_the_failed_batch_fails(llama_dir, make_llm):
    """Two sequences run at a time: the batch that fails holds the first two requests; the
    waiting two were in no batch and finish with the tokens they get in a clean run."""
    llm = make_llm(llama_dir, max_num_seqs=2)
    want = tokens(llm.generate(PROMPTS, PARAMS))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    engine.step()  # r0 and r1 prefill
    engine.inject_failure()
    with pytest.raises(StepFailed) as failure:  # overlapped, a step is read back (and fails) one call later
        for _ in range(2 if engine.async_scheduling else 1):
            engine.step()
    assert failure.value.request_ids == ["r0", "r1"]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(done) == ["r2", "r3"]
    assert tokens([done["r2"], done["r3"]]) == want[2:]
    engine.check_pages_idle()


def test_runtime_fails_only_the_batch_waiters(llama_dir):
    """Through the runtime (what the server and the search programs use): the awaits of the
    failed batch raise StepFailed; the requests still waiting for a slot, and one admitted
    after the failure, complete with a clean run's tokens."""

    def load() -> Runtime:
        specs = [ModelSpec("g", llama_dir, engine_args={"max_num_seqs": 2})]
        return Runtime.load(specs, kv_cache_memory=8 << 20, device_config=DeviceConfig(dtype="float32"))

    runtime, clean = load(), load()

    async def scenario() -> tuple[list, list]:
        tasks = [asyncio.ensure_future(runtime.generate("g", p, PARAMS)) for p in PROMPTS[:3]]
        engine = runtime.engine("g")
        while not engine.scheduler.running:  # the first two are in a batch, the third waits
            await asyncio.sleep(0)
        engine.inject_failure()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        results.append(await runtime.generate("g", PROMPTS[3], PARAMS))
        reference = [await clean.generate("g", p, PARAMS) for p in PROMPTS[2:]]
        await runtime.close()
        await clean.close()
        return results, reference

    results, reference = asyncio.run(scenario())
    assert [type(r) for r in results[:2]] == [StepFailed, StepFailed]
    assert tokens(results[2:]) == tokens(reference)
    runtime.check_pages_idle()
