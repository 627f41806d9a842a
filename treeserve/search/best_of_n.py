"""Best-of-N (vanilla and weighted) and majority voting: N whole solutions from one request."""

from __future__ import annotations

from treeserve.search.certainty import vote_certainty
from treeserve.search.context import SearchContext
from treeserve.search.trace import FINISHED, TOO_LONG
from treeserve.search.types import Beam, Problem


async def _completions(ctx: SearchContext, problem: Problem, n: int, round_: int, first: int) -> list[Beam]:
    root = Beam(path=() if round_ == 0 else (round_,))
    children = await ctx.expand(problem, root, n=n, to_eos=True)
    for i, child in enumerate(children):
        child.path = (first + i,)
        split = child.steps[-1].split("\n\n") if child.steps else []
        child.steps = [s for s in split if s.strip()]
    return children


async def _sample(ctx: SearchContext, problem: Problem, scored: bool) -> list[Beam]:
    beams: list[Beam] = []
    c = ctx.config
    for round_, width in enumerate(c.widths()):
        fresh = await _completions(ctx, problem, width - len(beams), round_, len(beams))
        if scored:
            for beam in fresh:
                await ctx.score_beam(problem, beam)
        beams += fresh
        if not c.adaptive:
            break
        certainty = vote_certainty(ctx.answers(problem, [b for b in beams if not b.dropped]))
        if ctx.budget.decide(problem, round_, width, certainty, exhausted=width == c.n, grows=True):
            break
    ctx.traces.report(problem, 0, beams, [TOO_LONG if b.dropped else FINISHED for b in beams])
    return ctx.check_left(problem, [b for b in beams if not b.dropped])


async def best_of_n(ctx: SearchContext, problem: Problem) -> list[Beam]:
    return await ctx.verify(problem, await _sample(ctx, problem, scored=True))


async def majority(ctx: SearchContext, problem: Problem) -> list[Beam]:
    return await ctx.verify(problem, await _sample(ctx, problem, scored=False))
