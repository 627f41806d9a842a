"""`treeserve compare`: each run against the first on shared `unique_id`s (Wilson intervals, discordant
counts, paired Wald difference, exact McNemar p). Files whose answer rules differ are re-selected and
compared under each rule, so a weighted accuracy is never paired with a naive one."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treeserve.eval.metrics import SELECTIONS, select, wilson_interval
from treeserve.eval.report import answer_rule, problems_from_records, read_results


@dataclass
class PairedComparison:
    name: str
    rule: str | None  # the answer rule both accuracies use (None: as recorded, by files that name none)
    recorded_rule: str | None  # the rule this file's own answers were chosen by
    file: str
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


@dataclass
class Run:
    path: str | Path
    name: str
    rule: str | None
    results: dict

    @classmethod
    def read(cls, path: str | Path) -> Run:
        results = read_results(path)
        ids = Counter(str(p["unique_id"]) for p in results["problems"])
        duplicates = [uid for uid, count in ids.items() if count > 1]
        if duplicates:
            raise ValueError(f"{path}: problem {duplicates[0]!r} appears twice")
        search = results["config"].get("search", {})
        parts = [search.get("strategy"), f"n={search['n']}" if "n" in search else None]
        parts.append(f"T={search['temperature']}" if "temperature" in search else None)
        label = ", ".join(str(x) for x in parts if x is not None)
        return cls(path, f"{Path(path).name} ({label})", answer_rule(results), results)

    def outcomes(self, rule: str | None = None) -> dict[str, tuple[str, bool]]:
        """{unique_id: (problem, solved?)}: as recorded, or with each answer re-selected under `rule`."""
        agg = self.results["config"].get("search", {}).get("agg") or self.results["summary"].get("agg", "last")
        records = self.results["problems"]
        ids = [str(p["unique_id"]) for p in records]
        if rule is None or rule == self.rule:
            return {uid: (p["problem"], bool(p["correct"])) for uid, p in zip(ids, records, strict=True)}
        solved = {}
        for uid, problem in zip(ids, problems_from_records(records), strict=True):
            i = select(problem.completions, rule, agg)
            solved[uid] = (problem.problem, i is not None and problem.completions[i].correct)
        return solved


def compare_results(paths: Sequence[str | Path], rule: str | None = None) -> list[PairedComparison]:
    """One PairedComparison per file (the first is the baseline) over the problems all share, answers as
    recorded or re-selected under `rule`. ValueError for < 2 files, no shared problem or a clashing id."""
    if len(paths) < 2:
        raise ValueError("compare needs at least two results files")
    return _compare([Run.read(p) for p in paths], rule)


def _compare(files: Sequence[Run], rule: str | None) -> list[PairedComparison]:
    if rule is not None and rule not in SELECTIONS:
        raise ValueError(f"rule must be one of {', '.join(SELECTIONS)}, got {rule!r}")
    paths = [f.path for f in files]
    runs = [(f.name, f.outcomes(rule)) for f in files]
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
    for file, (name, outcomes) in zip(files, runs, strict=True):
        mine = [outcomes[uid][1] for uid in ids]
        pairs = list(zip(mine, baseline, strict=True))
        comparisons.append(
            PairedComparison(
                name=name,
                rule=rule or file.rule,
                recorded_rule=file.rule,
                file=Path(file.path).name,
                total=len(ids),
                both=pairs.count((True, True)),
                only_this=pairs.count((True, False)),
                only_baseline=pairs.count((False, True)),
                neither=pairs.count((False, False)),
            )
        )
    return comparisons


def compare_by_rule(paths: Sequence[str | Path]) -> dict[str | None, list[PairedComparison]]:
    """{rule: comparisons}: the files as recorded if they share one rule, else re-selected under each."""
    if len(paths) < 2:
        raise ValueError("compare needs at least two results files")
    files = [Run.read(p) for p in paths]
    rules = {f.rule for f in files}
    if len(rules) == 1:
        return {rules.pop(): _compare(files, None)}
    return {rule: _compare(files, rule) for rule in SELECTIONS if rule in rules}


def format_by_rule(by_rule: dict[str | None, list[PairedComparison]]) -> str:
    """`compare_by_rule`'s tables, after a note when the files' own rules differed."""
    tables = list(by_rule.values())
    if len(tables) == 1:
        return format_comparison(tables[0])
    own = ", ".join(f"{c.file}: {c.recorded_rule or 'not recorded'}" for c in tables[0])
    note = (
        f"The files chose their answers by different rules ({own}); a comparison across rules "
        "would not compare like with like, so every file is compared under each rule."
    )
    return "\n\n".join([note, *(format_comparison(c) for c in tables)])


def format_comparison(comparisons: Sequence[PairedComparison]) -> str:
    """A Markdown table under its answer rule: the first row is the baseline."""
    rule = comparisons[0].rule or "as recorded (rule not recorded)"
    lines = [
        f"{comparisons[0].total} shared problems; answer rule: {rule}; baseline: {comparisons[0].name}",
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
