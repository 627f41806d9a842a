"""A server's settings (`treeserve serve`'s flags), checked before any model loads, and
`build_served`: the generator, PRM and verifier in one runtime, for the API or the core process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from treeserve.models.tokenizer import Tokenizer
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.prm import check_verifier, load_prm
from treeserve.server.completions import Served
from treeserve.server.metrics import ServerMetrics, engine_stats
from treeserve.server.reasoning import ReasoningParser
from treeserve.server.traces import TraceRing


@dataclass
class ServerSettings:
    generator: ModelSettings
    prm: ModelSettings | None = None  # None: no /v1/search
    verifier: ModelSettings | None = None  # an outcome RM re-ranking /v1/search
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)  # both models'
    served_model_name: str | None = None  # default: the generator directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    engine_process: bool = True  # False: engines in this process
    shutdown_timeout: float = 30.0  # seconds open requests get on SIGTERM
    trace_ring: int = 32  # traced searches GET /ui keeps
    reasoning_parser: str | None = None  # server/reasoning.py's PARSERS

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.generator.path).resolve().name

    def names(self) -> dict[str, str]:
        """Each hosted model's name by role: "-prm" / "-verifier" added to one repeating a name."""
        names = {"generator": self.name}
        for role, model in (("prm", self.prm), ("verifier", self.verifier)):
            if model is not None:
                name = Path(model.path).resolve().name
                names[role] = f"{name}-{role}" if name in names.values() else name
        return names

    def check(self) -> None:
        self.runtime.check(self.generator, self.prm, self.verifier)
        if self.verifier is not None:
            check_verifier(self.verifier.path, self.verifier.style)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.trace_ring < 0:
            raise ValueError(f"trace_ring must be >= 0 (0 keeps no traced search), got {self.trace_ring}")
        if self.reasoning_parser is not None:
            ReasoningParser(self.reasoning_parser)

    def reasoning(self) -> ReasoningParser | None:
        """The generator's parser, checked against its tokenizer before any weights load."""
        if self.reasoning_parser is None:
            return None
        return ReasoningParser.for_tokenizer(self.reasoning_parser, Tokenizer(self.generator.path))


def build_served(settings: ServerSettings) -> Served:
    settings.check()
    reasoning = settings.reasoning()
    runtime = settings.runtime.load(settings.generator, settings.prm, settings.verifier)
    print(runtime.memory_plan.table(), flush=True)
    prm = load_prm(runtime, "prm", settings.prm.style) if settings.prm else None  # a bad PRM fails at startup
    verifier = load_prm(runtime, "verifier", settings.verifier.style) if settings.verifier else None
    if verifier is not None and not verifier.outcome:
        raise ValueError(f"--verifier must be an outcome reward model (style orm), got style {verifier.style!r}")
    metrics = ServerMetrics(lambda: engine_stats(runtime))
    names = settings.names()
    return Served(
        runtime,
        settings.name,
        metrics,
        prm=prm,
        verifier=verifier,
        prm_name=names.get("prm"),
        verifier_name=names.get("verifier"),
        traces=TraceRing(settings.trace_ring),
        reasoning=reasoning,
    )
