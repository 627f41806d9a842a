"""A run's token budget (`ctx.budget`): adaptive search's stop decisions and its width pacing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from treeserve.search.config import SearchConfig
from treeserve.search.types import Problem


@dataclass
class Budget:
    config: SearchConfig
    spent_tokens: Callable[[], int]  # the run's tokens sampled and fed the PRM so far (what `limit` bounds)
    certainties: dict[str, float] = field(default_factory=dict)  # paced problems in flight -> latest certainty
    expected_problems: int = 0
    # of the paced problems that ended: how many, their spend, the sum of each one's cost per beam
    ended: int = 0
    ended_spent: int = 0
    ended_beam_tokens: float = 0.0

    def decide(
        self, problem: Problem, iteration: int, width: int, certainty: float, exhausted: bool, grows: bool
    ) -> str:
        """Why `problem` stops ("settled", "exhausted", "budget": only when it `grows`) or "" to go on."""
        c = self.config
        reason = "settled" if certainty >= c.certainty else "exhausted" if exhausted else ""
        stop = problem.stop if problem.stop is not None else {"widths": [], "certainty": []}
        problem.stop = stop
        if self.paced:
            problem.count_beam_tokens(width, cumulative=grows)
            self.certainties[problem.uid] = certainty
            if not reason and grows and not self.may_widen(problem):
                reason = "budget"
            if reason:  # its unspent share joins the surplus
                del self.certainties[problem.uid]
                self.ended += 1
                self.ended_spent += problem.spent_tokens
                self.ended_beam_tokens += problem.beam_tokens
                if c.budget_tokens is None:  # the limit the run picked, as it stands now
                    stop["budget_tokens"] = round(self.limit)
        stop["widths"].append(width)
        stop["certainty"].append(round(certainty, 4))
        if reason:
            stop |= {"iteration": iteration, "reason": reason}
        return reason

    @property
    def paced(self) -> bool:
        c = self.config
        picked = c.adaptive and c.budget_fraction is not None and self.expected_problems > 0
        return c.budget_tokens is not None or picked

    @property
    def limit(self) -> float | None:
        """`budget_tokens`, or problems x (first_width + budget_fraction x (n - first_width)) x the
        mean cost per beam of the problems ended (None before one has)."""
        c = self.config
        if c.budget_tokens is not None:
            return c.budget_tokens
        if not self.paced or not self.ended:
            return None
        first = c.widths()[0]
        width = first + c.budget_fraction * (c.n - first)
        return self.expected_problems * width * self.ended_beam_tokens / self.ended

    def may_widen(self, problem: Problem) -> bool:
        limit = self.limit
        if limit is None:
            return True
        return self.spent_tokens() < limit and not self.over_pace(problem) and self._less_settled(problem)

    def next_width(self, problem: Problem, width: int, widths: list[int]) -> int:
        """One wider while `may_widen`; over pace, one narrower unless less settled than the median;
        the first width once the limit is spent."""
        at = widths.index(width)
        if self.may_widen(problem):
            return widths[min(at + 1, len(widths) - 1)]
        if not self.over_pace(problem):
            return width
        if self.spent_tokens() >= self.limit:
            return widths[0]
        return width if self._less_settled(problem, strictly=True) else widths[max(at - 1, 0)]

    def _less_settled(self, problem: Problem, strictly: bool = False) -> bool:
        ordered = sorted(self.certainties.values())
        mine, median = self.certainties.get(problem.uid, 0.0), ordered[(len(ordered) - 1) // 2]
        return mine < median if strictly else mine <= median

    def expect(self, problems: int) -> None:
        """The largest count stands: a Ray worker is told the run's, then searches one a call."""
        self.expected_problems = max(self.expected_problems, problems)

    @property
    def share(self) -> float:
        limit = self.limit
        return limit / self.expected_problems if self.expected_problems else limit

    @property
    def surplus(self) -> float:
        return self.ended * self.share - self.ended_spent

    def over_pace(self, problem: Problem) -> bool:
        if self.limit is None:
            return False
        in_flight = max(1, len(self.certainties))
        return problem.spent_tokens >= self.share + max(0.0, self.surplus) / in_flight
