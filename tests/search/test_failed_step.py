"""A failed engine step ends the whole search at once: the search raises `StepFailed`, and
the beams that were not in the failed batch (waiting for a slot here) are aborted before the
error reaches the caller, not left decoding for nobody."""

from __future__ import annotations

import asyncio

import pytest

from treeserve import StepFailed
from treeserve.config import DeviceConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.runtime import Runtime
from treeserve.search.beam_search import beam_search
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm


def test_a_failed_step_cancels_the_rest_of_the_search():
    runtime = Runtime.for_search(
        DEFAULT_GENERATOR,
        DEFAULT_PRM,
        32 << 20,
        device_config=DeviceConfig(dtype="float32"),
        engine_args={"generator": {"max_num_seqs": 2}},
    )
    ctx = SearchContext(SearchConfig(n=4, beam_width=2, seed=0), runtime, "generator", load_prm(runtime, "prm", None))
    generator = runtime.engine("generator")

    async def go() -> None:
        problem = ctx.problem("q", "Compute (12 + 7) * 3.")
        search = asyncio.ensure_future(beam_search(ctx, problem))
        while len(generator.requests) < 4:  # two beams in the running batch, two waiting for a slot
            await asyncio.sleep(0)
        generator.inject_failure()
        with pytest.raises(StepFailed):
            await search
        assert not any(e.has_unfinished_requests() for e in runtime.engines.values())
        await runtime.close()

    asyncio.run(go())
    runtime.check_pages_idle()
