"""Which mistakes a search lets through, read from `treeserve eval` results on the arithmetic world.

    python -m tools.arith.search_mistakes results.json [more.json ...] [--against baseline.json]

Every completion is judged step by step (`treeserve.eval.arith_labels.step_verdicts`) and
counted under the kind of its first wrong step ("none" when every step is good). Two tallies
per file: over all completions (what the generator wrote during the search), and over the
chosen completions of the problems the search got wrong (the first completion whose answer is
the one the search picked). A PRM that cannot see a kind of mistake shows it as a larger share
of the chosen wrong completions than of all completions.

With `--against` (a run on the same problems, e.g. majority voting), two paired tallies more:
"lost", the problems the baseline gets right and this run wrong, by this run's first mistake;
"won", the problems this run gets right and the baseline wrong, by the baseline's first mistake.
"""

from __future__ import annotations

import argparse
from collections import Counter

from treeserve.eval.arith_labels import MISTAKES, split_steps, step_verdicts
from treeserve.eval.report import read_results

KINDS = ("none", *MISTAKES)


def first_mistake(problem: str, text: str) -> str:
    """The kind of the first wrong step of a completion, or "none"."""
    return next((v for v in step_verdicts(problem, split_steps(text)) if v != "good"), "none")


def chosen_mistake(record: dict) -> str | None:
    """The first mistake of a problem's chosen completion (the first whose answer is the pick)."""
    chosen = next((c for c in record["completions"] if c["answer"] == record["pred"]), None)
    return None if chosen is None else first_mistake(record["problem"], chosen["text"])


def mistake_counts(document: dict) -> dict[str, Counter]:
    """{"all": kinds over every completion, "chosen_wrong": kinds over the wrong problems' chosen ones}."""
    counts = {"all": Counter(), "chosen_wrong": Counter()}
    for record in document["problems"]:
        counts["all"].update(first_mistake(record["problem"], c["text"]) for c in record["completions"])
        if not record["correct"] and (kind := chosen_mistake(record)) is not None:
            counts["chosen_wrong"][kind] += 1
    return counts


def paired_counts(document: dict, baseline: dict) -> dict[str, Counter]:
    """{"lost": this run's mistakes where only the baseline is right, "won": the baseline's where
    only this run is right}, over the problems both runs have (by `unique_id`)."""
    theirs = {record["unique_id"]: record for record in baseline["problems"]}
    counts = {"lost": Counter(), "won": Counter()}
    for record in document["problems"]:
        other = theirs.get(record["unique_id"])
        if other is None or record["correct"] == other["correct"]:
            continue
        label, wrong = ("won", other) if record["correct"] else ("lost", record)
        counts[label][chosen_mistake(wrong) or "none"] += 1
    return counts


def format_counts(name: str, counts: dict[str, Counter]) -> str:
    lines = [f"{name}", "| completions | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    for label, counter in counts.items():
        total = sum(counter.values()) or 1
        cells = " | ".join(f"{counter[k]} ({counter[k] / total:.0%})" for k in KINDS)
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="`treeserve eval --output` files")
    parser.add_argument("--against", help="a baseline run on the same problems: adds the paired tallies")
    args = parser.parse_args()
    try:  # every file is checked before anything is printed
        documents = [read_results(path) for path in args.results]
        baseline = read_results(args.against) if args.against else None
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    for path, document in zip(args.results, documents, strict=True):
        counts = mistake_counts(document)
        if baseline is not None:
            counts |= paired_counts(document, baseline)
        print(format_counts(path, counts), end="\n\n")


if __name__ == "__main__":
    main()
