"""How treeserve's beam search scales: problems/min as N grows and as more problems are in flight.

    OMP_NUM_THREADS=1 python bench/search_scaling.py --problems 20 --repeats 3 --out bench/out/search_scaling.json

Same workload as bench/search.py (arithmetic levels 4-5, shipped generator and PRM, bf16,
beam width 4, T=0.8, last iteration to EOS), through `treeserve eval`'s code path in this
process. Two sweeps: N in `--ns` with every problem in flight, and problems in flight
(`max_concurrent_problems`) in `--in-flight` at N=16. Medians over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from treeserve.eval.arith import arith_dataset
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.search.config import SearchConfig


def measure(records: list[dict], n: int, in_flight: int, repeats: int) -> dict:
    settings = EvalSettings(dataset="inline", progress=False)
    config = SearchConfig(
        strategy="beam_search", n=n, beam_width=4, final_to_eos=True, max_concurrent_problems=in_flight
    )
    runs = []
    for _ in range(repeats):
        s = run_eval(settings, config, inline=records)["summary"]
        per_s = s["generated_tokens_per_s"]
        runs.append(
            {"problems_per_min": s["problems_per_s"] * 60, "generated_tokens_per_s": per_s, "accuracy": s["accuracy"]}
        )
    return {
        "n": n,
        "in_flight": in_flight,
        "runs": runs,
        "problems_per_min": statistics.median(r["problems_per_min"] for r in runs),
        "generated_tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in runs),
        "accuracy": statistics.median(r["accuracy"] for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ns", default="4,16,64,256")
    ap.add_argument("--in-flight", default="1,4,16,64")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "search_scaling.json"))
    args = ap.parse_args()
    records = arith_dataset(size=args.problems, seed=0, levels=(4, 5))
    rows = [measure(records, int(n), len(records), args.repeats) for n in args.ns.split(",")]
    rows += [measure(records, 16, int(k), args.repeats) for k in args.in_flight.split(",")]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("| N | problems in flight | problems/min | generated tok/s | accuracy |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['in_flight']} | {r['problems_per_min']:.1f} | {r['generated_tokens_per_s']:.0f} | "
            f"{r['accuracy']:.1%} |"
        )


if __name__ == "__main__":
    main()
