"""Particle filtering over reasoning steps (Puri et al. 2025; its_hub's `ParticleFiltering`).
Log weight logit(value) / T; resampling by softmax(log weights), seeded by (seed, problem,
iteration), only once ESS <= `resample_threshold` * n. Ended particles stay in the pool."""

from __future__ import annotations

import math
import random

from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.seeds import resample_seed
from treeserve.search.trace import FINISHED, KEPT, PRUNED, TOO_LONG
from treeserve.search.types import Beam, Problem

CLIP = 1e-7  # its_hub's: scores clipped to [CLIP, 1 - CLIP] before their log-odds


def log_weight(value: float, temperature: float) -> float:
    p = min(max(value, CLIP), 1.0 - CLIP)
    return math.log(p / (1.0 - p)) / temperature


def probabilities(log_weights: list[float]) -> list[float]:
    top = max(log_weights)
    weights = [math.exp(w - top) for w in log_weights]
    total = sum(weights)
    return [w / total for w in weights]


def effective_sample_size(probs: list[float]) -> float:
    return 1.0 / sum(p * p for p in probs)


def resample(probs: list[float], seed: int, problem_id: str, iteration: int) -> list[int]:
    rng = random.Random(resample_seed(seed, problem_id, iteration))
    return sorted(rng.choices(range(len(probs)), weights=probs, k=len(probs)))


async def particle_filtering(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    temperature = c.softmax_temperature()
    particles = [Beam(path=(j,)) for j in range(c.n)]
    for iteration in range(c.num_iterations):
        last = iteration == c.num_iterations - 1
        moving = [i for i, p in enumerate(particles) if not (p.completed or p.dropped)]
        grown = await gather_or_cancel(
            *(ctx.expand(problem, particles[i], to_eos=last and c.final_to_eos) for i in moving)
        )
        for i, children in zip(moving, grown, strict=True):
            particles[i] = children[0]
        stepped = [particles[i] for i in moving]
        await gather_or_cancel(*(ctx.score_beam(problem, p) for p in stepped))
        if all(p.dropped for p in particles):
            ctx.traces.report(problem, iteration, stepped, [TOO_LONG] * len(stepped))
            break
        ends = last or all(p.completed or p.dropped for p in particles)
        weights = [-math.inf if p.dropped else log_weight(p.value(c.agg), temperature) for p in particles]
        probs = probabilities(weights)
        if ends or effective_sample_size(probs) > c.resample_threshold * c.n:
            fates = [TOO_LONG if p.dropped else FINISHED if p.completed or ends else KEPT for p in stepped]
            ctx.traces.report(problem, iteration, stepped, fates)
            if ends:
                break
            continue
        ancestors = resample(probs, c.seed, problem.uid, iteration)
        drawn = set(ancestors)
        fates = [
            TOO_LONG if p.dropped else FINISHED if p.completed else KEPT if i in drawn else PRUNED
            for i, p in zip(moving, stepped, strict=True)
        ]
        ctx.traces.report(problem, iteration, stepped, fates)
        copies: dict[int, int] = {}
        resampled = []
        for a in ancestors:
            resampled.append(particles[a].child(copies.get(a, 0)))
            copies[a] = copies.get(a, 0) + 1
        particles = resampled
    kept = [p for p in particles if not p.dropped]
    return await ctx.verify(problem, ctx.check_left(problem, kept))
