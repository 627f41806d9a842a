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

`--lookaheads 0,1,2` adds beam search at N=16 with each lookahead K (issue 37's row),
written to `lookahead.json`/`lookahead.md` with the rollouts' extra generated and PRM
tokens and a paired comparison (`treeserve compare`) of each K against the first;
`--only-lookahead` runs just those:

    OMP_NUM_THREADS=1 python bench/search_matrix.py --size 200 --lookaheads 0,1,2 --only-lookahead
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from treeserve.eval.compare import compare_by_rule, format_by_rule
from treeserve.eval.metrics import wilson_interval
from treeserve.eval.report import write_results
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig

ABLATION = {
    "all optimisations": {},
    "no prefix cache": {},  # RUNTIME_ABLATION's
    "no score cache": {"score_cache": False},
    "one problem at a time": {"max_concurrent_problems": 1},
    "+ decode ahead (k=1)": {"decode_ahead": 1},
}
RUNTIME_ABLATION = {"no prefix cache": {"prefix_cache": False}}  # the runtime's settings, not the search's


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
        rows.append(
            {
                "name": label if selection else name,
                "strategy": config.strategy,
                "n": config.n,
                "rule": selection or summary["accuracy_rule"],
                "accuracy": correct / len(problems),
                "ci95": [low, high],
                "problems": len(problems),
                "problems_per_min": 60 * summary["problems_per_s"],
                "generated_tokens": summary["generated_tokens"],
                "prm_tokens_prefilled": summary.get("prm_tokens_prefilled", 0),
                "prm_unique_tokens": summary.get("prm_unique_tokens", 0),
                "wall_s": time.perf_counter() - start,
                "lookahead": config.lookahead,
                "lookahead_generated_tokens": summary.get("lookahead_generated_tokens", 0),
                "lookahead_prm_tokens": summary.get("lookahead_prm_tokens", 0),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| configuration | N | accuracy | answer rule | 95% CI | problems/min | generated tokens "
        "| PRM tokens prefilled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['n']} | {r['accuracy']:.1%} | {r['rule']} | {r['ci95'][0]:.1%}-{r['ci95'][1]:.1%} "
            f"| {r['problems_per_min']:.1f} | {r['generated_tokens']} | {r['prm_tokens_prefilled']} |"
        )
    return "\n".join(lines)


def run_lookaheads(settings: EvalSettings, beam: SearchConfig, ks: list[int], out: Path) -> str:
    """Beam search at each lookahead K on the same problems: rows, and each K paired against the first."""
    rows, paths = [], []
    for k in ks:
        name = f"beam_search N={beam.n} lookahead={k}"
        rows += run(name, settings, replace(beam, lookahead=k), out)
        paths.append(out / f"{name.replace(' ', '_')}.json")
    lines = [
        "| configuration | accuracy | answer rule | 95% CI | problems/min | generated tokens | of them lookahead "
        "| PRM tokens prefilled | lookahead PRM tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['accuracy']:.1%} | {r['rule']} | {r['ci95'][0]:.1%}-{r['ci95'][1]:.1%} "
            f"| {r['problems_per_min']:.1f} | {r['generated_tokens']} | {r['lookahead_generated_tokens']} "
            f"| {r['prm_tokens_prefilled']} | {r['lookahead_prm_tokens']} |"
        )
    paired = format_by_rule(compare_by_rule(paths))
    (out / "lookahead.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    text = f"## Lookahead (beam search, N={beam.n})\n\n" + "\n".join(lines) + f"\n\nPaired:\n\n{paired}\n"
    (out / "lookahead.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=200, help="problems (levels 4 and 5, half each)")
    parser.add_argument("--ns", default="4,16,64")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8, help="of every sampled configuration")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--lookaheads", default=None, help="also beam search N=16 at each lookahead K, e.g. 0,1,2")
    parser.add_argument("--only-lookahead", action="store_true", help="run only the --lookaheads rows")
    parser.add_argument("--out", type=Path, default=Path("bench/out/search_matrix"))
    args = parser.parse_args()
    if args.only_lookahead and not args.lookaheads:
        parser.error("--only-lookahead needs --lookaheads K,K,...")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = EvalSettings(
        dataset=f"arith:level=4,5,size={args.size},seed=0",
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype=args.dtype),
    )
    base = SearchConfig(beam_width=args.beam_width, num_iterations=40, temperature=args.temperature)
    if args.lookaheads:
        ks = [int(k) for k in args.lookaheads.split(",")]
        print(run_lookaheads(settings, replace(base, strategy="beam_search", n=16), ks, args.out))
    if args.only_lookahead:
        return
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
            own = replace(settings, runtime=replace(settings.runtime, **RUNTIME_ABLATION.get(name, {})))
            ablation += run(f"ablation {name}", own, replace(beam16, **change), args.out)
        ablation += run("ablation reference mode", replace(settings, reference=True), beam16, args.out)
    (args.out / "matrix.json").write_text(json.dumps({"rows": rows, "ablation": ablation}, indent=1) + "\n")
    text = f"## Strategies\n\n{table(rows)}\n\n## Ablation (beam search, N=16)\n\n{table(ablation)}\n"
    (args.out / "matrix.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
