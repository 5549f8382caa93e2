"""The server's side of the engine core: start the core process, feed it, read its reports (vLLM V1's
`AsyncMPClient` with its `OutputProcessor`).

The client binds a PUSH socket (inputs) and a PULL socket (outputs) on IPC paths, starts
`python -m specfleet.engine.core.proc` and waits for its `Ready`. Then, on the event
loop: `generate` tokenizes and sends the request, one reader task decodes every report, feeds its deltas
through the `OutputProcessor` into each request's `RequestStream` and its statistics into /metrics.
A thread waits on the process: if the core exits, or stops reporting for `HEARTBEAT_TIMEOUT_S`, the
client is dead: in-flight requests fail, /ready turns false, and `on_dead` (the server's exit, non-zero)
runs, with one log line naming the pid and the exit code or signal.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import pickle
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from specfleet.engine.checkpoint import load_tokenizer
from specfleet.engine.config import EngineConfig, LiveConfig
from specfleet.engine.python_child import python_command
from specfleet.engine.quant.gguf_source import resolve_source
from specfleet.engine.sampling_params import ParameterError, SamplingParams
from specfleet.engine.tokenizer import chat_prompt_ids

from .messages import (
    ENCODER,
    INTERNAL_ERROR,
    OUTPUT_DECODER,
    Abort,
    AddRequest,
    AddResult,
    Dead,
    FinishSequence,
    Ready,
    RequestType,
    StepReport,
    UtilityCall,
    UtilityResult,
)
from .output_processor import OutputProcessor

logger = logging.getLogger("specfleet.engine.server")
# A core that sends nothing for this long is taken as hung (it reports every step and every second
# while idle; vLLM's proposed health ping waits 60 s too): long enough for one long prefill step.
HEARTBEAT_TIMEOUT_S = 60.0
# How often the watchdog thread looks at the time of the last report: a hang is noticed within this of
# HEARTBEAT_TIMEOUT_S, whether or not anything polls /ready.
WATCHDOG_INTERVAL_S = 1.0
READY_TIMEOUT_S = 900.0  # loading (and converting a GGUF once) may take minutes on a cold node
STOP_TIMEOUT_S = 10.0


class QueueFullError(Exception):
    """The waiting queue holds `max_waiting` requests already."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone (exited, or hung and killed); nothing in flight can finish here: the
    API answers 503 `engine_dead` with Retry-After, so a router retries the request on another replica."""


class EngineInternalError(RuntimeError):
    """The core's `add_request` raised something else than a ParameterError or ValueError: a bug of the
    engine's, not of the request (which passed validation). That request fails (500 `internal_error`);
    the core serves on."""


class CoreInfo:
    """What the routes read of the engine without a round trip: the model's facts and its tokenizer."""

    def __init__(self, ready: Ready, tokenizer: Any) -> None:
        self.model_name, self.max_model_len = ready.model_name, ready.max_model_len
        self.vocab_size, self.eos_token_ids = ready.vocab_size, set(ready.eos_token_ids)
        self.sampling_defaults = dict(ready.sampling_defaults)  # what a request leaves out samples with
        self.kv_block_size, self.num_kv_blocks = ready.kv_block_size, ready.num_kv_blocks
        self.enable_prefix_caching = ready.enable_prefix_caching
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages: list[dict], **controls: Any) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self.model_name, messages, **controls)


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log_level: str = "info",
        ready_timeout_s: float = READY_TIMEOUT_S,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """Start the core process and wait until its model is loaded. RuntimeError when it fails to.
        `heartbeat_timeout_s`: how long the core may send nothing before it is declared hung."""
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.metrics: Any = None  # ServerMetrics, set by the server
        self.tracer: Any = None  # engine/server/tracing.py's RequestTracer when traces are on
        self.max_waiting = 512
        self.on_dead: list[Callable[[str], None]] = []
        self.streams: dict[str, Any] = {}  # event loop only: requests not yet finished
        self.engine_error: BaseException | None = None
        self.dead: str | None = None
        self._pending_adds: dict[str, Any] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stopping = False
        self._dir = tempfile.TemporaryDirectory(prefix="specfleet-core-")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        input_addr, output_addr = (f"ipc://{Path(self._dir.name) / name}" for name in ("input", "output"))
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        cmd = python_command(
            "-m",
            "specfleet.engine.core.proc",
            "--input",
            input_addr,
            "--output",
            output_addr,
            "--config",
            json.dumps(asdict(config)),
            "--log-level",
            log_level,
        )
        # Not a new session: on Linux each session is its own CPU autogroup, which would give the core a
        # separate CPU share from the server's (suspected, not shown, in the slowdown docs/engine_core.md
        # leaves open). The core ignores SIGINT, so the terminal's Ctrl-C stays the server's.
        self.proc = subprocess.Popen(cmd)
        try:
            # The tokenizer loads while the core process loads the model, on the other core, instead of after.
            # A model that cannot be found fails in the core too, with the core's own message: wait for it.
            tokenizer, tokenizer_error = None, None
            try:
                tokenizer = load_tokenizer(resolve_source(config.model, config.quantization).path)
            except Exception as exc:
                tokenizer_error = exc
            ready = self._wait_ready(ready_timeout_s)
            if tokenizer is None:
                raise RuntimeError(f"the tokenizer did not load: {tokenizer_error}") from tokenizer_error
        except BaseException:
            self._kill()
            raise
        self.pid = ready.pid
        self.info = CoreInfo(ready, tokenizer)
        self.processor = OutputProcessor(self.info.tokenizer)
        self.live = LiveConfig(**ready.live)
        self.last_seen = time.monotonic()
        logger.info("event=engine_core_ready pid=%d model=%s", self.pid, ready.model_name)

    def _wait_ready(self, timeout_s: float) -> Ready:
        deadline = time.monotonic() + timeout_s
        sync_out: zmq.Socket[bytes] = zmq.Socket.shadow(self._output.underlying)
        while time.monotonic() < deadline:
            if sync_out.poll(200):
                msg = OUTPUT_DECODER.decode(sync_out.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Dead):
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"the engine core (pid {self.proc.pid}) exited while loading: {_exit_text(code)}"
                )
        raise RuntimeError(f"the engine core did not load within {timeout_s:.0f} s")

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        if self._reader is None:
            self._reader = self._loop.create_task(self._read())
            threading.Thread(target=self._watch_process, name="specfleet-core-monitor", daemon=True).start()
            threading.Thread(target=self._watchdog, name="specfleet-core-watchdog", daemon=True).start()
            if self.metrics is not None:
                self.metrics.set_live_config(self.live)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the core (SIGTERM, then SIGKILL after `timeout`) and close the sockets."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._dir.cleanup()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def alive(self) -> bool:
        """The core runs and reported within `heartbeat_timeout_s` (/ready requires it)."""
        if self.dead is None:
            self._check_heartbeat()
        return self.dead is None

    def _watchdog(self) -> None:
        """A thread: notice a hung core by itself (no report for `heartbeat_timeout_s`), not only when
        something polls /ready. The verdict is taken on the event loop, where the reader notes reports."""
        interval = min(WATCHDOG_INTERVAL_S, self.heartbeat_timeout_s / 4)
        while self.dead is None and not self._stopping and self._loop is not None:
            time.sleep(interval)
            if time.monotonic() - self.last_seen > self.heartbeat_timeout_s:
                try:
                    self._loop.call_soon_threadsafe(self._check_heartbeat)
                except RuntimeError:  # loop closed
                    return

    def _check_heartbeat(self) -> None:
        """On the loop: a core silent for longer than `heartbeat_timeout_s` is hung. It is killed (a hung
        process would keep the model's memory, and its late reports must not reach a failed request),
        then the death path runs: in-flight requests get 503, readiness goes down, `on_dead` runs."""
        silent = time.monotonic() - self.last_seen
        if self.dead is not None or self._stopping or silent <= self.heartbeat_timeout_s:
            return
        reason = (
            f"no report from the engine core (pid {self.pid}) for {silent:.0f} s "
            f"(limit {self.heartbeat_timeout_s:.0f} s): hung, killed"
        )
        self._die(reason)
        if self.proc.poll() is None:
            self.proc.kill()

    def _watch_process(self) -> None:
        code = self.proc.wait()
        if self._stopping or self._loop is None:
            return
        reason = f"the engine core (pid {self.pid}) exited: {_exit_text(code)}"
        try:
            self._loop.call_soon_threadsafe(self._die, reason)
        except RuntimeError:  # loop closed
            pass

    def _die(self, reason: str) -> None:
        if self.dead is not None or self._stopping:
            return
        self.dead = reason
        self.engine_error = EngineDeadError(reason)
        logger.error(
            "event=engine_core_dead %s; failing %d in-flight requests, readiness down",
            reason,
            len(self.streams),
        )
        for request_id, stream in list(self.streams.items()):
            if request_id in self._pending_adds:
                stream.reject(self.engine_error)
            else:
                stream.fail(self.engine_error)
        self.streams.clear()
        self._pending_adds.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._calls.clear()
        for callback in self.on_dead:
            callback(reason)

    # ---- requests --------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.streams.values() if s.first_token_time is None)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
        *,
        trace: Any = None,
        lora_name: str | None = None,
    ) -> Any:
        """Submit a request; returns its RequestStream once the core accepted it. ValueError for bad input
        (a `priority` the core's scheduling policy refuses is a ParameterError naming it).
        `trace`: the request's RequestTrace (engine/server/tracing.py), its span made when it finishes."""
        from specfleet.engine.server.streams import RequestStream

        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        assert self._loop is not None, "EngineCoreClient.start() was not called"
        if isinstance(prompt, str):
            text, ids = prompt, self.info.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, list(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        vocab = self.info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):  # before msgpack meets a 2**70
            raise ParameterError("prompt", f"prompt token ids must be in [0, {vocab})")
        stream = RequestStream(
            request_id, params.n, self._loop, on_close=self.abort, on_finish=self._finished
        )
        stream.trace = trace
        stream.lora_name = lora_name
        self.streams[request_id] = stream
        self._pending_adds[request_id] = stream
        self.processor.add(request_id, text, ids, params, stream.arrival)
        self._send(
            RequestType.ADD,
            AddRequest(request_id, ids, pickle.dumps(params), kv_transfer_params, priority, lora_name),
        )
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
        stream = self.streams.get(request_id)
        self.processor.drop(request_id)
        if self.dead is None:
            self._send(RequestType.ABORT, Abort([request_id]))
        if stream is not None and request_id not in self._pending_adds:
            stream.aborted()

    def abort_all(self) -> None:
        for request_id in list(self.streams):
            self.abort(request_id)

    async def call(self, method: str, **kwargs: int | str) -> Any:
        """Run one of the core's UTILITIES between its steps and return the result."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        self._send(RequestType.UTILITY, UtilityCall(call_id, method, kwargs))
        return await future

    def call_sync(self, method: str, timeout: float = 30.0, **kwargs: int | str) -> Any:
        """`call` from another thread than the event loop's."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self.call(method, **kwargs), self._loop).result(timeout)

    async def update_config(self, **changes: int) -> LiveConfig:
        self.live = LiveConfig(**await self.call("update_config", **changes))
        return self.live

    async def live_config(self) -> LiveConfig:
        return LiveConfig(**await self.call("live_config"))

    def _send(self, kind: RequestType, msg: msgspec.Struct) -> None:
        if self._loop is not None and _running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self._send, kind, msg)
            return
        self._input.send_multipart((kind.value, ENCODER.encode(msg)), copy=False)

    def _finished(self, stream: Any) -> None:
        self.streams.pop(stream.request_id, None)
        self.processor.drop(stream.request_id)
        record = stream.summary()
        if self.metrics is not None:
            self.metrics.observe_request(
                finish_reason=record["finish_reason"],
                ttft=stream.ttft,
                e2e=stream.e2e,
                queue_time=stream.queue_time,
                itls=stream.itls,
                tpot=stream.tpot,
                lora_name=stream.lora_name,
                output_tokens=stream.completion_tokens,
            )
        logger.info(" ".join(f"{k}={v}" for k, v in record.items()))
        if self.tracer is not None and stream.trace is not None:
            try:
                self.tracer.record(stream)
            except Exception:  # a trace must never take serving down
                logger.exception("event=trace_failed request_id=%s", stream.request_id)

    # ---- the core's reports -----------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            self.last_seen = time.monotonic()
            try:
                msg = OUTPUT_DECODER.decode(frame.buffer)
                if isinstance(msg, StepReport):
                    self._on_report(msg)
                elif isinstance(msg, AddResult):
                    self._on_added(msg)
                elif isinstance(msg, UtilityResult):
                    self._on_utility(msg)
                elif isinstance(msg, Dead):
                    self._die(f"the engine core (pid {self.pid}) failed: {msg.reason}")
            except Exception:  # one bad report must not stop the reader
                logger.exception("event=core_report_failed")

    def _on_added(self, msg: AddResult) -> None:
        stream = self._pending_adds.pop(msg.request_id, None)
        if stream is None:
            return
        if msg.error is None:
            stream.accept()
            return
        self.processor.drop(msg.request_id)
        self.streams.pop(msg.request_id, None)
        if msg.code == INTERNAL_ERROR:
            stream.reject(EngineInternalError(msg.error))
        elif msg.param:
            stream.reject(ParameterError(msg.param, msg.error, msg.code or "invalid_value"))
        else:
            stream.reject(ValueError(msg.error))

    def _on_utility(self, msg: UtilityResult) -> None:
        future = self._calls.pop(msg.call_id, None)
        if future is None or future.done():
            return
        if msg.error is None:
            future.set_result(msgspec.msgpack.decode(msg.result))
        elif msg.param is not None:
            future.set_exception(ParameterError(msg.param, msg.error, msg.code or "invalid_value"))
        else:
            future.set_exception(RuntimeError(msg.error))

    def _on_report(self, report: StepReport) -> None:
        now = time.monotonic()
        if report.deltas:
            outputs, to_finish = self.processor.process(report.deltas)
            for output in outputs:
                stream = self.streams.get(output.request_id)
                if stream is not None:
                    stream.deliver(output, now, now)
            for request_id, index in to_finish:
                self._send(RequestType.FINISH_SEQ, FinishSequence(request_id, index))
        if report.error is not None:
            exc = RuntimeError(f"engine step failed: {report.error}")
            self.engine_error = exc
            for request_id in report.aborted:
                self.processor.drop(request_id)
                stream = self.streams.get(request_id)
                if stream is not None:
                    stream.fail(exc)
        if report.live:
            self.live = LiveConfig(**report.live)
        if self.metrics is not None and report.stats is not None:
            try:
                idle_kv = None if report.stepped or report.kv_blocks_in_use else 0.0
                self.metrics.observe_step(report.stats, report.stepped, len(self._pending_adds), idle_kv)
                self.metrics.set_live_config(self.live)
            except Exception:  # metrics must never take serving down
                logger.exception("event=metrics_update_failed")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _exit_text(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
