"""Monte Carlo tree search over reasoning steps: UCT with the PRM as the value (rStar, ReST-MCTS*).

The tree's nodes are partial solutions; the prompt is the root. A simulation walks down from the
root, at each node taking the child of highest UCT score Q + c * sqrt(ln N(parent) / N(child))
(Q: the mean value backed up through the child, N: visits, c: `SearchConfig.exploration`), until
it reaches a node with room for another child or a finished one. A node has room for floor(sqrt(its
visits)) children, at least 1 and at most `beam_width` (progressive widening: a walk goes deep before
the tree grows wide). There it
samples one new step (child k of a node draws with the node's lineage seed and copy index k), the
PRM scores it (with `lookahead` K, after a greedy rollout of K more steps whose text is discarded:
the rollouts share the tree's pages through the prefix cache), and that value is added to every
node on the way back to the root. A finished node is a solution; a walk that ends on one backs its
value up again without sampling.

Simulations run in rounds of `beam_width`: each walk of a round adds a virtual visit (value 0) to
its path, so the next walk of the round goes elsewhere, the round's steps are sampled together,
and their values are backed up in walk order; the search is the same whatever else is in flight.
A node `num_iterations` steps deep is not extended: it is a solution as it stands (as beam search
returns its beams at its last iteration). It ends once it holds n solutions, or after
n * num_iterations simulations, or when no node is left to expand, and returns its solutions,
topped up to n with the best-valued unfinished leaves. A step whose PRM input outgrew the
PRM's context is dropped (fate "too_long"); with a verifier the solutions are re-scored by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from treeserve.search.context import SearchContext, gather_or_cancel
from treeserve.search.trace import FINISHED, KEPT, TOO_LONG
from treeserve.search.types import Beam, Problem


@dataclass
class Node:
    beam: Beam
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    pending: int = 0  # children being sampled in this round
    visits: int = 0
    total: float = 0.0  # values backed up through this node
    ended: bool = False  # a solution: finished, or as deep as the search goes (`num_iterations` steps)

    def uct(self, exploration: float) -> float:
        parent_visits = self.parent.visits if self.parent is not None else self.visits
        return self.total / self.visits + exploration * math.sqrt(math.log(max(parent_visits, 1)) / self.visits)

    def back_up(self, value: float, visits: int = 1) -> None:
        node: Node | None = self
        while node is not None:
            node.visits += visits
            node.total += value
            node = node.parent


def room(node: Node, width: int) -> int:
    """The children `node` may have by now: progressive widening, floor(sqrt(visits)), 1 to `width`."""
    return min(width, max(1, math.isqrt(node.visits)))


def select(root: Node, width: int, exploration: float) -> Node | None:
    """Where the next walk ends: a node with room for a child, or a solution; None when the whole
    tree is spent (every child of the walk's nodes dropped or still being sampled)."""
    node = root
    while True:
        if node.ended or len(node.children) + node.pending < room(node, width):
            return node
        open_children = [c for c in node.children if not c.beam.dropped and c.visits]
        if not open_children:
            return None
        node = max(open_children, key=lambda c: c.uct(exploration))


async def mcts(ctx: SearchContext, problem: Problem) -> list[Beam]:
    c = ctx.config
    root = Node(Beam(path=()), visits=1)
    solutions: list[Node] = []
    leaves: list[Node] = []
    simulations, limit = 0, c.n * c.num_iterations
    while len(solutions) < c.n and simulations < limit:
        walks: list[tuple[Node, int]] = []  # (where a walk ended, the copy index of the child it samples)
        for _ in range(min(c.beam_width, limit - simulations)):
            node = select(root, c.beam_width, c.exploration)
            if node is None:
                break
            node.back_up(0.0)  # the virtual visit: the next walk of this round goes elsewhere
            walks.append((node, len(node.children) + node.pending))
            node.pending += not node.ended
        if not walks:
            break
        simulations += len(walks)
        grown = await gather_or_cancel(*(_sample(ctx, problem, node, copy) for node, copy in walks))
        for (node, _), child in zip(walks, grown, strict=True):
            if child is None:  # a solution walked to again: its value, once more
                node.back_up(node.beam.value(c.agg), visits=0)
                continue
            node.pending -= 1
            new = Node(child, parent=node, ended=child.completed or len(child.steps) >= c.num_iterations)
            node.children.append(new)
            ctx.traces.report(
                problem,
                len(new.beam.steps) - 1,
                [new.beam],
                [TOO_LONG if new.beam.dropped else FINISHED if new.ended else KEPT],
            )
            if new.beam.dropped:
                node.back_up(0.0, visits=-1)  # the walk's virtual visit, taken back
                continue
            value = new.beam.value(c.agg)
            new.visits, new.total = 1, value
            node.back_up(value, visits=0)  # the virtual visit becomes this one
            (solutions if new.ended else leaves).append(new)
    # fewer than n solutions within the budget: the best-valued unfinished leaves stand beside them
    ends = sorted((n for n in leaves if not n.children), key=lambda n: -n.beam.value(c.agg))
    found = [n.beam for n in (solutions + ends)[: c.n]]
    return await ctx.verify(problem, ctx.check_left(problem, found))


async def _sample(ctx: SearchContext, problem: Problem, node: Node, copy: int) -> Beam | None:
    """Child `copy` of `node`, scored (None for a solution: nothing to sample)."""
    if node.ended:
        return None
    seeded = node.beam.child(copy)  # its lineage seed: copy 0 continues the node's stream
    (child,) = await ctx.expand(problem, seeded)
    child.path = seeded.path
    await ctx.score_beam(problem, child, lookahead=bool(ctx.config.lookahead))
    return child
