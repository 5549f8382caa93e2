"""specfleet's inference engine: paged KV cache, continuous batching, speculative decoding."""

from specfleet.engine.config import EngineConfig, LiveConfig
from specfleet.engine.llm import LLM
from specfleet.engine.llm_engine import Engine
from specfleet.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from specfleet.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "Engine", "EngineConfig", "LiveConfig", "Logprob", "PositionLogprobs", "RequestOutput",
    "SamplingParams",
]
