"""specfleet's inference engine: paged KV cache, continuous batching, speculative decoding.

The names below load on first use, so that `specfleet.engine.knobs` and `specfleet.engine.config` stay
importable without torch (the operator and the tuner import them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specfleet.engine.config import EngineConfig, LiveConfig
    from specfleet.engine.llm import LLM
    from specfleet.engine.llm_engine import Engine
    from specfleet.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
    from specfleet.engine.sampling_params import SamplingParams

_HOMES = {
    "EngineConfig": "config",
    "LiveConfig": "config",
    "LLM": "llm",
    "Engine": "llm_engine",
    "CompletionOutput": "outputs",
    "Logprob": "outputs",
    "PositionLogprobs": "outputs",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "LiveConfig",
    "Logprob",
    "PositionLogprobs",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'specfleet.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"specfleet.engine.{_HOMES[name]}"), name)
