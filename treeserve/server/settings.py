"""A server's settings (`treeserve serve`'s flags) and the models they load.

Owns `ServerSettings` (checked before any model loads) and `build_served`, which loads the
generator and, when given, a PRM into one runtime and returns what the routes serve. The
API process and the engine-core process (`core.py`) both build from here; `launch.py` starts
one or the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from treeserve.config import check_model_path, check_parallel, resolve_async_scheduling
from treeserve.device import resolve_attention_backend, resolve_device
from treeserve.engine.speculative import SpeculativeConfig
from treeserve.runtime.runtime import Runtime, parallel_sizes, per_model_engine_args
from treeserve.search.prm import load_prm
from treeserve.server.completions import Served
from treeserve.server.metrics import ServerMetrics, engine_stats
from treeserve.server.traces import TraceRing


@dataclass
class ServerSettings:
    model: str
    prm: str | None = None
    prm_style: str | None = None
    served_model_name: str | None = None  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda when torch sees a GPU, else cpu
    attention_backend: str | None = None  # None: the device's default (triton on CUDA, cpu on a CPU)
    kv_cache_memory: int | None = None  # bytes for both models' KV pages (1 GiB when no budget is given)
    memory_budget: int | None = None  # bytes for weights + activations + KV
    memory_fraction: float | None = None  # of the memory free at start, for everything
    prm_kv_fraction: float | None = None  # None: one page arena shared by both models; else a static split
    engine_args: dict | None = None  # per-model engine settings (from `treeserve tune`)
    max_model_len: int | None = None
    quantization: str | None = None  # the model's: "int8" (a Hugging Face checkpoint), "gguf" (a GGUF file's own)
    prm_quantization: str | None = None  # the PRM's, likewise
    dequantize: bool = False  # load GGUF files dense
    quant_activations: str | None = None  # every model's quantised matmuls: "int8" | "bf16" (None: the default)
    speculative_config: dict | str | None = None  # the generator's speculative decoding (EngineConfig's)
    async_scheduling: bool | None = None  # overlapped steps, both models (None: the device's default)
    enforce_eager: bool = False  # no CUDA graphs for decode steps, both models
    engine_process: bool = True  # the engines in an engine-core process of their own (False: in this one)
    shutdown_timeout: float = 30.0  # on SIGTERM, seconds open requests get before they are aborted
    trace_ring: int = 32  # how many traced searches (/v1/search "trace": true) GET /ui keeps, newest first
    tensor_parallel_size: int = 1  # the model's ranks (tensor shards), and the PRM's
    prm_tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # the model's pipeline stages, and the PRM's
    prm_pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # how parallel models' other ranks start: "mp" | "ray"

    @property
    def name(self) -> str:
        """The model id clients send: `served_model_name`, else the model directory's name."""
        return self.served_model_name or Path(self.model).resolve().name

    def check(self) -> None:
        self.device = resolve_device(self.device)  # resolved, so results record what ran
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        sizes_of = parallel_sizes(self)
        for name, path, sizes in (("model", self.model, sizes_of["generator"]), ("prm", self.prm, sizes_of["prm"])):
            if path is not None:
                check_model_path(path, name)
                check_parallel(path, self.device, sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"],
                               backend=self.distributed_executor_backend)  # fmt: skip
        spec = SpeculativeConfig.parse(self.speculative_config)  # checked before any model loads
        self.speculative_config = None if spec is None else asdict(spec)
        self.async_scheduling = resolve_async_scheduling(self.async_scheduling, self.device, spec is not None)
        if self.prm_kv_fraction is not None and not 0.0 < self.prm_kv_fraction < 1.0:
            raise ValueError(f"prm_kv_fraction must be in (0, 1), got {self.prm_kv_fraction}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.trace_ring < 0:
            raise ValueError(f"trace_ring must be >= 0 (0 keeps no traced search), got {self.trace_ring}")


def build_served(settings: ServerSettings) -> Served:
    settings.check()
    extra = {"max_model_len": settings.max_model_len} if settings.max_model_len else {}
    runtime = Runtime.for_search(
        settings.model, settings.prm, settings.kv_cache_memory, settings.prm_kv_fraction,
        per_model_engine_args(settings),
        dtype=settings.dtype, memory_budget=settings.memory_budget, memory_fraction=settings.memory_fraction,
        device=settings.device, attention_backend=settings.attention_backend,
        async_scheduling=settings.async_scheduling, enforce_eager=settings.enforce_eager, **extra,
    )  # fmt: skip
    print(runtime.memory_plan.table(), flush=True)
    prm = load_prm(runtime, "prm", settings.prm_style) if settings.prm else None  # a bad PRM fails at startup
    metrics = ServerMetrics(lambda: engine_stats(runtime))
    return Served(runtime, settings.name, metrics, prm=prm, traces=TraceRing(settings.trace_ring))
