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

The leg itself (which requests it covers, the one-token request, reading the prefill engine's answer, the
hold release) is engine/kv_transfer/prefill_leg.py, which a decode engine uses too when a gateway's endpoint
picker names its prefill engine in `x-prefiller-host-port` (router/endpoint_picker.py,
engine/server/remote_prefill.py); this module adds the router's part: choosing the prefill engine, trying
the next, counting the leg on it. The release is the KV connector's own ZeroMQ request
(engine/kv_transfer/wire.py: plain Python and pyzmq, no torch); pyzmq comes with the engine's install; a
router without it logs and leaves the hold to its timeout.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from specfleet.engine.kv_transfer.prefill_leg import (
    GENERATE_PATHS,
    PREFILLER_HEADER,
    Refusal,
    covered,
    decode_body,
    held_params,
    parse,
    prefill_body,
    release,
)

from .endpoints import EndpointSet

__all__ = [
    "GENERATE_PATHS",
    "PREFILLER_HEADER",
    "Refusal",
    "covered",
    "decode_body",
    "parse",
    "prefill",
    "prefill_body",
    "release",
]

logger = logging.getLogger("specfleet.router")


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
        params = held_params(status, content, content_type)  # Refusal: the client's answer
        if params is not None or status == 200:  # a 200 without a hold: it ended on a stop token first
            return params
    return None
