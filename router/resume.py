"""Streams that survive their engine: a stream cut after its first byte goes on from another engine.

A streamed completion or chat completion that can be resumed (`plan`) is sent with the engine's token-ids
header, so every streamed choice carries the output token ids its text covers. `StreamRelay` passes the
events on with those ids taken out and keeps them. When the engine's connection breaks before the
stream's end, or the engine ends the choice with `finish_reason: "abort"` (it drained) or sends its
`engine_dead` error, the relay drops what is left of that answer and the proxy sends the request again to
another engine with `resume_token_ids`: the tokens the client already has. That engine prefills prompt +
those tokens, counts them as output (seeded draws, penalties, stop strings, max_tokens and usage go on
from them) and streams only what follows (engine/server/resume.py). Its chunks get the first engine's `id`
and `created`, so the client reads one stream.

On the raw front (router/front.py) the relay runs in the engine connection's read callback, as a
passed-through body does (`_RelayNow`, upstream.py's `EngineResponse.pipe`): the request's task wakes only
for a cut, a full client or the answer's end, and `follow` resumes from there.

Not resumable (cut as before, then told so in an error event): n > 1 or best_of > 1, logprobs (the first
engine's are not replayed), echo, prompt_logprobs, a batch of prompts, tools and structured outputs (a
grammar's or a tool parser's state at the cut is not rebuilt), and a disaggregated request (its decode
engine holds the prompt's KV; `kv_transfer_params`).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from .upstream import EngineBroken, EngineResponse, EngineUnreachable

if TYPE_CHECKING:
    from .endpoints import EndpointSet
    from .metrics import RouterMetrics
    from .policies import Choice, RouteRequest
    from .upstream import EnginePool
    from .usage_tap import UsageTap

logger = logging.getLogger("specfleet.router")

# The engine's opt-in to token ids on streamed choices (engine/server/resume.py declares the same name;
# tests/router/test_resume.py holds the two equal: the router does not import the engine).
TOKEN_IDS_HEADER = "x-specfleet-token-ids"
RESUMABLE_PATHS = ("completions", "chat/completions")


class Rerouter(Protocol):
    """What resuming needs of the router (router/proxy.py's Router is one): its engines, its choice and
    its limits. A protocol, so this module stands below the proxy that calls it."""

    endpoints: EndpointSet
    engines: EnginePool
    metrics: RouterMetrics
    max_resumes: int
    max_retries: int
    connect_timeout_s: float
    request_timeout_s: float

    def choose(self, request: RouteRequest, tried: set[str]) -> Choice | None: ...


class Writer(Protocol):
    """Where the client's answer goes: aiohttp's `StreamResponse` or the raw front's (router/front.py)."""

    async def write(self, data: bytes) -> None: ...


class ImmediateWriter(Writer, Protocol):
    """A writer that also takes bytes at once from a callback (the raw front's `FrontResponse`): the relay
    then runs in the engine connection's read callback (`_RelayNow`)."""

    def write_now(self, data: bytes) -> bool: ...  # whether the client's transport is now full

    def end_now(self, data: bytes) -> None: ...  # the answer's last bytes and its end

    async def drained(self) -> None: ...


# Body fields whose presence (with a value other than these) makes a request not resumable
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    **dict.fromkeys(
        ("prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"), (None,)
    ),
    **dict.fromkeys(("structured_outputs", "kv_transfer_params", "resume_token_ids"), (None,)),
}


# Events that take the parsed path: a cut (abort, engine dead) or several choices (n > 1 is not resumed, but
# an engine answering one anyway must not be misread).
_ABORTED = b'"finish_reason":"abort"'
_ENGINE_DEAD = b'"engine_dead"'
_SECOND_CHOICE = b'"index":1'
_SLOW_MARKERS = (_ABORTED, _ENGINE_DEAD, _SECOND_CHOICE)
_FINISHED = b'"finish_reason":"'  # a string: the choice finished (null while it runs)
_ABORT_VALUE = _ABORTED[len(_FINISHED) :]  # what follows _FINISHED in _ABORTED
_TOKEN_IDS = b',"token_ids":['
# A choice's token ids as the engine's compact JSON writes them; the byte path cuts them out of a whole run
# in one pass and keeps their digits unparsed until a resume needs them (StreamRelay.token_ids)
_TOKEN_IDS_FIELD = re.compile(rb',"token_ids":\[([0-9,]*)\]')


def plan(
    path: str, method: str, body: bytes, max_resumes: int, parsed: Any = None
) -> tuple[dict[str, Any] | None, str | None]:
    """For a streamed generation request: its parsed body when the router can resume it, else why not
    (`(None, None)` for any other request). `parsed`: the body as the caller already parsed it (read
    only: the relay copies it for a resumed request), else it is parsed here."""
    if method != "POST" or path not in RESUMABLE_PATHS or b'"stream"' not in body:
        return None, None
    if parsed is None:
        try:
            parsed = json.loads(body)
        except ValueError:
            return None, None
    if not isinstance(parsed, dict) or parsed.get("stream") is not True:
        return None, None
    if max_resumes <= 0:
        return None, "the router resumes no stream (--max-resumes 0)"
    refused = not_resumable(parsed)
    if refused is not None:
        return None, f"a request with {refused}={json.dumps(parsed.get(refused))[:80]} is not resumable"
    return parsed, None


def not_resumable(body: dict[str, Any]) -> str | None:
    """Why this request cannot be resumed (the field that prevents it), or None."""
    if not body.keys().isdisjoint(REFUSED_FIELDS):  # (one set operation where none is there, the usual case)
        for name, allowed in REFUSED_FIELDS.items():
            if body.get(name) not in allowed:
                return name
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1:
        return "prompt"  # a batch of prompts: one stream per prompt, interleaved
    return None


@dataclass
class StreamRelay:
    """One resumable stream's events on their way to the client, across the engines that serve it."""

    body: dict[str, Any]  # the client's request
    where: tuple[RouteRequest, set[str], dict[str, str]]  # its route, the engines tried, its headers
    _ids: list[int] = field(default_factory=list)  # output tokens whose text the client has (token_ids)
    _unread_ids: list[bytes] = field(default_factory=list)  # and after them, as the byte path cut them out
    # The stream's first event as it came: its `id` and `created` (`identity`) are read from it only when a
    # later engine's chunks need them
    _first: bytes = b""
    _identity: dict[str, Any] | None = None
    forwarded: bool = False  # an event reached the client
    finished: bool = False  # the choice's finish_reason (not "abort") reached the client
    done: bool = False  # [DONE] reached the client
    cut: str | None = None  # why the current engine's answer is being dropped
    resumed: bool = False  # a later engine answers: its chunks take the first engine's identity
    # The stream's first event is compact JSON (no `": `): one engine's serializer writes the rest alike, so
    # the runs after it are not scanned for `": ` again (the markers below read compact JSON only)
    compact: bool = False
    _kept: bytearray = field(default_factory=bytearray)

    @property
    def identity(self) -> dict[str, Any] | None:
        """The first engine's chunk `id` and `created` (None before its first event)."""
        if self._identity is None and self._first:
            try:
                data = json.loads(self._first[6:])
            except ValueError:
                data = None
            data = data if isinstance(data, dict) else {}
            self._identity = {k: data[k] for k in ("id", "created") if k in data}
        return self._identity

    @property
    def token_ids(self) -> list[int]:
        """The output tokens whose text the client has, in order (the byte path's digits read now)."""
        if self._unread_ids:
            digits = b",".join(self._unread_ids).split(b",")
            self._unread_ids.clear()
            self._ids.extend(int(t) for t in digits if t)
        return self._ids

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in `chunk` (with what an earlier one left) as the client gets them; a cut
        (the engine aborted the choice or is dead) sets `cut` and drops the rest of this engine's answer."""
        if self.cut is not None:
            return b""
        if self._kept:  # an event begun in an earlier read
            self._kept += chunk
            chunk = bytes(self._kept)
            self._kept.clear()
        end = chunk.rfind(b"\n\n") + 2
        if end < 2:
            self._kept += chunk
            return b""
        events = chunk
        if end < len(chunk):  # the read ends inside an event: kept for the next one
            self._kept += chunk[end:]
            events = chunk[:end]
        if not self._first and events.startswith(b"data: {"):  # the stream's first event: kept as it came
            self._first = events[: events.index(b"\n\n")]
            self.compact = b'": ' not in self._first
        passed = self._as_they_came(events)
        if passed is not None:
            return passed
        out = []
        for event in events.split(b"\n\n")[:-1]:
            passed = self._event(event)
            if self.cut is not None:
                break
            if passed is not None:
                out.append(passed + b"\n\n")
        return b"".join(out)

    def _as_they_came(self, events: bytes) -> bytes | None:
        """A run of whole events as the client gets it, decided over the run at once (a few byte scans
        instead of one pass per event), or None for the per-event path: the first engine's, in compact
        JSON, with nothing the parsed path looks for (a cut, another choice); its token ids cut out in one
        pass (the key cannot occur inside a string value, where JSON escapes the quotes)."""
        if not events or self.resumed or not self.compact:
            return None
        # Each scan reads the whole run, about 2 ns a byte (a 64-event answer of 10 KB in one read took 7
        # scans, 10-30 us each, a third of the router's CPU per request in `specfleet bench router`): the
        # JSON's form is read off the first event; an abort is a finish_reason, read only where one is
        # found; [DONE] ends a stream, looked for inside the run only where it does not end it; the
        # ids come out in one regex split (a sub, a findall and a check of the result took three passes).
        at = events.find(_FINISHED)
        finished = at >= 0
        while at >= 0:  # each finish_reason string read where it is: the abort check costs no scan of its own
            if events.startswith(_ABORT_VALUE, at + len(_FINISHED)):
                return None
            at = events.find(_FINISHED, at + len(_FINISHED))
        if _ENGINE_DEAD in events or _SECOND_CHOICE in events:
            return None
        passed = events
        keys = events.count(_TOKEN_IDS)
        if keys:  # one regex pass: the text around the ids and the ids' digits, alternating
            parts = _TOKEN_IDS_FIELD.split(events)
            if len(parts) != 2 * keys + 1:  # ids in a form the pattern does not read: the per-event path
                return None
            passed = b"".join(parts[0::2])
            self._unread_ids += parts[1::2]
        self.forwarded = True
        self.finished = self.finished or finished
        self.done = (
            self.done
            or events.startswith(b"data: [DONE]\n\n")
            or events.endswith(b"\n\ndata: [DONE]\n\n")
            or b"\n\ndata: [DONE]\n\n" in events
        )
        return passed

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: {"):
            self.done = self.done or event == b"data: [DONE]"
            self.forwarded = True
            return event
        start = event.find(_TOKEN_IDS)
        if not self._first:
            self._first = event
        slow = self.resumed or any(m in event for m in _SLOW_MARKERS)
        # no ids and not compact JSON (the markers read compact JSON only): parsed, to be sure of a cut
        if slow or (start < 0 and b'": ' in event):
            return self._parsed(event)
        if start < 0:  # no ids to take out (a usage chunk, or an engine that sends none): as it came
            self.forwarded = True
            self.finished = self.finished or _FINISHED in event
            return event
        # The common event (the first engine's, one choice, nothing cut): its token ids cut out of the
        # engine's compact JSON by bytes, not parsed and written again. The key cannot occur inside a
        # string value, where JSON escapes the quotes.
        self.forwarded = True
        self.finished = self.finished or _FINISHED in event
        end = event.index(b"]", start)
        self.token_ids.extend(int(t) for t in event[start + len(_TOKEN_IDS) : end].split(b",") if t)
        return event[:start] + event[end + 1 :]

    def _parsed(self, event: bytes) -> bytes | None:
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        error = data.get("error")
        if isinstance(error, dict) and "engine_dead" in (error.get("type"), error.get("code")):
            self.cut = "engine_dead"
            return None
        choices = data.get("choices") or []
        if any(c.get("finish_reason") == "abort" for c in choices if isinstance(c, dict)):
            self.cut = "aborted"
            return None
        changed = False
        for choice in choices:
            if isinstance(choice, dict):
                changed = changed or "token_ids" in choice
                self.token_ids.extend(choice.pop("token_ids", None) or [])
                self.finished = self.finished or choice.get("finish_reason") is not None
        identity = self.identity if self.resumed else None  # the first engine's chunks keep their own
        if identity and any(data.get(k, v) != v for k, v in identity.items()):
            data.update(identity)
            changed = True
        self.forwarded = True
        if not changed:  # as the engine wrote it
            return event
        return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()

    def next_engine(self) -> None:
        """The current engine's answer is over: what it left unsent is dropped, the next one starts clean."""
        self._kept.clear()
        self.cut = None
        self.resumed = True

    def resumed_body(self) -> bytes:
        """The request for the next engine: the client's, going on after the tokens the client has (a
        client that has seen no event gets the request as it sent it)."""
        body = dict(self.body)
        if self.forwarded:
            body["resume_token_ids"] = list(self.token_ids)
        return json.dumps(body).encode()


def error_event(message: str) -> bytes:
    """An SSE error event and [DONE]: the stream ends with a reason instead of silence."""
    body = {"error": {"message": message, "type": "stream_broken", "param": None, "code": None}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def follow(
    router: Rerouter,
    target: str,
    out: Writer,
    upstream: EngineResponse,
    relay: StreamRelay,
    tap: UsageTap | None,
) -> str:
    """Relay `upstream`'s stream to `out`, resuming (the request sent again to `target`) it on other engines (at most `router.max_resumes`
    times) when it is cut; returns the request's outcome. The first engine's response is the caller's to
    close; the others are closed here."""
    route, tried, headers = relay.where
    url, engine, resumes = "", upstream, 0
    try:
        while True:
            broken = await _pipe(engine, relay, out, tap)
            if broken is None and relay.cut is None or relay.finished:
                if not relay.done:
                    await out.write(_feed(tap, b"data: [DONE]\n\n"))
                return "ok"
            reason = relay.cut or "broken"
            logger.warning(
                "event=stream_cut reason=%s tokens=%d error=%r", reason, len(relay.token_ids), broken
            )
            if engine is not upstream:
                engine.close()
                router.endpoints.release(url)
                engine = upstream  # nothing of this engine's is left to close
            opened = (
                f"resumed {resumes} times, the limit (--max-resumes)"
                if resumes >= router.max_resumes
                else await _reopen(router, target, relay, route, tried, headers)
            )
            if isinstance(opened, str):
                why = f"the engine failed mid-stream ({reason}) and the stream could not be resumed: {opened}"
                await out.write(_feed(tap, error_event(why)))
                return "broken"
            url, engine = opened
            resumes += 1
            router.metrics.resumed.labels(reason).inc()
            logger.info(
                "event=stream_resumed engine=%s reason=%s tokens=%d", url, reason, len(relay.token_ids)
            )
    finally:
        if engine is not upstream:
            engine.close()
            router.endpoints.release(url)


def _feed(tap: UsageTap | None, data: bytes) -> bytes:
    return data if tap is None else tap.feed(data)


async def _pipe(engine: EngineResponse, relay: StreamRelay, out: Writer, tap: UsageTap | None) -> str | None:
    """One engine's answer to the client until it ends or is cut; the error that broke it, or None."""
    if hasattr(out, "write_now"):  # the raw front's answer (a Protocol's isinstance costs microseconds)
        return await _pipe_now(engine, _RelayNow(engine, relay, cast(ImmediateWriter, out), tap))
    try:
        async for chunk in engine.chunks():
            data = relay.feed(chunk)
            if data:
                await out.write(_feed(tap, data))
            if relay.cut is not None:
                return None
    except EngineBroken as error:
        return str(error)
    return None


class _RelayNow:
    """A relay run from the engine connection's read callback (EngineResponse.pipe), as pass-through runs:
    each read's events go through `StreamRelay.feed` and out to the client there, without waking the
    request's task; it wakes for the answer's end, a cut, a failure or a full client, and the async
    machinery above (`follow`) takes over from there."""

    __slots__ = ("engine", "error", "out", "relay", "tap")

    def __init__(
        self, engine: EngineResponse, relay: StreamRelay, out: ImmediateWriter, tap: UsageTap | None
    ) -> None:
        self.engine, self.relay, self.out, self.tap = engine, relay, out, tap
        self.error: Exception | None = None  # what the relay raised: re-raised on the task, not the callback

    def __call__(self, data: bytes) -> bool:
        """One read to the client; True: stop reading (a cut, an error, or the client is full)."""
        if self.error is not None:
            return True
        relay = self.relay
        try:
            passed = relay.feed(data)
            if self.engine.ended and relay.cut is None and self.tap is None:
                # the engine's answer is whole: the client's ends in this write ([DONE] added as `follow`
                # would), not in one more from the task
                if not relay.done:
                    passed += b"data: [DONE]\n\n"
                    relay.done = True
                self.out.end_now(passed)
                return False
            full = bool(passed) and self.out.write_now(_feed(self.tap, passed))
        except Exception as error:  # not left to the transport's callback, which would only log it
            self.error = error
            return True
        return full or relay.cut is not None

    def stopped(self) -> bool:
        return self.relay.cut is not None or self.error is not None


async def _pipe_now(engine: EngineResponse, now: _RelayNow) -> str | None:
    try:
        await engine.pipe(now, now.out.drained, now.stopped)
    except EngineBroken as error:
        return str(error)
    if now.error is not None:
        raise now.error
    return None


async def _reopen(
    router: Rerouter,
    target: str,
    relay: StreamRelay,
    route: RouteRequest,
    tried: set[str],
    headers: dict[str, str],
) -> tuple[str, EngineResponse] | str:
    """The resumed request's answer from another engine (its URL is acquired), or why none gave one."""
    relay.next_engine()
    body = relay.resumed_body()
    why = "no other engine is ready"
    for _ in range(router.max_retries + 1):
        choice = router.choose(route, tried)
        if choice is None:
            return why
        url = choice.url
        tried.add(url)
        router.endpoints.acquire(url)
        try:
            engine = await router.engines.request(
                url,
                "POST",
                target,
                headers,
                body,
                router.connect_timeout_s,
                router.request_timeout_s,
            )
        except EngineUnreachable as error:
            router.endpoints.release(url)
            why = f"{url}: {error}"
            continue
        if engine.status == 200:
            return url, engine
        why = f"{url} answered {engine.status}: {(await engine.read(300)).decode(errors='replace')}"
        engine.close()
        router.endpoints.release(url)
        if engine.status not in (502, 503, 504):
            return why
    return why
