"""The endpoint picker's gRPC server (router/endpoint_picker.py has the protocol): Envoy's ext_proc service
and the gRPC health service the Gateway API Inference Extension's EPP protocol asks for (`liveness`,
`readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`), on grpcio's asyncio server.

envoy-data-plane's messages are betterproto2 classes with protobuf's `FromString`/`SerializeToString`, so
grpcio's generic handlers carry them as they are: nothing is generated at run time. The health service's two
one-field messages are written by hand rather than adding grpcio-health-checking and protobuf's runtime.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingRequest

from .endpoint_picker import EXT_PROC_SERVICE, Answer, Exchange

if TYPE_CHECKING:
    from .proxy import Router

logger = logging.getLogger("specfleet.router.epp")

HEALTH_SERVICE = "grpc.health.v1.Health"
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1.HealthCheckResponse.ServingStatus


class EndpointPicker:
    """The gRPC side: the ext_proc stream and the health service, over one Router's endpoints and policy."""

    def __init__(self, router: Router, prefill_key: bytes | None = None) -> None:
        self.router = router
        self.prefill_key = prefill_key  # --remote-prefill-key-file: the prefill engine it names is signed

    async def process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Answer]:
        exchange = Exchange(self.router, self.prefill_key)
        try:
            async for message in requests:
                for response in exchange.handle(message):
                    yield response
                    if isinstance(response, bytes):
                        continue
                    if (refused := response.immediate_response) is not None:
                        logger.info(
                            "event=epp_refused status=%s path=%s details=%s",
                            refused.status.code if refused.status is not None else "",
                            exchange.headers.get(":path", ""),
                            refused.details,
                        )
                        return  # Envoy answers the client and sends nothing more on this stream
        finally:
            exchange.close()  # the gateway closed the stream (a client that left included)

    def ready(self) -> bool:
        return self.router.synced and not self.router.stopping

    async def check(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """grpc.health.v1.Health/Check, its two one-field messages written by hand (no generated code)."""
        service = health_service_name(request)
        if service in ("", "liveness"):
            return bytes([0x08, SERVING])
        if service in ("readiness", EXT_PROC_SERVICE):
            return bytes([0x08, SERVING if self.ready() else NOT_SERVING])
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        raise AssertionError("unreachable: abort raises")

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        process = grpc.stream_stream_rpc_method_handler(
            self.process,
            request_deserializer=ProcessingRequest.FromString,
            response_serializer=serialize,
        )
        check = grpc.unary_unary_rpc_method_handler(self.check)  # bytes in, bytes out
        return [
            grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process}),
            grpc.method_handlers_generic_handler(HEALTH_SERVICE, {"Check": check}),
        ]


def serialize(answer: Answer) -> bytes:
    """A message's protobuf bytes; an answer already encoded (ext_proc_wire.py) goes as it is."""
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


def health_service_name(request: bytes) -> str:
    """HealthCheckRequest's `string service = 1` (tag 0x0a, a varint length, the bytes); '' when absent."""
    if not request or request[0] != 0x0A:
        return ""
    length, shift, i = 0, 0, 1
    while i < len(request):
        byte = request[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    return request[i : i + length].decode(errors="replace")


async def serve_endpoint_picker(
    router: Router, host: str, port: int, prefill_key: bytes | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start the EPP's gRPC server on the running loop; the server and the port it bound (for port 0). With
    `prefill_key` the prefill engine it names is signed (engine/kv_transfer/prefill_signature.py)."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(EndpointPicker(router, prefill_key).handlers())
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    await server.start()
    logger.info("event=listening epp=true host=%s port=%d", host, bound)
    return server, bound
