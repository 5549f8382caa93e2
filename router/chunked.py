"""HTTP/1.1 chunked framing, read lazily: where an engine's chunked body passes through the router as it came.

An answer relayed with its framing (router/upstream.py's raw connections, the front's pass-through) is not
read chunk by chunk: httptools checks the framing in C and says where the message ends. Two things still
need the framing, and both only rarely, so they read it here in Python when they need it:

- `ChunkedTail`: whether what reached the client ends between two chunks. Only a stream cut mid-way asks
  (the router then ends it with an error event in a chunk of its own, or, in the middle of a chunk, by
  closing the connection). It keeps the bytes since the last point it knows is a boundary and walks them
  only when asked or when they pass `WALK_BYTES`, so a short answer is never walked and memory stays
  bounded for a long one.
- `dechunk`: the data of the whole chunks in a body's first bytes (an engine's error answer, read for the
  message of a retry).
"""

from __future__ import annotations

# What a stream may pass through before the bytes kept for `ChunkedTail.at_boundary` are walked and
# dropped: above a whole answer of `specfleet bench router` (10 KB) and most short chat answers, small
# against the 256 KiB the engine's connection may hold for a slow client (upstream.HIGH_WATER_BYTES).
WALK_BYTES = 64 * 1024


class ChunkedTail:
    """Follows a chunked body through its pieces, walking the framing only when asked (or past WALK_BYTES)."""

    __slots__ = ("_kept", "_kept_size", "_left", "_line", "ended")

    def __init__(self) -> None:
        self._kept: list[bytes] = []  # pieces not walked yet
        self._kept_size = 0
        self._left = 0  # bytes of the current chunk's data (and its CRLF) not seen yet
        self._line = b""  # a chunk-size line begun and not ended
        self.ended = False  # the last chunk (size 0) was seen: trailers or the final CRLF follow

    def add(self, piece: bytes) -> None:
        self._kept.append(piece)
        self._kept_size += len(piece)
        if self._kept_size > WALK_BYTES:
            self._walk()

    def at_boundary(self) -> bool:
        """Whether the pieces so far end between two chunks (no chunk begun and unfinished) and before the
        last chunk: where one more chunk can follow."""
        self._walk()
        return self._left == 0 and not self._line and not self.ended

    def _walk(self) -> None:
        data = b"".join(self._kept)
        self._kept.clear()
        self._kept_size = 0
        at, size = 0, len(data)
        while at < size and not self.ended:
            if self._left:
                step = min(self._left, size - at)
                self._left -= step
                at += step
                continue
            end = data.find(b"\n", at)
            if end < 0:
                self._line += data[at:]
                return
            line = self._line + data[at:end]
            self._line = b""
            at = end + 1
            try:
                chunk = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:  # httptools accepted the framing before it got here: not expected
                self.ended = True  # no chunk can be added after what is not understood
                return
            if chunk == 0:
                self.ended = True
            else:
                self._left = chunk + 2  # the data and its CRLF


def dechunk(body: bytes) -> bytes:
    """The data of the whole chunks at the start of a chunked `body` (what follows an incomplete chunk, or
    a line that is not a chunk's size, is left out)."""
    out, at = [], 0
    while True:
        end = body.find(b"\r\n", at)
        if end < 0:
            break
        try:
            size = int(body[at:end].split(b";", 1)[0].strip(), 16)
        except ValueError:
            break
        if size == 0 or end + 2 + size > len(body):
            out.append(body[end + 2 : end + 2 + size])  # a partial last chunk: its data so far
            break
        out.append(body[end + 2 : end + 2 + size])
        at = end + 2 + size + 2
    return b"".join(out)
