"""treeserve: an LLM inference runtime built for test-time search, with vLLM's offline API (`LLM`,
`SamplingParams`, `RequestOutput`). Names load on first use, so light submodules skip torch."""

from importlib import import_module

_EXPORTS = {
    "LLM": "treeserve.llm",
    "EngineConfig": "treeserve.config",
    "CompletionOutput": "treeserve.outputs",
    "Logprob": "treeserve.outputs",
    "RequestOutput": "treeserve.outputs",
    "ScoreOutput": "treeserve.outputs",
    "SamplingParams": "treeserve.sampling_params",
    "ScoreParams": "treeserve.sampling_params",
    "RequestOutputKind": "treeserve.sampling_params",
    "StructuredOutputsParams": "treeserve.sampling_params",
    "StepFailed": "treeserve.engine.llm_engine",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treeserve' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
