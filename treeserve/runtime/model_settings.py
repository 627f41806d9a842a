"""One model's settings (`ModelSettings`): what a runtime needs to load and run the generator,
the PRM or the verifier. `check()` refuses bad values before any weight loads; `engine_args()`
is what the model's `EngineConfig` gets beyond the runtime-wide settings. It never loads a model.
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

TUNED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


@dataclass
class ModelSettings:
    # None below: the engine's default (EngineConfig's field of the same name)
    path: str  # a Hugging Face checkpoint directory or a .gguf file
    style: str | None = None  # a PRM's or verifier's input format (None: its own)
    quantization: str | None = None  # "int8" | "gguf"
    dequantize: bool = False
    quant_activations: str | None = None
    speculative_config: dict | str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    async_scheduling: bool | None = None  # resolved by `check` for the device
    enforce_eager: bool = False
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    kv_fraction: float | None = None  # its share of the KV pages in a static split (None: one shared arena)
    max_num_seqs: int | None = None  # `treeserve tune` picks these three
    max_num_batched_tokens: int | None = None
    block_size: int | None = None  # None: the runtime's choice for the model's role

    def check(self, name: str, device: str) -> None:
        """Refuse bad values, naming the model `name`; resolve `speculative_config` to a dict and
        `async_scheduling` to what `device` runs (results record what ran)."""
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
        """This model's EngineConfig settings that differ from the engine's defaults."""
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
        """From a results file's config (`asdict`'s); unknown keys refused."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model settings {sorted(unknown)}")
        return cls(**values)


# the fields that are EngineConfig's settings of the same name
ENGINE_KEYS = tuple(f.name for f in fields(ModelSettings) if f.name not in ("path", "style", "kv_fraction"))
