"""Where treeserve's beam search spends its time: wall-clock timers around the engine's calls.

    OMP_NUM_THREADS=1 python bench/profile_search.py [--problems 40] [--n 16]

Runs `treeserve eval` (beam search on arithmetic levels 4-5, the shipped models) with
timers wrapped around the model forward, the engine step, sampling and scheduling, each C
kernel and every `F.linear` call (noting the first call of each (rows, weight) shape, where
oneDNN builds its kernel). Timers cost microseconds against millisecond calls, unlike a
tracing profiler, so the split matches an untimed run. Nested timers overlap: the kernels
are inside the forward, the forward inside the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treeserve import cli  # noqa: E402
from treeserve.engine import attention, llm_engine, model_runner, scheduler  # noqa: E402
from treeserve.kernels import cpu as cpu_kernels  # noqa: E402

seconds: Counter[str] = Counter()
calls: Counter[str] = Counter()
linear_shapes: set[tuple] = set()


def timed(owner: object, name: str, label: str) -> None:
    inner: Callable = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


def timed_linear() -> None:
    inner = cpu_kernels.F.linear

    def wrapper(x, weight, bias=None):  # noqa: ANN001, ANN202 - F.linear's signature
        shape = (x.shape[:-1], weight.shape)
        start = time.perf_counter()
        out = inner(x, weight, bias)
        label = "F.linear (first call of a shape)" if shape not in linear_shapes else "F.linear (shape seen before)"
        linear_shapes.add(shape)
        seconds[label] += time.perf_counter() - start
        calls[label] += 1
        return out

    cpu_kernels.F.linear = wrapper  # the module object is torch.nn.functional: every F.linear caller


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--n", type=int, default=16)
    args = ap.parse_args()
    timed(llm_engine.LLMEngine, "step", "engine step")
    timed(model_runner.ModelRunner, "run", "  model forward")
    timed(attention.AttentionBatch, "__call__", "    attention (all of it)")
    for kernel in ("paged_decode", "paged_prefill", "rms_norm_bf16", "rope_bf16", "linear_bf16", "sample_rows"):
        timed(cpu_kernels, kernel, f"    C {kernel}")
    timed(llm_engine.LLMEngine, "_sample", "  sampling (LM head included)")
    timed(scheduler.Scheduler, "schedule", "  scheduling")
    timed_linear()
    dataset = f"arith:level=4,5,size={args.problems},seed=0"
    start = time.perf_counter()
    cli.main(["eval", "--dataset", dataset, "--strategy", "beam_search", "--n", str(args.n), "--output", os.devnull])
    print(f"\nwhole command {time.perf_counter() - start:.2f} s (start-up included)\n")
    print("| timer | seconds | calls |\n|---|---|---|")
    for label, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {total:.2f} | {calls[label]} |")


if __name__ == "__main__":
    main()
