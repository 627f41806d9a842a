"""PRM-guided beam search over reasoning steps (search-and-learn semantics and names).

Each iteration every active beam samples one more step (up to "\n\n"); the PRM scores it;
the best n / beam_width unfinished beams survive and are copied back up to n beams. Beams
that end (EOS, length, empty step) are set aside. At `num_iterations` the thesis returns
what the beam holds; `final_to_eos` instead samples the last iteration to EOS, as
search-and-learn does. With `fixed_steps` (random-weight benchmarks) every step is
`max_tokens` long and beams end only at `num_iterations`. With `lookahead` K, beams are
ranked by the PRM's score at the end of a greedy rollout of K more steps (not on the last
iteration, whose beams are not ranked); the beam keeps only its sampled step.

Adaptive (`config.adaptive`): the first iteration runs `first_width` beams; after each
iteration the problem's certainty (`certainty.reward_certainty` over the beams finished and
alive) is recorded in `problem.stop`, and the search stops there once it reaches
`config.certainty`, returning the beams finished and alive; else it keeps the survivors of
twice the width (at most n), width / beam_width of them, and copies them up to it (keeping the
current width's would leave one survivor copied 8 times on the way from 4 to 8). With a budget
(`SearchContext.next_width`) a problem may also narrow again. Off, the search is exactly the
fixed-width one.

A beam whose PRM input outgrew the PRM's context is dropped (fate "too_long"); with a
verifier (`SearchContext.verify`) the beams returned are re-scored and re-ranked by it.
"""

from __future__ import annotations

from treeserve.search.certainty import reward_certainty
from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import DUPLICATE, FINISHED, KEPT, PRUNED, TOO_LONG
from treeserve.search.types import Beam, Problem, aggregate


async def beam_search(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    widths = c.widths()  # [n]; adaptive: first_width, doubled up to n while unsettled
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
        if c.adaptive:  # Dynasor's reward certainty over the beams finished and alive
            pool = finished + [beams[i] for i in alive]
            certainty = reward_certainty(ctx.answers(problem, pool), [b.value(c.agg) for b in pool])
            ended = ctx.budget.decide(problem, iteration, width, certainty, exhausted=not alive or last, grows=False)
            last = last or bool(ended)  # settled (or out of budget): the beams alive are returned as they stand
        if not alive or last:
            finished += [beams[i] for i in alive]
            ctx.traces.report(problem, iteration, beams, fates)
            break
        # adaptive: wider while unsettled (with a budget: narrower once past the problem's share)
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
