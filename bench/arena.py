"""The shared page arena against every static KV split and the min-max tuner's choice (issue 8).

    OMP_NUM_THREADS=1 python bench/arena.py --out bench/out/arena.json

PRM-guided beam search (N=16, beam width 4, the shipped arithmetic generator and PRM, levels
4-5) under three KV budgets, in this process, one configuration after another on the same
problems:

* `shared`: one page arena for both models, no tuning (the default of `treeserve eval`);
* `prm 0.1` ... `prm 0.7`: static splits giving the PRM that share of the KV bytes;
* `tuned`: the thesis's min-max tuner over static splits: what `treeserve tune --splits
  0.1,...,0.7` picks at that budget (grid: every static split x two `max_num_seqs` values, on
  `--tune-problems` other problems), run again here. (`treeserve tune` by default also
  offers the shared arena; at all three budgets it picked it.)

The budgets: generous (every page the run ever writes stays cached), medium (the peak of
pages in use fits, the prefix cache only partly) and tight (the peak of pages in use does not
fit: sequences are preempted). The working set is measured first, in a generous run. Each
configuration runs `--repeats` times, interleaved, and the table reports medians. A static
split that cannot hold one max_model_len sequence for a model cannot run: 0 problems/min.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from treeserve.eval.profile import measure, tune
from treeserve.eval.runner import EvalSettings, load_problems
from treeserve.search.config import SearchConfig

MIB = 1 << 20


def working_set(settings: EvalSettings, config: SearchConfig, records: list[dict]) -> dict:
    """Pages a generous run writes in all, and the peak it holds in use at once (bytes)."""
    budget = 512 * MIB
    m, doc = measure(replace(settings, page_logs=True), config, budget, None, records=records)
    page = doc["memory"]["page_bytes"]
    logs = doc["page_logs"]
    in_use = sum(max(r["in_use"] for r in rows) for rows in logs.values())  # each model's peak, added
    touched = doc["memory"]["num_pages"] - min(r["free"] for rows in logs.values() for r in rows)
    return {
        "page_bytes": page,
        "peak_in_use": in_use * page,
        "touched": touched * page,
        "problems_per_min": m.problems_per_min,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--tune-problems", type=int, default=12)
    ap.add_argument("--splits", default="0.1,0.2,0.3,0.5,0.7")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default=None, help="MiB, e.g. 160,24,8 (default: from the measured working set)")
    ap.add_argument("--out", default="bench/out/arena.json")
    args = ap.parse_args()

    settings = EvalSettings(dataset=f"arith:level=4,5,size={args.problems},seed=0", progress=False)
    tune_settings = replace(settings, dataset=f"arith:level=4,5,size={args.tune_problems},seed=7")
    config = SearchConfig(strategy="beam_search", n=16, beam_width=4, num_iterations=40, seed=0)
    records = load_problems(settings)
    splits = [float(x) for x in args.splits.split(",")]

    ws = working_set(settings, config, records)
    print(
        f"working set: peak in use {ws['peak_in_use'] / MIB:.1f} MiB, all pages written {ws['touched'] / MIB:.1f} MiB"
    )
    if args.budgets:
        budgets = [int(float(x) * MIB) for x in args.budgets.split(",")]
    else:  # generous: everything stays cached; medium: the in-use peak fits; tight: it does not
        budgets = [int(ws["touched"] * 1.2), int(ws["peak_in_use"] * 1.2), int(ws["peak_in_use"] * 0.4)]
    budgets = [b - b % MIB for b in budgets]

    tuned = {}
    for budget in budgets:
        choice, grid, _ = tune(tune_settings, config, budget, splits, [(64, 2048), (256, 2048)], False)
        tuned[budget] = choice
        print(f"KV {budget / MIB:g} MiB: tuner picks {choice.label}, max_num_seqs {choice.max_num_seqs}", flush=True)

    runs: list[dict] = []
    for repeat in range(args.repeats):
        for budget in budgets:
            choice = tuned[budget]
            plan = [("shared", None, None)] + [(f"prm {s:g}", s, None) for s in splits]
            plan.append(("tuned", choice.prm_kv_fraction, (choice.max_num_seqs, choice.max_num_batched_tokens)))
            for name, split, batch in plan:
                m, _ = measure(settings, config, budget, split, batch, records)
                runs.append({"repeat": repeat, "budget": budget, "config": name, **asdict(m)})
                print(
                    f"  [{repeat}] KV {budget / MIB:g} MiB {name}: {m.problems_per_min:.1f} problems/min, "
                    f"acc {m.accuracy:.3f}, hit gen {m.generator_hit_rate:.2f} prm {m.prm_hit_rate:.2f}, "
                    f"evictions {m.evictions}, preemptions {m.preemptions}",
                    flush=True,
                )

    table = []
    for budget in budgets:
        row = {"budget_mib": budget / MIB}
        for name in ["shared", *[f"prm {s:g}" for s in splits], "tuned"]:
            values = [r["problems_per_min"] for r in runs if r["budget"] == budget and r["config"] == name]
            row[name] = statistics.median(values)
        best_static = max(row[f"prm {s:g}"] for s in splits)
        row["best static"] = best_static
        row["shared / best static"] = row["shared"] / best_static if best_static else float("inf")
        row["shared / tuned"] = row["shared"] / row["tuned"] if row["tuned"] else float("inf")
        row["tuned choice"] = f"{tuned[budget].label}, max_num_seqs {tuned[budget].max_num_seqs}"
        table.append(row)
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "problems": args.problems,
        "working_set": ws,
        "budgets": budgets,
        "runs": runs,
        "table": table,
        "tuned": {b: asdict(m) for b, m in tuned.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    names = ["shared", *[f"prm {s:g}" for s in splits], "tuned"]
    print("\n| KV MiB | " + " | ".join(names) + " | shared / best static | shared / tuned | tuner's choice |")
    print("|---" * (len(names) + 4) + "|")
    for row in table:
        cells = " | ".join(f"{row[n]:.1f}" for n in names)
        print(
            f"| {row['budget_mib']:g} | {cells} | {row['shared / best static']:.2f}x | {row['shared / tuned']:.2f}x "
            f"| {row['tuned choice']} |"
        )


if __name__ == "__main__":
    main()
