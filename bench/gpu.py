"""treeserve against vLLM on one GPU: generation and arithmetic beam search, one invocation.

    python bench/gpu.py --out bench/out/gpu --repeats 3                  # on a machine with a GPU
    python bench/gpu.py --device cpu --repeats 1 --problems 2 --prompts 4 --out /tmp/gpu-smoke   # a smoke run

Runs, each in its own subprocess with the engines' order rotated per repetition (the CPU
benchmarks' machinery, with treeserve on `--device`; the `transformers` peers run on the
same device):
* generation, the issue-2 workload (`bench/generate.py`: random bf16 Llama, 64 prompts x
  n=4 x 128 tokens) against `transformers` `generate`, and Gemma 3 270M
  (`bench/generate.py --gemma`: batch-1 decode, 32 prompts x n=4, a 512-token prefill;
  treeserve reads the GGUF file, vLLM its bf16 directory);
* arithmetic beam search at N=16 and N=64 (`bench/search.py`, the shipped models or
  `--model-size` twins, 40 level-4/5 problems) against `sal-vllm`, `thesis-vllm` and
  `vllm-prefix-prm`, and at N=16 on `--transformers-problems` problems against
  `sal-transformers` (search-and-learn's loop over `transformers` on the same GPU).
vLLM runs from the Python that `VLLM_PYTHON` names (default `.venv-vllm/bin/python`), a GPU
build installed with `pip install vllm`; without it, the vLLM peers are left out and the
JSON says so. A sub-benchmark that fails is recorded as failed and the next one runs.
Writes `OUT/gpu.json` (the GPU, versions, backend, every sub-run's JSON and its medians)
and prints each sub-benchmark's table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(HERE, "..", ".venv-vllm", "bin", "python"))


def environment(device: str) -> dict:
    import torch

    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "torch": torch.__version__}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from treeserve.device import resolve_attention_backend

    info["attention_backend"] = resolve_attention_backend(None, device)
    info["vllm"] = None
    if os.path.exists(VLLM_PYTHON):
        version = subprocess.run(
            [VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        )
        info["vllm"] = version.stdout.strip() or None
    return info


def run(results: dict, key: str, name: str, command: list[str], out_dir: str) -> None:
    """One sub-benchmark into results["runs"][key], then gpu.json rewritten (a later one may
    not finish); a failure is recorded and printed, and the next one runs."""
    out = os.path.join(out_dir, f"{key}.json")
    command = [*command, "--output" if command[0].endswith("generate.py") else "--out", out]
    print(f"\n== {name}: {' '.join(command)}", flush=True)
    proc = subprocess.run([sys.executable, *command], cwd=os.path.join(HERE, ".."))
    if proc.returncode == 0 and os.path.exists(out):
        with open(out) as f:
            results["runs"][key] = json.load(f)
    else:
        print(f"== {name} FAILED (exit {proc.returncode})", flush=True)
        results["runs"][key] = {"error": f"exit {proc.returncode}", "command": command}
    with open(os.path.join(out_dir, "gpu.json"), "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--problems", type=int, default=40, help="beam search problems")
    ap.add_argument("--prompts", type=int, default=64, help="generation prompts (issue-2 workload)")
    ap.add_argument("--ns", default="16,64", help="beam search N values")
    ap.add_argument("--skip-gemma", action="store_true", help="without the Gemma 3 270M generation runs")
    ap.add_argument("--model-size", default="arith", help="search models: arith (shipped) or a twin size (s, m, l)")
    ap.add_argument(
        "--transformers-problems",
        type=int,
        default=10,
        help="problems for the sal-transformers search peer (0: leave it out)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.device)
    with_vllm = env["vllm"] is not None
    if not with_vllm:
        print(f"vLLM not found at {VLLM_PYTHON} (a GPU build: pip install vllm): its peers are left out", flush=True)
    engines = "treeserve,transformers,vllm" if with_vllm else "treeserve,transformers"
    common = ["--device", args.device, "--repeats", str(args.repeats)]
    results: dict = {"environment": env, "runs": {}}
    generate = ["bench/generate.py", *common, "--engines", engines]
    run(results, "generate", "generation (issue-2 workload)", [*generate, "--prompts", str(args.prompts)], args.out)
    if not args.skip_gemma:
        run(results, "generate_gemma", "Gemma 3 270M", [*generate, "--gemma"], args.out)
    search = ["bench/search.py", *common, "--model-size", args.model_size]
    peers = ",sal-vllm,thesis-vllm,vllm-prefix-prm" if with_vllm else ""
    for n in args.ns.split(","):
        run(
            results,
            f"search_n{n}",
            f"beam search N={n}",
            [
                *search,
                "--systems",
                "treeserve" + peers,
                "--n",
                n,
                "--problems",
                str(args.problems),
            ],
            args.out,
        )
    if args.transformers_problems:  # the slow peer on a few problems, treeserve beside it on the same ones
        run(
            results,
            "search_sal_transformers",
            "beam search N=16 against sal-transformers",
            [
                *search,
                "--systems",
                "treeserve,sal-transformers",
                "--n",
                "16",
                "--problems",
                str(args.transformers_problems),
            ],
            args.out,
        )
    print(f"\n{json.dumps(env)}\nwrote {os.path.join(args.out, 'gpu.json')}")


if __name__ == "__main__":
    main()
