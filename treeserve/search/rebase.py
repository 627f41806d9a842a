"""REBASE, reward-balanced search (Wu et al. 2024, "Inference Scaling Laws", section 3.2).
The budget, n less the solutions so far, is split over the live nodes by softmax(value / T_b)."""

from __future__ import annotations

import math

from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import FINISHED, KEPT, PRUNED, TOO_LONG
from treeserve.search.types import Beam, Problem


def expand_counts(values: list[float], budget: int, temperature: float) -> list[int]:
    """`budget` split by softmax(value / temperature) as REBASE's code does: by value, each node the
    ceiling of its share of what is left, so the counts sum to `budget`."""
    weights = [math.exp((v - max(values)) / temperature) for v in values]
    order = sorted(range(len(values)), key=lambda j: (-values[j], j))
    counts = [0] * len(values)
    left, mass = budget, sum(weights)
    for j in order:
        take = min(left, math.ceil(left * weights[j] / mass)) if mass > 0 else 0
        counts[j] = take
        left -= take
        mass -= weights[j]
    return counts


async def rebase(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    temperature = c.softmax_temperature()
    last = c.num_iterations == 1
    nodes = await ctx.expand(problem, Beam(path=()), n=c.n, to_eos=last and c.final_to_eos)
    solutions: list[Beam] = []
    for iteration in range(c.num_iterations):
        last = iteration == c.num_iterations - 1
        await gather_or_cancel(*(ctx.score_beam(problem, b) for b in nodes))
        solutions += [b for b in nodes if b.completed and not b.dropped]
        live = [b for b in nodes if not (b.completed or b.dropped)]
        budget = c.n - len(solutions)
        if last or not live or budget <= 0:
            solutions += live  # at the last iteration the live nodes stand as solutions
            ctx.traces.report(problem, iteration, nodes, [TOO_LONG if b.dropped else FINISHED for b in nodes])
            break
        counts = expand_counts([b.value(c.agg) for b in live], budget, temperature)
        given = dict(zip((id(b) for b in live), counts, strict=True))
        fates = [
            TOO_LONG if b.dropped else FINISHED if b.completed else KEPT if given[id(b)] else PRUNED for b in nodes
        ]
        ctx.traces.report(problem, iteration, nodes, fates)
        to_eos = iteration + 1 == c.num_iterations - 1 and c.final_to_eos
        grown = await gather_or_cancel(
            *(ctx.expand(problem, b, n=k, to_eos=to_eos) for b, k in zip(live, counts, strict=True) if k)
        )
        nodes = [child for children in grown for child in children]
    return await ctx.verify(problem, ctx.check_left(problem, solutions))
