"""cbgen: continuous-batching generation for transformers causal LMs.

Public API only; everything else is an implementation detail.
"""

from cbgen.batch_invariant import parity, processed_logprobs, token_logprobs
from cbgen.config import EngineConfig
from cbgen.llm import LLM
from cbgen.outputs import CompletionOutput, RequestOutput
from cbgen.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "parity",
    "processed_logprobs",
    "token_logprobs",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The async engine pulls in asyncio machinery that batch users never need.
    if name == "AsyncEngine":
        from cbgen.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
