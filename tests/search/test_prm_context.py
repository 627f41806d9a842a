"""A beam whose PRM input outgrows the PRM's context: dropped, counted and traced, never scored
0; a search left with nothing raises the PRM's error (a 400 on /v1/search), and a run of
many problems goes on without it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import API_KEY, start_server
from treeserve.config import DeviceConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import Runtime
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import PRMInputTooLong, load_prm
from treeserve.search.run import STRATEGY_FUNCTIONS, search_problems
from treeserve.search.types import Beam
from treeserve.server.settings import ServerSettings

QUESTION = "Compute 3 * (25 - 7) + 40."


def run(config: SearchConfig, body, prm_limit: int | None = None):
    """`body(ctx)` over the shipped pair, the PRM's context cut to `prm_limit`; every page back after."""
    runtime = Runtime.for_search(DEFAULT_GENERATOR, DEFAULT_PRM, 32 << 20, device_config=DeviceConfig(dtype="float32"))
    if prm_limit is not None:
        runtime.engine("prm").max_model_len = prm_limit

    async def main():
        try:
            return await body(SearchContext(config, runtime, "generator", load_prm(runtime, "prm", None)))
        finally:
            await runtime.close()

    out = asyncio.run(main())
    runtime.check_pages_idle()
    return out


def test_a_beam_too_long_for_the_prm_is_dropped_and_counted():
    async def body(ctx: SearchContext):
        problem = ctx.problem("q", QUESTION)
        short, long = Beam(path=(0,), steps=["3 * 18 = 54."]), Beam(path=(1,), steps=["54 + 40 = 94. " * 40])
        await asyncio.gather(ctx.score_beam(problem, short), ctx.score_beam(problem, long))
        return ctx, problem, short, long

    ctx, problem, short, long = run(SearchConfig(n=2, beam_width=1), body, prm_limit=96)
    assert not short.dropped and len(short.scores) == 1
    assert long.dropped and long.scores == []
    assert ctx.prm_too_long == problem.too_long == 1
    assert isinstance(problem.too_long_error, PRMInputTooLong) and problem.too_long_error.limit == 96


@pytest.mark.parametrize("strategy", ["beam_search", "best_of_n", "dvts", "rebase", "particle_filtering"])
def test_a_search_with_every_beam_too_long_raises_and_a_run_goes_on(strategy):
    config = SearchConfig(strategy=strategy, n=4, beam_width=2, num_iterations=3, max_tokens=48, seed=0, trace=True)

    async def body(ctx: SearchContext):
        with pytest.raises(PRMInputTooLong, match="at most 24"):
            await STRATEGY_FUNCTIONS[strategy](ctx, ctx.problem("a", QUESTION))
        first = ctx.prm_too_long
        return ctx, first, (await search_problems(ctx, [("b", QUESTION)]))[0]

    ctx, first, result = run(config, body, prm_limit=24)  # the PRM's prompt alone nearly fills it
    assert result.beams == [] and result.stop["reason"] == "prm_context" and result.stop["dropped"] >= 2
    assert "at most 24" in result.stop["error"]
    fates = {node[7] for node in result.trace["nodes"]}
    assert fates == {"too_long"} and first >= 2 and ctx.prm_too_long == first + result.stop["dropped"]


def test_search_over_http_is_a_400_naming_the_lengths():
    settings = ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        ModelSettings.from_flat(DEFAULT_PRM, max_model_len=24),
        served_model_name="arith",
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=32 << 20),
    )
    server = start_server(settings)
    try:
        body = {"problem": QUESTION, "strategy": "beam_search", "n": 2, "beam_width": 1, "max_tokens": 32}
        response = httpx.post(
            server.base_url + "/v1/search", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        )
        assert response.status_code == 400, response.text
        assert "at most 24" in response.text and "max_model_len" in response.text
        server.check_baseline()
    finally:
        server.stop()
