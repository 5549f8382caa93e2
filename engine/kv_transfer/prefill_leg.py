"""The prefill leg of a disaggregated request, for whoever runs it: the router's proxy
(router/disaggregation.py, which picks the prefill engine itself) and a decode engine that a gateway's
endpoint picker sent a request naming its prefill engine (engine/server/remote_prefill.py, the
`x-prefiller-host-port` header). Both send the same one-token request, read its answer the same way and
release an unused hold with the same message; only their HTTP clients differ (aiohttp in the router, httpx
in the engine's server), so the sending stays with them.

The leg: the client's request as a non-streaming one-token request with
`kv_transfer_params={"do_remote_decode": true}`; the prefill engine answers with the first token and
`kv_transfer_params` naming where the prompt's KV blocks wait. The original request then runs on the decode
engine with those params; its answer contains the first token again, since the decode engine's sequence
starts with it. Requests the leg does not cover (`covered`: n > 1, max_tokens < 2, a batch of prompts,
echo, prompt logprobs, a resumed stream, params of their own) run aggregated.

Plain Python (no torch, no HTTP client, no pyzmq at import): the router, which runs without the engine's
dependencies, imports it. The hold release goes through the KV connector's ZeroMQ request
(engine/kv_transfer/wire.py), imported where it is sent.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger("specfleet.engine.kv_transfer")

GENERATE_PATHS = ("completions", "chat/completions")  # below /v1/
# The header naming the prefill engine (`host:port` of its HTTP API) that a decode engine runs the prefill
# leg on: llm-d's name (its endpoint picker sets it, its routing sidecar beside the decode engine reads
# it), so specfleet's endpoint picker and llm-d's sidecar, or llm-d's picker and specfleet's engine, pair.
PREFILLER_HEADER = "x-prefiller-host-port"
RELEASE_TIMEOUT_S = 1.0  # a release is best effort: the prefill engine's hold timeout covers a lost one


def covered(body: dict[str, Any]) -> bool:
    """Requests the two-engine path serves; the rest run aggregated on a decode engine."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16 if "prompt" in body else None))
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return (
        body.get("n", 1) == 1
        and (max_tokens is None or max_tokens >= 2)
        and not many
        and not body.get("kv_transfer_params")
        and not body.get("resume_token_ids")  # a resumed stream re-prefills here (engine/server/resume.py)
        and not body.get("echo")
        and body.get("prompt_logprobs") is None
    )


def parse(path: str, method: str, content: bytes) -> dict[str, Any] | None:
    """The request body when the two-engine path serves it, else None. `path` is below /v1/."""
    if method != "POST" or path not in GENERATE_PATHS:
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return None  # the engine answers with the proper 400
    return body if isinstance(body, dict) and covered(body) else None


class Refusal(Exception):
    """The prefill engine refused the request (a 4xx the client must see)."""

    def __init__(self, status: int, content: bytes, content_type: str | None) -> None:
        super().__init__(f"prefill engine answered {status}")
        self.status, self.content, self.content_type = status, content, content_type


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the same request for its first token only. `min_tokens` is clamped to that one
    token (min_tokens >= 1 keeps the first token from being a stop token, as in the aggregated run; more
    would be a 400 against max_tokens=1); the decode engine counts the first token toward the rest.
    Everything else stays, logprobs included: the prefill engine returns the first token's logprobs in
    its kv_transfer_params and the decode engine reports them, so the client gets one per token."""
    one = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    one.pop("stream_options", None)
    one.pop("max_completion_tokens", None)
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 1:
        one["min_tokens"] = 1
    return one


def held_params(status: int, content: bytes, content_type: str | None) -> dict[str, Any] | None:
    """The prefill engine's answer read: the kv_transfer_params to decode with, or None when this engine
    gave none (a 5xx, 408 or 429, an answer without params: try another, or run aggregated). Raises
    Refusal for any other 4xx, which is the request's fault and the client's answer."""
    if 400 <= status < 500 and status not in (408, 429):
        raise Refusal(status, content, content_type)
    if status != 200:
        return None
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    return json.dumps({**body, "kv_transfer_params": params}).encode()


def release(params: dict[str, Any]) -> None:
    """The decode engine will not take the KV (the client left, the decode engine is gone or refused the
    request): the prefill engine drops its hold now rather than at its timeout. Blocking (a ZeroMQ round
    trip of at most RELEASE_TIMEOUT_S): callers on an event loop run it in an executor."""
    try:  # pyzmq: with the engine's install; the router's image has it only where disaggregation runs
        from specfleet.engine.kv_transfer.wire import KVTransferParams, release_hold
    except ImportError as error:
        logger.warning("event=kv_release_skipped transfer_id=%s error=%r", params.get("transfer_id"), error)
        return
    try:
        held = KVTransferParams.from_dict(params)
    except (ValueError, TypeError) as error:
        logger.warning("event=kv_release_failed transfer_id=%s error=%r", params.get("transfer_id"), error)
        return
    release_hold(held, RELEASE_TIMEOUT_S)
