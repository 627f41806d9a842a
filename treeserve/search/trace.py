"""Search traces: every candidate step a search produced, its PRM scores and its fate.

Owns `SearchTrace` (one problem's) and `Traces` (a run's, per problem in flight, with its
progress callback: `ctx.traces`). Strategies `report` each scored iteration with the fate of
every candidate; nothing reads a trace back while searching, so tracing changes no beam.
Its JSON, stored as a problem record's "trace" (results, journal, `/v1/search`), holds one
row per candidate, its fields named once (a node's id is its row's index)::

    {"version": 1, "strategy": "beam_search", "n": 16, "beam_width": 4, "agg": "last",
     "fields": ["parent", "iteration", "text", "tokens", "step_scores", "score",
                "lookahead_scores", "fate", "decoded_ahead", "cache"],
     "nodes": [[null, 0, "15 + 4 = 19.", 9, [0.81], 0.81, [], "kept", false, "prm"], ...],
     "completions": [41, 42, ...],        # the node of each of the problem's completions, in order
     "seconds": 1.2,                      # the problem's search, start to end
     "generated_tokens": 812}             # every candidate's tokens, kept or pruned (rollouts aside)

    parent            the node it extends (null: a child of the prompt)
    text, tokens      its own step (best-of-N: the whole completion) and its generated tokens
    step_scores       the PRM's score of each of its steps (6 decimals; the completions keep all)
    score             what the search ranked it by (aggregated, with lookahead)
    lookahead_scores  the PRM's scores of its greedy rollout (whose text is discarded)
    fate              kept | pruned | finished | duplicate | too_long (its PRM input outgrew
                      the PRM's context: dropped, unscored)
    decoded_ahead     its step was decoded past the previous boundary (decode_ahead)
    cache             where its scores came from: prm | cache | shared | "" (no PRM)

`nodes(trace)` turns the rows into dicts with an "id".
Best-of-N and majority have no tree: one iteration of N finished nodes (a flat list).
Particle filtering's copies of a finished particle are one node, which each such completion names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from treeserve.search.config import SearchConfig
from treeserve.search.types import Beam, Problem

VERSION = 1
KEPT, PRUNED, FINISHED, DUPLICATE, TOO_LONG = "kept", "pruned", "finished", "duplicate", "too_long"
FATES = (KEPT, PRUNED, FINISHED, DUPLICATE, TOO_LONG)
FLAT_STRATEGIES = ("best_of_n", "weighted_best_of_n", "majority")
FIELDS = (
    "parent",
    "iteration",
    "text",
    "tokens",
    "step_scores",
    "score",
    "lookahead_scores",
    "fate",
    "decoded_ahead",
    "cache",
)


def _number(x: float) -> float | None:
    """Six decimals (for viewing; the results' completions keep every digit); JSON has no NaN
    or infinity: they are written as null."""
    return round(float(x), 6) if math.isfinite(x) else None


@dataclass
class SearchTrace:
    strategy: str
    n: int
    beam_width: int
    agg: str
    rows: list[list] = field(default_factory=list)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # beam lineage path -> its node

    def add(self, iteration: int, beams: Sequence[Beam], fates: Sequence[str]) -> None:
        """One scored iteration: `beams[i]` ended it with fate `fates[i]`."""
        flat = self.strategy in FLAT_STRATEGIES
        first = len(self.rows)
        for beam, fate in zip(beams, fates, strict=True):
            assert fate in FATES, fate
            grew = len(beam.steps) > iteration  # false when the context was full: no step was added
            if flat:
                text, tokens, scores = beam.text, beam.generated_tokens, beam.scores
            elif grew:
                text, tokens, scores = beam.steps[-1], len(beam.step_ids[-1]), beam.scores[-1:]
            else:
                text, tokens, scores = "", 0, []
            self.rows.append(
                [
                    self._parent(beam.path),
                    iteration,
                    text,
                    tokens,
                    [_number(s) for s in scores],
                    _number(beam.value(self.agg)),
                    [_number(s) for s in beam.lookahead_scores],
                    fate,
                    beam.decoded_ahead,
                    beam.score_source,
                ]
            )
        for k, beam in enumerate(beams):
            self.index[beam.path] = first + k

    def _parent(self, path: tuple[int, ...]) -> int | None:
        """The node `path` extends: its longest proper prefix that is a node of an earlier
        iteration (a beam search copy adds a copy index and an expansion index to its path)."""
        return self._node(path[:-1])

    def _node(self, path: tuple[int, ...]) -> int | None:
        """The node of `path`, or of its longest prefix that is one (a copy of a finished
        particle is its original's node)."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.index:
                return self.index[path[:end]]
        return None

    def to_json(self, completions: Sequence[Beam], seconds: float) -> dict:
        return {
            "version": VERSION,
            "strategy": self.strategy,
            "n": self.n,
            "beam_width": self.beam_width,
            "agg": self.agg,
            "fields": list(FIELDS),
            "nodes": self.rows,
            "completions": [self._node(b.path) for b in completions],
            "seconds": seconds,
            "generated_tokens": sum(row[3] for row in self.rows),
        }


@dataclass
class Traces:
    config: SearchConfig
    on_iteration: Callable[[int, list[Beam]], None] | None = None  # progress: (iteration, scored beams)
    kept: dict[str, SearchTrace] = field(default_factory=dict)  # problem id -> its trace (config.trace)

    def _new(self) -> SearchTrace:
        c = self.config
        return SearchTrace(c.strategy, c.n, c.beam_width, c.agg)

    def report(self, problem: Problem, iteration: int, beams: list[Beam], fates: list[str]) -> None:
        """An iteration's scored candidates and what the search did with each (FATES)."""
        if self.config.trace:
            self.kept.setdefault(problem.uid, self._new()).add(iteration, beams, fates)
        if self.on_iteration is not None:
            self.on_iteration(iteration, beams)

    def take(self, problem: Problem, completions: list[Beam], seconds: float) -> dict | None:
        """`problem`'s trace as JSON (None unless `config.trace`), forgotten here."""
        trace = self.kept.pop(problem.uid, None)
        if not self.config.trace:
            return None
        doc = (trace or self._new()).to_json(completions, seconds)
        if problem.stop is not None:
            doc["stop"] = problem.stop
        return doc


def nodes(trace: dict) -> list[dict]:
    """A trace's rows as dicts of its fields, plus "id" (the row's index)."""
    return [{"id": i, **dict(zip(trace["fields"], row, strict=True))} for i, row in enumerate(trace["nodes"])]
