"""The score cache and in-flight sharing of PRM requests (`SearchContext.score`).

A counting stand-in PRM replaces the model here: what is tested is which requests reach
the PRM and what each caller gets back, not the scores themselves (the equivalence tests
run the real adapters).
"""

from __future__ import annotations

import asyncio

import pytest

from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.types import Problem


class CountingPRM:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple[tuple[str, ...], int]] = []
        self.on_input = None
        self.fail = fail
        self.release = asyncio.Event()

    async def score(self, question: str, steps: list[str], start: int = 0, on_input: object = None) -> list[float]:
        self.calls.append((tuple(steps), start))
        await self.release.wait()
        if self.fail:
            raise RuntimeError("PRM failed")
        return [len(s) / 100 for s in steps[start:]]


def context(prm: CountingPRM, score_cache: bool = True) -> SearchContext:
    return SearchContext(SearchConfig(score_cache=score_cache), runtime=None, generator="g", prm=prm)  # type: ignore[arg-type]


PROBLEM = Problem("p0", "Compute 1 + 2.", [1, 2, 3])
STEPS = ["1 + 2 = 3.", "The answer is \\boxed{3}."]


async def _release_soon(prm: CountingPRM) -> None:
    await asyncio.sleep(0.01)
    prm.release.set()


def test_concurrent_identical_requests_share_one_prm_call() -> None:
    async def main():
        prm = CountingPRM()
        ctx = context(prm)
        results = await asyncio.gather(*(ctx.score(PROBLEM, STEPS) for _ in range(8)), _release_soon(prm))
        return prm, ctx, results[:8]

    prm, ctx, results = asyncio.run(main())
    assert len(prm.calls) == 1 and ctx.prm_requests == 1
    assert all(r == [0.1, 0.24] for r in results)
    assert ctx.in_flight == {}

    # now cached: a later request for a longer beam reads only its new step
    async def later():
        prm.release.set()
        return await ctx.score(PROBLEM, [*STEPS, "extra"])

    assert asyncio.run(later()) == [0.1, 0.24, 0.05]
    assert prm.calls[-1] == ((*STEPS, "extra"), 2)


def test_without_the_score_cache_every_request_reaches_the_prm() -> None:
    async def main():
        prm = CountingPRM()
        ctx = context(prm, score_cache=False)
        await asyncio.gather(*(ctx.score(PROBLEM, STEPS) for _ in range(3)), _release_soon(prm))
        return prm

    assert len(asyncio.run(main()).calls) == 3


def test_a_cancelled_owner_leaves_its_waiters_to_score_themselves() -> None:
    async def main():
        prm = CountingPRM()
        ctx = context(prm)
        owner = asyncio.ensure_future(ctx.score(PROBLEM, STEPS))
        await asyncio.sleep(0)
        waiter = asyncio.ensure_future(ctx.score(PROBLEM, STEPS))
        await asyncio.sleep(0)
        owner.cancel()
        await asyncio.sleep(0)
        prm.release.set()
        return prm, ctx, await waiter, owner

    prm, ctx, result, owner = asyncio.run(main())
    assert owner.cancelled() and result == [0.1, 0.24]
    assert len(prm.calls) == 2 and ctx.in_flight == {}


def test_a_failed_request_fails_its_waiters_too() -> None:
    async def main():
        prm = CountingPRM(fail=True)
        ctx = context(prm)
        return await asyncio.gather(
            *(ctx.score(PROBLEM, STEPS) for _ in range(3)), _release_soon(prm), return_exceptions=True
        )

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) for r in results[:3])


def test_scoring_needs_a_prm() -> None:
    ctx = SearchContext(SearchConfig(), runtime=None, generator="g", prm=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a PRM"):
        asyncio.run(ctx.score(PROBLEM, STEPS))
