"""Paired comparison of results files: is one strategy really more accurate than another?

Two runs on the same problems are paired data: a problem both runs solve (or both miss) says
nothing about which is better; only the problems one run solves and the other misses do. So
this module matches problems by `unique_id` and reports, for each run against the first
(the baseline):

* accuracy and its 95% Wilson interval, on the problems every file shares;
* the four counts both / only this run / only the baseline / neither;
* the accuracy difference with a 95% interval for paired proportions (Wald, on the
  discordant counts);
* the exact two-sided McNemar p-value: a binomial test of "only this run" against
  "only the baseline" with p = 1/2. Small p (say < 0.05) means the difference is unlikely
  to be sampling noise over these problems.

It reads results documents (`report.read_results`) and never runs a search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treeserve.eval.metrics import wilson_interval
from treeserve.eval.report import read_results


@dataclass
class PairedComparison:
    name: str
    total: int
    both: int  # solved by this run and the baseline
    only_this: int
    only_baseline: int
    neither: int

    @property
    def correct(self) -> int:
        return self.both + self.only_this

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    @property
    def difference(self) -> float:
        """This run's accuracy minus the baseline's."""
        return (self.only_this - self.only_baseline) / self.total

    def difference_interval(self, z: float = 1.96) -> tuple[float, float]:
        """95% Wald interval of the paired difference of proportions."""
        b, c, n = self.only_this, self.only_baseline, self.total
        half = z * math.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n
        return self.difference - half, self.difference + half

    @property
    def p_value(self) -> float:
        return mcnemar_exact(self.only_this, self.only_baseline)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for discordant counts b and c (1.0 when both are 0)."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _outcomes(path: str | Path) -> tuple[str, dict[str, tuple[str, bool]]]:
    results = read_results(path)
    search = results["config"].get("search", {})
    selection = results["config"].get("selection")
    parts = [search.get("strategy"), selection, f"n={search['n']}" if "n" in search else None]
    parts.append(f"T={search['temperature']}" if "temperature" in search else None)
    label = ", ".join(str(x) for x in parts if x is not None)
    name = f"{Path(path).name} ({label})"
    outcomes: dict[str, tuple[str, bool]] = {}
    for p in results["problems"]:
        if p["unique_id"] in outcomes:
            raise ValueError(f"{path}: problem {p['unique_id']!r} appears twice")
        outcomes[p["unique_id"]] = (p["problem"], bool(p["correct"]))
    return name, outcomes


def compare_results(paths: Sequence[str | Path]) -> list[PairedComparison]:
    """One PairedComparison per file (the first, the baseline, against itself), over the
    problems all files share. ValueError when fewer than two files are given, when they share
    no problem, or when one `unique_id` names different problems in two files."""
    if len(paths) < 2:
        raise ValueError("compare needs at least two results files")
    runs = [_outcomes(p) for p in paths]
    shared = set(runs[0][1]).intersection(*(set(o) for _, o in runs[1:]))
    if not shared:
        raise ValueError("the results files share no problem (matched by unique_id)")
    ids = sorted(shared)
    for path, (_, outcomes) in zip(paths[1:], runs[1:], strict=True):
        for uid in ids:
            if outcomes[uid][0] != runs[0][1][uid][0]:
                raise ValueError(f"{path}: problem {uid!r} differs from the one in {paths[0]}")
    baseline = [runs[0][1][uid][1] for uid in ids]
    comparisons = []
    for name, outcomes in runs:
        mine = [outcomes[uid][1] for uid in ids]
        pairs = list(zip(mine, baseline, strict=True))
        comparisons.append(
            PairedComparison(
                name=name,
                total=len(ids),
                both=pairs.count((True, True)),
                only_this=pairs.count((True, False)),
                only_baseline=pairs.count((False, True)),
                neither=pairs.count((False, False)),
            )
        )
    return comparisons


def format_comparison(comparisons: Sequence[PairedComparison]) -> str:
    """A Markdown table: the first row is the baseline."""
    lines = [
        f"{comparisons[0].total} shared problems; baseline: {comparisons[0].name}",
        "",
        "| run | accuracy (95% CI) | both | only this | only baseline | neither | difference (95% CI) | McNemar p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, c in enumerate(comparisons):
        low, high = wilson_interval(c.correct, c.total)
        accuracy = f"{c.accuracy:.1%} ({low:.1%}-{high:.1%})"
        if k == 0:
            lines.append(f"| {c.name} | {accuracy} | | | | | baseline | |")
            continue
        d_low, d_high = c.difference_interval()
        lines.append(
            f"| {c.name} | {accuracy} | {c.both} | {c.only_this} | {c.only_baseline} | {c.neither} "
            f"| {c.difference:+.1%} ({d_low:+.1%} to {d_high:+.1%}) | {c.p_value:.3g} |"
        )
    return "\n".join(lines)
