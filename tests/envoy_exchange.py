"""Envoy's side of one ext_proc exchange with an endpoint picker, from the published protos (envoy-data-plane):
the request's headers, then its whole body (BUFFERED body modes), and the two answers read; what the picker
set on the request comes back by header name. The fleet tests that ask the router's picker for a prefill and
decode pair share it (tests/fleet/test_epp_disaggregation.py, test_up_pd_key.py); tests/router/
test_endpoint_picker.py plays the streamed modes and the refusals with an Envoy of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as Mode
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from specfleet.router.endpoint_picker import EXT_PROC_SERVICE

ANSWER_TIMEOUT_S = 10  # each answer of a picker on loopback; a picker that never answers fails the test


async def buffered_exchange(port: int, path: str, body: bytes) -> dict[str, str]:
    """One POST of `body` to `path` through the picker on 127.0.0.1:`port`: the request headers it set (the
    pick, the prefill engine, the signature), by name."""
    mode = ProtocolConfiguration(request_body_mode=Mode.BUFFERED, response_body_mode=Mode.BUFFERED)
    head = {":path": path, ":method": "POST", "content-type": "application/json"}

    async def messages() -> AsyncIterator[ProcessingRequest]:
        values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in head.items()]
        yield ProcessingRequest(
            request_headers=HttpHeaders(headers=HeaderMap(headers=values)), protocol_config=mode
        )
        yield ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            f"/{EXT_PROC_SERVICE}/Process",
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )(messages())
        answers = [await asyncio.wait_for(call.read(), ANSWER_TIMEOUT_S) for _ in range(2)]
        call.cancel()
    mutation = answers[1].request_body.response.header_mutation
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
