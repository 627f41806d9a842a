"""Best-of-N (vanilla and weighted) and majority voting: N full solutions, then choose.

All N completions come from one request (`n=N`), so the prompt is prefilled once and the
completions share its pages; completion i draws with the problem's root seed and index i.
Best-of-N scores every step of every completion with the PRM; majority voting needs no PRM.
Which answer wins (naive / weighted / majority) is decided by eval/metrics from these.

Adaptive (`config.adaptive`, Adaptive-Consistency's sequential sampling): completions come
in rounds, `first_width` of them first (the same ones as the first of a fixed run: the root
seed, indices 0..), then more (seeded by the round) up to twice as many in all, at most n,
until the answers' certainty (`certainty.vote_certainty`) reaches `config.certainty`.

A completion whose PRM input outgrew the PRM's context is dropped (fate "too_long", not
returned). With an outcome reward model as the PRM (style orm) and agg "last", each
completion's score is the ORM's on the whole of it; with a verifier
(`SearchContext.verify`) the completions returned are re-scored by it (majority's too: its vote
is unchanged, and the naive and weighted rules pick by the verifier).
"""

from __future__ import annotations

from treeserve.search.certainty import vote_certainty
from treeserve.search.context import SearchContext
from treeserve.search.trace import FINISHED, TOO_LONG
from treeserve.search.types import Beam, Problem


async def _completions(ctx: SearchContext, problem: Problem, n: int, round_: int, first: int) -> list[Beam]:
    """`n` whole solutions from one request (round 0: the root seed; round r: seeded by r), as
    beams numbered from `first`, their text cut into steps."""
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
