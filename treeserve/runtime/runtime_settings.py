"""What every model of a search runtime shares: dtype, device, attention kernels, memory, prefix cache.

Owns `RuntimeSettings`: `check` refuses bad values for the runtime and every model (each a
`ModelSettings`) before any weight loads and resolves the device once; `load` builds the
`Runtime`. Per-model settings never live here.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeserve.device import resolve_attention_backend, resolve_device
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import Runtime


@dataclass
class RuntimeSettings:
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda when torch sees a GPU, else cpu
    attention_backend: str | None = None  # None: triton on CUDA, cpu on a CPU
    kv_cache_memory: int | None = None  # bytes for all models' KV pages (none of the three: planner.default_budget)
    memory_budget: int | None = None  # bytes for weights + activations + KV (runtime/planner.py)
    memory_fraction: float | None = None  # of the memory free at start, for everything
    # each model steps on a CUDA stream of its own (None: on with CUDA; a CPU ignores it)
    overlap_models: bool | None = None
    prefix_cache: bool = True  # every engine's prefix cache (EngineConfig.enable_prefix_caching)

    def check(self, generator: ModelSettings, prm: ModelSettings | None, verifier: ModelSettings | None = None) -> None:
        """Resolve the device and backend (so results record what ran) and check every model on it."""
        if self.overlap_models is not None and not isinstance(self.overlap_models, bool):
            raise ValueError(f"overlap_models must be True, False or None (the default), got {self.overlap_models!r}")
        self.device = resolve_device(self.device)
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        if self.overlap_models is None:
            self.overlap_models = self.device.startswith("cuda")
        generator.check("generator", self.device)
        if generator.kv_fraction is not None:
            raise ValueError(
                "a static KV split is given as the PRM's share (prm kv_fraction); the generator gets the rest"
            )
        if prm is not None:
            prm.check("prm", self.device)
        if verifier is not None:
            verifier.check("verifier", self.device)
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
            self.kv_cache_memory,
            prm.kv_fraction if prm else None,
            {name: m.engine_args() for name, m in models.items() if m is not None},
            str(verifier.path) if verifier else None,
            dtype=self.dtype,
            enable_prefix_caching=self.prefix_cache,
            memory_budget=self.memory_budget,
            memory_fraction=self.memory_fraction,
            overlap_models=bool(self.overlap_models),
            device=self.device,
            attention_backend=self.attention_backend,
        )
