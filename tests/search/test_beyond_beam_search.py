"""REBASE, particle filtering and MCTS: their rules; REBASE and particle filtering against a
plain reference written here from the papers' algorithms (one node at a time, no caches,
sequential), on the shipped arithmetic pair; their traces and their views."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import numpy as np
import pytest

from treeserve.cli import main
from treeserve.eval.merge import merge_results
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.eval.view import write_view
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.mcts import Node, room, select
from treeserve.search.particle_filtering import effective_sample_size, log_weight, probabilities, resample
from treeserve.search.prm import load_prm
from treeserve.search.rebase import expand_counts
from treeserve.search.run import search_problems
from treeserve.search.trace import nodes
from treeserve.search.types import Beam, Problem

QUESTIONS = [("a", "Compute 3 * (25 - 7) + 40."), ("b", "Compute ((12 + 7) * 3) - 15."), ("c", "Compute 81 - 9 * 4.")]


def test_expand_counts_splits_the_budget_by_softmax_of_rewards():
    # weights exp((v - 0.9) / 0.2) = 1, e^-2, e^-4: 8 * 1 / 1.1536 -> 7, then the 1 left goes to the second
    assert expand_counts([0.9, 0.5, 0.1], 8, 0.2) == [7, 1, 0]
    assert expand_counts([0.1, 0.5, 0.9], 8, 0.2) == [0, 1, 7]  # order follows value, not position
    assert expand_counts([0.5, 0.5, 0.5, 0.5], 6, 0.2) == [2, 2, 1, 1]  # equals: the first first
    assert expand_counts([0.9, 0.1], 5, 1e-3) == [5, 0]  # cold: greedy
    for values, budget in [([0.3, 0.31, 0.9, 0.0, 0.7], 13), ([0.2] * 7, 3), ([1.0], 4)]:
        assert sum(expand_counts(values, budget, 0.2)) == budget


def test_particle_weights_and_resampling():
    assert log_weight(0.5, 1.0) == 0.0
    assert log_weight(0.9, 2.0) == pytest.approx(math.log(9) / 2)
    assert log_weight(1.0, 1.0) == pytest.approx(math.log((1 - 1e-7) / 1e-7))  # clipped, finite
    probs = probabilities([0.0, math.log(3), -math.inf])
    assert probs == pytest.approx([0.25, 0.75, 0.0])
    assert effective_sample_size([0.25] * 4) == pytest.approx(4.0)
    assert effective_sample_size([1.0, 0.0]) == pytest.approx(1.0)
    draws = resample([0.1, 0.6, 0.3, 0.0], seed=0, problem_id="q", iteration=2)
    assert draws == sorted(draws) and len(draws) == 4 and 3 not in draws
    assert draws == resample([0.1, 0.6, 0.3, 0.0], seed=0, problem_id="q", iteration=2)  # seeded
    many = [tuple(resample([0.25] * 4, seed=0, problem_id="q", iteration=i)) for i in range(20)]
    assert len(set(many)) > 10  # each iteration its own draw
    counts = Counter(a for i in range(500) for a in resample([0.1, 0.6, 0.3], 1, "p", i))
    assert counts[1] / 1500 == pytest.approx(0.6, abs=0.05)  # multinomial by the probabilities


def test_mcts_walks_by_uct_and_widens_progressively():
    root = Node(Beam(path=()), visits=1)
    assert select(root, width=4, exploration=1.0) is root  # room for a first child
    assert [room(Node(Beam(path=()), visits=v), 4) for v in (1, 3, 4, 9, 16, 100)] == [1, 1, 2, 3, 4, 4]
    a, b = Node(Beam(path=(0,), steps=["x"]), parent=root), Node(Beam(path=(1,), steps=["y"]), parent=root)
    root.children = [a, b]
    a.back_up(0.9)
    b.back_up(0.2)
    root.visits = 4  # room for 2: full, so the walk goes down by UCT
    a.children = [Node(Beam(path=(0, 0)), parent=a, visits=1)]  # a and b full as well
    b.children = [Node(Beam(path=(1, 0)), parent=b, visits=1)]
    assert select(root, 4, exploration=0.0) is a.children[0]  # greedy: under the higher mean value
    for _ in range(30):
        a.back_up(0.9)
    assert select(root, 2, exploration=5.0) is b.children[0]  # exploration: under the less visited
    b.ended = True
    assert select(root, 2, exploration=5.0) is b  # a solution ends the walk
    b.beam.dropped = a.children[0].beam.dropped = True
    assert select(root, 1, exploration=0.0) is None  # nothing left to walk to (one child a node: all there)


# ---- the plain references: the algorithms as their papers write them --------------------------------------


async def plain_rebase(ctx: SearchContext, problem: Problem) -> list[Beam]:
    """Wu et al. 2024, section 3.2: N first steps; each depth, completed nodes leave the budget,
    W_j = the budget by softmax(R_j / T_b) (REBASE's ceiling-greedy split) children of node j."""
    c = ctx.config
    nodes_ = await ctx.expand(problem, Beam(path=()), n=c.n)
    solutions: list[Beam] = []
    for depth in range(c.num_iterations):
        for node in nodes_:
            node.scores = await ctx.score(problem, node.steps)
        solutions += [b for b in nodes_ if b.completed]
        live = [b for b in nodes_ if not b.completed]
        budget = c.n - len(solutions)
        if depth == c.num_iterations - 1 or not live or budget <= 0:
            return solutions + live
        rewards = np.array([b.scores[-1] for b in live])
        weights = np.exp(rewards / 0.2)
        left, mass, width = budget, weights.sum(), {}
        for j in sorted(range(len(live)), key=lambda j: (-rewards[j], j)):
            width[j] = min(left, math.ceil(left * weights[j] / mass))
            left, mass = left - width[j], mass - weights[j]
        nodes_ = []
        for j, node in enumerate(live):
            if width[j]:
                nodes_ += await ctx.expand(problem, node, n=width[j])
    return solutions


async def plain_particle_filtering(ctx: SearchContext, problem: Problem) -> list[Beam]:
    """its_hub's particle filtering: every particle one step, weight logit(PRM score), resample
    all (ended ones too) by softmax of the weights when the ESS is at most threshold * N."""
    c = ctx.config
    particles = [Beam(path=(j,)) for j in range(c.n)]
    for step in range(c.num_iterations):
        for i, particle in enumerate(particles):
            if not particle.completed:
                (child,) = await ctx.expand(problem, particle)
                child.scores = await ctx.score(problem, child.steps)
                particles[i] = child
        if step == c.num_iterations - 1 or all(p.completed for p in particles):
            return particles
        scores = np.clip([p.scores[-1] for p in particles], 1e-7, 1 - 1e-7)
        logits = np.log(scores / (1 - scores))
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if 1 / np.sum(probs**2) > c.resample_threshold * c.n:
            continue
        seen: Counter = Counter()
        resampled = []
        for a in resample(list(probs), c.seed, problem.uid, step):  # the seeded draw is the specification
            resampled.append(particles[a].child(seen[a]))
            seen[a] += 1
        particles = resampled
    return particles


PLAIN = {"rebase": plain_rebase, "particle_filtering": plain_particle_filtering}


def search(runtime, config: SearchConfig, plain: bool) -> list[list[tuple[str, list[float]]]]:
    async def main():
        ctx = SearchContext(
            config.reference() if plain else config, runtime, "generator", load_prm(runtime, "prm", None)
        )
        if plain:
            out = [await PLAIN[config.strategy](ctx, ctx.problem(uid, q)) for uid, q in QUESTIONS]
        else:
            out = [r.beams for r in await search_problems(ctx, QUESTIONS)]
        return [[(b.text, b.scores) for b in beams] for beams in out]

    return asyncio.run(main())


@pytest.mark.parametrize(
    "config",
    [
        SearchConfig(strategy="rebase", n=8, num_iterations=6, max_tokens=48, seed=3),
        SearchConfig(strategy="particle_filtering", n=8, num_iterations=6, max_tokens=48, seed=3),
        SearchConfig(
            strategy="particle_filtering", n=8, num_iterations=6, max_tokens=48, seed=4, resample_threshold=0.6
        ),
    ],
    ids=["rebase", "particles", "particles_ess"],
)
def test_search_equals_the_plain_reference(runtime, config):
    fast, plain = search(runtime, config, plain=False), search(runtime, config, plain=True)
    assert [[t for t, _ in p] for p in fast] == [[t for t, _ in p] for p in plain]
    for got, want in zip(fast, plain, strict=True):
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    assert all(len(p) == config.n for p in fast)  # every budget unit ends as a solution or a particle
    assert max(len(s) for p in plain for s, _ in p) > 0


def traced(strategy: str, **fields) -> dict:
    config = SearchConfig(strategy=strategy, n=8, num_iterations=6, max_tokens=48, trace=True, **fields)
    settings = EvalSettings(
        dataset="arith:level=4,size=3,seed=0",
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    return run_eval(settings, config)


def by_iteration(trace: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for node in nodes(trace):
        out.setdefault(node["iteration"], []).append(node)
    return out


def test_rebase_trace_and_view(tmp_path):
    doc = traced("rebase")
    for problem in doc["problems"]:
        trace, rows = problem["trace"], nodes(problem["trace"])
        iterations = by_iteration(trace)
        assert len(iterations[0]) == 8 and all(n["parent"] is None for n in iterations[0])
        finished = 0
        for it in sorted(iterations)[:-1]:
            finished += sum(n["fate"] == "finished" for n in iterations[it])
            kept = [n for n in iterations[it] if n["fate"] == "kept"]
            pruned = [n for n in iterations[it] if n["fate"] == "pruned"]
            assert not pruned or min(n["score"] for n in kept) >= max(n["score"] for n in pruned)
            children = iterations[it + 1]
            assert {n["parent"] for n in children} == {n["id"] for n in kept}
            assert len(children) == 8 - finished  # the budget: n less the solutions so far
        assert sorted(trace["completions"]) == sorted(n["id"] for n in rows if n["fate"] == "finished")
    out = tmp_path / "rebase.json"
    out.write_text(json.dumps(doc))
    write_view([str(out)], str(tmp_path / "view.html"), None)
    assert "rebase" in (tmp_path / "view.html").read_text()


def test_mcts_trace_and_view(tmp_path):
    doc = traced("mcts", beam_width=3)
    for problem in doc["problems"]:
        trace, rows = problem["trace"], nodes(problem["trace"])
        for node in rows:  # each node is one step deeper than the node it extends
            assert node["iteration"] == (0 if node["parent"] is None else rows[node["parent"]]["iteration"] + 1)
            assert node["iteration"] < 6 and node["fate"] in ("kept", "finished", "too_long")
        children = Counter(n["parent"] for n in rows)
        assert max(children.values()) <= 3  # beam_width: the most children a node has
        assert len(problem["completions"]) <= 8
        assert all(rows[i]["fate"] == "finished" for i in trace["completions"])
    out = tmp_path / "mcts.json"
    out.write_text(json.dumps(doc))
    write_view([str(out)], str(tmp_path / "view.html"), None)
    assert "mcts" in (tmp_path / "view.html").read_text()


def test_particle_trace_and_view(tmp_path):
    doc = traced("particle_filtering")
    for problem in doc["problems"]:
        trace, rows = problem["trace"], nodes(problem["trace"])
        iterations = by_iteration(trace)
        assert len(iterations[0]) == 8
        for it in sorted(iterations)[1:]:
            assert all(rows[n["parent"]]["fate"] == "kept" for n in iterations[it])  # resampled ancestors
        assert len(problem["completions"]) == 8
        assert all(rows[i]["fate"] == "finished" for i in trace["completions"])  # copies name their original
    out = tmp_path / "particles.json"
    out.write_text(json.dumps(doc))
    write_view([str(out)], str(tmp_path / "view.html"), None)
    assert "particle_filtering" in (tmp_path / "view.html").read_text()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"strategy": "rebase", "reward_temperature": 0}, "reward_temperature must be a number > 0"),
        ({"strategy": "beam_search", "reward_temperature": 0.5}, "leave it unset"),
        ({"strategy": "particle_filtering", "resample_threshold": 1.5}, r"resample_threshold must be in \(0, 1\]"),
        ({"strategy": "rebase", "resample_threshold": 0.5}, "particle filtering's"),
        ({"strategy": "rebase", "adaptive": True}, "adaptive search is"),
        ({"strategy": "particle_filtering", "decode_ahead": 1}, "decode_ahead=0"),
        ({"strategy": "rebase", "lookahead": 1}, "use it with beam_search, dvts or mcts"),
        ({"strategy": "beam_search", "exploration": 2.0}, "exploration is MCTS's"),
        ({"strategy": "mcts", "exploration": -1.0}, "exploration must be a number >= 0"),
        ({"strategy": "mcts", "adaptive": True}, "adaptive search is"),
    ],
)
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**fields)


@pytest.mark.parametrize("strategy", ["rebase", "particle_filtering", "mcts"])
def test_shards_merge_to_the_unsharded_run(tmp_path, strategy):
    """Each problem's search depends on its own seeds only, so shards (and resumed runs, which
    skip the problems a journal holds) give the whole run's records."""
    flags = [
        "eval",
        "--dataset",
        "arith:level=4,5,size=4,seed=0",
        "--strategy",
        strategy,
        "--n",
        "4",
        "--num-iterations",
        "5",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(64 << 20),
    ]
    assert main([*flags, "--output", str(tmp_path / "all.json")]) == 0
    shards = [tmp_path / f"shard{i}.json" for i in range(2)]
    for i, path in enumerate(shards):
        assert main([*flags, "--shard", f"{i}/2", "--output", str(path)]) == 0
    whole = json.loads((tmp_path / "all.json").read_text())
    assert merge_results(shards)["problems"] == whole["problems"]
