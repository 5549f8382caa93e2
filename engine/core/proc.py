"""The engine core process: the scheduler and the model in a busy loop fed by ZeroMQ (vLLM V1's EngineCore).

`python -m specfleet.engine.core.proc --input ADDR --output ADDR --config JSON` connects a PULL socket to
the server's input address and a PUSH socket to its output address, loads the engine, sends `Ready`, then
loops: take every waiting input without blocking, run one step, push a `StepReport`. It never waits on
the server: a PUSH send only queues the message for ZeroMQ's I/O thread. While idle it blocks on its
input for at most `HEARTBEAT_S` and then reports anyway, so the server can tell a live idle core from a
hung one. It has no HTTP, no tokenizer on its hot path and no text: stop strings are the server's, which
ends a sample with `FinishSequence`.

It exits when its parent (the server) is gone, so a killed server leaves no orphan holding the model, and
when a worker of a split model dies (`WorkerDied`, in a step or found by the idle heartbeat's check): the
server then fails what is in flight, takes readiness down and exits non-zero, as for the core's own death.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq
from specfleet.engine.config import EngineConfig
from specfleet.engine.detokenizer import TextCursor
from specfleet.engine.distributed import WorkerDied
from specfleet.engine.errors import UnsupportedModel
from specfleet.engine.outputs import PositionLogprobs, RequestOutput
from specfleet.engine.sampling_params import ParameterError

from .background_calls import POLL_S, BackgroundCalls, Split, reply
from .messages import (
    ENCODER,
    INPUT_DECODERS,
    INTERNAL_ERROR,
    AddRequest,
    AddResult,
    Dead,
    FinishSequence,
    Logprobs,
    Ready,
    RequestType,
    SeqDelta,
    StepReport,
    UtilityCall,
    UtilityResult,
)

log = logging.getLogger("specfleet.engine.core")
# An idle core reports this often; the server's readiness wants a report within HEARTBEAT_TIMEOUT_S
# (client.py), 60 times this, so that one long prefill step is not mistaken for a hang.
HEARTBEAT_S = 1.0
# ZeroMQ keeps unsent messages this long at close, so the `Dead` message gets out (vLLM: 4 s).
LINGER_MS = 4000

# What the server may call between steps: name -> fn(engine, **kwargs) -> msgpack-encodable result.
UTILITIES: dict[str, Callable[..., Any]] = {
    "live_config": lambda engine: engine.live_config().as_dict(),
    "update_config": lambda engine, **changes: engine.update_config(**changes).as_dict(),
    "kv_blocks_in_use": lambda engine: engine.kv_blocks_in_use(),
    "stats": lambda engine: engine.stats,
    # disaggregation: the KV connector's counters (None without a kv_role)
    "kv_transfer_stats": lambda engine: engine.kv_connector.stats if engine.kv_connector else None,
    # LoRA (engine/lora/): a bad adapter is a ParameterError naming the field, the server's 400
    "unload_lora_adapter": lambda engine, lora_name: _lora_call(
        "lora_name", lambda: engine.unload_lora_adapter(lora_name)
    ),
    "lora_state": lambda engine: engine.lora_state(),
}

# What the server may call whose slow half runs on a worker thread while the core steps (background_calls).
SPLIT_UTILITIES: dict[str, Split] = {
    # an adapter's files are read off the loop, so a load never stalls the streams in flight
    "load_lora_adapter": Split(
        lambda engine, lora_name, lora_path: _lora_call(
            "lora_path", lambda: engine.read_lora_adapter(lora_name, lora_path)
        ),
        lambda engine, read: _lora_call("lora_path", lambda: engine.register_lora_adapter(*read).digest),
    ),
}


def _lora_call(param: str, call: Callable[[], Any]) -> Any:
    from specfleet.engine.lora.adapter import LoraError

    try:
        return call()
    except LoraError as exc:
        raise ParameterError(param, str(exc)) from None


def encode_logprobs(lp: PositionLogprobs) -> Logprobs:
    return Logprobs(lp.token_id, lp.logprob, lp[lp.token_id].rank, list(lp.top), list(lp.top.values()))


class EngineCore:
    """One engine and the bookkeeping that turns its cumulative outputs into per-step deltas."""

    def __init__(self, engine: Any, cursors: list[TextCursor]) -> None:
        self.engine = engine
        self._new_cursors = cursors  # filled by the engine's text_cursor factory during add_request
        self._cursors: dict[str, list[TextCursor]] = {}
        self._sent: dict[str, list[int]] = {}  # request id -> output tokens sent per sample (-1: finished)
        self._prompt_sent: set[str] = set()
        self.background = BackgroundCalls(engine)

    # -- inputs ------------------------------------------------------------------------------------
    def add(self, msg: AddRequest) -> AddResult:
        params = pickle.loads(msg.params)
        self._new_cursors.clear()
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                msg.kv_transfer_params,
                msg.priority,
                lora_name=msg.lora_name,
            )
        except ParameterError as exc:
            return AddResult(msg.request_id, str(exc), exc.param, exc.code)
        except ValueError as exc:
            return AddResult(msg.request_id, str(exc))
        except Exception as exc:
            # The engine's bug, not the request's (it passed validation): this request fails, the core
            # serves on with everything else in flight.
            log.exception(
                "event=add_request_failed request_id=%s error=%s", msg.request_id, type(exc).__name__
            )
            self.engine.discard(msg.request_id)
            return AddResult(msg.request_id, f"{type(exc).__name__}: {exc}", code=INTERNAL_ERROR)
        self._cursors[msg.request_id] = list(self._new_cursors)
        self._sent[msg.request_id] = [0] * params.n
        return AddResult(msg.request_id)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._forget(request_id)

    def finish_sequence(self, msg: FinishSequence) -> None:
        self.engine.finish_sequence(msg.request_id, msg.index, msg.reason)
        sent = self._sent.get(msg.request_id)
        if sent is not None:
            sent[msg.index] = -1
            if all(n < 0 for n in sent):
                self._forget(msg.request_id)

    def utility(self, msg: UtilityCall) -> UtilityResult | None:
        """The call's reply, or None for a split call: its reply comes from `background.done()` later."""
        split = SPLIT_UTILITIES.get(msg.method)
        if split is not None:
            self.background.start(msg.call_id, split, msg.kwargs)
            return None
        fn = UTILITIES.get(msg.method)
        if fn is None:
            known = sorted([*UTILITIES, *SPLIT_UTILITIES])
            return UtilityResult(
                msg.call_id, error=f"ValueError: unknown utility {msg.method!r}; known: {known}"
            )
        return reply(msg.call_id, lambda: fn(self.engine, **msg.kwargs))

    def _forget(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)
        self._sent.pop(request_id, None)
        self._prompt_sent.discard(request_id)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """One engine step. `stepped` in the report is whether a batch ran: an empty step (nothing could be
        scheduled) reports stepped=False, so the server records nothing into the step histograms."""
        before = self.engine.stats.num_steps
        try:
            outputs = self.engine.step()
        except WorkerDied:  # a rank of the split model is gone: no step can run again, so the core exits
            raise
        except Exception as exc:  # the step broke: fail what is in flight, keep serving
            log.exception("event=engine_step_failed error=%s", type(exc).__name__)
            aborted = list(self._sent)
            self.abort(aborted)
            return self.report(True, aborted=aborted, error=f"{type(exc).__name__}: {exc}")
        deltas = [d for out in outputs for d in self._deltas(out)]
        return self.report(self.engine.stats.num_steps != before, deltas)

    def report(
        self,
        stepped: bool,
        deltas: list[SeqDelta] | None = None,
        aborted: list[str] | None = None,
        error: str | None = None,
    ) -> StepReport:
        engine = self.engine
        return StepReport(
            deltas or [],
            aborted or [],
            engine.stats,
            stepped,
            engine.kv_blocks_in_use(),
            engine.live_config().as_dict(),
            error,
        )

    def _deltas(self, out: RequestOutput) -> list[SeqDelta]:
        rid = out.request_id
        sent, cursors = self._sent.get(rid), self._cursors.get(rid)
        if sent is None or cursors is None:
            return []
        deltas = []
        prompt_lps = None
        if (
            out.prompt_logprobs is not None
            and rid not in self._prompt_sent
            and all(lp is not None for lp in out.prompt_logprobs[1:])
        ):
            self._prompt_sent.add(rid)
            prompt_lps = [None if lp is None else encode_logprobs(lp) for lp in out.prompt_logprobs]
        for c in out.outputs:
            done = sent[c.index]
            if done < 0:
                continue
            new = c.token_ids[done:]
            if not new and c.finish_reason is None and prompt_lps is None:
                continue
            delta = SeqDelta(
                rid,
                c.index,
                new,
                cursors[c.index].upto,
                c.finish_reason,
                c.stop_reason if isinstance(c.stop_reason, int) else None,
            )
            if c.logprobs:
                delta.logprobs = [encode_logprobs(lp) for lp in c.logprobs[done:]]
            if done == 0:
                delta.num_cached_tokens = out.num_cached_tokens
                if out.metrics is not None:
                    delta.first_scheduled_time = out.metrics.first_scheduled_time
                    delta.kv_transfer = out.metrics.kv_transfer
            if prompt_lps is not None:
                delta.prompt_logprobs, prompt_lps = prompt_lps, None
            if out.finished and out.kv_transfer_params is not None:
                delta.kv_transfer_params = out.kv_transfer_params
            if out.finished and out.embedding is not None:
                delta.embedding = out.embedding
            sent[c.index] = -1 if c.finish_reason is not None else done + len(new)
            deltas.append(delta)
        if out.finished:
            self._forget(rid)
        return deltas


def serve(config: EngineConfig, input_addr: str, output_addr: str) -> int:
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, LINGER_MS)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    parent = os.getppid()
    try:
        from specfleet.engine.llm_engine import Engine

        cursors: list[TextCursor] = []

        def cursor() -> TextCursor:
            cursors.append(TextCursor())
            return cursors[-1]

        engine = Engine(config, text_cursor=cursor)
        core = EngineCore(engine, cursors)
        out.send(
            ENCODER.encode(
                Ready(
                    engine.model_name,
                    engine.max_model_len,
                    engine.runner.vocab_size,
                    sorted(engine.eos_token_ids),
                    engine.live_config().as_dict(),
                    os.getpid(),
                    engine.sampling_defaults,
                    engine.kv.block_size,
                    engine.kv.num_blocks,
                    engine.kv.enable_prefix_caching,
                )
            )
        )
        try:
            _loop(core, inp, out, parent)
        finally:
            core.background.close()  # a read still blocked on its files is left behind, not waited for
    except BaseException as exc:
        if isinstance(exc, SystemExit) and not exc.code:
            return 0
        if isinstance(exc, WorkerDied):  # the message names the rank and its exit code; no traceback
            log.error("event=engine_worker_died %s; the engine core exits", exc)
        elif isinstance(exc, UnsupportedModel):  # the message names the field and the supported values
            log.error("event=engine_core_failed error=UnsupportedModel %s", exc)
        else:
            log.exception("event=engine_core_failed error=%s", type(exc).__name__)
        out.send(ENCODER.encode(Dead(f"{type(exc).__name__}: {exc}")))
        return 1
    finally:
        out.close()
        inp.close()
        ctx.term()
    return 0


def _loop(core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    """Take inputs, step, report. The loop never spins: an idle engine blocks on its input (reporting every
    HEARTBEAT_S), and so does an engine whose last step scheduled nothing (`stalled`: every request waits on
    something), for BACKGROUND_WAIT_S when the engine has background work that may unblock a request
    (`has_pending_background_work`), else until an input arrives or a heartbeat is due. Empty steps send
    a report only when they end or change something, or as the heartbeat."""
    from specfleet.engine.llm_engine import BACKGROUND_WAIT_S  # the engine module is loaded by now

    engine = core.engine
    last_report = time.monotonic()
    stalled = False
    # when the last step's `Engine.step()` returned, while work stayed unfinished since
    gap_from: float | None = None
    while True:
        busy = engine.has_unfinished_requests()
        if busy and not stalled:
            timeout_s = 0.0
        elif busy and engine.has_pending_background_work():
            timeout_s = BACKGROUND_WAIT_S
        else:  # idle, or stalled on nothing that moves by itself: until an input or the next heartbeat
            timeout_s = max(0.0, last_report + HEARTBEAT_S - time.monotonic())
        if core.background.pending():
            timeout_s = min(timeout_s, POLL_S)
        if timeout_s == 0.0 or inp.poll(int(timeout_s * 1000)):
            for result in _drain(core, inp):
                out.send(ENCODER.encode(result))
            stalled = False  # an input may have changed what can be scheduled
        for result in core.background.done():  # between steps: a load's adapter is registered here
            out.send(ENCODER.encode(result))
            stalled = False
        if os.getppid() != parent:
            log.warning("event=engine_core_orphaned parent=%d: the server is gone, exiting", parent)
            return
        heartbeat_due = time.monotonic() - last_report >= HEARTBEAT_S
        if engine.has_unfinished_requests():
            started = time.perf_counter()
            if gap_from is not None:
                engine.stats.step_gap_s += max(0.0, started - gap_from)
            report = core.step()
            # `Engine.step()` times itself from its start to its outputs; the rest of `core.step()` (the
            # report's deltas) counts as the gap before the next step
            gap_from = started + engine.stats.last_step.duration_s if report.stepped else None
            went_stalled = not report.stepped and not stalled
            stalled = not report.stepped
            news = report.stepped or report.deltas or report.aborted or report.error or went_stalled
            if news or heartbeat_due:
                if stalled and heartbeat_due:
                    engine.check_health()  # no collective runs while stalled either
                out.send(ENCODER.encode(report))
                last_report = time.monotonic()
        else:
            stalled = False
            gap_from = None
            engine.poll_kv_transfers()  # a finished hold's blocks come back while idle too
            if heartbeat_due or busy:
                engine.check_health()  # a dead split-model worker: WorkerDied, the core exits
                out.send(ENCODER.encode(core.report(False)))  # idle (or just went idle): gauges and heartbeat
                last_report = time.monotonic()


def _drain(core: EngineCore, inp: zmq.Socket) -> list[Any]:
    """Every input waiting now, in order; the replies to send."""
    replies: list[AddResult | UtilityResult] = []
    while True:
        try:
            kind, payload = inp.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return replies
        msg = INPUT_DECODERS[kind].decode(payload)
        if kind == RequestType.ADD.value:
            replies.append(core.add(msg))
        elif kind == RequestType.ABORT.value:
            core.abort(msg.request_ids)
        elif kind == RequestType.FINISH_SEQ.value:
            core.finish_sequence(msg)
        else:
            result = core.utility(msg)
            if result is not None:
                replies.append(result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specfleet.engine.core.proc", description=__doc__.split("\n")[0]
    )
    p.add_argument("--input", required=True, help="the server's input address (ZeroMQ, the core connects)")
    p.add_argument("--output", required=True, help="the server's output address")
    p.add_argument("--config", required=True, help="EngineConfig's fields as JSON")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # Ctrl-C is the server's to handle (it drains, then stops the core with SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(EngineConfig(**json.loads(args.config)), args.input, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
