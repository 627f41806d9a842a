"""The thesis's setup at its real shapes: a Llama-3.2-1B generator and a Llama-3.1-8B step-tag PRM, beam search.

    python bench/thesis_shapes.py --out bench/out/thesis                       # one GPU (--device cuda)
    python bench/thesis_shapes.py --device cpu --tiny --out /tmp/thesis        # a smoke run on a CPU, ~1 min
    python bench/thesis_shapes.py --generator-shape qwen3-30b-a3b --prm-shape qwen3-1.7b --out bench/out/qwen3
    python bench/thesis_shapes.py --device cpu --tiny --generator-shape qwen3-1.7b --prm-shape qwen3-1.7b \\
        --configs graphs,sal-transformers --out /tmp/qwen3          # the Qwen3 shapes at 2 layers on a CPU

No weights can be downloaded, so both models are random-weight directories: config.json
(for the Llama pair the shapes of bench/roofline_floor.py, plus what its `Shape` does not
hold: tied embeddings, rope theta 500000 with llama3 scaling), a word-level tokenizer of all
the model's ids (128256 for Llama 3), and treeserve's random-weights marker
(treeserve/models/loader.py), which makes the loader draw every tensor on the device in bf16;
nothing is written but those small files. The PRM is read in the step-tag style (a tag after
each step, P('+') against P('-')).

Shapes (`--generator-shape`, `--prm-shape`): generators `llama3.2-1b` (the default),
`qwen3-1.7b` (hidden 2048, 28 layers, 16 / 8 heads of 128, MLP 6144, q/k norms, tied
embeddings, vocabulary 151936, rope theta 1e6) and `qwen3-30b-a3b` (hidden 2048, 48 layers,
32 / 4 heads of 128, 128 experts of width 768, top 8, normalised; untied); PRMs `llama3.1-8b`
(the default) and `qwen3-1.7b`. The Qwen3 configs are bench/workloads.py's QWEN3_SHAPES (the
Hugging Face config.json values). `--layers L` gives both models L decoder layers (the widths
stay), for a CPU or a GPU too small for the full depth: qwen3-30b-a3b's weights alone are 61 GB
in bf16 (with the 8B PRM, 77 GB: an H200; on an H100 80 GB pair it with qwen3-1.7b or cut
layers). Prompts are random ids below the smaller of the two vocabularies (a generated id
past the PRM's reads as its <unk>).

Workload (issue 53): beam search, beam width 4, `fixed_steps` (10 iterations of exactly
100-token steps: random weights never write "\\n\\n"), T=0.8, on prompts of 200 random token
ids (decoded to text: the search API takes questions), at N=16 and N=64, every problem in
flight at once (`max_concurrent_problems` = the problem count, 64 by default), both models
in one page arena sized from `--memory-fraction` of the free GPU memory. Each N first runs a
warm-up (2 problems, 2 short iterations: Triton compiles), then the timed search.

Configurations (`--configs`, side by side, each treeserve one in a fresh process):
* `graphs`: the default runtime on CUDA: CUDA graphs for decode steps, overlapped steps, and
  both models at once, each on a CUDA stream of its own (`overlap_models`; the PRM, which
  never decodes, captures batch 1 only: `cuda_graph_sizes=[1]`);
* `one-stream`: the same with `overlap_models=False` (the models' kernels in turn on one stream);
* `eager`: `graphs` with `enforce_eager=True`;
* `sal-transformers`: search-and-learn's loop on `transformers` (bench/peers/sal_search.py,
  one problem at a time) on `--sal-problems` problems at the first N, its own random
  initialisation of the same shapes.

Reported per configuration and N: problems/min; that as a fraction of roofline_floor.py's
floor for the workload, serial (generator then PRM) and overlapped (the larger of the two
alone; the Llama pair at full depth on a GPU it knows, else None); generator and PRM milliseconds per
engine step (time inside `step()`; with overlapped steps a step also waits for the one
before it) and step counts; peak pages in use and held (cached too), evictions; kernel
launches per generator decode step (torch.profiler's cudaLaunchKernel / cuLaunchKernel and
cudaGraphLaunch calls, and the GPU kernels run, over 8 decode steps of 64 sequences; None on
a CPU); the memory plan's table. JSON to `--out`/thesis_shapes.json, rewritten after each
configuration; SIGTERM or SIGINT (a `timeout`) keeps the N values the running configuration
finished, and stops. Time: the roofline's floor alone is ~20 s for 64 problems at N=16 and
~90 s at N=64 on an H100 SXM, so a whole run takes several minutes; under bench/gpu_check.sh's
THESIS_TIMEOUT (240 s) expect `graphs` at N=16 first, then whatever fits.

`--tiny` (for CPUs): 2-layer models (the Llama shapes at generator hidden 64, PRM hidden 128,
their 128256-id vocabulary and tokenizer kept; the Qwen3 shapes at their own widths,
`--layers` if given), 4 problems of 48-token prompts, N=4, 2 iterations of 16-token steps,
2 sal-transformers problems. It checks that everything runs, not how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from roofline_floor import GENERATOR, GPUS, PRM, Shape, search_floor  # noqa: E402
from search import run_system  # noqa: E402
from workloads import FIRST_WORD, QWEN3_SHAPES, build_random_weights_dir, word_level_tokenizer  # noqa: E402

# what roofline_floor.Shape does not hold, from the models' config.json
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
COMMON = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
GENERATOR_EXTRA = {**COMMON, "tie_word_embeddings": True, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}}
PRM_EXTRA = {**COMMON, "tie_word_embeddings": False, "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}}
TINY_GENERATOR = Shape("generator tiny", 2, 64, 4, 2, 16, 128, GENERATOR.vocab)  # Llama 3's vocabulary kept
TINY_PRM = Shape("PRM tiny", 2, 128, 4, 2, 32, 256, PRM.vocab)

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
CONFIGS = ("graphs", "one-stream", "eager", "sal-transformers")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    step_tokens: int
    iterations: int
    ns: tuple[int, ...]
    problems: int
    sal_problems: int
    beam_width: int = 4
    max_model_len: int = 2048


THESIS = Workload(prompt_tokens=200, step_tokens=100, iterations=10, ns=(16, 64), problems=64, sal_problems=2)
TINY = Workload(prompt_tokens=48, step_tokens=16, iterations=2, ns=(4,), problems=4, sal_problems=2, max_model_len=512)


# ---- the checkpoints and problems -----------------------------------------------------------
def hf_config(shape: Shape, extra: dict) -> dict:
    """config.json of a Llama of `shape` (bench/roofline_floor.py's fields) plus `extra`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.mlp,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        **extra,
    }


# --generator-shape / --prm-shape -> config.json; at --tiny a Llama is its tiny twin (TINY_SHAPES)
GENERATOR_SHAPES = {"llama3.2-1b": hf_config(GENERATOR, GENERATOR_EXTRA), **QWEN3_SHAPES}
PRM_SHAPES = {"llama3.1-8b": hf_config(PRM, PRM_EXTRA), "qwen3-1.7b": QWEN3_SHAPES["qwen3-1.7b"]}
TINY_SHAPES = {"llama3.2-1b": hf_config(TINY_GENERATOR, GENERATOR_EXTRA), "llama3.1-8b": hf_config(TINY_PRM, PRM_EXTRA)}
THESIS_PAIR = ("llama3.2-1b", "llama3.1-8b")  # the pair roofline_floor.py's floor is for


def model_config(name: str, shapes: dict[str, dict], tiny: bool, layers: int | None) -> dict:
    """config.json of the shape `name` of `shapes`, with `layers` decoder layers where given."""
    config = TINY_SHAPES.get(name, shapes[name]) if tiny else shapes[name]
    return config if layers is None else {**config, "num_hidden_layers": layers}


def random_problems(tokenizer: object, count: int, length: int, tag: str, vocab: int) -> list[tuple[str, str]]:
    """(unique id, question) pairs: `length` random word ids below `vocab` each, decoded (seeded by `tag`)."""
    rng = random.Random(tag)
    return [
        (f"{tag}-{i}", tokenizer.decode([rng.randrange(FIRST_WORD, vocab) for _ in range(length)]))
        for i in range(count)
    ]


def write_json(path: str, content: dict) -> None:
    with open(path, "w") as f:
        json.dump(content, f, indent=1)


# ---- one treeserve configuration, in a process of its own -----------------------------------
def engine_args(tiny: bool, eager: bool) -> dict[str, dict]:
    """Per model: room for the workload's context; a generator batch as wide as the graphs go;
    large PRM prefill steps; no decode graphs for the PRM (it only scores)."""
    max_len = (TINY if tiny else THESIS).max_model_len
    generator = {
        "max_model_len": max_len,
        "max_num_seqs": 64 if tiny else 512,
        "max_num_batched_tokens": 1024 if tiny else 4096,
    }
    prm = {"max_model_len": max_len, "max_num_batched_tokens": 1024 if tiny else 8192}
    if not eager:
        prm["cuda_graph_sizes"] = [1]
    return {"generator": generator, "prm": prm}


def gpu_key(device: str, override: str | None) -> str | None:
    """roofline_floor.GPUS' name for this device (H100 SXM / PCIe, H200), or None."""
    import torch

    if override or not device.startswith("cuda"):
        return override
    name = torch.cuda.get_device_name(torch.device(device))
    if "H200" in name:
        return "h200"
    if "H100" in name:
        return "h100-pcie" if "PCIe" in name else "h100-sxm"
    return None


def counters(runtime: object) -> dict[str, dict]:
    return {
        name: {
            "steps": runtime.steps[name],
            "busy_s": runtime.busy_s[name],
            "rows": engine.page_log.steps,
            "computed_tokens": engine.num_computed_tokens,
        }
        for name, engine in runtime.engines.items()
    }


def engine_report(runtime: object, name: str, before: dict, after: dict) -> dict:
    """One engine's steps, time per step and pages over a timed run."""
    b, a = before[name], after[name]
    steps, busy = a["steps"] - b["steps"], a["busy_s"] - b["busy_s"]
    rows = [r for r in runtime.engines[name].page_log.rows() if r["step"] > b["rows"]]
    return {
        "steps": steps,
        "busy_s": busy,
        "ms_per_step": 1e3 * busy / steps if steps else None,
        "computed_tokens": a["computed_tokens"] - b["computed_tokens"],
        # after each of its steps: pages its running sequences hold, and those plus its cached ones
        "peak_pages_in_use": max((r["in_use"] for r in rows), default=0),
        "peak_pages_held": max((r["in_use"] + r["cached"] for r in rows), default=0),
        "min_free_pages": min((r["free"] for r in rows), default=None),  # the arena's (both models)
        "evictions": rows[-1]["evictions"] - rows[0]["evictions"] if rows else 0,
    }


def decode_launches(engine: object, batch: int, prompt_tokens: int, vocab: int, steps: int = 8) -> dict | None:
    """Kernel launches per generator decode step (torch.profiler, CUDA only): `batch` sequences
    of random ids below `vocab` past their prefill, `steps` steps profiled."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from treeserve import SamplingParams

    if engine.device.type != "cuda":
        return None
    rng = random.Random(0)
    ids = [f"launch-probe-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        params = SamplingParams(max_tokens=4 * steps + 64, temperature=0.8, seed=i, ignore_eos=True)
        engine.add_request(request_id, [rng.randrange(FIRST_WORD, vocab) for _ in range(prompt_tokens)], params)
    for _ in range(
        -(-batch * prompt_tokens // engine.config.scheduler_config.max_num_batched_tokens) + 3
    ):  # prefill, first decodes
        engine.step()
    torch.cuda.synchronize(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize(engine.device)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    names = [e.name for e in events]
    launches = sum(names.count(n) for n in LAUNCHES)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return {
        "batch": batch,
        "steps": steps,
        "kernel_launches_per_step": launches / steps,
        "graph_launches_per_step": names.count("cudaGraphLaunch") / steps,
        "gpu_kernels_per_step": len(kernels) / steps,
    }


def graph_share(before: dict | None, after: dict | None) -> dict | None:
    """The generator's forwards over a run: how many replayed a graph, and why the others did not."""
    if after is None:
        return None
    replays = after["replays"] - before["replays"]
    eager = {why: count - before["eager"][why] for why, count in after["eager"].items()}
    total = replays + sum(eager.values())
    return {"replays": replays, "eager": eager, "replayed_share": replays / total if total else None}


def find_syncs(run: Callable[[], None]) -> dict:
    """The host syncs `run()` makes: torch.cuda.set_sync_debug_mode("warn") turns each into a
    warning, counted by the Python line that caused it (file:line, most frequent first)."""
    import warnings

    import torch

    sites: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{os.path.relpath(w.filename)}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    ordered = dict(sorted(sites.items(), key=lambda kv: -kv[1]))
    return {"total": sum(sites.values()), "sites": ordered}


def run_treeserve(config: str, setup: dict) -> dict:
    """Load both models once (`config` "graphs" or "eager"), count a decode step's launches,
    then for each N a warm-up and the timed search. What is done so far is rewritten to
    `setup["partial"]` after each part (the parent reads it if this process is stopped)."""
    import torch

    from treeserve.config import DeviceConfig
    from treeserve.models.tokenizer import Tokenizer
    from treeserve.runtime.runtime import Runtime
    from treeserve.search.config import SearchConfig
    from treeserve.search.context import SearchContext
    from treeserve.search.prm import load_prm
    from treeserve.search.run import search_problems

    begun = time.perf_counter()

    def progress(what: str) -> None:  # where a run cut short spent its time
        print(f"  [{config} {time.perf_counter() - begun:6.1f} s] {what}", flush=True)

    w, device = Workload(**{**setup["workload"], "ns": tuple(setup["workload"]["ns"])}), setup["device"]
    cpu = not device.startswith("cuda")
    if cpu:
        torch.set_num_threads(setup["threads"])
    args = engine_args(setup["tiny"], config == "eager")
    args = {name: {**model, "enforce_eager": config == "eager"} for name, model in args.items()}
    start = time.perf_counter()
    runtime = Runtime.for_search(
        setup["generator"],
        setup["prm"],
        setup["kv_cache_memory"] if cpu else None,
        engine_args=args,
        device_config=DeviceConfig(device, dtype="bfloat16"),
        memory_fraction=None if cpu else setup["memory_fraction"],
        overlap_models=config != "one-stream",
    )
    generator = runtime.engine("generator")
    result = {
        "load_s": time.perf_counter() - start,
        "runs": [],
        "cuda_graphs": generator.graph_stats is not None,
        "async_scheduling": generator.async_scheduling,
        "engine_args": args,
        "two_streams": generator.queue.stream is not None,
        "memory_table": runtime.memory_plan.table(),
        "memory": runtime.memory_plan.to_json(),
    }
    progress(f"loaded both models ({result['load_s']:.1f} s; graphs captured: {result['cuda_graphs']})")
    vocab = setup["vocab"]
    result["launches_per_decode_step"] = decode_launches(generator, 64, w.prompt_tokens, vocab)
    progress(f"counted a decode step's launches: {result['launches_per_decode_step']}")
    write_json(setup["partial"], result)
    prm = load_prm(runtime, "prm", "step_tag")
    tokenizer = Tokenizer(setup["generator"])
    gpu = gpu_key(device, setup["gpu"])
    for n in w.ns:
        search = SearchConfig(
            strategy="beam_search",
            n=n,
            beam_width=w.beam_width,
            num_iterations=w.iterations,
            max_tokens=w.step_tokens,
            fixed_steps=True,
            temperature=0.8,
            agg="last",
            seed=0,
            max_concurrent_problems=w.problems,
        )
        warm = replace(search, num_iterations=2, max_tokens=min(16, w.step_tokens))
        asyncio.run(
            search_problems(
                SearchContext(warm, runtime, "generator", prm),
                random_problems(tokenizer, 2, w.prompt_tokens, f"warm{n}", vocab),
            )
        )
        progress(f"N={n}: warmed up")
        if "syncs" not in result and not cpu:  # once: the host syncs one short search makes
            short = SearchContext(warm, runtime, "generator", prm)
            few = random_problems(tokenizer, 2, w.prompt_tokens, "sync", vocab)
            result["syncs"] = find_syncs(lambda: asyncio.run(search_problems(short, few)))  # noqa: B023 (called here)
            progress(f"syncs in a short search: {result['syncs']['total']} at {len(result['syncs']['sites'])} sites")
            write_json(setup["partial"], result)
        problems = random_problems(tokenizer, w.problems, w.prompt_tokens, f"n{n}", vocab)
        ctx = SearchContext(search, runtime, "generator", prm)
        before = counters(runtime)
        graphs_before = json.loads(json.dumps(generator.graph_stats)) if generator.graph_stats else None
        start = time.perf_counter()
        try:
            asyncio.run(search_problems(ctx, problems))
        except Exception as e:  # recorded; the next N runs
            result["runs"].append({"n": n, "error": f"{type(e).__name__}: {e}"})
            continue
        wall = time.perf_counter() - start
        after = counters(runtime)
        runtime.check_pages_idle()
        per_min = 60 * len(problems) / wall
        run = {
            "n": n,
            "problems": len(problems),
            "wall_s": wall,
            "problems_per_min": per_min,
            "generated_tokens": ctx.generated_tokens,
            "prm_input_tokens": ctx.prm_input_tokens,
            "generator": engine_report(runtime, "generator", before, after),
            "prm": engine_report(runtime, "prm", before, after),
            "roofline": None,
            "generator_graphs": graph_share(graphs_before, generator.graph_stats),
        }
        if gpu is not None and setup["roofline"]:
            f = search_floor(n, prompt=w.prompt_tokens, iterations=w.iterations, step=w.step_tokens, gpu=GPUS[gpu])
            serial, overlapped = 60 / (f["gen_s"] + f["prm_s"]), 60 / max(f["gen_s"], f["prm_s"])
            run["roofline"] = {
                "gpu": gpu,
                **f,
                "serial_floor_per_min": serial,
                "overlapped_floor_per_min": overlapped,
                "of_serial": per_min / serial,
                "of_overlapped": per_min / overlapped,
            }
        result["runs"].append(run)
        write_json(setup["partial"], result)
        progress(
            f"N={n}: {len(problems)} problems in {wall:.1f} s, {per_min:.1f} problems/min; generator "
            f"{run['generator']['ms_per_step']:.2f} ms/step, PRM {run['prm']['ms_per_step']:.2f} ms/step; "
            f"graphs: {run['generator_graphs']}"
        )
    asyncio.run(runtime.close())
    return result


# ---- search-and-learn on transformers ------------------------------------------------------
def run_sal(setup: dict) -> dict:
    """bench/peers/sal_search.py's `sal-transformers` on `sal_problems` problems at the first N."""
    from treeserve.models.tokenizer import Tokenizer

    w = setup["workload"]
    n = w["ns"][0]
    tokenizer = Tokenizer(setup["generator"])
    problems = random_problems(tokenizer, w["sal_problems"], w["prompt_tokens"], f"sal{n}", setup["vocab"])
    workload = {
        "problems": [{"problem": q, "answer": "", "unique_id": uid} for uid, q in problems],
        "generator": setup["generator"],
        "prm": setup["prm"],
        "n": n,
        "beam_width": w["beam_width"],
        "num_iterations": w["iterations"],
        "max_tokens": w["step_tokens"],
        "fixed_steps": True,
        "temperature": 0.8,
        "top_p": 1.0,
        "agg": "last",
        "seed": 0,
        "dtype": "bfloat16",
        "kv_gib": 1,
        "device": setup["device"],
        "max_model_len": w["max_model_len"],
    }
    path = os.path.join(setup["models"], "sal_workload.json")
    with open(path, "w") as f:
        json.dump(workload, f)
    out = run_system("sal-transformers", path, setup["threads"])
    run = {
        "n": n,
        "problems": len(problems),
        "wall_s": out["wall_s"],
        "load_s": out["load_s"],
        "problems_per_min": 60 * len(problems) / out["wall_s"],
        "generated_tokens": out["generated_tokens"],
        "prm_tokens_prefilled": out["prm_tokens_prefilled"],
    }
    return {"runs": [run]}


# ---- the report -------------------------------------------------------------------------------
def table(results: dict[str, dict]) -> str:
    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        "| config | N | problems | wall (s) | problems/min | of serial floor | of overlapped floor | "
        "generator ms/step (steps) | PRM ms/step (steps) | launches / decode step: kernel + graph (GPU kernels) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, result in results.items():
        launches = result.get("launches_per_decode_step")
        launch = (
            "-"
            if launches is None
            else (
                f"{launches['kernel_launches_per_step']:.0f} + "
                f"{launches['graph_launches_per_step']:.0f} "
                f"({launches['gpu_kernels_per_step']:.0f})"
            )
        )
        for run in result.get("runs", []):
            if "error" in run:
                lines.append(f"| {config} | {run['n']} | failed: {run['error'][:200]} |")
                continue
            roof = run.get("roofline") or {}
            steps = {
                k: (f"{fmt(run[k]['ms_per_step'], '.2f')} ({run[k]['steps']})" if k in run else "-")
                for k in ("generator", "prm")
            }
            lines.append(
                f"| {config} | {run['n']} | {run['problems']} | {run['wall_s']:.1f} | "
                f"{run['problems_per_min']:.1f} | {fmt(roof.get('of_serial'), '.0%')} | "
                f"{fmt(roof.get('of_overlapped'), '.0%')} | {steps['generator']} | {steps['prm']} | "
                f"{launch if 'generator' in run else '-'} |"
            )
        if "error" in result:  # after the N values it finished, if any
            lines.append(f"| {config} | failed or stopped: {result['error'][:200]} |")
    return "\n".join(lines)


def environment(device: str, tiny: bool) -> dict:
    import torch

    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "torch": torch.__version__, "tiny": tiny}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def run_configs(configs: list[str], setup: dict, results: dict, save: Callable[[], None]) -> None:
    """Each configuration in turn into `results`, saved after each. A failure is recorded and
    the next one runs; SIGTERM or SIGINT (a timeout) keeps what the configuration finished
    (its process's partial file) and stops."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    for config in configs:
        print(f"\n== {config}", flush=True)
        start = time.perf_counter()
        partial = os.path.join(setup["models"], f"partial-{config}.json")
        stopped = False
        try:
            if config == "sal-transformers":
                results[config] = run_sal(setup)
            else:  # a fresh process: the GPU memory of one configuration is gone before the next loads
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    results[config] = pool.apply(run_treeserve, (config, {**setup, "partial": partial}))
        except (Exception, KeyboardInterrupt) as e:
            if not isinstance(e, KeyboardInterrupt):
                traceback.print_exc()
            done = {}
            if os.path.isfile(partial):
                with open(partial) as f:
                    done = json.load(f)
            results[config] = {**done, "error": f"{type(e).__name__}: {e}"}
            stopped = isinstance(e, KeyboardInterrupt)
        results[config]["seconds"] = time.perf_counter() - start
        save()
        print(f"== {config}: {results[config]['seconds']:.0f} s", flush=True)
        if stopped:
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer models, 4 problems, N=4: a smoke run (CPU)")
    ap.add_argument("--generator-shape", default=THESIS_PAIR[0], choices=list(GENERATOR_SHAPES))
    ap.add_argument("--prm-shape", default=THESIS_PAIR[1], choices=list(PRM_SHAPES))
    ap.add_argument(
        "--layers", type=int, default=None, help="both models' decoder layers (default: the shapes'; --tiny 2)"
    )
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    ap.add_argument("--ns", default=None, help="beam search N values (default 16,64; --tiny 4)")
    ap.add_argument("--problems", type=int, default=None, help="problems per N, all in flight (default 64)")
    ap.add_argument("--sal-problems", type=int, default=None, help="sal-transformers problems (default 2)")
    ap.add_argument("--memory-fraction", type=float, default=0.85, help="of the free GPU memory, for everything")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="KV bytes on a CPU")
    ap.add_argument("--gpu", default=None, choices=sorted(GPUS), help="roofline's GPU (default: from the name)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each system (on a CPU; README: Threads)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "thesis"))
    args = ap.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    w = TINY if args.tiny else THESIS
    w = replace(
        w,
        ns=tuple(int(n) for n in args.ns.split(",")) if args.ns else w.ns,
        problems=args.problems or w.problems,
        sal_problems=args.sal_problems or w.sal_problems,
    )
    layers = args.layers or (2 if args.tiny else None)
    shapes = {
        "generator": model_config(args.generator_shape, GENERATOR_SHAPES, args.tiny, layers),
        "prm": model_config(args.prm_shape, PRM_SHAPES, args.tiny, layers),
    }
    roofline = not args.tiny and layers is None and (args.generator_shape, args.prm_shape) == THESIS_PAIR
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "thesis_shapes.json")
    notes = []
    if args.tiny:
        notes.append(
            f"tiny: {layers} layers (Llama shapes at hidden 64 / 128, their vocabulary kept; Qwen3 shapes "
            "at their own widths)"
        )
    if not roofline:
        notes.append("no roofline fraction: its floor is for the Llama pair at full depth, on a GPU")
    if not args.device.startswith("cuda"):
        notes.append(
            "on a CPU `graphs` and `eager` run the same path (no CUDA graphs); kernel launches are "
            "counted on CUDA only (None here)"
        )
    document = {
        "environment": environment(args.device, args.tiny),
        "workload": asdict(w),
        "shapes": {
            "generator": {"name": args.generator_shape, "config": shapes["generator"]},
            "prm": {"name": args.prm_shape, "config": shapes["prm"]},
        },
        "notes": notes,
        "configs": {},
    }
    results = document["configs"]
    with tempfile.TemporaryDirectory(prefix="thesis-models-") as models:
        dirs = {
            role: build_random_weights_dir(
                os.path.join(models, role),
                config,
                word_level_tokenizer(config["vocab_size"]),
                seed=int(role == "prm"),
                step_tag_prm=role == "prm",
            )
            for role, config in shapes.items()
        }
        setup = {
            "device": args.device,
            "tiny": args.tiny,
            "workload": asdict(w),
            "models": models,
            "gpu": args.gpu,
            "memory_fraction": args.memory_fraction,
            "kv_cache_memory": args.kv_cache_memory,
            "threads": args.threads,
            "roofline": roofline,
            "vocab": min(config["vocab_size"] for config in shapes.values()),
            **dirs,
        }
        run_configs(configs, setup, results, lambda: write_json(out_path, document))
    for config, result in results.items():
        if "memory_table" in result:
            print(f"\n{config}: {result['memory_table']}")
        if result.get("syncs"):
            print(
                f"{config}: {result['syncs']['total']} host syncs in a short search, by line: "
                f"{json.dumps(dict(list(result['syncs']['sites'].items())[:12]))}"
            )
    print(f"\n{table(results)}\n")
    print("\n".join(f"note: {n}" for n in notes))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
