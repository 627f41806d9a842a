"""Monte Carlo tree search over reasoning steps: UCT with the PRM as the value (rStar, ReST-MCTS*).
Walks run in rounds of beam_width, each adding a virtual visit to its path, so a search does
not depend on what else is in flight. Widening is progressive: floor(sqrt(visits)) children."""

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
    total: float = 0.0
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
    return min(width, max(1, math.isqrt(node.visits)))


def select(root: Node, width: int, exploration: float) -> Node | None:
    """Where the next walk ends: a node with room for a child, or a solution; None: the tree is spent."""
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
        walks: list[tuple[Node, int]] = []  # (where a walk ended, the copy index it samples)
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
    if node.ended:
        return None
    seeded = node.beam.child(copy)  # its lineage seed: copy 0 continues the node's stream
    (child,) = await ctx.expand(problem, seeded)
    child.path = seeded.path
    await ctx.score_beam(problem, child, lookahead=bool(ctx.config.lookahead))
    return child
