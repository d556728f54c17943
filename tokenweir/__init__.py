"""tokenweir: an LLM inference and serving engine whose heart is its request scheduler.

The public API follows vLLM's names. `LLM` and `RequestOutput` pull in torch, so they are
imported lazily: the scheduler core (`tokenweir.core`) stays importable without torch.
"""

from typing import Any

from tokenweir.config import EngineArgs
from tokenweir.request import RequestStatus, SamplingParams

__all__ = ["LLM", "EngineArgs", "RequestOutput", "RequestStatus", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenweir.engine.llm import LLM
        return LLM
    if name == "RequestOutput":
        from tokenweir.engine.output import RequestOutput
        return RequestOutput
    raise AttributeError(f"module 'tokenweir' has no attribute {name!r}")
