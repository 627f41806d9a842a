"""Scale-out on Ray: problems/min with 1 and 2 workers, and what Ray's dispatch costs per problem.

    OMP_NUM_THREADS=1 python bench/ray_eval.py --problems 40 --n 16 --repeats 3 --out bench/out/ray_eval.json

Workload: bench/search.py's (arithmetic levels 4-5, the shipped generator and PRM, bf16, beam
width 4, T=0.8, last iteration to EOS) through `treeserve eval`'s code paths in this process:
`in-process` (run_eval, one torch thread, no Ray) and `ray-W` (run_eval_distributed on W Ray
actors of one CPU and one torch thread each) on one local Ray instance started here with
`--cpus` CPUs. Systems rotate order every repetition; numbers are medians. Problems/min count
from the first problem handed out to the last answer (model loading and actor start-up are
reported apart, as `startup_s`).

Dispatch overhead, three ways:
- `noop_rtt_ms`: the round trip of an empty call to an async actor (Ray's floor), and with a
  payload the size of one problem's result (`result_rtt_ms`);
- `dispatch_overhead_ms`: per problem, the driver's wait from handing it out to holding its
  answer, minus the worker's own search time for it (the summary's `dispatch_overhead_s`),
  next to that search time (`worker_search_s`);
- `driver_cpu_ms_per_problem`: the driver process's CPU time per problem over the whole call
  (dispatch, merging, grading), which on a small machine competes with the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import torch

from treeserve.eval.arith import arith_dataset
from treeserve.eval.distributed import RayOptions, run_eval_distributed
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.search.config import SearchConfig


class Echo:
    async def echo(self, x: object) -> object:
        await asyncio.sleep(0)
        return x


def round_trips(ray, calls: int) -> dict:  # noqa: ANN001
    """Median and p90 round trip (ms) of sequential calls to an async actor, empty and with a
    payload like one problem's result (16 completions of ~300 characters with 8 step scores)."""
    actor = ray.remote(Echo).options(num_cpus=0).remote()
    payload = {"completions": [("x" * 300, [0.5] * 8)] * 16, "seconds": 1.0, "counters": {str(i): i for i in range(24)}}
    out = {}
    for name, arg in (("noop_rtt_ms", None), ("result_rtt_ms", payload)):
        ray.get([actor.echo.remote(arg) for _ in range(20)])  # warm up
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get(actor.echo.remote(arg))
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        out[name] = {"median": statistics.median(times), "p90": times[int(0.9 * (len(times) - 1))]}
    ray.kill(actor)
    return out


def run_once(system: str, records: list[dict], config: SearchConfig) -> dict:
    settings = EvalSettings(dataset="inline", progress=False)
    cpu = time.process_time()
    if system == "in-process":
        doc = run_eval(settings, config, inline=records)
    else:
        doc = run_eval_distributed(settings, config, RayOptions(workers=int(system.split("-")[1])), inline=records)
    cpu = time.process_time() - cpu
    s = doc["summary"]
    return {
        "problems_per_min": s["problems_per_s"] * 60,
        "wall_s": s["wall_time_s"],
        "startup_s": s.get("worker_startup_s"),
        "worker_search_s": s.get("worker_search_s"),
        "dispatch_overhead_ms": s["dispatch_overhead_s"] * 1e3 if "dispatch_overhead_s" in s else None,
        "driver_cpu_ms_per_problem": cpu / len(records) * 1e3,
        "accuracy": s["accuracy"],
        "preds": [p["pred"] for p in doc["problems"]],
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="worker counts to run (one CPU and one thread each)")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    ap.add_argument("--rtt-calls", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "ray_eval.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # the in-process system gets what one worker gets
    import ray

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        rtt = round_trips(ray, args.rtt_calls)
        records = arith_dataset(size=args.problems, seed=0, levels=(4, 5))
        config = SearchConfig(strategy="beam_search", n=args.n, beam_width=4, final_to_eos=True)
        systems = ["in-process"] + [f"ray-{w}" for w in args.workers.split(",")]
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for rep in range(args.repeats):
            for system in systems[rep % len(systems) :] + systems[: rep % len(systems)]:
                runs[system].append(run_once(system, records, config))
                print(f"rep {rep} {system}: {runs[system][-1]['problems_per_min']:.1f} problems/min", flush=True)
    finally:
        ray.shutdown()

    keys = (
        "problems_per_min",
        "wall_s",
        "startup_s",
        "worker_search_s",
        "dispatch_overhead_ms",
        "driver_cpu_ms_per_problem",
        "accuracy",
    )
    rows = {s: {k: median_of(r, k) for k in keys} for s, r in runs.items()}
    base = runs["in-process"][0]["preds"]
    for s, r in runs.items():
        rows[s]["same_answers_as_in_process"] = sum(a == b for a, b in zip(r[0]["preds"], base, strict=True))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "round_trips": rtt, "rows": rows, "runs": runs}, f, indent=1)

    empty, result = rtt["noop_rtt_ms"], rtt["result_rtt_ms"]
    print(
        f"\nRay round trip: empty {empty['median']:.2f} ms (p90 {empty['p90']:.2f}), "
        f"one problem's result {result['median']:.2f} ms (p90 {result['p90']:.2f})"
    )
    print(f"{args.problems} problems, beam search N={args.n}, medians of {args.repeats}\n")
    print(
        "| system | problems/min | vs ray-1 | start-up s | search s/problem | dispatch ms/problem | "
        "driver CPU ms/problem | accuracy | same answers |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    one = rows.get("ray-1", {}).get("problems_per_min")

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for s, r in rows.items():
        print(
            f"| {s} | {r['problems_per_min']:.1f} | {fmt(one and r['problems_per_min'] / one, '.2f')} | "
            f"{fmt(r['startup_s'], '.1f')} | {fmt(r['worker_search_s'], '.2f')} | "
            f"{fmt(r['dispatch_overhead_ms'], '.1f')} | {r['driver_cpu_ms_per_problem']:.1f} | "
            f"{r['accuracy']:.1%} | {r['same_answers_as_in_process']}/{args.problems} |"
        )


if __name__ == "__main__":
    main()
