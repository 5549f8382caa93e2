"""Utility calls whose slow half runs on a worker thread, so that the engine core keeps stepping meanwhile.

A LoRA adapter's load reads and checks its files (tens of milliseconds to seconds: a rank-64 adapter on
every projection, a slow volume) and only then changes the engine (registers it). Run inline between two
steps, the read would stall every stream for its duration; here `work(engine, **kwargs)` runs on one worker
thread (loads are served in the order they came), and `then(engine, work's result)` runs on the core's own
thread when the loop next collects (`done`), between steps, so the engine is only ever changed by the
thread that steps it. The reply goes out then, with what `then` returned or the error either half raised.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from specfleet.engine.sampling_params import ParameterError

from .messages import ENCODER, UtilityResult

# While a call is in flight, the loop waits at most this long for input before collecting, so the reply
# leaves promptly even from an idle core (whose poll would otherwise last a whole heartbeat, 1 s).
POLL_S = 0.005


@dataclass(frozen=True)
class Split:
    """A utility in two halves: `work` (any thread, changes nothing) and `then` (the core's thread)."""

    work: Callable[..., Any]
    then: Callable[[Any, Any], Any]


def reply(call_id: int, call: Callable[[], Any]) -> UtilityResult:
    """The result of `call()` as the server's reply: a ParameterError keeps its field (the server's 400)."""
    try:
        return UtilityResult(call_id, msgspec.Raw(ENCODER.encode(call())))
    except ParameterError as exc:
        return UtilityResult(call_id, error=str(exc), param=exc.param, code=exc.code)
    except Exception as exc:
        return UtilityResult(call_id, error=f"{type(exc).__name__}: {exc}")


class BackgroundCalls:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-utility")
        self._pending: list[tuple[int, Split, Future]] = []

    def start(self, call_id: int, split: Split, kwargs: dict[str, Any]) -> None:
        self._pending.append((call_id, split, self._pool.submit(split.work, self.engine, **kwargs)))

    def pending(self) -> bool:
        return bool(self._pending)

    def done(self) -> list[UtilityResult]:
        """The replies of the calls whose work finished, their `then` run now; the others stay pending."""
        finished = [p for p in self._pending if p[2].done()]
        self._pending = [p for p in self._pending if not any(p is f for f in finished)]
        return [self._finish(call_id, split, future) for call_id, split, future in finished]

    def _finish(self, call_id: int, split: Split, future: Future) -> UtilityResult:
        return reply(call_id, lambda: split.then(self.engine, future.result()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
