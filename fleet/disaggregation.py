"""The local fleet's prefill/decode orchestration: one OpenAI request, two engines.

The request goes to a prefill engine as a non-streaming one-token request with
`kv_transfer_params={"do_remote_decode": true}`; the prefill engine answers with the first token and
`kv_transfer_params` naming where the prompt's KV blocks wait. The original request then goes to a decode
engine with those params; its answer (JSON or Server-Sent Events) is the client's, and it contains the
first token again, since the decode engine's sequence starts with it.

Failures: a prefill engine that cannot be reached is retried on the next one, then the request runs
aggregated on a decode engine. A prefill that did not end on its one token (a stop token first) or a
request the orchestration does not cover (n > 1, max_tokens = 1) runs aggregated on a decode engine too.
A client that leaves while the prefill runs gets its hold released at once (not after the hold timeout).
A decode engine that dies mid-transfer fails the client's request with 502 (its hold was consumed or
times out on the prefill side); a decode engine whose pull fails recomputes the prompt itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from specfleet.engine.kv_transfer.base import KVTransferParams
from specfleet.engine.kv_transfer.wire import release_hold

GENERATE_PATHS = ("completions", "chat/completions")


@dataclass
class Roles:
    """Which ready engines compute prefills; the proxy's Backends are the decode engines."""

    prefill_urls: list[str]
    ready: set[str] = field(default_factory=set)
    outstanding: dict[str, int] = field(default_factory=dict)

    def candidates(self) -> list[str]:
        live = [u for u in self.prefill_urls if u in self.ready]
        return sorted(live, key=lambda u: self.outstanding.get(u, 0))


def covered(body: dict[str, Any]) -> bool:
    """Requests the two-engine path serves; the rest run aggregated on a decode engine."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16 if "prompt" in body else None))
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return (body.get("n", 1) == 1 and (max_tokens is None or max_tokens >= 2) and not many
            and not body.get("kv_transfer_params") and not body.get("echo") and body.get("prompt_logprobs") is None)


async def prefill(client: httpx.AsyncClient, roles: Roles, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> tuple[dict[str, Any] | None, httpx.Response | None]:
    """Run the prefill: (kv_transfer_params, None) to continue on a decode engine, (None, response) to
    return the prefill engine's refusal (a 4xx the client must see), (None, None) to run aggregated."""
    one = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    one.pop("stream_options", None)
    one.pop("max_completion_tokens", None)
    for url in roles.candidates():
        roles.outstanding[url] = roles.outstanding.get(url, 0) + 1
        try:
            response = await client.post(f"{url}/v1/{path}", json=one, headers=headers)
        except httpx.HTTPError:
            continue  # that prefill engine is gone: the next one
        finally:
            roles.outstanding[url] -= 1
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            return None, response
        if response.status_code != 200:
            continue
        params = response.json().get("kv_transfer_params")
        return params, None
    return None, None


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    return json.dumps({**body, "kv_transfer_params": params}).encode()


def release(params: dict[str, Any]) -> None:
    """The client left before the decode engine took the KV: the prefill engine drops its hold now."""
    release_hold(KVTransferParams.from_dict(params))
