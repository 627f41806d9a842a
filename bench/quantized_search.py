"""Search accuracy with the shipped pair quantised as users download checkpoints (issue 88).

Writes the shipped generator and PRM as compressed-tensors checkpoints (compressed-tensors'
own writer, data-free min-max scales: tests/quantized_files.py) in each scheme asked for, then
runs the same `treeserve eval` search with the bf16 pair and with each quantised pair, and
prints `treeserve compare`'s paired accuracy. Accuracy and tokens are deterministic, so the
machine's load does not change them. Needs compressed-tensors and transformers (the test extras).

    python bench/quantized_search.py --schemes W4A16,W8A8 --size 100 --n 16
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.quantized_files import write_compressed_tensors  # noqa: E402
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="W4A16,W8A8", help="compressed-tensors preset schemes")
    parser.add_argument("--size", type=int, default=100, help="problems")
    parser.add_argument("--seed", type=int, default=0, help="the arithmetic problem set's seed")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--strategy", default="beam_search")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "quantized_search"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset = f"arith:level=4,5,size={args.size},seed={args.seed}"
    search = ["--dataset", dataset, "--strategy", args.strategy, "--n", str(args.n)]
    results = {"bf16": out / "bf16.json"}
    for scheme in args.schemes.split(","):
        pair = out / scheme
        for role, source in (("generator", DEFAULT_GENERATOR), ("prm", DEFAULT_PRM)):
            if not (pair / role / "config.json").exists():
                write_compressed_tensors(str(source), str(pair / role), scheme)
        results[scheme] = out / f"{scheme}.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    treeserve = [sys.executable, "-m", "treeserve.cli"]
    for name, result in results.items():
        if result.exists():
            continue
        models = (
            [] if name == "bf16" else ["--generator", str(out / name / "generator"), "--prm", str(out / name / "prm")]
        )
        subprocess.run([*treeserve, "eval", *search, *models, "--output", str(result)], check=True, env=env)
    for name, result in results.items():
        if name != "bf16":
            print(f"== bf16 vs {name}", flush=True)
            subprocess.run([*treeserve, "compare", str(results["bf16"]), str(result)], check=True, env=env)


if __name__ == "__main__":
    main()
