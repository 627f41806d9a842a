"""Diverse verifier tree search (DVTS): n / beam_width independent subtrees, greedy by PRM.
Adaptive, subtrees run in waves, one vote a subtree; subtree i is the same in any wave."""

from __future__ import annotations

from treeserve.search.certainty import vote_certainty
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import FINISHED, KEPT, PRUNED, TOO_LONG
from treeserve.search.types import Beam, Problem


async def _subtree(ctx: SearchContext, problem: Problem, index: int) -> list[Beam]:
    c = ctx.config
    beam = Beam(path=(index,))
    candidates: list[Beam] = []
    for iteration in range(c.num_iterations):
        last = iteration == c.num_iterations - 1
        candidates = await ctx.expand(problem, beam, n=c.beam_width, to_eos=last and c.final_to_eos)
        await gather_or_cancel(*(ctx.score_beam(problem, b, lookahead=not last) for b in candidates))
        if all(b.dropped for b in candidates):  # the subtree outgrew the PRM: what it kept before
            ctx.traces.report(problem, iteration, candidates, [TOO_LONG] * len(candidates))
            return [beam] if iteration else []
        best = _best(candidates, c.agg)
        beam = candidates[best]
        ends = beam.completed or last  # the result is this expansion's candidates
        fates = [
            TOO_LONG if b.dropped else FINISHED if ends else KEPT if i == best else PRUNED
            for i, b in enumerate(candidates)
        ]
        ctx.traces.report(problem, iteration, candidates, fates)
        if beam.completed:
            break
    return [b for b in candidates if not b.dropped]


def _best(candidates: list[Beam], agg: str) -> int:
    """The candidate a subtree keeps: the highest value, the first of equals."""
    return max(range(len(candidates)), key=lambda i: (not candidates[i].dropped, candidates[i].value(agg), -i))


def waves(config: SearchConfig) -> list[int]:
    if not config.adaptive:
        return [config.n]
    return list(range(min(config.first_width, config.n), config.n, config.beam_width)) + [config.n]


async def dvts(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    subtrees: list[list[Beam]] = []
    for wave, width in enumerate(waves(c)):
        count = width // c.beam_width
        subtrees += await gather_or_cancel(*(_subtree(ctx, problem, i) for i in range(len(subtrees), count)))
        if not c.adaptive:
            break
        kept = [tree[_best(tree, c.agg)] for tree in subtrees if tree]  # one vote a subtree
        certainty = vote_certainty(ctx.answers(problem, kept))
        if ctx.budget.decide(problem, wave, width, certainty, exhausted=width == c.n, grows=True):
            break
    beams = ctx.check_left(problem, [b for tree in subtrees for b in tree])
    return await ctx.verify(problem, beams)
