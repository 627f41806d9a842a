"""Accuracy and speed of every search strategy on the arithmetic world, plus an ablation.

    OMP_NUM_THREADS=1 python bench/search_matrix.py --size 200 --out bench/out/search_matrix

Runs `treeserve eval`'s code path (`run_eval`) in this process, one configuration after
another, on the same problems (arithmetic levels 4-5, seed 0) with the shipped generator
and PRM:

* greedy (one completion at temperature 0);
* at `--temperature` (default 0.8, search-and-learn's): majority (self-consistency), best-of-N
  and weighted best-of-N (one best-of-N run gives both selections from the same samples), beam
  search and DVTS, at each N of `--ns`;
* beam search at N=16 with each optimisation switched off in turn, and the reference mode.

Writes one results JSON per configuration and `matrix.json`/`matrix.md` with accuracy
(95% Wilson interval), problems/min, generated tokens and PRM tokens prefilled.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from treeserve.eval.metrics import wilson_interval
from treeserve.eval.report import write_results
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.search.context import SearchConfig

ABLATION = {
    "all optimisations": {},
    "no prefix cache": {"prefix_cache": False},
    "no score cache": {"score_cache": False},
    "one problem at a time": {"max_concurrent_problems": 1},
    "+ speculative steps (k=1)": {"speculative_steps": 1},
}


def run(name: str, settings: EvalSettings, config: SearchConfig, out: Path) -> list[dict]:
    """One eval run; one row per selection rule it reports (best-of-N gives two)."""
    start = time.perf_counter()
    document = run_eval(settings, config)
    write_results(document, out / f"{name.replace(' ', '_')}.json")
    summary, problems = document["summary"], document["problems"]
    selections = ["naive", "weighted"] if config.strategy == "best_of_n" else [None]
    rows = []
    for selection in selections:
        correct = (
            sum(p["correct"] for p in problems)
            if selection is None
            else round(summary[f"{selection}@n"][str(config.n)] * len(problems))
        )
        label = {"naive": "best_of_n", "weighted": "weighted_best_of_n"}.get(selection or "", name)
        low, high = wilson_interval(correct, len(problems))
        rows.append({
            "name": label if selection else name, "strategy": config.strategy, "n": config.n,
            "accuracy": correct / len(problems), "ci95": [low, high], "problems": len(problems),
            "problems_per_min": 60 * summary["problems_per_s"], "generated_tokens": summary["generated_tokens"],
            "prm_tokens_prefilled": summary.get("prm_tokens_prefilled", 0),
            "prm_unique_tokens": summary.get("prm_unique_tokens", 0), "wall_s": time.perf_counter() - start,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| configuration | N | accuracy | 95% CI | problems/min | generated tokens | PRM tokens prefilled |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['n']} | {r['accuracy']:.1%} | {r['ci95'][0]:.1%}-{r['ci95'][1]:.1%} "
            f"| {r['problems_per_min']:.1f} | {r['generated_tokens']} | {r['prm_tokens_prefilled']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=200, help="problems (levels 4 and 5, half each)")
    parser.add_argument("--ns", default="4,16,64")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8, help="of every sampled configuration")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/out/search_matrix"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = EvalSettings(dataset=f"arith:level=4,5,size={args.size},seed=0", dtype=args.dtype, progress=False)
    base = SearchConfig(beam_width=args.beam_width, num_iterations=40, temperature=args.temperature)
    rows = run("greedy", settings, replace(base, strategy="majority", n=1, temperature=0.0), args.out)
    for n in (int(x) for x in args.ns.split(",")):
        rows += run(f"majority N={n}", settings, replace(base, strategy="majority", n=n), args.out)
        rows += run(f"best_of_n N={n}", settings, replace(base, strategy="best_of_n", n=n), args.out)
        rows += run(f"beam_search N={n}", settings, replace(base, strategy="beam_search", n=n), args.out)
        rows += run(f"dvts N={n}", settings, replace(base, strategy="dvts", n=n), args.out)
    ablation: list[dict] = []
    if not args.skip_ablation:
        beam16 = replace(base, strategy="beam_search", n=16)
        for name, change in ABLATION.items():
            ablation += run(f"ablation {name}", settings, replace(beam16, **change), args.out)
        ablation += run("ablation reference mode", replace(settings, reference=True), beam16, args.out)
    (args.out / "matrix.json").write_text(json.dumps({"rows": rows, "ablation": ablation}, indent=1) + "\n")
    text = f"## Strategies\n\n{table(rows)}\n\n## Ablation (beam search, N=16)\n\n{table(ablation)}\n"
    (args.out / "matrix.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
