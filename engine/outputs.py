"""What the engine hands back: typed results for the offline API and the HTTP server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-N alternatives, token id -> logprob


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # cumulative detokenised text (stop string removed)
    token_ids: list[int]  # cumulative generated tokens
    finish_reason: str | None = None  # None while running; "stop", "length" or "abort" once done
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[Logprob] | None = None  # one per generated token when requested

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative per sample, so a streamer sends the difference."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
