"""RequestStream: one request's outputs on the event loop, with the timestamps its latency metrics need.

Outputs are cumulative (each holds the tokens, text, logprobs and finish of every step so far), so what a
stream holds for its reader is one pending output, not a queue: an output delivered while the reader has
not taken the previous one replaces it, and the reader's next chunk covers both steps (vLLM's
`RequestOutputCollector` merges the same way). A slow SSE reader costs one output's memory, not one per
step (a queue of cumulative outputs grew as the square of the output length).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from specfleet.engine.outputs import RequestOutput

_END = object()  # the stream ended without a finished output (aborted)


class RequestStream:
    """Filled by the engine thread (through call_soon_threadsafe), read by one HTTP handler."""

    def __init__(
        self,
        request_id: str,
        n: int,
        loop: asyncio.AbstractEventLoop,
        on_close: Callable[[str], None],
        on_finish: Callable[[RequestStream], None],
    ) -> None:
        self.request_id = request_id
        self.n = n
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._pending: RequestOutput | None = None  # the latest output the reader has not taken
        self._end: Any = None  # then: _END or the exception that ended the stream
        self._wake = asyncio.Event()
        self._on_close = on_close
        self._on_finish = on_finish
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.queue_time: float | None = None
        self.itls: list[float] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.lora_name: str | None = None  # the LoRA adapter the request runs on (None: the base model)
        self.max_sample_tokens = 0
        self.closed = False
        self.finished = False
        self.last: RequestOutput | None = None
        self.trace: Any = None  # its RequestTrace when traces are on (engine/server/tracing.py)

    # ---- called on the loop by the engine thread --------------------------------------------------
    def accept(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    def reject(self, exc: BaseException) -> None:
        self.finished = True
        if not self.accepted.done():
            if self.closed:  # nobody waits any more
                self.accepted.cancel()
            else:
                self.accepted.set_exception(exc)

    def deliver(self, output: RequestOutput, step_start: float, _step_end: float) -> None:
        if self.finished:
            return
        now = time.monotonic()
        tokens = [len(o.token_ids) for o in output.outputs]
        total = sum(tokens)
        if total > self.completion_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
                self.queue_time = self._queue_time(output, step_start)
            elif self.last_token_time is not None:
                self.itls.append(now - self.last_token_time)
            self.last_token_time = now
        self.completion_tokens = total
        self.max_sample_tokens = max(tokens, default=0)
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.last = output
        self._pending = output  # cumulative: it holds whatever an untaken earlier output held
        self._wake.set()
        if output.finished:
            reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
            self._finish(reasons[0] if reasons else "stop")

    def aborted(self) -> None:
        if not self.finished:
            self._end = _END
            self._wake.set()
            self._finish("abort")

    def fail(self, exc: BaseException) -> None:
        if not self.finished:
            self._end = exc
            self._wake.set()
            self._finish("abort")

    @property
    def num_pending(self) -> int:
        """Outputs delivered and not yet taken by the reader: at most one, whatever the reader does."""
        return int(self._pending is not None)

    def _queue_time(self, output: RequestOutput, step_start: float) -> float:
        m = output.metrics
        if m is not None and m.first_scheduled_time is not None and m.arrival_time is not None:
            return max(0.0, m.first_scheduled_time - m.arrival_time)
        return max(0.0, step_start - self.arrival)

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        self._on_finish(self)

    # ---- the handler's side ----------------------------------------------------------------------
    def close(self) -> None:
        """The consumer is gone (disconnect, cancel, drain timeout): abort if still running."""
        if not self.closed:
            self.closed = True
            if not self.finished:
                self._on_close(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            if self._pending is not None:
                item, self._pending = self._pending, None
                yield item
                if item.finished:
                    return
            elif self._end is not None:  # after the last output delivered, as a queue would have it
                if isinstance(self._end, BaseException):
                    raise self._end
                return
            else:
                self._wake.clear()
                await self._wake.wait()

    # ---- metrics ---------------------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finish_time or time.monotonic()) - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.max_sample_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.max_sample_tokens - 1)

    def summary(self) -> dict[str, Any]:
        """The request's log record: ids, token counts, latencies. Never the prompt or the text."""
        ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
        return {
            "event": "request",
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "n": self.n,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot),
            "queue_ms": ms(self.queue_time),
            "e2e_ms": ms(self.e2e),
        }
