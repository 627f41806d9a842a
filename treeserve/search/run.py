"""Run a strategy over many problems at once: each is an asyncio task, up to
`max_concurrent_problems` in flight, so the engines' batches stay full with no batcher of their own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from treeserve.search.beam_search import beam_search
from treeserve.search.best_of_n import best_of_n, majority
from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.dvts import dvts
from treeserve.search.mcts import mcts
from treeserve.search.particle_filtering import particle_filtering
from treeserve.search.prm.base import PRMInputTooLong
from treeserve.search.rebase import rebase
from treeserve.search.types import Beam

STRATEGY_FUNCTIONS = {
    "best_of_n": best_of_n,
    "weighted_best_of_n": best_of_n,
    "majority": majority,
    "beam_search": beam_search,
    "dvts": dvts,
    "rebase": rebase,
    "particle_filtering": particle_filtering,
    "mcts": mcts,
}


@dataclass
class ProblemResult:
    uid: str
    beams: list[Beam]
    seconds: float
    trace: dict | None = None  # search/trace.py's JSON, when the config traces
    spent: dict | None = None  # tokens the search sampled and fed the PRM for this problem
    stop: dict | None = None  # `Problem.stop`

    @property
    def generated_tokens(self) -> int:
        return sum(b.generated_tokens for b in self.beams)


async def search_problems(
    ctx: SearchContext,
    problems: list[tuple[str, str]],
    on_done: Callable[[ProblemResult], None] | None = None,
    stop: asyncio.Event | None = None,
) -> list[ProblemResult | None]:
    """Results of (unique id, question) pairs, in order; once `stop` is set no problem starts (None)."""
    strategy = STRATEGY_FUNCTIONS[ctx.config.strategy]
    ctx.budget.expect(len(problems))
    gate = asyncio.Semaphore(ctx.config.max_concurrent_problems)

    async def one(uid: str, question: str) -> ProblemResult | None:
        async with gate:
            if stop is not None and stop.is_set():
                return None
            start = time.perf_counter()
            problem = ctx.problem(uid, question)
            try:
                beams = await strategy(ctx, problem)
            except PRMInputTooLong as e:
                beams = []
                problem.stop = (problem.stop or {}) | {
                    "reason": "prm_context",
                    "dropped": problem.too_long,
                    "error": str(e),
                }
            finally:
                ctx.forget(problem)
            seconds = time.perf_counter() - start
            trace = ctx.traces.take(problem, beams, seconds)
            result = ProblemResult(uid, beams, seconds, trace, problem.spent, problem.stop)
            if on_done is not None:
                on_done(result)
            return result

    return list(await gather_or_cancel(*(one(uid, q) for uid, q in problems)))
