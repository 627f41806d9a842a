"""Adaptive search against fixed N: accuracy per computed token on held-out arithmetic (issue 63).

    python bench/adaptive.py --problems 120 --threads 1 --out bench/out/adaptive
    treeserve plot bench/out/adaptive/*.json --x computed-tokens    (the figure it also draws)
    python bench/adaptive.py --smoke                                 (a check: ~20 s on 2 cores)

On the same held-out arithmetic problems (levels 4-5, `arith_dataset` seed 0, the test split
bench/search_scaling.py uses; `--dataset-seed` picks another set, to calibrate on), through
`treeserve eval`'s code path (`run_eval`) in this process, with `treeserve eval`'s search
defaults (beam width 4, T=0.8, 40 iterations, the shipped generator and PRM, bf16):
`--strategy` (beam search) at each fixed N of `--ns` (4, 8, 16, 32, 64), then adaptive at
N=`--adaptive-n` (16; its fixed run is added to `--ns` when missing) from `--first-width` (4)
at each certainty of `--thresholds` (0.5, 0.7, 0.8, 0.9, 0.95). One run after another, each
writing its results JSON into `--out` (only those: `treeserve plot DIR/*.json --x
computed-tokens` draws them), and `DIR/accuracy_vs_computed_tokens.png`
(`plot_accuracy_vs_compute`: each run's accuracy against its computed tokens, with the Pareto
front).

It prints a markdown table and writes it with the rows to `--summary` (default: `--out`
with `.json` added, beside the folder): per run, accuracy (the summary's, under the
strategy's answer rule), computed tokens (generator + PRM tokens the engines ran),
generated tokens, wall seconds of the search and problems/min, and for adaptive runs the
share of problems that settled and their mean stop iteration. Then, against fixed
N=`--adaptive-n`: each adaptive run's computed tokens as a fraction of the fixed run's and
its accuracy difference in points, and problems/min at the same accuracy: of the adaptive
runs at most 2.5 points below the fixed run's accuracy (`--tolerance`), the one with the
most problems/min, and its ratio to the fixed run's.

The issue's curve: `--curve-ns 4,8,32` adds adaptive runs at those N (at `--curve-certainty`, 0.9), and
the summary gives, per fixed run, the best accuracy of an adaptive run that computed at most as many
tokens (the Pareto front as a step) and its margin in points. An item `N:W` runs from first width W
instead of `--first-width`, and `N:W:B` also under `--budget-tokens B` (`--curve-ns 32:8:4400000,64:8`).

Adaptive runs are `--adaptive` as the command line gives it: without `--budget-tokens` the run picks
its budget (`SearchConfig.budget_fraction`, docs/adaptive.md), so the `--thresholds` run at 0.9 is
`--adaptive` alone, the default point. `--fractions off,0.2,0.4` adds adaptive runs at
N=`--adaptive-n` and `--curve-certainty` at those budget fractions (`off`: no budget, the rule before
the run picked one); each row records the budget fraction and the picked budget's range over the run.

`--budgets 300000,440000` adds adaptive runs at N=`--adaptive-n` and `--curve-certainty` under those
`--budget-tokens` (paced over the problems: docs/adaptive.md); each row records the tokens the run
spent (sampled and fed to the PRM: what a budget counts) beside its computed tokens.

`--reuse` takes a run from `--out` when its results there are of that very run (search config and
problems): a cut-short invocation resumes, and runs added later run alone while the table, the figure
and the comparison still hold every run.

`--smoke`: 4 problems, fixed N 4 and 8, adaptive at N=8 with the middle threshold (0.8).

Another generator (`--generator`, e.g. Gemma 3 270M's GGUF, a base model without a chat template):
`--few-shot K` gives it K worked examples of the world (levels `--levels`, `arith_dataset` seed 7,
a set apart from the held-out and calibration ones) as a plain prompt (`SearchConfig.prompt_format`),
and a solution ends at the next "Question:" or a blank line pair (`SearchConfig.stop`); majority
voting needs no PRM:

    python bench/adaptive.py --generator ~/.cache/treeserve/gguf/gemma-3-270m-q4_k_m.gguf --few-shot 3 \
        --strategy majority --levels 1 --problems 60 --ns 4,8,16 --thresholds 0.8,0.9 --max-tokens 96 \
        --threads 2 --out bench/out/adaptive_gemma
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from treeserve.eval.arith import arith_dataset
from treeserve.eval.journal import config_differences
from treeserve.eval.plots import plot_accuracy_vs_compute
from treeserve.eval.report import upgrade_config, write_results
from treeserve.eval.runner import DEFAULT_GENERATOR, EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.search.config import SearchConfig

FEW_SHOT_STOP = ["Question:", "\n\n\n"]  # a base model writes on into the next question


def few_shot_prompt(shots: int, levels: tuple[int, ...]) -> str:
    """`shots` worked examples of the world (seed 7: neither the held-out set nor the calibration set),
    then the question: a plain prompt for a base model."""
    examples = arith_dataset(size=shots, seed=7, levels=levels)
    worked = "".join(f"Question: {r['problem']}\nSolution: {r['solution']}\n\n\n" for r in examples)
    return worked + "Question: {question}\nSolution:"


def reusable(path: Path, config: SearchConfig, records: list[dict]) -> dict | None:
    """The results at `path` when they are of this very run (search config, problems), else None."""
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    ran = upgrade_config(document["config"])  # settings added since it ran, at their defaults
    same = not config_differences(ran["search"], json.loads(json.dumps(asdict(config))))
    ids = [p["unique_id"] for p in document["problems"]]
    return document if same and ids == [r["unique_id"] for r in records] else None


def run(
    name: str,
    records: list[dict],
    config: SearchConfig,
    out: Path,
    generator: str = DEFAULT_GENERATOR,
    reuse: bool = False,
) -> dict:
    """One eval run, its results written to `out/<name>.json` (with `reuse`, read from there when it
    holds this run); the row of the table."""
    start = time.perf_counter()
    path = out / f"{name}.json"
    document = reusable(path, config, records) if reuse else None
    if document is None:
        settings = EvalSettings(dataset="inline", generator=ModelSettings(generator), progress=False)
        document = run_eval(settings, config, inline=records)
        path = write_results(document, path)
    summary, problems = document["summary"], document["problems"]
    stops = [p["stop"] for p in problems if p.get("stop")]
    picks = [s["budget_tokens"] for s in stops if "budget_tokens" in s]
    settled = [s["iteration"] for s in stops if s.get("reason") == "settled"]
    row = {
        "name": name,
        "path": str(path),
        "strategy": config.strategy,
        "n": config.n,
        "adaptive": config.adaptive,
        "certainty": config.certainty if config.adaptive else None,
        "problems": len(problems),
        "accuracy": summary["accuracy"],
        "rule": summary.get("accuracy_rule"),
        "computed_tokens": summary["computed_tokens"],
        "generated_tokens": summary["generated_tokens"],
        "budget_tokens": config.budget_tokens,
        "budget_fraction": config.budget_fraction if config.adaptive and config.budget_tokens is None else None,
        "picked_budget": [min(picks), max(picks)] if picks else None,  # as it stood when problems ended
        "spent_tokens": sum(p["spent"]["generated_tokens"] + p["spent"]["prm_input_tokens"] for p in problems),
        "wall_s": summary["wall_time_s"],
        "problems_per_min": 60 * summary["problems_per_s"],
        "process_s": time.perf_counter() - start,  # with model loading and grading
        "settled_share": len(settled) / len(problems) if config.adaptive else None,
        "mean_stop_iteration": statistics.mean(settled) if settled else None,
        "stop_reasons": {r: sum(s.get("reason") == r for s in stops) for r in sorted({s["reason"] for s in stops})},
    }
    print(json.dumps(row), flush=True)
    return row


def derived(rows: list[dict], n: int, tolerance: float) -> dict:
    """Each adaptive run at N=`n` against fixed N=`n`, the fastest one within `tolerance` points below
    it, and the curve of every adaptive run."""
    fixed = next(r for r in rows if not r["adaptive"] and r["n"] == n)
    against = [
        {
            "name": r["name"],
            "certainty": r["certainty"],
            "computed_fraction": r["computed_tokens"] / fixed["computed_tokens"] if fixed["computed_tokens"] else None,
            "accuracy_points": 100 * (r["accuracy"] - fixed["accuracy"]),
            "problems_per_min": r["problems_per_min"],
        }
        for r in rows
        if r["adaptive"] and r["n"] == n
    ]
    close = [a for a in against if a["accuracy_points"] >= -tolerance - 1e-9]
    best = max(close, key=lambda a: a["problems_per_min"], default=None)
    speedup = best["problems_per_min"] / fixed["problems_per_min"] if best and fixed["problems_per_min"] else None
    return {
        "fixed": fixed["name"],
        "against_fixed": against,
        "same_accuracy": best,
        "same_accuracy_speedup": speedup,
        "tolerance_points": tolerance,
        "curve": curve(rows),
    }


def curve(rows: list[dict]) -> list[dict]:
    """Per fixed run, the adaptive curve at its computed tokens: the best accuracy of an adaptive run
    that computed at most as many tokens (the Pareto front as a step), and its margin in points
    (None: no adaptive run is that cheap)."""
    adaptive = [r for r in rows if r["adaptive"]]
    out = []
    for f in (r for r in rows if not r["adaptive"]):
        cheaper = [r for r in adaptive if r["computed_tokens"] <= f["computed_tokens"]]
        best = max(cheaper, key=lambda r: (r["accuracy"], -r["computed_tokens"]), default=None)
        out.append(
            {
                "fixed": f["name"],
                "n": f["n"],
                "adaptive": best and best["name"],
                "margin_points": None if best is None else 100 * (best["accuracy"] - f["accuracy"]),
            }
        )
    return out


def curve_runs(spec: str, first_width: int) -> list[tuple[int, int, int | None]]:
    """`--curve-ns`'s runs as (N, first width, budget or None): items N, N:W or N:W:B."""
    runs = []
    for item in (i for i in spec.split(",") if i):
        parts = [int(x) for x in item.split(":")]
        width = parts[1] if len(parts) > 1 else first_width
        runs.append((parts[0], width, parts[2] if len(parts) > 2 else None))
    return sorted(set(runs), key=lambda r: (r[0], r[1], r[2] or 0))


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], figures: dict, n: int) -> str:
    lines = [
        "| run | N | certainty | accuracy | computed tokens | generated tokens | wall s | problems/min "
        "| settled | mean stop iteration | spent tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['n']} | {_or_dash(r['certainty'], 'g')} | {r['accuracy']:.1%} "
            f"| {r['computed_tokens']} | {r['generated_tokens']} | {r['wall_s']:.1f} | {r['problems_per_min']:.1f} "
            f"| {_or_dash(r['settled_share'], '.0%')} | {_or_dash(r['mean_stop_iteration'], '.2f')} "
            f"| {r['spent_tokens']} |"
        )
    lines += [
        "",
        f"| adaptive run | computed tokens / fixed N={n}'s | accuracy - fixed N={n}'s (points) |",
        "|---|---|---|",
    ]
    for a in figures["against_fixed"]:
        lines.append(f"| {a['name']} | {_or_dash(a['computed_fraction'], '.2f')} | {a['accuracy_points']:+.1f} |")
    lines += ["", "| fixed run | the adaptive curve at its computed tokens | margin (points) |", "|---|---|---|"]
    for c in figures["curve"]:
        lines.append(f"| {c['fixed']} | {c['adaptive'] or '-'} | {_or_dash(c['margin_points'], '+.1f')} |")
    best, tol = figures["same_accuracy"], figures["tolerance_points"]
    head = f"\n\nproblems/min at the same accuracy (at most {tol:g} points below fixed N={n}):"
    if best is None:
        return "\n".join(lines) + f"{head} no adaptive run\n"
    return "\n".join(lines) + (
        f"{head} {best['name']} at {best['problems_per_min']:.1f} problems/min, "
        f"{_or_dash(figures['same_accuracy_speedup'], '.2f')}x fixed N={n}'s\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=120, help="arithmetic problems (of `--levels`)")
    ap.add_argument("--dataset-seed", type=int, default=0, help="arith_dataset's seed (0: the held-out test split)")
    ap.add_argument("--strategy", default="beam_search")
    ap.add_argument("--ns", default="4,8,16,32,64", help="fixed runs' N")
    ap.add_argument("--adaptive-n", type=int, default=16)
    ap.add_argument(
        "--curve-ns",
        default="",
        help="adaptive runs at these N too (at --curve-certainty): the curve; "
        "an item N:W runs from first width W, N:W:B also under --budget-tokens B",
    )
    ap.add_argument("--curve-certainty", type=float, default=0.9)
    ap.add_argument(
        "--budgets",
        default="",
        help="adaptive runs at --adaptive-n and --curve-certainty with these "
        "--budget-tokens (tokens sampled and fed to the PRM)",
    )
    ap.add_argument(
        "--fractions",
        default="",
        help="adaptive runs at --adaptive-n and --curve-certainty with these "
        "--budget-fraction values (the budget the run picks; off: none)",
    )
    ap.add_argument("--first-width", type=int, default=4)
    ap.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95", help="adaptive runs' certainty")
    ap.add_argument("--tolerance", type=float, default=2.5, help="points below fixed N that count as the same")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("bench/out/adaptive"), help="folder of the runs' results")
    ap.add_argument("--summary", type=Path, default=None, help="rows and table (default: OUT.json)")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="take a run's results from --out when they hold that very run (a run cut short, resumed)",
    )
    ap.add_argument("--smoke", action="store_true", help="4 problems, N 4 and 8, adaptive N=8 at one threshold")
    ap.add_argument("--generator", default=DEFAULT_GENERATOR, help="the generator (default: the shipped one)")
    ap.add_argument("--levels", default="4,5", help="the problems' levels")
    ap.add_argument("--max-tokens", type=int, default=None, help="per step or completion (default: SearchConfig's)")
    ap.add_argument(
        "--few-shot",
        type=int,
        default=0,
        metavar="K",
        help="a plain prompt of K worked examples, for a base model without a chat template",
    )
    args = ap.parse_args()
    if args.smoke:  # the middle threshold
        thresholds = args.thresholds.split(",")
        args.problems, args.ns, args.adaptive_n, args.thresholds = 4, "4,8", 8, thresholds[len(thresholds) // 2]
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.summary or args.out.with_name(args.out.name + ".json")
    levels = tuple(int(level) for level in args.levels.split(","))
    records = arith_dataset(size=args.problems, seed=args.dataset_seed, levels=levels)
    common: dict = {"strategy": args.strategy}
    if args.max_tokens is not None:
        common["max_tokens"] = args.max_tokens
    if args.few_shot:
        common |= {"prompt_format": few_shot_prompt(args.few_shot, levels), "stop": FEW_SHOT_STOP}
    ns = sorted({int(n) for n in args.ns.split(",")} | {args.adaptive_n})
    rows = [
        run(f"{args.strategy}_n{n}", records, SearchConfig(n=n, **common), args.out, args.generator, args.reuse)
        for n in ns
    ]
    picked = SearchConfig().budget_fraction
    adaptive = [(args.adaptive_n, float(t), args.first_width, None, picked) for t in args.thresholds.split(",") if t]
    adaptive += [
        (n, args.curve_certainty, w, b, picked)
        for n, w, b in curve_runs(args.curve_ns, args.first_width)
        if (n, w, b) != (args.adaptive_n, args.first_width, None)
    ]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    adaptive += [(args.adaptive_n, args.curve_certainty, args.first_width, b, picked) for b in budgets]
    fractions = [None if f == "off" else float(f) for f in args.fractions.split(",") if f]
    adaptive += [(args.adaptive_n, args.curve_certainty, args.first_width, None, f) for f in fractions if f != picked]
    for n, t, width, budget, fraction in adaptive:
        config = SearchConfig(
            n=n,
            adaptive=True,
            certainty=t,
            first_width=min(width, n),
            budget_tokens=budget,
            budget_fraction=fraction,
            **common,
        )
        name = f"{args.strategy}_n{n}_adaptive_t{t:g}" + (f"_w{width}" if width != args.first_width else "")
        if budget:
            name += f"_budget{budget}"
        elif fraction != picked:
            name += "_nobudget" if fraction is None else f"_f{fraction:g}"
        rows.append(run(name, records, config, args.out, args.generator, args.reuse))
    figures = derived(rows, args.adaptive_n, args.tolerance)
    png = plot_accuracy_vs_compute([r["path"] for r in rows], args.out / "accuracy_vs_computed_tokens.png")
    text = table(rows, figures, args.adaptive_n)
    document = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "derived": figures,
        "plot": str(png),
        "table": text,
    }
    summary_path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\n{text}\nwrote {summary_path}, {png} and {len(rows)} results files in {args.out}")


if __name__ == "__main__":
    main()
