"""AsyncEngine: the asyncio front end of the (single-threaded) Engine.

One dedicated engine thread owns the Engine: it drains a command queue (add, abort, call), runs `step()`
while work exists and sleeps on an event otherwise. The asyncio side submits requests and reads each
request's outputs from its own `RequestStream`; per-request latency metrics are measured here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from specfleet.engine.outputs import RequestOutput
from specfleet.engine.sampling_params import SamplingParams

from .metrics import ServerMetrics
from .streams import RequestStream

logger = logging.getLogger("specfleet.engine.server")


class QueueFullError(Exception):
    """The waiting queue holds `max_waiting` requests already."""


class AsyncEngine:
    def __init__(self, engine: Any, metrics: ServerMetrics | None = None, max_waiting: int = 512) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owned: dict[str, RequestStream] = {}  # engine thread only
        self.streams: dict[str, RequestStream] = {}  # event loop only: requests not yet finished
        self.engine_error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specfleet-engine", daemon=True)
            self._thread.start()
            if self.metrics is not None:
                self.metrics.set_live_config(self.engine.live_config())

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- asyncio side ----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.streams.values() if s.first_token_time is None)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       kv_transfer_params: dict[str, Any] | None = None) -> RequestStream:
        """Submit a request; returns once the engine accepted it. ValueError for bad input."""
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        assert self._loop is not None, "AsyncEngine.start() was not called"
        stream = RequestStream(request_id, params.n, self._loop, on_close=self.abort, on_finish=self._finished)
        self.streams[request_id] = stream
        self._submit(("add", stream, prompt, params, kv_transfer_params))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.streams.pop(request_id, None)
            stream.close()
            raise
        except BaseException:
            self.streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def abort_all(self) -> None:
        for request_id in list(self.streams):
            self.abort(request_id)

    def call_sync(self, fn: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """Run fn(engine) on the engine thread between steps (from any other thread) and return its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(("call", fn, future))
        return future.result(timeout)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._submit(("call", fn, future))
        return await asyncio.wrap_future(future)

    def _submit(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _finished(self, stream: RequestStream) -> None:
        self.streams.pop(stream.request_id, None)
        record = stream.summary()
        if self.metrics is not None:
            self.metrics.observe_request(
                finish_reason=record["finish_reason"],
                ttft=stream.ttft,
                e2e=stream.e2e,
                queue_time=stream.queue_time,
                itls=stream.itls,
                tpot=stream.tpot,
            )
        logger.info(" ".join(f"{k}={v}" for k, v in record.items()))

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        idle_reported = False
        while not self._stopped.is_set():
            self._wake.clear()
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                if not idle_reported:
                    self._observe(stepped=False)
                    idle_reported = True
                self._wake.wait(timeout=1.0)
                self.engine.poll_kv_transfers()  # a finished hold's blocks return while idle too
                continue
            idle_reported = False
            start = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine broke: fail what is in flight, keep serving
                logger.exception("event=engine_step_failed error=%s", type(exc).__name__)
                self.engine_error = exc
                self._fail_all(exc)
                continue
            self._dispatch(outputs, start, time.monotonic())
            self._observe(stepped=True)

    def _observe(self, stepped: bool) -> None:
        if self.metrics is None:
            return
        try:
            # Idle after aborts: the last step's KV usage is stale, the block count is not.
            idle_kv = None if stepped or self.engine.kv_blocks_in_use() else 0.0
            self.metrics.observe_step(self.engine.stats, stepped, self._commands.qsize(), idle_kv)
            self.metrics.set_live_config(self.engine.live_config())
        except Exception:  # metrics must never take the engine down
            logger.exception("event=metrics_update_failed")

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                fn, future = command[1], command[2]
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)

    def _add(self, stream: RequestStream, prompt: str | list[int], params: SamplingParams,
             kv_transfer_params: dict[str, Any] | None = None) -> None:
        if stream.closed:  # the client left before the engine saw the request
            self._post(stream.reject, ConnectionAbortedError("client disconnected"))
            return
        try:
            self.engine.add_request(stream.request_id, prompt, params, kv_transfer_params)
        except Exception as exc:
            self._post(stream.reject, exc)
            return
        self._owned[stream.request_id] = stream
        self._post(stream.accept)

    def _abort(self, request_id: str) -> None:
        stream = self._owned.pop(request_id, None)
        if stream is None:
            return
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("event=abort_failed request_id=%s", request_id)
        self._post(stream.aborted)

    def _dispatch(self, outputs: list[RequestOutput], step_start: float, now: float) -> None:
        for output in outputs:
            stream = self._owned.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._owned[output.request_id]
            self._post(stream.deliver, output, step_start, now)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._owned.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                pass
            self._post(stream.fail, exc)
        self._owned.clear()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass
