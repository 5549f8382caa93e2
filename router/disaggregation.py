"""The router's prefill/decode orchestration: one OpenAI request, two engines.

Used when the endpoint set has prefill engines (`Endpoint.role == "prefill"`): the request goes to a prefill
engine as a non-streaming one-token request with `kv_transfer_params={"do_remote_decode": true}`; the
prefill engine answers with the first token and `kv_transfer_params` naming where the prompt's KV blocks
wait. The original request then goes to a decode engine (the router's policy picks it among the routable
ones) with those params; its answer (JSON or Server-Sent Events) is the client's, and it contains the first
token again, since the decode engine's sequence starts with it.

Failures: a prefill engine that cannot be reached is tried on the next one, then the request runs
aggregated on a decode engine. A prefill that did not end on its one token (a stop token first) or a
request the orchestration does not cover (n > 1, max_tokens = 1, a batch of prompts) runs aggregated on a
decode engine too. A client that leaves while the prefill runs, or a decode engine that cannot be reached,
gets its hold released at once (not after the prefill engine's hold timeout). A decode engine whose pull
fails recomputes the prompt itself.

The hold release is the KV connector's own ZeroMQ request (engine/kv_transfer/wire.py: plain Python and
pyzmq, no torch, the one module of the engine the router imports, and only here). pyzmq comes with the
engine's install; a router without it logs and leaves the hold to its timeout.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from .endpoints import EndpointSet

logger = logging.getLogger("specfleet.router")

GENERATE_PATHS = ("completions", "chat/completions")
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
        and not body.get("echo")
        and body.get("prompt_logprobs") is None
    )


def parse(path: str, method: str, content: bytes) -> dict[str, Any] | None:
    """The request body when the two-engine path serves it, else None."""
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


async def prefill(
    session: aiohttp.ClientSession,
    endpoints: EndpointSet,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> dict[str, Any] | None:
    """Run the prefill: the kv_transfer_params to continue with on a decode engine, or None to run the
    request aggregated. Raises Refusal for the prefill engine's 4xx."""
    one = prefill_body(body)
    headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
    for endpoint in endpoints.prefill_routable():
        endpoints.acquire(endpoint.url)
        try:
            async with session.post(f"{endpoint.url}/v1/{path}", json=one, headers=headers) as response:
                content = await response.read()
                status, content_type = response.status, response.headers.get("content-type")
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            logger.info(
                "event=prefill_failed engine=%s error=%r", endpoint.url, f"{type(error).__name__}: {error}"
            )
            continue  # that prefill engine is gone: the next one
        finally:
            endpoints.release(endpoint.url)
        if 400 <= status < 500 and status not in (408, 429):
            raise Refusal(status, content, content_type)
        if status != 200:
            continue
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            continue
        return params if isinstance(params, dict) else None
    return None


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    return json.dumps({**body, "kv_transfer_params": params}).encode()


def release(params: dict[str, Any]) -> None:
    """The decode engine will not take the KV (the client left, or the decode engine is gone): the prefill
    engine drops its hold now."""
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
