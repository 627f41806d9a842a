"""Overlapped steps lose nothing and leak no page when something goes wrong while a step is in flight.

With `async_scheduling`, `step()` launches step t+1 before it reads step t back, so an abort, a
client that goes away or a failing step meets a step whose work is still running. Each case here
makes sure that such a step really is in flight at that moment, then checks that the other
requests get exactly the outputs of a run where nothing happened, and that every page is free or
held by the prefix cache afterwards. (The engine-core process killed mid-load is
tests/server/test_engine_process.py::test_kill_9_mid_load, whose core steps overlapped.)
"""

from __future__ import annotations

import asyncio

import pytest

from treeserve import SamplingParams, StepFailed
from treeserve.config import DeviceConfig
from treeserve.runtime.runtime import ModelSpec, Runtime

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers 0 1 2 3", "A B C D"]
PARAMS = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def in_flight(engine) -> set[str]:  # noqa: ANN001 - an LLMEngine
    """Requests of the step in flight (launched, not yet read back)."""
    flight = engine._in_flight
    return set() if flight is None else {item.seq.request.request_id for item in flight.step.batch}


def test_abort_while_its_step_is_in_flight(llama_dir, make_llm):
    llm = make_llm(llama_dir, async_scheduling=True)
    want = tokens(llm.generate(PROMPTS[1:], PARAMS))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    for _ in range(4):
        engine.step()
    assert "r0" in in_flight(engine)  # its next token is being computed
    engine.abort("r0")
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(done) == ["r1", "r2", "r3"]
    assert tokens([done[f"r{i}"] for i in (1, 2, 3)]) == want
    engine.check_pages_idle()


def test_a_failing_step_fails_its_requests_and_undoes_the_step_after_it(llama_dir, make_llm, monkeypatch):
    """r0 and r1 are decoding in the failing step; r2 and r3 arrive after it was launched and are
    prefilled in its successor, which was launched before the failure was read back. The successor
    read the failing step's samples, so it is undone: r2 and r3 prefill again and finish with a
    clean run's tokens."""
    llm = make_llm(llama_dir, async_scheduling=True)
    want = tokens(llm.generate(PROMPTS[2:], PARAMS))
    engine = llm.engine
    undone: list[set[str]] = []
    roll_back = engine.postprocessor.roll_back

    def recording(step) -> None:  # noqa: ANN001 - a PreparedStep
        undone.append({item.seq.request.request_id for item in step.batch if not item.seq.is_finished})
        roll_back(step)

    monkeypatch.setattr(engine.postprocessor, "roll_back", recording)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, PARAMS)
    engine.step()
    engine.step()  # r0, r1 decoding
    engine.inject_failure()
    engine.step()  # launches the failing step
    assert in_flight(engine) == {"r0", "r1"}
    for i, prompt in enumerate(PROMPTS[2:], 2):
        engine.add_request(f"r{i}", prompt, PARAMS)
    with pytest.raises(StepFailed) as failure:
        engine.step()  # launches the successor (r2, r3 prefill), then reads the failing step back
    assert sorted(failure.value.request_ids) == ["r0", "r1"]
    assert undone == [{"r2", "r3"}] and engine._in_flight is None  # the successor was undone, not left running
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(done) == ["r2", "r3"]
    assert tokens([done["r2"], done["r3"]]) == want
    engine.check_pages_idle()


def test_a_stream_closed_while_its_step_is_in_flight(llama_dir):
    """A client that goes away (the server closes its stream) mid-generation: its request is
    aborted with a step of it in flight; another stream and a request admitted later finish with
    a clean run's tokens."""

    def load() -> Runtime:
        return Runtime.load(
            [ModelSpec("g", llama_dir, engine_args={"async_scheduling": True})],
            kv_cache_memory=8 << 20,
            device_config=DeviceConfig(dtype="float32"),
        )

    runtime, clean = load(), load()

    async def scenario() -> tuple[list, list, set]:
        engine = runtime.engine("g")
        gone = runtime.generate_stream("g", PROMPTS[0], PARAMS)
        other = asyncio.ensure_future(runtime.generate("g", PROMPTS[1], PARAMS))
        for _ in range(3):
            out = await gone.__anext__()
        flight = in_flight(engine)
        await gone.aclose()  # the client went away (the runtime's first request: id "0")
        later = await runtime.generate("g", PROMPTS[2], PARAMS)
        results = [await other, later]
        reference = [await clean.generate("g", p, PARAMS) for p in PROMPTS[1:3]]
        await runtime.close()
        await clean.close()
        assert len(out.outputs[0].token_ids) < PARAMS.max_tokens
        return results, reference, flight

    results, reference, flight = asyncio.run(scenario())
    assert "0" in flight  # a step of it was in flight when the stream closed
    assert tokens(results) == tokens(reference)
    runtime.check_pages_idle()
