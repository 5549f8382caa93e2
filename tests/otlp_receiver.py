"""A small real OTLP/HTTP trace receiver for the tests: an HTTP server on a free loopback port that decodes
each `POST /v1/traces` body with opentelemetry-proto's `ExportTraceServiceRequest` (gzip or not), as a
collector does, and keeps the spans. Strict at its edge: another path is a 404, a body that is not the
protobuf a 400 (and counted in `errors`), so an exporter speaking anything else fails the test."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class Span:
    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    receiver.errors.append(f"POST {self.path}")
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    request = ExportTraceServiceRequest.FromString(body)
                except (DecodeError, OSError) as error:
                    receiver.errors.append(f"undecodable body: {error}")
                    self.send_response(400)
                    self.end_headers()
                    return
                receiver.take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(
                        Span(
                            str(resource.get("service.name", "")),
                            s.name,
                            KINDS.get(s.kind, str(s.kind)),
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def wait_for(self, found: Callable[[list[Span]], bool], timeout_s: float = 60.0) -> list[Span]:
        """The spans received so far, once `found(spans)` holds (AssertionError past the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"spans not received in {timeout_s}s; got {names}; errors {self.errors}")
            time.sleep(0.1)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


def children(spans: list[Span], parent: Span) -> list[Span]:
    """The spans whose parent is `parent`, by start time."""
    return sorted((s for s in spans if s.parent_id == parent.span_id), key=lambda s: s.start_ns)


def one(spans: list[Span], **match: Any) -> Span:
    """The one span whose fields equal `match` (AssertionError naming what was found otherwise)."""
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, f"{len(found)} spans match {match}: {[(s.service, s.name) for s in spans]}"
    return found[0]
