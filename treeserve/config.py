"""One engine's settings (`EngineConfig`): model, dtype, KV memory, batch limits, speculation,
parallelism; checked with clear `ValueError`s before anything loads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field, fields, replace

import torch

from treeserve.device import resolve_attention_backend, resolve_device
from treeserve.layers.quant import ACTIVATIONS, kernels_available
from treeserve.models.gguf_loader import GGUFCheckpoint, is_gguf
from treeserve.models.loader import CHECKPOINT, QUANTIZATIONS, read_hf_config
from treeserve.models.quantized_checkpoint import read_scheme

log = logging.getLogger(__name__)

DEFAULT_KV_CAP = 1 << 30  # a CPU engine's KV when not told: at most this
GPU_MEMORY_FRACTION = 0.9  # on CUDA, the share of free memory an engine or a runtime takes (vLLM's)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the KV pages hold: "auto" the model's dtype; "fp8_e4m3" one byte a value, scaled per layer
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
EXECUTOR_BACKENDS = ("mp", "ray")  # how a parallel engine starts its other ranks (vLLM's names)
SPECULATIVE_METHODS = ("ngram", "tree", "model")  # where drafts come from (engine/speculative/)


def check_model_path(path: str, name: str = "model") -> None:
    """A model is a Hugging Face checkpoint directory (with config.json) or a .gguf file."""
    if os.path.isfile(os.path.join(path, "config.json")) or is_gguf(path):
        return
    if os.path.isdir(path):
        raise FileNotFoundError(f"{name} directory has no config.json: {path!r}")
    raise FileNotFoundError(f"{name} not found (a checkpoint directory or a .gguf file): {path!r}")


def check_kv_cache_dtype(value: object, name: str = "kv_cache_dtype") -> None:
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"{name} must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")


ASYNC_ENV = "TREESERVE_ASYNC_SCHEDULING"


def resolve_async_scheduling(value: bool | None, device: str, speculating: bool) -> bool:
    """`async_scheduling` as an engine runs it (None: SchedulerConfig.async_scheduling's default)."""
    if value and speculating:
        raise ValueError(
            "async_scheduling and speculative_config cannot be combined: drafts are proposed from the last "
            "sampled token, which overlapped steps read back one step late; turn one of them off"
        )
    if value is not None:
        return value
    env = os.environ.get(ASYNC_ENV)
    if env is not None and env not in ("0", "1"):
        raise ValueError(f"{ASYNC_ENV} must be 0 or 1, got {env!r}")
    on = env == "1" if env is not None else not device.startswith("cpu")
    return on and not speculating


def check_parallel(
    model: str, device: str, parallel: ParallelConfig, quantization: str | None = None, speculating: bool = False
) -> None:
    """Parallel sizes against this host's devices ("mp"), the formats and the model's shapes (its
    config only); ValueError naming the numbers."""
    tp, pp, backend = (
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.distributed_executor_backend,
    )
    if tp * pp == 1:
        return
    sizes = f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}"
    available = torch.cuda.device_count() if device.startswith("cuda") else os.cpu_count() or 1
    kind = "GPUs" if device.startswith("cuda") else "CPU cores (a rank needs a core)"
    if backend == "mp" and tp * pp > available:
        raise ValueError(f"{sizes} needs {tp * pp} ranks, more than the {available} {kind} here")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'treeserve[ray]'")
    if speculating:
        raise ValueError(f"speculative decoding runs on one rank: it is not supported at {sizes}")
    from treeserve.models.loader import read_model_config
    from treeserve.models.sharding import check_divisible, check_stages, check_whole_blocks

    config = read_model_config(model)
    if tp > 1:
        check_divisible(config, tp, config.vocab_size)
    if tp > 1 and quantization == "int8":  # each rank quantises its shard: whole 32-weight blocks
        widths = {
            "attention heads x head_dim": config.num_heads * config.head_dim // tp,
            "intermediate size": config.intermediate_size // tp,
        }
        if config.moe is not None:
            widths["experts' intermediate size"] = config.moe.intermediate_size // tp
        bad = {name: width for name, width in widths.items() if width % 32}
        if bad:
            raise ValueError(
                f"int8 at tensor_parallel_size={tp} needs each rank's matrix widths to be multiples "
                f"of 32 (whole blocks), got {bad}"
            )
    if tp > 1 and quantization == "gguf":  # a rank's blocks are the file's: row-parallel inputs split whole blocks
        check_whole_blocks(GGUFCheckpoint(model).quantized_blocks(), tp)
    check_stages(config, pp)


@dataclass
class SpeculativeConfig:
    """vLLM's `speculative_config` keys (a `model` path alone means method "model")."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a dict (or its JSON text); raises ValueError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "disable_by_batch_size",
        }
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; it takes {sorted(known)}")
        method = value.get("method", "model" if value.get("model") else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (k, the tokens drafted per step)")
        config = cls(method=method, **{k: v for k, v in value.items() if k != "method"})
        config.check()
        return config

    def check(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1 or None, got {limit!r}")
        if self.method == "model":
            if not self.model:
                raise ValueError("speculative_config method 'model' needs model: a draft model's checkpoint")
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise FileNotFoundError(f"draft model directory has no config.json: {self.model!r}")
        elif self.model:
            raise ValueError(f"speculative_config method {self.method!r} takes no model")

    def check_draft(self, target: str) -> None:
        """Before anything loads: a draft model must have the target's vocabulary (config.json;
        a GGUF target is checked when the draft loads)."""
        if self.method != "model":
            return
        draft, mine = _vocab_size(self.model), _vocab_size(target)
        if mine is not None and draft != mine:
            raise ValueError(
                f"draft model {self.model!r} has a vocabulary of {draft} tokens, the target {mine}: "
                "a draft must share the target's tokenizer"
            )


def _vocab_size(path: str) -> int | None:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    return config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))


def _positive_ints(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class DeviceConfig:
    """Where every model of a runtime runs, and in what dtype; the device is resolved here."""

    device: str | None = None  # "cuda", "cuda:N" or "cpu"; None: "cuda" when torch sees a GPU, else "cpu"
    attention_backend: str | None = None  # "triton" | "sdpa" | "cpu"; None: triton on CUDA, cpu on a CPU
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.device = resolve_device(self.device)
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class ArenaConfig:
    """The KV page arena every model of a runtime shares: its bytes and the prefix cache."""

    kv_cache_memory: int | None = None  # bytes; None: a share of the memory free after the weights
    kv_cache_fraction: float = 0.25  # a lone engine's share on a CPU (a runtime's planner sizes its own)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None and (
            not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory <= 0
        ):
            raise ValueError(f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")

    def kv_budget(self, available: int, device: str) -> int:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.startswith("cuda"):
            return int(GPU_MEMORY_FRACTION * available)
        return min(int(self.kv_cache_fraction * available), DEFAULT_KV_CAP)


@dataclass
class LoadConfig:
    """How one model's weights load: quantisation and the longest sequence."""

    # "int8": quantise per channel at load; "gguf": run a GGUF file's blocks (its default on a CPU)
    quantization: str | None = None
    dequantize: bool = False  # load a GGUF file dense
    quant_activations: str = "int8"  # what quantised matmuls take activations as: "int8" | "bf16"
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped)

    def __post_init__(self) -> None:
        if self.quantization not in (None, CHECKPOINT, *QUANTIZATIONS):  # CHECKPOINT: as a checkpoint is stored
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}")
        if not isinstance(self.dequantize, bool):
            raise ValueError(f"dequantize must be True or False, got {self.dequantize!r}")
        if self.quant_activations not in ACTIVATIONS:
            choices = list(ACTIVATIONS)
            raise ValueError(f"quant_activations must be one of {choices}, got {self.quant_activations!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """One model's KV pages: tokens a page and what a page holds."""

    page_size: int | None = None  # None: 16, or the runtime's choice for the model's role
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.page_size is not None:
            _positive_ints(self, ("page_size",))
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass
class SchedulerConfig:
    """One model's batch limits and whether steps overlap."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # schedule step t+1 while the device runs t (None: on with CUDA; CPU: TREESERVE_ASYNC_SCHEDULING)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _positive_ints(self, ("max_num_seqs", "max_num_batched_tokens"))
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True, False or None (the default), got {self.async_scheduling!r}"
            )


@dataclass
class ParallelConfig:
    """How one model splits over ranks."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # how ranks 1..k-1 start: "mp" (this host) | "ray"
    parallel_timeout_s: float = 60.0  # a rank silent this long fails the requests

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            backends = list(EXECUTOR_BACKENDS)
            raise ValueError(
                f"distributed_executor_backend must be one of {backends}, got {self.distributed_executor_backend!r}"
            )
        _positive_ints(self, ("tensor_parallel_size", "pipeline_parallel_size"))
        if not self.parallel_timeout_s > 0:
            raise ValueError(f"parallel_timeout_s must be > 0 seconds, got {self.parallel_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class GraphConfig:
    """One model's CUDA graphs for decode steps."""

    enforce_eager: bool = False  # no CUDA graphs
    # the batch sizes captured (None: 1, 2, 4, 8, then steps of 8 up to max_num_seqs)
    cuda_graph_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (
            not isinstance(sizes, list | tuple)
            or not sizes
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
        ):
            raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive batch sizes, got {sizes!r}")


DEFAULT_PAGE_SIZE = 16
# EngineConfig's sub-configs by field name: `from_kwargs` maps each flat keyword to the one holding it
SUB_CONFIGS: dict[str, type] = {
    "device_config": DeviceConfig,
    "arena_config": ArenaConfig,
    "load_config": LoadConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "graph_config": GraphConfig,
}
TOP_LEVEL = ("model_id", "seed", "speculative_config")


# vLLM's names for settings treeserve names otherwise: a KV page is vLLM's block
VLLM_NAMES = {"block_size": "page_size"}


def nest(values: dict[str, object], groups: dict[str, type]) -> dict[str, object]:
    """Flat settings (vLLM's keyword names) as `groups`' sub-configs; a group may also be given
    whole under its own name. Names in no group are left as they are, for the caller to refuse."""
    owner = {f.name: group for group, kind in groups.items() for f in fields(kind)}
    flat: dict[str, dict] = {group: {} for group in groups}
    out: dict[str, object] = {}
    for name, value in values.items():
        name = VLLM_NAMES.get(name, name)
        if name in owner:
            flat[owner[name]][name] = value
        else:
            out[name] = value
    for group, kind in groups.items():
        if group in out and flat[group]:
            raise TypeError(f"{group} and {sorted(flat[group])} are both given: give one of them")
        if group not in out:
            out[group] = kind(**flat[group])
    return out


@dataclass
class EngineConfig:
    """One engine's settings, vLLM's `VllmConfig` shape: a sub-config a concern."""

    model: str  # a Hugging Face checkpoint directory or a GGUF file
    model_id: str = ""  # salts prefix-cache hashes so two models never share a page
    seed: int = 0  # the draws of requests that set no seed
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    arena_config: ArenaConfig = field(default_factory=ArenaConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    graph_config: GraphConfig = field(default_factory=GraphConfig)
    speculative_config: SpeculativeConfig | dict | str | None = None  # or vLLM's dict, or its JSON

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineConfig:
        """From vLLM's flat keywords (`dtype=`, `max_num_seqs=`, ...; `LLM`'s), or sub-configs whole."""
        values = nest(kwargs, SUB_CONFIGS)
        unknown = sorted(set(values) - set(SUB_CONFIGS) - set(TOP_LEVEL))
        if unknown:
            known = sorted([*TOP_LEVEL, *(f.name for kind in SUB_CONFIGS.values() for f in fields(kind))])
            raise TypeError(f"unknown engine settings {unknown}; known: {known}")
        return cls(model, **values)

    def __post_init__(self) -> None:
        """Checks across sub-configs (each checked its own fields); resolved values replace the
        sub-configs given, never change them (a runtime's settings record what was asked)."""
        device = self.device_config.device
        check_model_path(self.model)
        if not self.model_id:
            self.model_id = os.path.abspath(self.model)
        if self.cache_config.page_size is None:
            self.cache_config = replace(self.cache_config, page_size=DEFAULT_PAGE_SIZE)
        quantization = self._resolve_quantization()
        if quantization != self.load_config.quantization:
            self.load_config = replace(self.load_config, quantization=quantization)
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None:
            spec.check()
            spec.check_draft(self.model)
        self.speculative_config = spec
        scheduler = self.scheduler_config
        overlap = resolve_async_scheduling(scheduler.async_scheduling, device, spec is not None)
        if overlap != scheduler.async_scheduling:
            self.scheduler_config = replace(scheduler, async_scheduling=overlap)
        check_parallel(self.model, device, self.parallel_config, quantization, spec is not None)

    def _resolve_quantization(self) -> str | None:
        load, device = self.load_config, self.device_config.device
        method, gguf = load.quantization, is_gguf(self.model)
        scheme = None
        if not gguf and os.path.isfile(os.path.join(self.model, "config.json")):
            scheme = read_scheme(self.model, read_hf_config(self.model))  # refuses what treeserve does not run
        if scheme is not None:  # GPTQ / AWQ / compressed-tensors: run as stored, or dense with dequantize=True
            if method not in (None, CHECKPOINT):
                raise ValueError(
                    f"{self.model!r} is a {scheme.method} checkpoint, quantised already: "
                    f"quantization={method!r} does not apply (dequantize=True loads it dense)"
                )
            if load.dequantize:
                return None
            if device == "cpu" and not kernels_available():
                log.warning(
                    "%s: the CPU kernels are not built; dequantising the %s weights on load", self.model, scheme.method
                )
                return None
            return CHECKPOINT
        if method == CHECKPOINT:
            raise ValueError(f"quantization={CHECKPOINT!r} is for GPTQ, AWQ and compressed-tensors checkpoints")
        if method == "int8" and gguf:
            raise ValueError(
                "quantization='int8' is for Hugging Face checkpoints: a GGUF file runs its own quantised "
                "formats (the default), or dense with dequantize=True"
            )
        if method == "int8" and load.dequantize:
            raise ValueError("quantization='int8' and dequantize=True contradict each other")
        if method == "gguf" and not gguf:
            raise ValueError(f"quantization='gguf' needs a .gguf file, got {self.model!r}")
        if not gguf or load.dequantize:
            method = method if not gguf else None
        elif method is None:
            method = "gguf"
        if method is None or (device == "cpu" and kernels_available()):
            return method
        why = "quantised kernels are CPU kernels" if device != "cpu" else "the CPU kernels are not built"
        if method == "int8":
            raise ValueError(f"quantization='int8' cannot run here: {why}")
        log.warning("%s: %s; dequantising the GGUF weights on load", self.model, why)
        return None

    def kv_budget(self, available: int) -> int:
        return self.arena_config.kv_budget(available, self.device_config.device)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype of the KV pages: `kv_cache_dtype`'s, or the model's for "auto"."""
        return KV_CACHE_DTYPES[self.cache_config.kv_cache_dtype] or self.device_config.torch_dtype
