"""Reads the engine's `usage` off a response on its way to the client (proxy.py feeds it every chunk).

A whole JSON answer is kept (up to MAX_KEPT_BYTES) and its `usage` read at the end. A stream is cut into
Server-Sent Events; the one that carries a `usage` object is read, and when the client did not ask for it
(the gateway added `stream_options.include_usage` for its own accounting) that event is dropped and the
`"usage":null` the engine puts in every other chunk is taken out, so the client sees the stream it asked
for. Bytes after the last complete event wait for the next chunk or `flush`. With `keep_text` (a stream
without `max_tokens`, whose estimate has no room for its answer) the text its choices carried is kept too
(`streamed_text`): such a stream cut before its usage (the client left) is charged by it.
"""

from __future__ import annotations

import json
from typing import Any

# A non-streamed answer longer than this is passed on without reading its usage (the estimate stays
# charged): 8 MiB is a 2M-token answer as JSON, far past any context.
MAX_KEPT_BYTES = 8 * 1024 * 1024
_NULL_USAGE = b',"usage":null'  # the engine's compact JSON (engine/server/serving.py sse)


class UsageTap:
    def __init__(self, stream: bool, strip: bool, keep_text: bool = False) -> None:
        self.stream = stream
        self.strip = strip  # drop the usage event: the client did not ask for it
        # keep the choices' text (each event parsed): only where it can matter, a stream without max_tokens
        self.keep_text = keep_text
        self.usage: dict[str, Any] | None = None
        self._kept = bytearray()
        self._texts: list[str] = []  # the text of the stream's choices so far

    def feed(self, chunk: bytes) -> bytes:
        if not self.stream:
            if len(self._kept) + len(chunk) <= MAX_KEPT_BYTES:
                self._kept += chunk
            return chunk
        self._kept += chunk
        end = self._kept.rfind(b"\n\n")
        if end < 0:
            return b""
        events = bytes(self._kept[: end + 2])
        del self._kept[: end + 2]
        if self.keep_text:  # every event's text is read
            return b"".join(self._event(e + b"\n\n") for e in events.split(b"\n\n")[:-1])
        return self._run(events)

    def _run(self, events: bytes) -> bytes:
        """A run of whole events, without a parse where every usage is the engine's null (the gateway asks
        every tenant stream for its usage, so every chunk carries one): those are passed, or stripped, in
        bulk; only an event with another `"usage"` (the usage itself, or a text that spells it) is parsed."""
        if events.count(b'"usage"') == events.count(_NULL_USAGE):  # the common run: no usage in it yet
            return self._nulls(events)
        out = []
        start = 0
        at = events.find(b'"usage"')
        while at >= 0:
            if events.startswith(_NULL_USAGE, at - 1):
                at = events.find(b'"usage"', at + len(_NULL_USAGE))
                continue
            before = events.rfind(b"\n\n", start, at)
            begin = start if before < 0 else before + 2
            end = events.find(b"\n\n", at) + 2  # a run ends with a whole event
            out.append(self._nulls(events[start:begin]))
            out.append(self._event(events[begin:end]))
            start = end
            at = events.find(b'"usage"', start)
        out.append(self._nulls(events[start:]))
        return b"".join(out)

    def _nulls(self, events: bytes) -> bytes:
        """Events whose every usage is null: as they came, or without it when the client did not ask."""
        return events.replace(_NULL_USAGE, b"") if self.strip else events

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or not self.keep_text and b'"usage"' not in event:
            return event
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(data, dict):
            return event
        if self.keep_text:
            self._keep_text(data.get("choices"))
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
            if self.strip and not data.get("choices"):
                return b""
        return event.replace(_NULL_USAGE, b"") if self.strip and b'"usage"' in event else event

    def _keep_text(self, choices: Any) -> None:
        """The text of one event's choices: a completion's `text`, a chat delta's `content`,
        `reasoning_content` and tool calls' `arguments`."""
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            parts = [choice.get("text")]
            if isinstance(delta, dict):
                parts += [delta.get("content"), delta.get("reasoning_content")]
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") if isinstance(call, dict) else None
                    parts.append(function.get("arguments") if isinstance(function, dict) else None)
            self._texts.extend(p for p in parts if isinstance(p, str) and p)

    def streamed_text(self) -> str:
        """The text the stream's choices carried so far ("" for a whole answer)."""
        return "".join(self._texts)

    def flush(self) -> bytes:
        """What is left at the end: a stream's unterminated tail as it came; a whole answer's usage is read."""
        rest = bytes(self._kept)
        self._kept.clear()
        if self.stream:
            return rest
        try:
            data = json.loads(rest)
        except ValueError:
            return b""
        if isinstance(data, dict) and isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        return b""

    def total_tokens(self) -> int | None:
        if self.usage is None:
            return None
        total = self.usage.get("total_tokens")
        if isinstance(total, int):
            return total
        parts = [self.usage.get("prompt_tokens"), self.usage.get("completion_tokens")]
        return sum(p for p in parts if isinstance(p, int)) if any(isinstance(p, int) for p in parts) else None
