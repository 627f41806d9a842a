"""The memory planner: what each model's weights and activations take, and what is left for KV pages.

Measured per model: weights, the activation peak of one `max_num_batched_tokens` step (summed
over models: each keeps its allocator's cache) and the rest its load added. As in the thesis,
Mem_KV = budget - activations - weights - other, unless the KV bytes are given.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from treeserve.config import DEFAULT_KV_CAP, GPU_MEMORY_FRACTION, EngineConfig
from treeserve.device import total_memory
from treeserve.engine.llm_engine import LLMEngine
from treeserve.layers.group_quant import checkpoint_weights
from treeserve.layers.quant import quantized_weights
from treeserve.sampling_params import ScoreParams


@dataclass
class ModelMemory:
    name: str
    weights: int
    activation_peak: int
    token_bytes: int  # of its KV pages: 1 byte a value with kv_cache_dtype "fp8_e4m3"
    sampler_peak: int = 0
    other: int = 0  # process memory its load added beyond its weights
    loaded: int = 0  # process memory its load added (RSS on a CPU)
    checkpoint_bytes: int = 0
    page_size: int = 0
    page_bytes: int = 0
    num_pages: int = 0  # pages of its own arena (static split); the whole shared arena otherwise
    kv_fraction: float | None = None  # static split share; None: the shared arena
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # a parallel model: its sizes and {"rank", "weights", "kv_bytes"} per rank; the rest is rank 0's
    parallel: dict | None = None
    graphs: dict | None = None  # its CUDA graphs' {"sizes", "capture_s", "memory_bytes"}


@dataclass
class MemoryPlan:
    device: str
    total_memory: int
    free_at_start: int
    budget: int | None  # bytes for weights + activations + other + KV (None: KV bytes given directly)
    kv_bytes: int
    shared: bool
    page_bytes: int = 0
    num_pages: int = 0
    models: list[ModelMemory] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def weights(self) -> int:
        return sum(m.weights for m in self.models)

    @property
    def activations(self) -> int:
        return sum(m.activation_peak + m.sampler_peak for m in self.models)

    @property
    def other(self) -> int:
        return sum(m.other for m in self.models)

    def to_json(self) -> dict:
        return {**asdict(self), "weights": self.weights, "activations": self.activations, "other": self.other}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)

    def table(self) -> str:
        mib = 1 << 20
        lines = [f"memory plan on {self.device} (MiB)"]
        if self.budget is not None:
            lines.append(f"  budget {self.budget / mib:10.1f}  (free at start {self.free_at_start / mib:.0f})")
        lines += [
            f"  weights {self.weights / mib:9.1f}   activations {self.activations / mib:.1f}"
            f"   other {self.other / mib:.1f}",
            f"  KV {self.kv_bytes / mib:14.1f}   "
            + (
                f"one shared arena: {self.num_pages} pages of {self.page_bytes} bytes"
                if self.shared
                else "static split"
            ),
        ]
        for m in self.models:
            share = "shared" if m.kv_fraction is None else f"{m.kv_fraction:.2f} of KV"
            lines.append(
                f"  {m.name:<10} weights {m.weights / mib:7.1f}  activations {m.activation_peak / mib:7.1f}"
                f" (+{m.sampler_peak / mib:.1f} sampler, estimated)  "
                f"other {m.other / mib:6.1f}  "
                f"{m.num_pages} pages x {m.page_size} tokens ({share})"
                + (f"  KV in {m.kv_cache_dtype}" if m.kv_cache_dtype != "auto" else "")
                + (f"  weights in {m.quantization}" if m.quantization else "")
                + (f"  rank 0 of {_describe(m.parallel)}" if m.parallel else "")
            )
            memory = "device memory" if self.device.startswith("cuda") else "RSS"
            load = f"  {'':<10}   its load added {m.loaded / mib:.1f} of {memory} (measured)"
            if m.checkpoint_bytes:
                load += f", {m.loaded / m.checkpoint_bytes:.2f}x its files' {m.checkpoint_bytes / mib:.1f}"
            lines.append(load)
            if m.graphs:
                lines.append(
                    f"  {'':<10}   CUDA graphs: {len(m.graphs['sizes'])} decode batch sizes up to "
                    f"{max(m.graphs['sizes'])}, {m.graphs['memory_bytes'] / mib:.1f} MiB, captured in "
                    f"{m.graphs['capture_s']:.1f} s (measured)"
                )
            for rank in (m.parallel or {}).get("ranks", []):
                lines.append(
                    f"  {'':<10}   rank {rank['rank']}: weights {rank['weights'] / mib:.1f}, "
                    f"KV {rank['kv_bytes'] / mib:.1f} (its process)"
                )
        lines += [f"  {name}: {how}" for name, how in self.sources.items()]
        return "\n".join(lines)


def _parallel(config: EngineConfig) -> dict | None:
    parallel = config.parallel_config
    keys = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend")
    return {k: getattr(parallel, k) for k in keys} if parallel.world_size > 1 else None


def _describe(parallel: dict) -> str:
    tp, pp = parallel["tensor_parallel_size"], parallel["pipeline_parallel_size"]
    kinds = [f"{tp} tensor-parallel shards"] * (tp > 1) + [f"{pp} pipeline stages"] * (pp > 1)
    return " x ".join(kinds) + (" (Ray actors)" if parallel["distributed_executor_backend"] == "ray" else "")


SAMPLER_BYTES_PER_LOGIT = 12  # the logits row, its fp32 probabilities and their running sum (the CDF)


LOADED_CPU = "RSS after a load minus before it (mapped weights count once read: those it does not read join later)"
LOADED_CUDA = "device memory after a load minus before it"


def sources(device: torch.device) -> dict[str, str]:
    cuda = device.type == "cuda"
    return {
        "total_memory": "measured: " + ("torch.cuda.mem_get_info" if cuda else "sysconf physical pages"),
        "free_at_start": "measured: " + ("torch.cuda.mem_get_info" if cuda else "/proc/meminfo MemAvailable"),
        "weights": "measured: bytes of the models' parameters and buffers",
        "activation_peak": "measured: peak allocated over one max_num_batched_tokens step, by "
        + ("the CUDA caching allocator" if cuda else "the PyTorch profiler"),
        "sampler_peak": f"estimated: max_num_seqs x vocab x {SAMPLER_BYTES_PER_LOGIT} bytes",
        "other": "measured: beyond the weights, "
        + ("device memory the loads took (mem_get_info: CUDA context, workspaces)" if cuda else "RSS the loads added"),
        "loaded": "measured: " + (LOADED_CUDA if cuda else LOADED_CPU),
    }


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters, buffers and quantised weights, each byte counted once (the
    union of the tensors' byte ranges: views of one storage count what they cover)."""
    tensors = list(model.state_dict().values())
    for weight in quantized_weights(model).values():
        tensors += [t for part in weight.parts for t in (part.data, part.scales) if t is not None]
    for stored in checkpoint_weights(model).values():
        tensors += stored.tensors()
    ranges = sorted({(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()})
    total, reached = 0, 0
    for start, end in ranges:
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def checkpoint_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    if not os.path.isdir(path):
        return 0
    return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".safetensors") and e.is_file())


def activation_peak(engine: LLMEngine) -> int:
    """Peak bytes allocated by one engine step that prefills `max_num_batched_tokens` tokens."""
    num_tokens = engine.config.scheduler_config.max_num_batched_tokens
    chunk = engine.max_model_len
    lengths = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
    bs = engine.config.cache_config.page_size
    pages = max(sum(-(-n // bs) for n in lengths), -(-engine.max_model_len // bs) + 1)
    engine.attach_own_kv(pages * engine.kv_layout.page_bytes(bs))
    has_head = engine.model_config.has_lm_head
    for i, n in enumerate(lengths):
        params = ScoreParams([n - 1], token_ids=[0] if has_head else [], return_hidden_states=not has_head)
        engine.add_request(f"memory-probe-{i}", [1] * n, params)
    with engine.uncounted():  # the probe is not work the engine did for anyone
        peak = _peak_bytes(lambda: engine.step_plain(), engine.device)
    for i in range(len(lengths)):
        engine.abort(f"memory-probe-{i}")
    engine.check_pages_idle()
    return peak


def _peak_bytes(fn: object, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    events = _allocations(fn)
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


def _allocations(fn: object) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (+) and free (-) of PyTorch's CPU allocator during `fn()`.
    The profiler's C++ side is driven directly: `torch.profiler.profile` imports torch._dynamo."""
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, _ExperimentalConfig
    from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU}
    with _quiet_stderr():
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities)
        try:
            fn()
        finally:
            result = _disable_profiler()
    return [(e.start_ns(), e.nbytes()) for e in result.events() if e.name() == "[memory]"]


def default_budget(device: torch.device) -> tuple[int | None, float | None]:
    """(kv_cache_memory, memory_fraction) when none is given: on CUDA GPU_MEMORY_FRACTION of the
    free memory for everything (vLLM's gpu_memory_utilization); on a CPU DEFAULT_KV_CAP bytes of KV."""
    if device.type == "cuda":
        return None, GPU_MEMORY_FRACTION
    return DEFAULT_KV_CAP, None


def check_budget(kv_cache_memory: int | None, memory_budget: int | None, memory_fraction: float | None) -> None:
    if sum(x is not None for x in (kv_cache_memory, memory_budget, memory_fraction)) != 1:
        raise ValueError("give exactly one of kv_cache_memory, memory_budget and memory_fraction")
    for name, value in (("kv_cache_memory", kv_cache_memory), ("memory_budget", memory_budget)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive byte count, got {value!r}")
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ side logs its start and stop there)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def plan(
    engines: dict[str, LLMEngine],
    kv_fractions: dict[str, float] | None,
    free_at_start: int,
    loaded_bytes: dict[str, int],
    kv_cache_memory: int | None = None,
    memory_budget: int | None = None,
    memory_fraction: float | None = None,
) -> MemoryPlan:
    """Measure the engines and size their KV (`kv_fractions` None: one shared arena). Give exactly
    one of `kv_cache_memory`, `memory_budget` (bytes for everything) or `memory_fraction`."""
    check_budget(kv_cache_memory, memory_budget, memory_fraction)
    device = next(iter(engines.values())).device
    models = []
    for name, engine in engines.items():
        weights = weight_bytes(engine.model)
        sampler = engine.config.scheduler_config.max_num_seqs * engine.model_config.vocab_size * SAMPLER_BYTES_PER_LOGIT
        models.append(
            ModelMemory(
                name,
                weights,
                activation_peak(engine),
                engine.kv_layout.token_bytes,
                sampler_peak=sampler,
                other=max(0, loaded_bytes[name] - weights),
                loaded=loaded_bytes[name],
                checkpoint_bytes=checkpoint_bytes(engine.config.model),
                kv_fraction=None if kv_fractions is None else kv_fractions[name],
                quantization=engine.quantization,
                kv_cache_dtype=engine.config.cache_config.kv_cache_dtype,
                parallel=_parallel(engine.config),
            )
        )
    budget = memory_budget if memory_fraction is None else int(memory_fraction * free_at_start)
    result = MemoryPlan(
        str(device),
        total_memory(device),
        free_at_start,
        budget,
        kv_cache_memory or 0,
        kv_fractions is None,
        models=models,
        sources=sources(device),
    )
    if kv_cache_memory is None:
        result.kv_bytes = budget - result.weights - result.activations - result.other
        if result.kv_bytes <= 0:
            raise ValueError(
                f"the memory budget ({budget} bytes) leaves nothing for KV pages after weights ({result.weights}), "
                f"activations ({result.activations}) and other overhead ({result.other})"
            )
    return result


def record_pages(plan: MemoryPlan, engines: dict[str, LLMEngine]) -> None:
    for m in plan.models:
        engine = engines[m.name]
        m.graphs = engine.graph_stats
        m.page_size, m.page_bytes, m.num_pages = (
            engine.page_size,
            engine.arena.pages.page_bytes,
            engine.pages.num_pages,
        )
        if m.parallel and engine.ranks is not None:
            m.parallel["ranks"] = [
                {"rank": r, "weights": part["weights"], "kv_bytes": m.num_pages * m.page_size * part["kv_token_bytes"]}
                for r, part in enumerate(engine.ranks.parts, start=1)
            ]
    if plan.shared:
        plan.page_bytes, plan.num_pages = plan.models[0].page_bytes, plan.models[0].num_pages
