"""One model's settings: what a runtime needs to load and run one model (the generator, the PRM
or the verifier).

Owns `ModelSettings`: where the model is, how it is quantised, split over ranks (tensor and
pipeline parallel) and stepped (speculative decoding, overlapped steps, CUDA graphs), its
batch limits, its share of the KV pages in a static split and, for a PRM, its input format.
`check()` refuses bad values with errors naming the model and the value, before any weight
loads; `engine_args()` is what the model's engine gets on top of the runtime-wide settings
(a `ModelSpec`'s `engine_args`, `Runtime.for_search`'s per-model dict). `EvalSettings` and
`ServerSettings` hold one for the generator, one for the PRM and one for a verifier; the command
line makes their flags from this dataclass's fields (cli.py, `MODEL_FLAGS`).

It never loads a model and knows nothing of searches, datasets or servers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from treeserve.config import (
    SpeculativeConfig,
    check_kv_cache_dtype,
    check_model_path,
    check_parallel,
    resolve_async_scheduling,
)
from treeserve.layers.quant import ACTIVATIONS

# the engine settings `treeserve tune` chooses per model (its settings file's "engine_args")
TUNED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


@dataclass
class ModelSettings:
    path: str  # a Hugging Face checkpoint directory or a .gguf file
    style: str | None = None  # a PRM's or verifier's input format (search/prm's PRM_STYLES; None: its own)
    # "int8": quantise a Hugging Face checkpoint per channel at load; "gguf": run a GGUF file's own blocks
    quantization: str | None = None
    dequantize: bool = False  # load a GGUF file dense
    quant_activations: str | None = None  # what quantised matmuls take: "int8" | "bf16" (None: the engine's default)
    speculative_config: dict | str | None = None  # a generator's speculative decoding (EngineConfig's)
    tensor_parallel_size: int = 1  # ranks holding tensor shards
    pipeline_parallel_size: int = 1  # pipeline stages
    distributed_executor_backend: str = "mp"  # how a parallel model's other ranks start: "mp" | "ray"
    async_scheduling: bool | None = None  # overlapped steps (None: the device's default; resolved by check)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_model_len: int | None = None  # None: the model's own (capped)
    kv_cache_dtype: str | None = None  # what its KV pages hold: "auto" | "fp8_e4m3" (None: the engine's "auto")
    kv_fraction: float | None = None  # this model's share of the KV pages in a static split (None: one shared arena)
    max_num_seqs: int | None = None  # batch limits (None: the engine's defaults); `treeserve tune` picks them
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # tokens per page (None: the runtime's choice for the model's role)

    def check(self, name: str, device: str) -> None:
        """Refuse bad values before any weight loads (ValueError or FileNotFoundError naming the
        model `name`, "generator", "prm" or "verifier"); resolves `speculative_config` to a dict and
        `async_scheduling` to what `device` runs, so results record what ran."""
        check_model_path(str(self.path), f"{name} model")
        try:
            check_parallel(
                str(self.path),
                device,
                self.tensor_parallel_size,
                self.pipeline_parallel_size,
                self.quantization,
                backend=self.distributed_executor_backend,
            )
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and name != "generator":
            raise ValueError(
                f"a {'PRM' if name == 'prm' else name} only scores (one forward per input): "
                "speculative decoding is for the generator"
            )
        self.speculative_config = None if speculative is None else asdict(speculative)
        self.async_scheduling = resolve_async_scheduling(self.async_scheduling, device, speculative is not None)
        if self.quant_activations not in (None, *ACTIVATIONS):
            raise ValueError(
                f"{name}: quant_activations must be one of {list(ACTIVATIONS)} or None, got {self.quant_activations!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"{name}: enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.kv_cache_dtype is not None:
            try:
                check_kv_cache_dtype(self.kv_cache_dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if self.kv_fraction is not None and not 0.0 < self.kv_fraction < 1.0:
            raise ValueError(f"{name}_kv_fraction must be in (0, 1), got {self.kv_fraction}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{name}: max_model_len must be >= 2, got {self.max_model_len}")
        for key in TUNED_KEYS:
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: {key} must be a positive integer, got {value!r}")

    def engine_args(self) -> dict:
        """This model's EngineConfig settings, those that differ from the engine's defaults
        (parallel sizes of 1 and how ranks start are left out when the model runs on one rank)."""
        args: dict = {key: getattr(self, key) for key in ENGINE_KEYS if getattr(self, key) is not None}
        if not self.dequantize:
            del args["dequantize"]
        if not self.enforce_eager:
            del args["enforce_eager"]
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if args[key] == 1:
                del args[key]
        if self.tensor_parallel_size * self.pipeline_parallel_size == 1:
            del args["distributed_executor_backend"]
        return args

    @classmethod
    def from_dict(cls, values: dict) -> ModelSettings:
        """A model's settings from a results file's config (`asdict`'s), unknown keys refused."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model settings {sorted(unknown)}")
        return cls(**values)


# the fields that are EngineConfig settings of the same name (the path and the PRM's style and
# KV share are the runtime's and the search's)
ENGINE_KEYS = tuple(f.name for f in fields(ModelSettings) if f.name not in ("path", "style", "kv_fraction"))
