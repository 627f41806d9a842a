"""Search strategies at equal compute: accuracy against computed tokens on held-out arithmetic (issue 89).

    python bench/strategies.py --problems 120 --threads 1 --out bench/out/strategies
    python bench/strategies.py --strategies beam_search,dvts,best_of_n --ns 4,16,64   (a subset)
    python bench/strategies.py --smoke                                                (a check: 4 problems, N=4)
    treeserve plot bench/out/strategies/*.json --x computed-tokens                    (the points, without lines)

On the held-out arithmetic problems bench/adaptive.py uses (levels 4-5, `arith_dataset` seed 0;
`--dataset-seed` picks another set), through `treeserve eval`'s code path (`run_eval`) in this
process, one run after another: each strategy of `--strategies` (beam_search, dvts,
weighted_best_of_n, rebase, particle_filtering, mcts; names passed as they are to
`SearchConfig.strategy`) at each N of `--ns` (4, 8, 16, 32, 64). N is the width: the beams of
beam search and DVTS (beam width 4, so N=4 DVTS is one subtree), the samples of best-of-N,
REBASE's budget (the nodes it expands per depth, the solutions it returns), the particles of
particle filtering and the solutions MCTS collects (at most 4 children a node). Every run has
`treeserve eval`'s search defaults otherwise (T=0.8, 256 tokens a step, 40 iterations, the
shipped generator and PRM, bf16). `--reward-temperature`
(REBASE and particle filtering) and `--resample-threshold` (particle filtering) reach those
strategies' configs only when given, as `--exploration` does MCTS's; unset, each strategy keeps
`SearchConfig`'s default. `--reuse` takes a run from `--out` when its results there are of that very
run (search config, problems, rule): a cut-short invocation resumes, and a strategy added later runs
alone while the figure and the comparison still hold every run.

Every run is judged by one answer rule, `--rule` (weighted), passed to `run_eval` as its
selection (`EvalSettings.selection`), so each strategy's headline accuracy is that rule's
(`best_of_n` and `weighted_best_of_n` are then the same run).

Each run's results JSON goes into `--out`, with `OUT/accuracy_vs_computed_tokens.png`
(`plot_accuracy_vs_compute`, `lines=True`: one line per strategy and the Pareto front over all
runs). The rows, the runs on the Pareto front, the comparison and the markdown table go to
`--summary` (default: `--out` with `.json` added, beside the folder) and the table also to the
same path with `.md`. Per run: accuracy, computed tokens (generator + PRM tokens the engines
ran, the summary's `computed_tokens`), generated tokens, wall seconds of the search and
problems/min.

The comparison, at each N of `--compare-ns` (16, 64): beam search's run against every other
strategy at equal computed tokens: that strategy's accuracy interpolated linearly in log tokens
(the figure's axis) between its two runs around beam search's tokens, or its nearest run's
when beam search's tokens lie outside its runs; printed as "at equal computed tokens, X is
+p points vs beam search at N=16".

`--smoke`: 4 problems, N=4, the strategies of `--strategies` that `SearchConfig` knows
(`context.STRATEGIES`), compared at N=4, into `bench/out/strategies_smoke` unless `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from treeserve.eval.arith import arith_dataset
from treeserve.eval.journal import config_differences
from treeserve.eval.metrics import SELECTIONS
from treeserve.eval.plots import pareto_front, plot_accuracy_vs_compute
from treeserve.eval.report import upgrade_config, write_results
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.search.config import STRATEGIES, SearchConfig

ALL_STRATEGIES = "beam_search,dvts,weighted_best_of_n,rebase,particle_filtering,mcts"
TREE_STRATEGIES = ("beam_search", "dvts", "mcts")  # beam width 4, as `treeserve eval` (MCTS: children a node)
# SearchConfig fields given only when their flag is, and only to the strategies that take them (it refuses others)
TUNED = {
    "reward_temperature": ("rebase", "particle_filtering"),
    "resample_threshold": ("particle_filtering",),
    "exploration": ("mcts",),
}


def configs(strategies: list[str], ns: list[int], knobs: dict[str, float | None]) -> list[SearchConfig]:
    """Every run's config, built (and so checked) before any model loads."""
    out = []
    for strategy in strategies:
        extra: dict = {"beam_width": 4} if strategy in TREE_STRATEGIES else {}
        extra |= {f: knobs[f] for f, takers in TUNED.items() if strategy in takers and knobs[f] is not None}
        out += [SearchConfig(strategy=strategy, n=n, temperature=0.8, **extra) for n in ns]
    return out


def reusable(path: Path, config: SearchConfig, records: list[dict], rule: str) -> dict | None:
    """The results at `path` when they are of this very run (search config, problems, rule), else None."""
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    ran = upgrade_config(document["config"])  # settings added since it ran, at their defaults
    now = json.loads(json.dumps(asdict(config)))
    same = not config_differences(ran["search"], now) and ran["selection"] == rule
    ids = [p["unique_id"] for p in document["problems"]]
    return document if same and ids == [r["unique_id"] for r in records] else None


def run(config: SearchConfig, records: list[dict], rule: str, out: Path, reuse: bool) -> dict:
    """One eval run under answer rule `rule`, its results written to `out/<strategy>_n<N>.json`
    (with `reuse`, read from there when it holds this run); its row."""
    name = f"{config.strategy}_n{config.n}"
    start = time.perf_counter()
    path = out / f"{name}.json"
    document = reusable(path, config, records, rule) if reuse else None
    if document is None:
        settings = EvalSettings(dataset="inline", selection=rule, progress=False)
        document = run_eval(settings, config, inline=records)
        path = write_results(document, path)
    summary = document["summary"]
    row = {
        "name": name,
        "path": str(path),
        "strategy": config.strategy,
        "n": config.n,
        "problems": len(document["problems"]),
        "accuracy": summary["accuracy"],
        "rule": summary["accuracy_rule"],
        "computed_tokens": summary["computed_tokens"],
        "generated_tokens": summary["generated_tokens"],
        "wall_s": summary["wall_time_s"],
        "problems_per_min": 60 * summary["problems_per_s"],
        "process_s": time.perf_counter() - start,  # with model loading and grading
    }
    print(json.dumps(row), flush=True)
    return row


def at_tokens(runs: list[dict], tokens: float) -> dict:
    """A strategy's accuracy at `tokens` computed tokens: interpolated linearly in log tokens between
    its runs on either side, else its nearest run's; with the runs it came from and their tokens."""
    runs = sorted(runs, key=lambda r: r["computed_tokens"])
    below = [r for r in runs if r["computed_tokens"] <= tokens]
    above = [r for r in runs if r["computed_tokens"] >= tokens]
    if below and above and below[-1]["computed_tokens"] == tokens:
        return {"accuracy": below[-1]["accuracy"], "how": "equal", "runs": {below[-1]["name"]: tokens}}
    if below and above:
        a, b = below[-1], above[0]
        weight = math.log(tokens / a["computed_tokens"]) / math.log(b["computed_tokens"] / a["computed_tokens"])
        accuracy = a["accuracy"] + weight * (b["accuracy"] - a["accuracy"])
        used = {a["name"]: a["computed_tokens"], b["name"]: b["computed_tokens"]}
        return {"accuracy": accuracy, "how": "interpolated", "runs": used}
    nearest = min(runs, key=lambda r: abs(math.log(r["computed_tokens"] / tokens)))
    return {"accuracy": nearest["accuracy"], "how": "nearest", "runs": {nearest["name"]: nearest["computed_tokens"]}}


def compare(rows: list[dict], ns: list[int]) -> list[dict]:
    """At each N of `ns`, beam search's run against every other strategy at its computed tokens."""
    out = []
    others = list(dict.fromkeys(r["strategy"] for r in rows if r["strategy"] != "beam_search"))
    for beam in (r for r in rows if r["strategy"] == "beam_search" and r["n"] in ns):
        for strategy in others:
            point = at_tokens([r for r in rows if r["strategy"] == strategy], beam["computed_tokens"])
            beam_side = {"n": beam["n"], "beam_search": beam["name"], "beam_accuracy": beam["accuracy"]}
            beam_side["computed_tokens"] = beam["computed_tokens"]
            points = 100 * (point["accuracy"] - beam["accuracy"])
            out.append(beam_side | {"strategy": strategy, "points": points} | point)
    return out


def sentence(c: dict) -> str:
    head = f"at equal computed tokens, {c['strategy']} is {c['points']:+.1f} points vs beam search at N={c['n']}"
    accuracies = f"beam search {c['beam_accuracy']:.1%}, {c['strategy']} {c['accuracy']:.1%}"
    runs = ", ".join(f"{name} at {tokens}" for name, tokens in c["runs"].items())
    return f"{head} ({c['computed_tokens']} tokens: {accuracies}; {c['how']}: {runs})"


def table(rows: list[dict], front: list[str]) -> str:
    lines = [
        "| run | strategy | N | accuracy | computed tokens | generated tokens | wall s | problems/min | Pareto front |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tokens = f"{r['computed_tokens']} | {r['generated_tokens']}"
        speed = f"{r['wall_s']:.1f} | {r['problems_per_min']:.1f}"
        head = f"{r['name']} | {r['strategy']} | {r['n']} | {r['accuracy']:.1%}"
        lines.append(f"| {head} | {tokens} | {speed} | {'yes' if r['name'] in front else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=120, help="arithmetic problems (levels 4-5)")
    ap.add_argument("--dataset-seed", type=int, default=0, help="arith_dataset's seed (0: the held-out test split)")
    ap.add_argument("--strategies", default=ALL_STRATEGIES, help="SearchConfig.strategy names, comma-separated")
    ap.add_argument("--ns", default="4,8,16,32,64", help="N of every strategy: beams, samples or particles")
    ap.add_argument("--rule", default="weighted", choices=SELECTIONS, help="the answer rule every run is judged by")
    ap.add_argument("--compare-ns", default="16,64", help="beam search's N to compare the others at")
    ap.add_argument("--reward-temperature", type=float, default=None, help="REBASE's, particle filtering's")
    ap.add_argument("--resample-threshold", type=float, default=None, help="particle filtering's (default: config's)")
    ap.add_argument("--exploration", type=float, default=None, help="MCTS's UCT constant (default: config's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="the runs' results (default: bench/out/strategies[_smoke])")
    ap.add_argument("--summary", type=Path, default=None, help="rows, front, comparison, table (default: OUT.json)")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="take a run's results from --out when they hold that very run (a run cut short, resumed)",
    )
    ap.add_argument("--smoke", action="store_true", help="4 problems, N=4, every strategy SearchConfig knows")
    args = ap.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    if args.smoke:
        skipped = [s for s in strategies if s not in STRATEGIES]
        strategies = [s for s in strategies if s in STRATEGIES]
        args.problems, args.ns, args.compare_ns = 4, "4", "4"
        print(f"smoke: {', '.join(strategies)}; not in SearchConfig yet: {', '.join(skipped) or 'none'}")
    out = args.out or Path("bench/out/strategies" + ("_smoke" if args.smoke else ""))
    summary_path = args.summary or out.with_name(out.name + ".json")
    ns = sorted({int(n) for n in args.ns.split(",")})
    knobs = {
        "reward_temperature": args.reward_temperature,
        "resample_threshold": args.resample_threshold,
        "exploration": args.exploration,
    }
    runs = configs(strategies, ns, knobs)
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    records = arith_dataset(size=args.problems, seed=args.dataset_seed, levels=(4, 5))
    rows = [run(config, records, args.rule, out, args.reuse) for config in runs]

    png = plot_accuracy_vs_compute([r["path"] for r in rows], out / "accuracy_vs_computed_tokens.png", lines=True)
    points = pareto_front([(r["computed_tokens"], r["accuracy"]) for r in rows])
    front = [next(r for r in rows if (r["computed_tokens"], r["accuracy"]) == p)["name"] for p in points]
    comparison = compare(rows, [int(n) for n in args.compare_ns.split(",") if n])
    text = table(rows, front)
    lines = [sentence(c) for c in comparison] or ["no beam search run at --compare-ns to compare against"]
    document = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rule": args.rule,
        "rows": rows,
        "pareto_front": [r for r in rows if r["name"] in front],
        "comparison": comparison,
        "plot": str(png),
        "table": text,
    }
    summary_path.write_text(json.dumps(document, indent=1) + "\n")
    markdown = summary_path.with_suffix(".md")
    markdown.write_text(f"answer rule: {args.rule}\n\n{text}\n" + "".join(f"- {line}\n" for line in lines))
    print(f"\nanswer rule: {args.rule}\n\n{text}")
    print("\n".join(lines))
    print(f"\nwrote {summary_path}, {markdown}, {png} and {len(rows)} results files in {out}")


if __name__ == "__main__":
    main()
