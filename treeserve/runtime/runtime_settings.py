"""What every model of a search runtime shares: dtype, device, attention kernels, memory budget.

Owns `RuntimeSettings` and loading a generator, a PRM and optionally a verifier (an outcome
reward model; each a `ModelSettings`) with them: `check` refuses bad values for the runtime and
every model before any weight loads; `load` builds the `Runtime` (`Runtime.for_search`). `EvalSettings` and
`ServerSettings` hold one beside their models' settings. Per-model settings never live here.
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
    attention_backend: str | None = None  # None: the device's default (triton on CUDA, cpu on a CPU)
    kv_cache_memory: int | None = None  # bytes for all models' KV pages (none of the three: planner.default_budget)
    memory_budget: int | None = None  # bytes for weights + activations + KV (see runtime/planner.py)
    memory_fraction: float | None = None  # of the memory free at start, for everything
    # both models' steps on CUDA streams of their own, the generator's at higher priority, so the
    # GPU runs them at once (None: on with CUDA; on a CPU accepted, and nothing changes)
    overlap_models: bool | None = None

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
        self,
        generator: ModelSettings,
        prm: ModelSettings | None,
        verifier: ModelSettings | None = None,
        **load_kwargs: object,
    ) -> Runtime:
        """The generator (engine "generator") and, when given, the PRM (engine "prm") and the
        verifier (engine "verifier") in one runtime, one page arena."""
        models = {"generator": generator, "prm": prm, "verifier": verifier}
        engine_args = {name: m.engine_args() for name, m in models.items() if m is not None}
        return Runtime.for_search(
            str(generator.path),
            str(prm.path) if prm else None,
            self.kv_cache_memory,
            prm.kv_fraction if prm else None,
            engine_args,
            str(verifier.path) if verifier else None,
            dtype=self.dtype,
            memory_budget=self.memory_budget,
            memory_fraction=self.memory_fraction,
            device=self.device,
            attention_backend=self.attention_backend,
            overlap_models=bool(self.overlap_models),
            **load_kwargs,
        )
