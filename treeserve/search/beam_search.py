"""PRM-guided beam search over reasoning steps (search-and-learn's semantics and names).
Adaptive, the width starts at `first_width` and doubles while unsettled (docs/adaptive.md)."""

from __future__ import annotations

from treeserve.search.certainty import reward_certainty
from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import DUPLICATE, FINISHED, KEPT, PRUNED, TOO_LONG
from treeserve.search.types import Beam, Problem, aggregate


async def beam_search(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    widths = c.widths()
    active = [Beam(path=(j,)) for j in range(widths[0])]
    finished: list[Beam] = []
    try:
        beams = ctx.check_left(problem, await _iterate(ctx, problem, active, finished, widths))
        return await ctx.verify(problem, beams)
    finally:  # decode-ahead requests of beams nobody will extend
        for beam in active + finished:
            beam.drop_decode_ahead()


async def _iterate(
    ctx: SearchContext, problem: Problem, active: list[Beam], finished: list[Beam], widths: list[int]
) -> list[Beam]:
    c = ctx.config
    width = widths[0]
    for iteration in range(c.num_iterations):
        last = iteration == c.num_iterations - 1
        grown = await gather_or_cancel(*(ctx.expand(problem, b, to_eos=last and c.final_to_eos) for b in active))
        beams = [children[0] for children in grown]
        await gather_or_cancel(*(ctx.score_beam(problem, b, lookahead=not last) for b in beams))
        finished += [b for b in beams if b.completed and not b.dropped]
        active[:] = beams
        alive = [i for i, b in enumerate(beams) if not (b.completed or b.dropped)]  # indices into beams
        fates = [TOO_LONG if b.dropped else FINISHED for b in beams]
        if c.filter_duplicates:  # the first of each text, in search-and-learn's order
            unique = list({beams[i].text: i for i in reversed(alive)}.values())[::-1]
            for i in set(alive) - set(unique):
                fates[i] = DUPLICATE
            alive = unique
        if c.adaptive:
            pool = finished + [beams[i] for i in alive]
            certainty = reward_certainty(ctx.answers(problem, pool), [b.value(c.agg) for b in pool])
            ended = ctx.budget.decide(problem, iteration, width, certainty, exhausted=not alive or last, grows=False)
            last = last or bool(ended)  # settled (or out of budget): the beams alive are returned as they stand
        if not alive or last:
            finished += [beams[i] for i in alive]
            ctx.traces.report(problem, iteration, beams, fates)
            break
        width = ctx.budget.next_width(problem, width, widths)
        keep = width // c.beam_width  # survivors for the width they are copied up to
        ranked = sorted(range(len(alive)), key=lambda k: (-beams[alive[k]].value(c.agg), k))
        survivors = [beams[alive[k]] for k in sorted(ranked[:keep])]
        for k in ranked[keep:]:
            fates[alive[k]] = PRUNED
            beams[alive[k]].drop_decode_ahead()
        for k in ranked[:keep]:
            fates[alive[k]] = KEPT
        ctx.traces.report(problem, iteration, beams, fates)
        # copy survivors back up to the width, round robin (search-and-learn's order)
        active[:] = [survivors[j % len(survivors)].child(j // len(survivors)) for j in range(width)]
    finished.sort(key=lambda b: -aggregate(b.scores, c.agg))  # stable: ties keep their order
    return finished[: c.n]
