"""A run's token budget: adaptive search's stopping decisions and the pacing of its problems' widths.

Owns `Budget`, which a `SearchContext` holds as `ctx.budget`; strategies ask it `decide` and
`next_width`. With a budget, what a problem gets depends on the other problems in flight.
"""

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
    expected_problems: int = 0  # `expect`: each gets an equal share
    # the paced problems that ended: how many, what they spent, the sum of what a beam of each cost
    ended: int = 0
    ended_spent: int = 0
    ended_beam_tokens: float = 0.0

    def decide(
        self, problem: Problem, iteration: int, width: int, certainty: float, exhausted: bool, grows: bool
    ) -> str:
        """Why `problem` stops after `iteration` ("settled", "exhausted", "budget"), or "" to go on;
        recorded in `problem.stop`. Only growing (`grows`: a sampling round, a DVTS wave) stops
        for the budget; beam search narrows instead (`next_width`)."""
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
        """`budget_tokens` given, or adaptive search over a run's problems with `budget_fraction`."""
        c = self.config
        picked = c.adaptive and c.budget_fraction is not None and self.expected_problems > 0
        return c.budget_tokens is not None or picked

    @property
    def limit(self) -> float | None:
        """The tokens the run may spend: `budget_tokens`, or the run's pick, problems x (first_width +
        budget_fraction x (n - first_width)) x the mean cost of a beam of the problems ended so far.
        None without a budget, and until a problem has ended."""
        c = self.config
        if c.budget_tokens is not None:
            return c.budget_tokens
        if not self.paced or not self.ended:
            return None
        first = c.widths()[0]
        width = first + c.budget_fraction * (c.n - first)
        return self.expected_problems * width * self.ended_beam_tokens / self.ended

    def may_widen(self, problem: Problem) -> bool:
        """Without a limit, always; else while the limit is not spent, `problem` is not `over_pace`
        and it is among the less settled half of the problems in flight."""
        limit = self.limit
        if limit is None:
            return True
        return self.spent_tokens() < limit and not self.over_pace(problem) and self._less_settled(problem)

    def next_width(self, problem: Problem, width: int, widths: list[int]) -> int:
        """Beam search's next width of `widths`: one wider while `may_widen`; once `over_pace`, one
        narrower unless `problem` is less settled than the median (an unfinished problem's certainty
        is 0, like most others'); the first width once the whole limit is spent; else the same."""
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
        """The run searches `problems` problems; the largest count stands (a Ray worker is told the
        run's, then searches one problem a call)."""
        self.expected_problems = max(self.expected_problems, problems)

    @property
    def share(self) -> float:
        """Each problem's share of the limit (all of it for one search, no count expected)."""
        limit = self.limit
        return limit / self.expected_problems if self.expected_problems else limit

    @property
    def surplus(self) -> float:
        """What the ended problems left of their shares, less what they spent beyond them."""
        return self.ended * self.share - self.ended_spent

    def over_pace(self, problem: Problem) -> bool:
        """`problem` spent its share and its part of the surplus (split over the problems in flight)."""
        if self.limit is None:
            return False
        in_flight = max(1, len(self.certainties))
        return problem.spent_tokens >= self.share + max(0.0, self.surplus) / in_flight
