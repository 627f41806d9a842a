"""A finished request leaves no reference cycle behind: refcounting frees its Request, its
Sequences and their rows as the engine lets go, so the cyclic collector has nothing of the
engine's to find (its passes were ~1% of the README job's wall before: docs/decisions.md)."""

from __future__ import annotations

import gc

import pytest

from treeserve import SamplingParams, ScoreParams
from treeserve.engine.request import Request, Sequence
from treeserve.engine.step_plan import SampleRow

ENGINE_TYPES = (Request, Sequence, SampleRow)


def _cyclic_garbage() -> list[str]:
    """Type names of the engine objects only the cyclic collector would free now."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage if isinstance(o, ENGINE_TYPES)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finished_requests_leave_no_cycles(make_llm, llama_dir, async_scheduling):
    llm = make_llm(llama_dir, async_scheduling=async_scheduling)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # what the run leaves is counted below, not collected on the way
    try:
        params = [
            SamplingParams(max_tokens=6, ignore_eos=True, seed=1),
            SamplingParams(max_tokens=5, n=3, temperature=0.8, seed=2, logprobs=1),
            SamplingParams(max_tokens=4, ignore_eos=True, seed=3, stop=["zzz"]),
        ]
        outs = llm.generate(["one two three", "four five", "six"], params)
        assert [len(o.outputs) for o in outs] == [1, 3, 1]
        scored = llm.score([[5, 6, 7, 8, 9]], ScoreParams(positions=[2, 4], token_ids=[7, 9]))
        assert scored[0].logprobs.shape[0] == 2
        assert _cyclic_garbage() == []
    finally:
        if enabled:
            gc.enable()
