"""One engine server's metrics with LoRA, without the engine: the server's own registry (ServerMetrics, with
LoraMetrics hooked to its finished requests as create_app wires it with --enable-lora), fed what the engine
core would report (`lora_state`) and the requests it finishes, and served over a real socket for a
Prometheus to scrape. What it does not model: the engine's scheduling (the test says what ran)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from specfleet.engine.server.lora_metrics import LoraMetrics
from specfleet.engine.server.metrics import CONTENT_TYPE, ServerMetrics


class Pod:
    def __init__(self, max_loras: int = 2) -> None:
        self.metrics = ServerMetrics("base", CollectorRegistry())
        self.lora = LoraMetrics(self.metrics.registry, "base", max_loras=max_loras)
        self.metrics.on_lora_request = self.lora.observe_request
        self.state: dict[str, Any] = {
            "adapters": {},
            "running": [],
            "waiting": [],
            "loads": 0,
            "evictions": 0,
            "load_s": [],
            "drafts": {},
        }
        self.lock = threading.Lock()  # a scrape sees whole updates (one `tick` of a test's load at a time)
        self._server: ThreadingHTTPServer | None = None

    def finish(self, lora: str | None, ttft: float, tpot: float, tokens: int, times: int = 1) -> None:
        """`times` finished requests on `lora` (None: the base model) with these latencies and output tokens."""
        for _ in range(times):
            self.metrics.observe_request(
                finish_reason="stop",
                ttft=ttft,
                e2e=ttft + tpot * tokens,
                queue_time=0.0,
                itls=[],
                tpot=tpot,
                lora_name=lora,
                output_tokens=tokens,
            )

    def serve(self, adapters: list[str]) -> None:
        self.state["adapters"] = {a: f"/adapters/{a}" for a in adapters}

    def draft(self, lora: str, drafted: int, accepted: int) -> None:
        """The engine core's per-adapter draft totals grow by these."""
        totals = self.state["drafts"].setdefault(lora, [0, 0])
        totals[0] += drafted
        totals[1] += accepted

    def scrape(self) -> str:
        """What GET /metrics answers: the core's state read in (LoraMetrics.update), then the registry."""
        with self.lock:
            self.lora.update({**self.state, "drafts": {k: list(v) for k, v in self.state["drafts"].items()}})
            return self.metrics.render().decode()

    def start(self) -> str:
        """Serve /metrics on a loopback port; returns the base URL."""
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pod.scrape().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
