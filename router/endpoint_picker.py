"""The router as a Gateway API InferencePool's endpoint picker (EPP): an Envoy ext_proc gRPC server.

The gateway (Envoy, or any gateway speaking ext_proc) streams each request's headers and body to the EPP;
the EPP picks an engine as the router's proxy does (adapter affinity, then the policy: prefix, load,
session; router/policies.py) over the endpoints discovery found, and answers with the pick as the Gateway
API Inference Extension's endpoint picker protocol specifies (its 004 proposal, v1.0.0): the header
`x-gateway-destination-endpoint` and the same value under the dynamic metadata namespace `envoy.lb`,
`ip:port` of the primary followed by ordered fallbacks. The
gateway then sends the request itself; the EPP sees its response pass by (response headers and body phases),
which ends the request's count on the engine that served it (`x-gateway-destination-endpoint-served`).

Body modes (the filter's `processing_mode`, which Envoy names in the first message's `protocol_config`):
- FULL_DUPLEX_STREAMED (the inference extension's, and the default when the gateway names none): the headers'
  answer is held until the body's last chunk; then come the headers' answer with the pick and the body,
  unchanged, as streamed chunks (at most CHUNK_BYTES each); response chunks are passed back as they come.
- BUFFERED: the headers pass on at once; the body's answer carries the pick (Envoy still holds the headers).
- STREAMED with `send_body_without_waiting_for_header_response`: as duplex, each held chunk answered after
  the headers. STREAMED without it: the headers go upstream before any body is seen, so the pick is made from
  the headers alone (no prompt: the policy's short-prompt choice, the least loaded engine).

Failures answer with an ImmediateResponse the gateway returns to the client: 503 naming why when no engine
may take the request (none ready, or none of the gateway's subset hint), 400 for a body that is not a JSON
object, 413 for a body over MAX_BODY_BYTES. The gRPC health service answers `liveness`, `readiness` and the
ext_proc service's name (ready once discovery has reported and until SIGTERM): router/ext_proc_server.py.

Prefill/decode disaggregation: the gateway sends a request to one endpoint, so the two hops the router's
proxy makes itself (router/disaggregation.py) move to the decode engine, as llm-d does. When the pool has
prefill engines (`Endpoint.role == "prefill"`) and the two-engine path covers the request, the EPP picks the
decode engine (the destination, with its fallbacks) as above and a prefill engine (the fewest requests in
flight, as the router's proxy picks), and names the prefill engine `ip:port` in the request header
`x-prefiller-host-port`, llm-d's name, so that llm-d's routing sidecar beside a decode engine, or specfleet's
engine started with `--accept-remote-prefill` (engine/server/remote_prefill.py), runs the prefill leg there
and then decodes locally. Without a prefill engine (or for a request the path does not cover) the header is
removed, so that no client names the host a decode engine sends its prompt to through the gateway. With
a shared key (`--remote-prefill-key-file`, the decode engines' too) the picker also signs the pair it sends
on, the prefill engine's `ip:port` and the request body, in `x-specfleet-prefill-signature`
(engine/kv_transfer/prefill_signature.py); a decode engine given the key honours only a signed header, so a
client that reaches it past the gateway cannot name a host either. A client's signature header is always
overwritten or removed.

Not done here: the scale-from-zero queue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envoy_data_plane.envoy.config.core.v3 import (
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    Metadata,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Struct, Value
from specfleet.engine.kv_transfer import prefill_signature

from . import disaggregation
from . import ext_proc_wire as wire
from .policies import RouteRequest
from .proxy import MAX_BODY_BYTES

if TYPE_CHECKING:
    from .proxy import Router

logger = logging.getLogger("specfleet.router.epp")

# The protocol's names (the inference extension's pkg/lwepp/metadata/consts.go).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_KEY = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DEFAULT_PORT = 9002  # the extension's default EPP port (InferencePool endpointPickerRef's)
# Streamed body chunks the EPP sends back: some Envoys cap a streamed chunk at 64 KiB, so the extension's own
# EPP cuts at 62 KiB (pkg/common/envoy/chunking.go); the margin covers the message's framing.
CHUNK_BYTES = 62 * 1024
DUPLEX = ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
# llm-d's header naming the prefill engine a decode engine runs the prefill leg on (prefill_leg.py)
PREFILLER_HEADER = disaggregation.PREFILLER_HEADER
SIGNATURE_HEADER = prefill_signature.HEADER  # the picker's signature over that header and the body


def address(url: str) -> str:
    """`ip:port` (`[v6]:port`) of an engine URL, as the protocol writes endpoints."""
    return url.split("://", 1)[-1].rstrip("/")


def _overwrite(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()),
        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _header_response(
    endpoints: str, prefiller: str | None, signature: str | None = None
) -> tuple[CommonResponse, Struct]:
    """The pick as the protocol wants it twice, identical: a request header and dynamic metadata. With a
    prefill engine, `x-prefiller-host-port` names it, replacing any the client sent; without one, a client's
    is removed: only the picker names the host a decode engine sends the prompt to. The same for the
    signature over it (with a key): set over a client's, or removed."""
    set_headers = [HeaderValueOption(header=HeaderValue(key=DESTINATION_KEY, raw_value=endpoints.encode()))]
    removed = [PREFILLER_HEADER, SIGNATURE_HEADER]
    if prefiller is not None:
        set_headers.append(_overwrite(PREFILLER_HEADER, prefiller))
        removed.remove(PREFILLER_HEADER)
    if prefiller is not None and signature is not None:
        set_headers.append(_overwrite(SIGNATURE_HEADER, signature))
        removed.remove(SIGNATURE_HEADER)
    mutation = HeaderMutation(set_headers=set_headers, remove_headers=removed)
    common = CommonResponse(header_mutation=mutation, clear_route_cache=True)
    lb = Struct(fields={DESTINATION_KEY: Value(string_value=endpoints)})
    return common, Struct(fields={DESTINATION_NAMESPACE: Value(struct_value=lb)})


def immediate(status: int, message: str) -> ProcessingResponse:
    """An answer the gateway returns to the client without sending the request on (OpenAI's error body)."""
    kind = {400: "invalid_request_error", 413: "invalid_request_error"}.get(status, "service_unavailable")
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    content_type = HeaderValueOption(header=HeaderValue(key="content-type", raw_value=b"application/json"))
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=StatusCode(status)),
            headers=HeaderMutation(set_headers=[content_type]),
            body=json.dumps(body).encode(),
            details=f"specfleet_epp_{status}",
        )
    )


def _metadata_value(metadata: Metadata | None, namespace: str, key: str) -> Any:
    if metadata is None or namespace not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[namespace].fields.get(key)
    return None if value is None else value.to_dict()


# What the picker sends back: a message, or one already encoded (ext_proc_wire.py).
Answer = ProcessingResponse | bytes
# How the request's body reaches the EPP, from the filter's request body mode.
DUPLEX_MODE, BUFFERED_MODE, HELD_MODE, HEADERS_MODE = "duplex", "buffered", "streamed-held", "headers-only"


def body_mode(config: Any) -> str:
    """duplex: the headers' answer waits for the body, which goes back as streamed chunks; buffered: the body's
    answer carries the pick; streamed-held: STREAMED whose headers wait for the body (Envoy's
    send_body_without_waiting_for_header_response); headers-only: STREAMED without it, or no body sent."""
    mode = config.request_body_mode
    if mode == DUPLEX:
        return DUPLEX_MODE
    if mode in (ProcessingModeBodySendMode.BUFFERED, ProcessingModeBodySendMode.BUFFERED_PARTIAL):
        return BUFFERED_MODE
    if mode == ProcessingModeBodySendMode.STREAMED and config.send_body_without_waiting_for_header_response:
        return HELD_MODE
    return HEADERS_MODE


def _continue_body() -> Answer:
    return wire.CONTINUE_REQUEST_BODY


def _streamed_body(body: bytes) -> list[Answer]:
    """The request body back to the gateway unchanged, in chunks of at most CHUNK_BYTES (duplex mode)."""
    parts = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [wire.streamed_body(wire.REQUEST_BODY, part, i == len(parts) - 1) for i, part in enumerate(parts)]


@dataclass
class Exchange:
    """One ext_proc stream: one HTTP request and its response as they pass through the gateway."""

    router: Router
    prefill_key: bytes | None = None  # --remote-prefill-key-file: sign the prefill engine named (module doc)
    mode: str = DUPLEX_MODE  # the request body's (the inference extension's when the gateway names none)
    duplex_response: bool = True  # response chunks go back as streamed chunks
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    held_chunks: int = 0  # body chunks not answered yet (streamed-held)
    subset: list[str] | None = None
    picked: str | None = None  # the engine URL counted as serving this request
    prefiller: str | None = None  # the prefill engine's URL named to the decode engine, counted there too
    decided: bool = False  # the pick (or a refusal) went out: a re-sent last chunk is not a new request

    def handle(self, message: ProcessingRequest) -> list[Answer]:
        if message.protocol_config is not None:
            self.mode = body_mode(message.protocol_config)
            self.duplex_response = message.protocol_config.response_body_mode == DUPLEX
        if message.request_headers is not None:
            return self._request_headers(message)
        if message.request_body is not None:
            return self._request_body(message.request_body.body, message.request_body.end_of_stream)
        if message.request_trailers is not None:
            return [wire.CONTINUE_REQUEST_TRAILERS]
        if message.response_headers is not None:
            self._served(message.metadata_context)
            if message.response_headers.end_of_stream:
                self.close()
            return [wire.CONTINUE_RESPONSE_HEADERS]
        if message.response_body is not None:
            return self._response_body(message.response_body.body, message.response_body.end_of_stream)
        if message.response_trailers is not None:
            self.close()
            return [wire.CONTINUE_RESPONSE_TRAILERS]
        return []

    def _request_headers(self, message: ProcessingRequest) -> list[Answer]:
        headers: HttpHeaders = message.request_headers  # type: ignore[assignment]
        for h in headers.headers.headers if headers.headers is not None else []:
            self.headers[h.key.lower()] = h.raw_value.decode(errors="replace") if h.raw_value else h.value
        hint = _metadata_value(message.metadata_context, SUBSET_NAMESPACE, SUBSET_KEY)
        self.subset = [str(a) for a in hint] if isinstance(hint, list) else None
        if headers.end_of_stream or self.mode == HEADERS_MODE:
            return [self._decide(b"", "request_headers")]
        if self.mode == BUFFERED_MODE:  # Envoy holds the headers while it buffers the body
            return [wire.CONTINUE_REQUEST_HEADERS]
        return []  # the answer waits for the body: the pick reads the prompt

    def _request_body(self, chunk: bytes, end: bool) -> list[Answer]:
        if self.decided:  # headers-only, or Envoy sent the last chunk again (envoy #46237): no new pick
            return [] if self.mode == DUPLEX_MODE else [_continue_body()]
        self.body += chunk
        if len(self.body) > MAX_BODY_BYTES:
            self.decided = True
            return [
                immediate(413, f"request body exceeds {MAX_BODY_BYTES} bytes, the endpoint picker's limit")
            ]
        if not end:
            if self.mode == BUFFERED_MODE:
                return [_continue_body()]
            self.held_chunks += 1
            return []
        body = bytes(self.body)
        if self.mode == BUFFERED_MODE:
            return [self._decide(body, "request_body")]
        first = self._decide(body, "request_headers")
        if first.immediate_response is not None:
            return [first]
        if self.mode == HELD_MODE:  # every held chunk still needs its answer, after the headers'
            return [first, *(_continue_body() for _ in range(self.held_chunks + 1))]
        return [first, *_streamed_body(body)]

    def _response_body(self, chunk: bytes, end: bool) -> list[Answer]:
        if end:
            self.close()
        if not self.duplex_response:
            return [wire.CONTINUE_RESPONSE_BODY]
        return [wire.streamed_body(wire.RESPONSE_BODY, chunk, end)]

    def _decide(self, body: bytes, phase: str) -> ProcessingResponse:
        """The pick for this request as the answer to `phase` (request_headers or request_body)."""
        self.decided = True
        if body:
            try:
                parsed = json.loads(body)
            except ValueError as error:
                return immediate(400, f"request body is not valid JSON: {error}")
            if not isinstance(parsed, dict):
                return immediate(400, "request body must be a JSON object")
        endpoints, why = self.pick(body)
        if endpoints is None:
            return immediate(503, why)
        prefiller = None if self.prefiller is None else address(self.prefiller)
        signature = (
            prefill_signature.sign(self.prefill_key, prefiller, body)
            if prefiller is not None and self.prefill_key is not None
            else None
        )
        common, metadata = _header_response(endpoints, prefiller, signature)
        if phase == "request_body":
            return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=metadata)
        return ProcessingResponse(request_headers=HeadersResponse(response=common), dynamic_metadata=metadata)

    def pick(self, body: bytes) -> tuple[str | None, str]:
        """`ip:port[,ip:port...]` (primary, then fallbacks) with the policy's reason, or None and why."""
        router = self.router
        if router.draining:  # as the proxy: after the shutdown delay new requests get 503
            return None, "the endpoint picker is stopping; retry against another endpoint"
        ready = router.endpoints.routable()
        if not ready:
            return None, "no engine of the pool is ready; retry shortly"
        candidates = ready
        if self.subset is not None:
            allowed = set(self.subset)
            candidates = [e for e in ready if address(e.url) in allowed]
            if not candidates:
                return (
                    None,
                    f"none of the gateway's subset hint ({', '.join(self.subset) or 'empty'}) is ready",
                )
        route = (
            router.route_request(body, self.headers)
            if body
            else RouteRequest(
                session=self.headers.get(router.session_header) if router.session_header else None
            )
        )
        # the proxy's own choice (adapter affinity, then the policy, which it tells), outside the subset
        # hint's endpoints counted as already tried
        choice = router.choose(route, {e.url for e in ready} - {e.url for e in candidates})
        if choice is None:
            return None, "no engine of the pool is ready; retry shortly"
        router.endpoints.acquire(choice.url)
        self.picked = choice.url
        self.prefiller = self._prefill_engine(body)
        logger.info(
            "event=epp_pick engine=%s policy=%s reason=%s match_blocks=%d prefill=%s",
            choice.url,
            router.policy.name,
            choice.reason,
            choice.match_blocks,
            self.prefiller or "",
        )
        return ",".join(
            address(u) for u in [choice.url, *fallbacks(candidates, choice.url, router.max_retries)]
        ), (choice.reason)

    def _prefill_engine(self, body: bytes) -> str | None:
        """The prefill engine for a request the two-engine path covers (disaggregation.parse), when the pool
        has one ready: the one with the fewest requests in flight, as the router's own orchestration picks.
        The picker never sees the prefill leg end (the decode engine runs it), so the request counts there
        until its response ends: an over-count of the leg's length that still spreads concurrent requests.
        None: the decode engine runs the request aggregated."""
        path = self.headers.get(":path", "").split("?", 1)[0].removeprefix("/v1/")
        if not body or disaggregation.parse(path, self.headers.get(":method", "POST"), body) is None:
            return None
        engines = self.router.endpoints.prefill_routable()
        if not engines:
            return None
        self.router.endpoints.acquire(engines[0].url)
        return engines[0].url

    def _served(self, metadata: Metadata | None) -> None:
        """The gateway names the engine that answered (a fallback after a retry): count the request there."""
        served = _metadata_value(metadata, DESTINATION_NAMESPACE, SERVED_KEY)
        if not isinstance(served, str) or self.picked is None or address(self.picked) == served:
            return
        for endpoint in self.router.endpoints.all():
            if address(endpoint.url) == served:
                self.router.endpoints.release(self.picked)
                self.router.endpoints.acquire(endpoint.url)
                self.picked = endpoint.url
                return

    def close(self) -> None:
        """The response ended (or the stream did): the request no longer counts on its engine."""
        if self.picked is not None:
            self.router.endpoints.release(self.picked)
            self.picked = None
        if self.prefiller is not None:
            self.router.endpoints.release(self.prefiller)
            self.prefiller = None


def fallbacks(candidates: Sequence[Any], primary: str, count: int) -> list[str]:
    """The engines a gateway retries on, in order: the least loaded others (the proxy's retries, too, go to
    another engine), at most `count` (--max-retries)."""
    others = sorted((e for e in candidates if e.url != primary), key=lambda e: (e.outstanding, e.url))
    return [e.url for e in others[:count]]
