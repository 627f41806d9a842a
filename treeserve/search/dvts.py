"""Diverse verifier tree search (DVTS): n / beam_width independent subtrees, greedy by PRM.

Each subtree holds one beam; every iteration it samples beam_width candidate next steps
(one request, n=beam_width), the PRM scores them, and the best one is kept. A subtree
stops when its chosen step ends the solution. As in search-and-learn, the result holds
all beam_width candidates of each subtree's last expansion, so n completions come back.
With `lookahead` K, candidates are compared by the PRM's score at the end of a greedy
rollout of K more steps (as in search-and-learn); the kept candidate keeps only its step.

Adaptive (`config.adaptive`, Adaptive-Consistency's sequential rule over subtrees): subtrees
run in waves, `first_width / beam_width` of them first, then one more a wave (at most
n / beam_width), until the certainty of their answers reaches `config.certainty`. Each subtree
casts one vote, the answer of the candidate it kept last (`certainty.vote_certainty`): the
beam_width candidates of one expansion are siblings of one parent and mostly repeat its
answer, so counting them as votes settled most problems on a single subtree. Subtree i is
the same whichever wave runs it (its seeds follow its index).

A candidate whose PRM input outgrew the PRM's context is dropped (fate "too_long"); a
subtree whose candidates are all dropped ends, its result the candidate it kept before
(none on its first expansion). With a verifier (`SearchContext.verify`) the completions
returned are re-scored by it.
"""

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
    """The widths (subtrees x beam_width) after each wave: all n at once, or adaptive, first_width
    and then one subtree more a wave."""
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
