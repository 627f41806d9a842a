"""Diverse verifier tree search (DVTS): n / beam_width independent subtrees, greedy by PRM.

Each subtree holds one beam; every iteration it samples beam_width candidate next steps
(one request, n=beam_width), the PRM scores them, and the best one is kept. A subtree
stops when its chosen step ends the solution. As in search-and-learn, the result holds
all beam_width candidates of each subtree's last expansion, so n completions come back.
With `lookahead` K, candidates are compared by the PRM's score at the end of a greedy
rollout of K more steps (as in search-and-learn); the kept candidate keeps only its step.

Adaptive (`config.adaptive`): subtrees run in waves, `first_width / beam_width` of them
first, then more, up to twice as many in all (at most n / beam_width), until the
certainty of their candidates (`certainty.reward_certainty`) reaches `config.certainty`.
Subtree i is the same whichever wave runs it (its seeds follow its index).
"""

from __future__ import annotations

from treeserve.search.certainty import reward_certainty
from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import FINISHED, KEPT, PRUNED
from treeserve.search.types import Beam, Problem


async def _subtree(ctx: SearchContext, problem: Problem, index: int) -> list[Beam]:
    c = ctx.config
    beam = Beam(path=(index,))
    candidates: list[Beam] = []
    for iteration in range(c.num_iterations):
        last = iteration == c.num_iterations - 1
        candidates = await ctx.expand(problem, beam, n=c.beam_width, to_eos=last and c.final_to_eos)
        await gather_or_cancel(*(ctx.score_beam(problem, b, lookahead=not last) for b in candidates))
        best = max(range(len(candidates)), key=lambda i: (candidates[i].value(c.agg), -i))
        beam = candidates[best]
        ends = beam.completed or last  # the result is this expansion's candidates
        fates = [FINISHED if ends else KEPT if i == best else PRUNED for i in range(len(candidates))]
        ctx.report(problem, iteration, candidates, fates)
        if beam.completed:
            break
    return candidates


async def dvts(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    subtrees: list[list[Beam]] = []
    for wave, width in enumerate(c.widths()):  # one wave of all n / beam_width subtrees unless adaptive
        count = width // c.beam_width
        subtrees += await gather_or_cancel(*(_subtree(ctx, problem, i) for i in range(len(subtrees), count)))
        if not c.adaptive:
            break
        pool = [b for tree in subtrees for b in tree]
        certainty = reward_certainty(ctx.answers(problem, pool), [b.value(c.agg) for b in pool])
        if ctx.decide(problem, wave, width, certainty, exhausted=width == c.n, grows=True):
            break
    return [b for tree in subtrees for b in tree]
