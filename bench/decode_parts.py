"""Where a batch-1 decode token's time goes: Gemma 3 270M, timers around its two big C calls.

    python bench/decode_parts.py --repeats 3 --tokens 128
    python /tmp/before/bench/decode_parts.py ...   # a copy in a `git worktree` runs that commit

The quantised GGUF as `LLM(model=<gguf>)` loads it (bench/generate.py's decode1 settings), one
16-token prompt, greedy tokens with
`ignore_eos`, after one warm-up request. Timers wrap `Stack.run` or `Stack.run_ids` (the layer stack:
every layer in one C call) and `Plan.run` (a quantised matmul called from Python: at decode, the
tied LM head), and the report gives per token, medians over each request's tokens: the stack,
the LM head, the host time from the stack to the LM head (final norm, logits call) and from the
LM head to the next stack (the greedy pick, read-back, scheduling, inputs, embedding), and the
request's ms/token. One process, so the memory state is the same for every part of a request.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from treeserve import LLM, SamplingParams  # noqa: E402
from treeserve.kernels.cpu import layer_stack, quant  # noqa: E402
from treeserve.models.pypi_gguf import fetch_gguf  # noqa: E402

EVENTS: list[tuple[str, int, float]] = []  # (call, 0 enter | 1 leave, time)


def timed(cls: type, name: str, label: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        EVENTS.append((label, 0, time.perf_counter()))
        result = original(*args, **kwargs)
        EVENTS.append((label, 1, time.perf_counter()))
        return result

    setattr(cls, name, wrapper)


def spans(first: tuple[str, int], second: tuple[str, int]) -> list[float]:
    """Seconds from each `first` event to a `second` event right after it."""
    return [b[2] - a[2] for a, b in itertools.pairwise(EVENTS) if a[:2] == first and b[:2] == second]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed requests")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    timed(layer_stack.Stack, "run", "stack")
    if hasattr(layer_stack.Stack, "run_ids"):  # the stack that looks the rows up itself (since 2026-11-29)
        timed(layer_stack.Stack, "run_ids", "stack")
    timed(quant.Plan, "run", "lm")
    llm = LLM(
        str(fetch_gguf("gemma3-270m")),
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory=1 << 30,
        seed=0,
    )  # as bench/generate.py's decode1
    prompt = [{"prompt_token_ids": [2] + list(range(1000, 1015))}]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompt, params)
    print(f"{args.threads} threads, {args.tokens} tokens a request; ms a token (medians over the request's tokens)")
    print("| ms/token | stack | stack -> LM head | LM head | LM head -> stack |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeats):
        EVENTS.clear()
        start = time.perf_counter()
        llm.generate(prompt, params)
        seconds = time.perf_counter() - start
        parts = [
            spans(("stack", 0), ("stack", 1)),
            spans(("stack", 1), ("lm", 0)),
            spans(("lm", 0), ("lm", 1)),
            spans(("lm", 1), ("stack", 0)),
        ]
        print(
            f"| {1e3 * seconds / args.tokens:.2f} | "
            + " | ".join(f"{1e3 * statistics.median(p):.3f}" for p in parts)
            + " |"
        )


if __name__ == "__main__":
    main()
