"""Which mistakes a search lets through, read from `treeserve eval` results on the arithmetic world.

    python -m tools.arith.search_mistakes results.json [more.json ...]

Every completion is judged step by step (`treeserve.eval.arith_labels.step_verdicts`) and
counted under the kind of its first wrong step ("none" when every step is good). Two tallies
per file: over all completions (what the generator wrote during the search), and over the
chosen completions of the problems the search got wrong (the first completion whose answer is
the one the search picked). A PRM that cannot see a kind of mistake shows it as a larger share
of the chosen wrong completions than of all completions.
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


def mistake_counts(document: dict) -> dict[str, Counter]:
    """{"all": kinds over every completion, "chosen_wrong": kinds over the wrong problems' chosen ones}."""
    counts = {"all": Counter(), "chosen_wrong": Counter()}
    for record in document["problems"]:
        kinds = [first_mistake(record["problem"], c["text"]) for c in record["completions"]]
        counts["all"].update(kinds)
        if not record["correct"]:
            chosen = next(
                (k for k, c in zip(kinds, record["completions"], strict=True) if c["answer"] == record["pred"]), None
            )
            if chosen is not None:
                counts["chosen_wrong"][chosen] += 1
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
    args = parser.parse_args()
    try:  # every file is checked before anything is printed
        documents = [read_results(path) for path in args.results]
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    for path, document in zip(args.results, documents, strict=True):
        print(format_counts(path, mistake_counts(document)), end="\n\n")


if __name__ == "__main__":
    main()
