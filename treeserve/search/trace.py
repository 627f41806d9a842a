"""Search traces: every candidate step a search produced, its PRM scores and its fate.

Owns `SearchTrace` (a problem's) and `Traces` (`ctx.traces`: a run's, and its progress callback);
tracing changes no beam. The JSON holds one row a candidate (its fields named once in "fields",
its id the row's index) and the node of each completion::

    {"version": 1, "strategy": "beam_search", "n": 16, "beam_width": 4, "agg": "last", "fields": [...],
     "nodes": [[null, 0, "15 + 4 = 19.", 9, [0.81], 0.81, [], "kept", false, "prm"]],
     "completions": [41, 42], "seconds": 1.2, "generated_tokens": 812}"""

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
    """Six decimals; NaN and infinity (not JSON) as null."""
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
        return self._node(path[:-1])

    def _node(self, path: tuple[int, ...]) -> int | None:
        """The node of `path`'s longest prefix that is one (a finished particle's copy: its original's)."""
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
    return [{"id": i, **dict(zip(trace["fields"], row, strict=True))} for i, row in enumerate(trace["nodes"])]
