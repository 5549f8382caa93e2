"""A decode engine runs a request's prefill leg itself, on the prefill engine named in the request's
`x-prefiller-host-port` header: prefill/decode disaggregation behind a gateway, which sends each request to
one endpoint. A gateway's endpoint picker (router/endpoint_picker.py) picks the decode engine as the
destination and a prefill engine, and names the latter in the header (llm-d's name for it: llm-d's routing
sidecar beside a vLLM decode engine reads the same header, so either picker pairs with either decode side).

The leg is the router's (engine/kv_transfer/prefill_leg.py, which router/disaggregation.py uses too): the
request's own JSON body as a one-token request with `kv_transfer_params={"do_remote_decode": true}`, POSTed
to `http://host:port/v1/<path>`; the answer's `kv_transfer_params` then go with the request into this
engine, which pulls the prompt's KV blocks and decodes. Requests the two-engine path does not cover (n > 1,
max_tokens = 1, a batch of prompts, a request that brings its own kv_transfer_params) run aggregated here.

Failures, as the router's orchestration has them: a prefill engine that cannot be reached, does not answer
within the KV transfer timeout, answers 5xx, 408 or 429, or holds nothing (its one token was a stop token):
the request runs aggregated here. Its other 4xx is the client's answer (400 and the like, its message
prefixed with the prefill engine's address). A hold this engine then does not take (its own 429 or 400 at
submission) is released at once instead of at the prefill engine's hold timeout.

Only with `--accept-remote-prefill` (and `--kv-role decode`): a request header must not make the engine send
requests to any host a client names. Without the flag the header is ignored (logged once) and the request
runs aggregated. With it, before anything is sent, the value must be `host:port` and nothing else: the host a
DNS name (dot-separated labels of letters, digits and inner hyphens, 1-63 characters each, 253 in all), a
dotted IPv4 address or a bracketed IPv6 one; the port decimal in 1-65535; no scheme, user, path, query or
space. With CIDRs after the flag (`--accept-remote-prefill 10.0.0.0/8`), the host must moreover be an IP
address inside one of them (a DNS name is refused there: what it resolves to can change between the check
and the connection). A value that fails is a 400 naming the header and the rule. The endpoint picker writes
pod IPs, and removes a client's header when it names no prefill engine; the CIDRs keep a client that reaches
the decode engine directly within the pool's network.

With `--remote-prefill-key-file PATH` (which accepts the header on its own, as the operator renders it) the
header counts only when the request also carries the endpoint picker's signature over it and the body
(`x-specfleet-prefill-signature`, engine/kv_transfer/prefill_signature.py): a request whose signature is
missing, malformed, older than its max age or made with another key runs aggregated here, nothing is sent
to the named host, and `specfleet_remote_prefill_rejected_total{reason}` counts it (the first of each
reason is logged as a warning). With CIDRs as well, a signed host must also be inside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter
from specfleet.engine.kv_transfer import prefill_leg, prefill_signature

from .errors import APIError

logger = logging.getLogger("specfleet.engine.server")

HEADER = prefill_leg.PREFILLER_HEADER
FLAG = "--accept-remote-prefill"
# The router's own connect timeout to an engine (router/proxy.py): a prefill engine that does not accept a
# connection within it is gone, and the request runs aggregated.
CONNECT_TIMEOUT_S = 5.0
# The request headers the leg carries on: the trace (the prefill joins the client's) and the request id.
FORWARDED = ("traceparent", "tracestate", "x-request-id")
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_PORT = re.compile(r"^[0-9]{1,5}$")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values: list[str]) -> tuple[Network, ...]:
    """The flag's CIDRs; a ValueError naming the flag and the value that is not one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError as exc:
            raise ValueError(f"{FLAG} takes CIDRs (e.g. 10.0.0.0/8), got {value!r}: {exc}") from exc
    return tuple(networks)


def _bad(value: str, rule: str) -> APIError:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return APIError(400, f"{HEADER} must be {rule}, got {shown!r}", HEADER, "invalid_value")


@dataclass
class RemotePrefill:
    """`--accept-remote-prefill [CIDR ...]`: the hosts a request's header may name, and the HTTP client the
    legs go out on (one pool of connections to the prefill engines, closed with the app)."""

    networks: tuple[Network, ...] = ()  # empty: any host the rules of the value allow
    timeout_s: float = 60.0  # the engine's kv_transfer_timeout_s: how long a decoder waits for the KV
    key: bytes | None = field(default=None, repr=False)  # --remote-prefill-key-file: signed headers only
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)
    _rejected: Counter | None = field(default=None, init=False, repr=False)
    _model_name: str = field(default="", init=False, repr=False)
    _rejections_logged: set[str] = field(default_factory=set, init=False, repr=False)

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """`specfleet_remote_prefill_rejected_total{model_name, reason}` on the server's registry, each
        reason's series there from the first scrape (with a key only: without one nothing is rejected)."""
        if self.key is None:
            return
        self._model_name = model_name
        self._rejected = Counter(
            "specfleet_remote_prefill_rejected",
            f"Requests whose {HEADER} was ignored (run aggregated) for want of a valid "
            f"{prefill_signature.HEADER}, by reason: " + ", ".join(prefill_signature.REASONS),
            ["model_name", "reason"],
            registry=registry,
        )
        for reason in prefill_signature.REASONS:
            self._rejected.labels(model_name, reason)

    def signed(self, request: Request, value: str, body: bytes) -> bool:
        """Whether the header may be honoured: no key, or the picker's signature over it and the body."""
        if self.key is None:
            return True
        try:
            prefill_signature.verify(self.key, request.headers.get(prefill_signature.HEADER), value, body)
        except prefill_signature.Rejected as rejected:
            if self._rejected is not None:
                self._rejected.labels(self._model_name, rejected.reason).inc()
            first = rejected.reason not in self._rejections_logged
            self._rejections_logged.add(rejected.reason)
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "event=remote_prefill_rejected reason=%s detail=%r header=%s outcome=aggregated%s",
                rejected.reason,
                str(rejected),
                HEADER,
                " (the first of this reason; the rest at debug level)" if first else "",
            )
            return False
        return True

    def target(self, value: str) -> str:
        """`host:port` of the prefill engine, checked as the module says; APIError 400 otherwise."""
        rule = "host:port (a DNS name, an IPv4 address or a bracketed IPv6 address, and a port in 1-65535)"
        if len(value) > 261 or not value.isascii():  # 253 for a name, ':' and 5 digits, brackets
            raise _bad(value, rule)
        host, sep, port = value.rpartition(":")
        if not sep or not _PORT.match(port) or not 1 <= int(port) <= 65535:
            raise _bad(value, rule)
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
        if host.startswith("[") and host.endswith("]"):
            try:
                address = ipaddress.IPv6Address(host[1:-1])
            except ValueError:
                raise _bad(value, rule) from None
        else:
            with contextlib.suppress(ValueError):
                address = ipaddress.IPv4Address(host)
            if address is None and not (
                len(host) <= 253 and all(_LABEL.match(label) for label in host.split("."))
            ):
                raise _bad(value, rule)
        if self.networks:
            allowed = ", ".join(map(str, self.networks))
            if address is None or not any(address in network for network in self.networks):
                raise _bad(value, f"an IP address:port inside {FLAG}'s networks ({allowed})")
        return value

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S),
                trust_env=False,  # the pod's HTTP(S)_PROXY is for the outside, not engine to engine
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


_ignored_logged: list[bool] = []  # the header arrived at an engine without the flag: said once


async def prefill(accept: RemotePrefill | None, request: Request, path: str) -> dict[str, Any] | None:
    """The kv_transfer_params of the prompt's KV that the named prefill engine holds for this engine, or
    None to run the request aggregated (no header, not accepted, not covered, the leg failed). Raises
    APIError for a bad header value and for the prefill engine's refusal. `path` is below /v1/."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    if accept is None:
        if not _ignored_logged:
            _ignored_logged.append(True)
            logger.warning(
                "event=remote_prefill_ignored header=%s the request runs aggregated: this engine was not "
                "started with %s (logged once)",
                HEADER,
                FLAG,
            )
        return None
    raw = await request.body()
    if not accept.signed(request, value.strip(), raw):
        return None
    target = accept.target(value.strip())
    try:
        body = json.loads(raw)
    except ValueError:
        return None  # parsed once already by the route: not reached
    if not isinstance(body, dict) or not prefill_leg.covered(body):
        return None
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
    try:
        response = await accept.client().post(
            f"http://{target}/v1/{path}", json=prefill_leg.prefill_body(body), headers=headers
        )
    except (httpx.HTTPError, OSError) as error:
        logger.info(
            "event=prefill_failed engine=%s error=%r outcome=aggregated",
            target,
            f"{type(error).__name__}: {error}",
        )
        return None
    try:
        params = prefill_leg.held_params(
            response.status_code, response.content, response.headers.get("content-type")
        )
    except prefill_leg.Refusal as refusal:
        raise _refused(target, refusal) from None
    if params is None:
        logger.info(
            "event=prefill_unheld engine=%s status=%d outcome=aggregated", target, response.status_code
        )
    return params


def _refused(target: str, refusal: prefill_leg.Refusal) -> APIError:
    """The prefill engine's 4xx as this engine's answer: its status, message, field and code. An answer
    that is not an OpenAI error body is not echoed (the host is a client's choice): its status only."""
    message, param, code = f"HTTP {refusal.status}", None, None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = json.loads(refusal.content)["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    return APIError(
        refusal.status, f"the prefill engine {target} refused the request: {message}", param, code
    )


@contextlib.contextmanager
def released_unless_taken(held: dict[str, Any] | None) -> Iterator[None]:
    """Around the submission of a request that brings a hold it made: a failure there (the engine's own 400
    or 429) releases the hold now, in a thread (a ZeroMQ round trip), rather than at its timeout."""
    try:
        yield
    except BaseException:
        if held is not None:
            asyncio.get_running_loop().run_in_executor(None, prefill_leg.release, held)
        raise
