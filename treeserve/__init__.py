"""treeserve: an LLM inference runtime built for test-time search.

The public API mirrors vLLM's offline API: `LLM`, `SamplingParams`, `RequestOutput`.
"""

from treeserve.config import EngineConfig
from treeserve.llm import LLM
from treeserve.outputs import CompletionOutput, Logprob, RequestOutput, ScoreOutput
from treeserve.sampling_params import SamplingParams, ScoreParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
    "ScoreParams",
]
__version__ = "0.1.0"
