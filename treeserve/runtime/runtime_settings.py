"""What every model of a search runtime shares: the device (and dtype), the page arena, memory.

Owns `RuntimeSettings`: `check` refuses bad values for the runtime and every model (each a
`ModelSettings`) before any weight loads; `load` builds the `Runtime`. Per-model settings never
live here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from treeserve.config import ArenaConfig, DeviceConfig, nest
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import ROLE_PAGE_SIZES, Runtime

RUNTIME_CONFIGS: dict[str, type] = {"device_config": DeviceConfig, "arena_config": ArenaConfig}


@dataclass
class RuntimeSettings:
    device_config: DeviceConfig = field(default_factory=DeviceConfig)  # resolved when made
    # kv_cache_memory: bytes for all models' KV pages (none of it and the two below: planner.default_budget)
    arena_config: ArenaConfig = field(default_factory=ArenaConfig)
    memory_budget: int | None = None  # bytes for weights + activations + KV (runtime/planner.py)
    memory_fraction: float | None = None  # of the memory free at start, for everything
    # each model steps on a CUDA stream of its own (None: on with CUDA; a CPU ignores it)
    overlap_models: bool | None = None

    @classmethod
    def from_flat(cls, **values: object) -> RuntimeSettings:
        """From flat settings (the flags' names: `dtype`, `kv_cache_memory`, ...), None for the default."""
        return cls(**nest({k: v for k, v in values.items() if v is not None}, RUNTIME_CONFIGS))

    def check(self, generator: ModelSettings, prm: ModelSettings | None, verifier: ModelSettings | None = None) -> None:
        """Check every model on the runtime's device (results record what ran)."""
        if self.overlap_models is not None and not isinstance(self.overlap_models, bool):
            raise ValueError(f"overlap_models must be True, False or None (the default), got {self.overlap_models!r}")
        device = self.device_config.device
        if self.overlap_models is None:
            self.overlap_models = device.startswith("cuda")
        generator.check("generator", device)
        if generator.kv_fraction is not None:
            raise ValueError(
                "a static KV split is given as the PRM's share (prm kv_fraction); the generator gets the rest"
            )
        if prm is not None:
            prm.check("prm", device)
        if verifier is not None:
            verifier.check("verifier", device)
            if verifier.kv_fraction is not None or (prm is not None and prm.kv_fraction is not None):
                raise ValueError(
                    "a verifier shares the page arena with the generator and the PRM: a static KV "
                    "split (prm or verifier kv_fraction) cannot take it"
                )

    def load(
        self, generator: ModelSettings, prm: ModelSettings | None, verifier: ModelSettings | None = None
    ) -> Runtime:
        """The generator (engine "generator") and, when given, the PRM ("prm") and the verifier
        ("verifier") in one runtime, one page arena."""
        models = {"generator": generator, "prm": prm, "verifier": verifier}
        return Runtime.for_search(
            str(generator.path),
            str(prm.path) if prm else None,
            self.arena_config.kv_cache_memory,
            prm.kv_fraction if prm else None,
            {name: m.engine_args(ROLE_PAGE_SIZES[name]) for name, m in models.items() if m is not None},
            str(verifier.path) if verifier else None,
            device_config=self.device_config,
            enable_prefix_caching=self.arena_config.enable_prefix_caching,
            memory_budget=self.memory_budget,
            memory_fraction=self.memory_fraction,
            overlap_models=bool(self.overlap_models),
        )


# the flat names `from_flat` takes
RUNTIME_KEYS = tuple(
    f.name
    for kind in (*RUNTIME_CONFIGS.values(), RuntimeSettings)
    for f in fields(kind)
    if f.name not in RUNTIME_CONFIGS
)
