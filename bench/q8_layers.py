"""Gemma 3 270M's layer matmuls on the 8-bit kernel, this tree's against another checkout's.

    python bench/q8_layers.py --before /tmp/before --rows 1,2,4,16,128 --repeats 20

A batch-1 decode step multiplies 72 layer matrices (q|k|v, o, gate|up, down of 18 layers: Q5_0,
Q8_0, Q4_K and Q6_K as the Q4_K_M GGUF stores them, laid out as packed panels) by one row. Each
pass here runs all 72 at `--rows` rows, as the layer stack does, after sweeping 64 MB so the
weights come from memory as they do in a decode step (`--warm`: the first 4 layers only, no
sweep, so they stay in the caches and the time is the kernel's arithmetic). The two libraries
(`q8_kernels.c` built from this tree and from `--before`, e.g. a `git worktree` of an earlier
commit) run on the same panels in one process, passes alternated and their order swapped every
repetition; without `--before` this tree's runs against itself (the harness's own spread).
Prints the median ms of a pass, the ratio, and whether every output is bit-identical.
`--lm-head`: the tied LM head's one matrix (262144 x 640 Q8_0 panels) instead of the layers.
The panels are laid out by this tree: a checkout that lays them out differently (before aae514a,
each panel's scales came after its codes) reads them wrongly, and bit-identical says False.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treeserve import LLM  # noqa: E402
from treeserve.kernels.cpu import build, quant  # noqa: E402
from treeserve.models.pypi_gguf import fetch_gguf  # noqa: E402

MATRICES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def library(checkout: str | None):  # noqa: ANN201 - a ctypes.CDLL
    if checkout is None:
        return quant.load_q8()
    lib = build(Path(checkout) / "treeserve" / "kernels" / "cpu" / "q8_kernels.c", quant.QUANT_FLAGS)
    lib.q8_matmul.argtypes = quant.MATMUL_ARGS
    return lib


def one_pass(matmul, plans: list, x: dict, out: list, rows: int, threads: int, sweep: torch.Tensor) -> float:  # noqa: ANN001
    """Seconds for every matrix at `rows` rows (`matmul`: a library's q8_matmul), after the sweep."""
    sweep.add_(1)
    start = time.perf_counter()
    for plan, o in zip(plans, out, strict=True):
        matmul(*plan.args, x[plan.k].data_ptr(), plan.k, rows, None, o.data_ptr(), plan.n, 1, 1, threads)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="the checkout to compare with (default: this tree)")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warm", action="store_true", help="4 layers kept in the caches: the arithmetic alone")
    ap.add_argument("--lm-head", action="store_true", help="the tied LM head (178 MB of Q8_0 panels) instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(str(fetch_gguf("gemma3-270m"))).engine.model
    layers = model.layers[:4] if args.warm else model.layers
    plans = [layer.get_submodule(name).weight.plan for layer in layers for name in MATRICES]
    if args.lm_head:
        plans = [model.embed_tokens.weight.plan]
    if not all(plan.q8 and plan.laid_out for plan in plans):
        raise SystemExit("these matrices are not on the 8-bit kernel's packed panels")
    libs = {"before": library(args.before), "after": library(None)}
    sweep = torch.empty(0 if args.warm else 64 << 20, dtype=torch.uint8)
    print(
        f"{len(plans)} matrices, {sum(d.numel() for plan in plans for _, d, *_ in plan.tensors) / 1e6:.0f} MB, "
        f"{args.threads} threads, {'warm' if args.warm else 'from memory'}"
    )
    print("| rows | before ms | after ms | after / before | bit-identical |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {plan.k: torch.randn(rows, plan.k).to(torch.bfloat16) for plan in plans}
        out = {name: [torch.empty(rows, plan.n, dtype=torch.bfloat16) for plan in plans] for name in libs}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for rep in range(args.repeats + 1):
            for name in ("before", "after") if rep % 2 else ("after", "before"):
                seconds = one_pass(libs[name].q8_matmul, plans, x, out[name], rows, args.threads, sweep)
                if rep:  # the first pass of each warms up
                    times[name].append(seconds)
        before, after = (1e3 * statistics.median(times[name]) for name in ("before", "after"))
        same = all(torch.equal(a, b) for a, b in zip(out["before"], out["after"], strict=True))
        print(f"| {rows} | {before:.3f} | {after:.3f} | {after / before:.3f} | {same} |")


if __name__ == "__main__":
    main()
