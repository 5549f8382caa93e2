"""The endpoint picker's most frequent ext_proc answers, as protobuf bytes written once or by hand.

envoy-data-plane's messages (betterproto2 on pydantic) cost about a millisecond each to serialise on the
shared host, most of it validation; a streamed response passes through the picker once per chunk (an SSE
token), so those answers, and the constant "go on" ones, skip the message classes. The gRPC server sends
bytes as they are (ext_proc_server.py). `tests/router/test_endpoint_picker.py` checks each against
betterproto2's own encoding.
"""

from __future__ import annotations

from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyResponse,
    CommonResponse,
    HeadersResponse,
    ProcessingResponse,
    TrailersResponse,
)

# ProcessingResponse's oneof fields (envoy/service/ext_proc/v3/external_processor.proto)
REQUEST_BODY, RESPONSE_BODY = 3, 4

CONTINUE_REQUEST_HEADERS = ProcessingResponse(
    request_headers=HeadersResponse(response=CommonResponse())
).SerializeToString()
CONTINUE_RESPONSE_HEADERS = ProcessingResponse(
    response_headers=HeadersResponse(response=CommonResponse())
).SerializeToString()
CONTINUE_REQUEST_BODY = ProcessingResponse(
    request_body=BodyResponse(response=CommonResponse())
).SerializeToString()
CONTINUE_RESPONSE_BODY = ProcessingResponse(
    response_body=BodyResponse(response=CommonResponse())
).SerializeToString()
CONTINUE_REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse()).SerializeToString()
CONTINUE_RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse()).SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _message_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def streamed_body(phase: int, chunk: bytes, end: bool) -> bytes:
    """ProcessingResponse{<phase>: BodyResponse{response: CommonResponse{body_mutation: BodyMutation{
    streamed_response: StreamedBodyResponse{body: chunk, end_of_stream: end}}}}}: a body chunk passed back
    unchanged in FULL_DUPLEX_STREAMED mode (phase REQUEST_BODY or RESPONSE_BODY)."""
    streamed = (_message_field(1, chunk) if chunk else b"") + (b"\x10\x01" if end else b"")
    mutation = _message_field(3, streamed)  # BodyMutation.streamed_response
    common = _message_field(3, mutation)  # CommonResponse.body_mutation
    return _message_field(phase, _message_field(1, common))  # BodyResponse.response
