"""Where treeserve's beam search spends its time: wall-clock timers around the engine's calls.

    OMP_NUM_THREADS=1 python bench/profile_search.py [--problems 40] [--n 16]

Runs `treeserve eval` (beam search on arithmetic levels 4-5, the shipped models) with
timers wrapped around the engine step (steps not overlapped), its device work
(`ModelRunner.execute`: forward, LM head, draw), attention, sampling, the draw, scheduling,
each pass of the garbage collector and every `F.linear` call that goes through
`torch.nn.functional` (noting the first call of each (rows, weight) shape, where oneDNN builds
its kernel; the C kernels are called by name and not
timed here: `bench/kernels.py` times them). Timers cost microseconds against millisecond calls,
unlike a tracing profiler, so the split matches an untimed run. Nested timers overlap: attention
is inside the device work, the device work inside the step. The step minus its device work is
the engine's host time; the run's wall minus the steps is the search's own Python and start-up.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treeserve import cli  # noqa: E402
from treeserve.engine import attention, llm_engine, model_runner, sampler, scheduler  # noqa: E402
from treeserve.kernels import cpu as cpu_kernels  # noqa: E402  (its F is torch.nn.functional)

seconds: Counter[str] = Counter()
calls: Counter[str] = Counter()
linear_shapes: set[tuple] = set()
inside: Counter[str] = Counter()  # timers running now, by label


def timed(owner: object, name: str, label: str) -> None:
    inner: Callable = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        inside[label] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            inside[label] -= 1
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


def timed_gc() -> None:
    """The cyclic collector's passes, by generation: `gc.callbacks` brackets each one."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            where = "inside an engine step" if inside["engine step"] else "between steps or at start-up"
            label = f"gc collection, generation {info['generation']}, {where}"
            seconds[label] += time.perf_counter() - started.pop()
            calls[label] += 1

    gc.callbacks.append(callback)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--n", type=int, default=16)
    args = ap.parse_args()
    timed(llm_engine.LLMEngine, "step_plain", "engine step")  # (the loop chosen at start-up: steps not overlapped)
    timed(model_runner.ModelRunner, "execute", "  device work: forward, LM head, draw")
    timed(attention.AttentionBatch, "__call__", "    attention (all of it)")
    timed(model_runner, "sample_plan", "    sampling (LM head included)")
    timed(sampler, "sample", "      draw")
    timed(scheduler.Scheduler, "schedule", "  scheduling")
    timed_linear()
    timed_gc()
    dataset = f"arith:level=4,5,size={args.problems},seed=0"
    start = time.perf_counter()
    cli.main(["eval", "--dataset", dataset, "--strategy", "beam_search", "--n", str(args.n), "--output", os.devnull])
    wall = time.perf_counter() - start
    print(f"\nwhole command {wall:.2f} s (start-up included)\n")
    collected = sum(t for label, t in seconds.items() if label.startswith("gc "))
    in_steps = sum(t for label, t in seconds.items() if label.startswith("gc ") and "inside" in label)
    print(f"garbage collection: {collected:.3f} s, {100 * collected / wall:.2f}% of the wall; ", end="")
    print(f"inside engine steps {in_steps:.3f} s, {100 * in_steps / wall:.2f}%\n")
    print("| timer | seconds | calls |\n|---|---|---|")
    for label, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {total:.2f} | {calls[label]} |")


if __name__ == "__main__":
    main()
