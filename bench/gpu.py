"""treeserve against vLLM on one GPU: generation and arithmetic beam search, one invocation.

    python bench/gpu.py --out bench/out/gpu --repeats 3                  # on a machine with a GPU
    python bench/gpu.py --device cpu --repeats 1 --problems 2 --prompts 4 --out /tmp/gpu-smoke   # a smoke run

Runs, each in its own subprocess with the engines' order rotated per repetition (the CPU
benchmarks' machinery, with treeserve on `--device`):
* generation, the issue-2 workload (`bench/generate.py`: random bf16 Llama, 64 prompts x
  n=4 x 128 tokens) and Gemma 3 270M (`bench/generate.py --gemma`: batch-1 decode, 32
  prompts x n=4, a 512-token prefill; treeserve reads the GGUF file, vLLM its bf16 directory);
* arithmetic beam search at N=16 and N=64 (`bench/search.py`, the shipped models, 40
  level-4/5 problems) against `sal-vllm` and `thesis-vllm`.
vLLM runs from the Python that `VLLM_PYTHON` names (default `.venv-vllm/bin/python`), a GPU
build installed with `pip install vllm`; without it, the vLLM peers are left out and the
JSON says so. Writes `OUT/gpu.json` (the GPU, versions, backend, every sub-run's JSON and its
medians) and prints each sub-benchmark's table. Nothing here has run on a GPU yet.
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
        version = subprocess.run([VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True)  # fmt: skip
        info["vllm"] = version.stdout.strip() or None
    return info


def run(name: str, command: list[str], out: str) -> dict:
    print(f"\n== {name}: {' '.join(command)}", flush=True)
    subprocess.run([sys.executable, *command], check=True, cwd=os.path.join(HERE, ".."))
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--problems", type=int, default=40, help="beam search problems")
    ap.add_argument("--prompts", type=int, default=64, help="generation prompts (issue-2 workload)")
    ap.add_argument("--ns", default="16,64", help="beam search N values")
    ap.add_argument("--skip-gemma", action="store_true", help="without the Gemma 3 270M generation runs")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "gpu"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = environment(args.device)
    with_vllm = env["vllm"] is not None
    if not with_vllm:
        print(f"vLLM not found at {VLLM_PYTHON} (a GPU build: pip install vllm): treeserve runs alone", flush=True)
    engines = "treeserve,vllm" if with_vllm else "treeserve"
    common = ["--device", args.device, "--repeats", str(args.repeats)]
    results: dict = {"environment": env, "runs": {}}
    gen = os.path.join(args.out, "generate.json")
    results["runs"]["generate"] = run("generation (issue-2 workload)", [
        "bench/generate.py", *common, "--engines", engines, "--prompts", str(args.prompts), "--output", gen,
    ], gen)  # fmt: skip
    if not args.skip_gemma:
        gemma = os.path.join(args.out, "generate_gemma.json")
        results["runs"]["generate_gemma"] = run("Gemma 3 270M", [
            "bench/generate.py", "--gemma", *common, "--engines", engines, "--output", gemma,
        ], gemma)  # fmt: skip
    systems = "treeserve,sal-vllm,thesis-vllm" if with_vllm else "treeserve"
    for n in args.ns.split(","):
        search = os.path.join(args.out, f"search_n{n}.json")
        results["runs"][f"search_n{n}"] = run(f"beam search N={n}", [
            "bench/search.py", *common, "--systems", systems, "--n", n, "--problems", str(args.problems),
            "--out", search,
        ], search)  # fmt: skip
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{json.dumps(env)}\nwrote {os.path.join(args.out, 'gpu.json')}")


if __name__ == "__main__":
    main()
