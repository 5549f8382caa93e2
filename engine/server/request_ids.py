"""Request ids as vLLM takes them: the `X-Request-Id` header, else the body's `request_id`, else a new one.

The id names the request in the response (`chatcmpl-<id>`, `cmpl-<id>`), in the engine and in the
server's log line, and comes back in the `X-Request-Id` response header of every response, errors
included (vLLM's `--enable-request-id-headers`, always on here: one header per response costs nothing
measurable next to a forward pass).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import Request

from .errors import APIError
from .protocol import REQUEST_ID_PATTERN

HEADER = b"x-request-id"
_STATE_KEY = "specfleet_request_id"
_FROM_HEADER_KEY = "specfleet_request_id_from_header"


class RequestIdHeader:
    """Plain ASGI (streamed bodies pass through untouched): picks the request's id before the route runs
    and writes it into the response's headers when the response starts."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == HEADER), "")
        state = scope.setdefault("state", {})
        state[_STATE_KEY] = incoming or uuid.uuid4().hex
        state[_FROM_HEADER_KEY] = bool(incoming)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((HEADER, state[_STATE_KEY].encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request, body_id: str | None) -> str:
    """This request's id: the header's, else the body's `request_id`, else the one generated for it. The
    response header echoes whichever wins."""
    state = request.scope.setdefault("state", {})
    if body_id and not state.get(_FROM_HEADER_KEY):
        state[_STATE_KEY] = body_id
    if state.get(_FROM_HEADER_KEY) and not re.match(REQUEST_ID_PATTERN, state[_STATE_KEY]):
        # the body's request_id is held to the same pattern by its model
        raise APIError(
            400,
            f"X-Request-Id={state[_STATE_KEY][:80]!r} must be 1-256 visible ASCII characters (it names the "
            "request in logs)",
            "X-Request-Id",
            "invalid_value",
        )
    return str(state.setdefault(_STATE_KEY, uuid.uuid4().hex))
