"""Where a beam search's time goes on a GPU: a timed eval, then a small one under torch.profiler.

    python bench/gpu_profile.py [--problems 16] [--n 16] [--profile-problems 2] [--device cuda]

Runs `treeserve eval`'s code path (the shipped arithmetic models, bf16) once to warm up
(Triton compiles, allocator), once timed (wall time per engine step, busy time per model),
then `--profile-problems` problems under the profiler: host operator calls per engine step,
the GPU's kernel time against the wall time, and the operators that take the most host and
device time. (On a CPU the memory planner's own profiler ends the outer one: use a GPU.)
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig


def summary(problems: int, args: argparse.Namespace) -> dict:
    settings = EvalSettings(
        dataset=f"arith:level=4,5,size={problems},seed=0",
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="bfloat16", kv_cache_memory=1 << 30, device=args.device),
    )
    return run_eval(settings, SearchConfig(strategy="beam_search", n=args.n, beam_width=4, seed=0))["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--profile-problems", type=int, default=2)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    summary(args.problems, args)  # warm-up
    s = summary(args.problems, args)
    wall, steps = s["wall_time_s"], s["generator_steps"] + s["prm_steps"]
    print(f"search {wall:.2f} s, {60 * args.problems / wall:.1f} problems/min, accuracy {s['accuracy']:.3f}")
    for name in ("generator", "prm"):
        print(
            f"  {name}: {s[f'{name}_steps']} steps, busy {s[f'{name}_busy_s']:.2f} s, "
            f"{s[f'{name}_computed_tokens']} tokens computed"
        )
    print(f"  {1000 * wall / steps:.2f} ms of wall time per engine step", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        s = summary(args.profile_problems, args)
    events = prof.key_averages()
    if not events:
        raise SystemExit("the profiler recorded nothing")
    wall, steps = s["wall_time_s"], s["generator_steps"] + s["prm_steps"]
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    print(f"profiled: {args.profile_problems} problems, {steps} steps, {calls / steps:.0f} aten calls per step")
    if args.device.startswith("cuda"):
        kernels = sum(e.self_device_time_total for e in events) / 1e6
        print(f"  GPU busy (sum of kernel times) {kernels:.2f} s = {100 * kernels / wall:.0f}% of the wall time")
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
