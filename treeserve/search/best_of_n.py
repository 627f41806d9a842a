"""Best-of-N (vanilla and weighted) and majority voting: N full solutions, then choose.

All N completions come from one request (`n=N`), so the prompt is prefilled once and the
completions share its pages; completion i draws with the problem's root seed and index i.
Best-of-N scores every step of every completion with the PRM; majority voting needs no PRM.
Which answer wins (naive / weighted / majority) is decided by eval/metrics from these.
"""

from __future__ import annotations

from treeserve.search.context import SearchContext
from treeserve.search.trace import FINISHED
from treeserve.search.types import Beam, Problem


async def sample_n(ctx: SearchContext, problem: Problem) -> list[Beam]:
    root = Beam(path=())
    children = await ctx.expand(problem, root, n=ctx.config.n, to_eos=True)
    for i, child in enumerate(children):
        child.path = (i,)
        split = child.steps[-1].split("\n\n") if child.steps else []
        child.steps = [s for s in split if s.strip()]
    return children


async def best_of_n(ctx: SearchContext, problem: Problem) -> list[Beam]:
    beams = await sample_n(ctx, problem)
    for beam in beams:
        await ctx.score_beam(problem, beam)
    ctx.report(problem, 0, beams, [FINISHED] * len(beams))
    return beams


async def majority(ctx: SearchContext, problem: Problem) -> list[Beam]:
    beams = await sample_n(ctx, problem)
    ctx.report(problem, 0, beams, [FINISHED] * len(beams))
    return beams
