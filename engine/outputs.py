"""What the engine hands back: typed results for the offline API and the HTTP server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


class PositionLogprobs(dict[int, Logprob]):
    """One position's logprobs in vLLM's shape (token id -> Logprob: the chosen token and the top-N),
    and by name: `token_id`, `logprob` and `top` (token id -> logprob of the top-N, most likely first)."""

    def __init__(
        self, token_id: int, logprob: float, top: dict[int, float] | None = None, rank: int | None = None
    ) -> None:
        top = top or {}
        ranks = {t: r for r, t in enumerate(top, 1)}
        super().__init__({token_id: Logprob(logprob, rank if rank is not None else ranks.get(token_id))})
        for t, lp in top.items():  # the chosen token first, then the top-N, as vLLM orders them
            self.setdefault(t, Logprob(lp, ranks[t]))
        self.token_id, self.logprob, self.top = token_id, logprob, dict(top)

    def decode_with(self, token_text) -> PositionLogprobs:
        """Fill `decoded_token` with `token_text(token_id) -> str`."""
        for token, entry in self.items():
            if entry.decoded_token is None:
                entry.decoded_token = token_text(token)
        return self


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # cumulative detokenised text (stop string removed)
    token_ids: list[int]  # cumulative generated tokens
    finish_reason: str | None = None  # None while running; "stop", "length" or "abort" once done
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per generated token when requested
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when requested

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
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # when requested; the first is None
    # A prefill engine's finished request: where its prompt's KV blocks wait for a decode engine.
    kv_transfer_params: dict[str, Any] | None = None
    # A finished pooling request (SamplingParams.pooling): its embedding, float32 as a list
    embedding: list[float] | None = None


@dataclass
class KVTransferMetrics:
    """A decode engine's pull of a remote prefill's KV blocks (engine/kv_transfer/), for the request's
    trace: times are `time.monotonic()` in the engine core (one clock per host)."""

    start: float  # the pull began (its blocks allocated)
    end: float  # its blocks were written, or it failed
    blocks_loaded: int  # blocks that came over the wire
    blocks_skipped: int  # blocks the decode engine's own prefix cache held
    bytes: int
    fallback: bool  # the pull failed: the prompt was recomputed here
    peer: str  # the prefill engine's KV address, host:port


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    kv_transfer: KVTransferMetrics | None = None  # a remote-prefilled request's pull
