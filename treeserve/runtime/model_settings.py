"""One model's settings (`ModelSettings`): what a runtime needs to load and run the generator,
the PRM or the verifier, as the `EngineConfig` sub-configs that are per model. `check()` refuses
bad values before any weight loads. It never loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from treeserve.config import (
    CacheConfig,
    GraphConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_model_path,
    check_parallel,
    nest,
    resolve_async_scheduling,
)

TUNED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "page_size")  # what `treeserve tune` picks
# the EngineConfig sub-configs a model has of its own (the runtime's are RuntimeSettings')
MODEL_CONFIGS: dict[str, type] = {
    "load_config": LoadConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "graph_config": GraphConfig,
}


@dataclass
class ModelSettings:
    path: str  # a Hugging Face checkpoint directory or a .gguf file
    style: str | None = None  # a PRM's or verifier's input format (None: its own)
    kv_fraction: float | None = None  # its share of the KV pages in a static split (None: one shared arena)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)  # page_size None: the role's
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    graph_config: GraphConfig = field(default_factory=GraphConfig)
    speculative_config: SpeculativeConfig | dict | str | None = None  # resolved by `check`

    @classmethod
    def from_flat(cls, path: str, name: str = "", **values: object) -> ModelSettings:
        """From flat engine settings (vLLM's names: flags, a tune file, an old results file), None
        for the default; a bad value's error names the model `name`."""
        try:
            nested = nest({k: v for k, v in values.items() if v is not None}, MODEL_CONFIGS)
        except ValueError as e:
            raise ValueError(f"{name}: {e}" if name else str(e)) from None
        unknown = sorted(set(nested) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown model settings {unknown}")
        return cls(path, **nested)

    @classmethod
    def from_dict(cls, values: dict) -> ModelSettings:
        """From a results file's config (`asdict`'s); unknown keys refused."""
        values = dict(values)
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model settings {sorted(unknown)}")
        for group, kind in MODEL_CONFIGS.items():
            if isinstance(values.get(group), dict):
                values[group] = kind(**values[group])
        return cls(**values)

    def check(self, name: str, device: str) -> None:
        """Refuse bad values, naming the model `name`; resolve `speculative_config` and
        `async_scheduling` to what `device` runs (results record what ran)."""
        check_model_path(str(self.path), f"{name} model")
        try:
            check_parallel(str(self.path), device, self.parallel_config, self.load_config.quantization)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and name != "generator":
            raise ValueError(
                f"a {'PRM' if name == 'prm' else name} only scores (one forward per input): "
                "speculative decoding is for the generator"
            )
        if speculative is not None:
            speculative.check()
        self.speculative_config = speculative
        overlap = resolve_async_scheduling(self.scheduler_config.async_scheduling, device, speculative is not None)
        self.scheduler_config = replace(self.scheduler_config, async_scheduling=overlap)
        if self.kv_fraction is not None and not 0.0 < self.kv_fraction < 1.0:
            raise ValueError(f"{name}_kv_fraction must be in (0, 1), got {self.kv_fraction}")

    def engine_args(self, page_size: int | None = None) -> dict:
        """`EngineConfig.from_kwargs`'s keywords for this model: its sub-configs, the pages
        `page_size` tokens unless it sets its own."""
        configs = {group: getattr(self, group) for group in MODEL_CONFIGS}
        if self.cache_config.page_size is None and page_size is not None:
            configs["cache_config"] = replace(self.cache_config, page_size=page_size)
        return {**configs, "speculative_config": self.speculative_config}
