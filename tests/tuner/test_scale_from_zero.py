"""Scale from zero in the cluster: `minReplicas: 0`, no engine pod, a request held by a real router
process; the operator's tuner (the real kopf timer, the Kubernetes API faked at its edge by
tests/fake_kube.py) reads the router's queue gauge, writes `status.autoscaling.replicas: 1` with a
`Scaled` Event, and, once the first engine is reachable, reports the router-measured cold start.

What the double does not model: no Deployment controller or kubelet turns the replica count into a pod.
The test plays that part: after the tuner scales to one, it makes the engine reachable at the address the
router probes (a TCP relay to a real engine process that was loaded beforehand), as a pod turning Ready
does. The cold start measured is therefore the relay's delay, not a model load.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_kube import FakeKube  # tests/ is on sys.path (rootdir conftest)
from helpers import free_port, stop_process, wait_for, wait_http_ready
from specfleet.engine.python_child import python_command

from .cluster import ISVC, example_service, operator_args, put_pod, put_service

pytestmark = pytest.mark.slow

NS = "team-z"


class Relay:
    """The pod turning reachable: accepts on `port` only once started, and pipes bytes to `target`."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port, self.target = port, target
        self._server: socket.socket | None = None

    def start(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port))
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()


def _service(fake_kube: FakeKube, router_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from specfleet.operator.resources import router_selector_labels
    from specfleet.tuner import handlers as tuner_handlers

    monkeypatch.setattr(
        tuner_handlers, "ROUTER_PORT", router_port
    )  # router pods listen on 8000; this one elsewhere
    doc = example_service(
        "smollm2",
        replicas=0,
        speculative={"method": "ngram", "numSpeculativeTokens": 0},
        autotune={"enabled": True, "intervalSeconds": 5},
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2},
        routing={"queueTimeoutSeconds": 120},
    )
    put_service(fake_kube, NS, doc)
    # the router's pod, ready; no engine pod (zero replicas)
    put_pod(fake_kube, NS, "smollm2-router-0", router_selector_labels("smollm2"), "127.0.0.1", ready=True)


def test_a_queued_request_scales_from_zero_and_the_cold_start_is_reported(
    engine_url: str, fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kopf.testing import KopfRunner

    router_port, pod_port = free_port(), free_port()
    _service(fake_kube, router_port, monkeypatch)
    host, port = engine_url.removeprefix("http://").split(":")
    relay = Relay(pod_port, (host, int(port)))
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        router = subprocess.Popen(
            python_command(
                "-m",
                "specfleet.router",
                "--port",
                str(router_port),
                "--host",
                "127.0.0.1",
                "--endpoint",
                f"http://127.0.0.1:{pod_port}",
                "--policy",
                "least-loaded",
                "--queue-timeout",
                "120",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    answers: list[httpx.Response] = []

    def client() -> None:  # a user's request, sent while no engine exists
        body = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answers.append(httpx.post(f"http://127.0.0.1:{router_port}/v1/completions", json=body, timeout=180))

    def autoscaling() -> dict[str, Any]:
        return ((fake_kube.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("autoscaling") or {}

    try:
        wait_http_ready(f"http://127.0.0.1:{router_port}/health", router, log)
        sender = threading.Thread(target=client, daemon=True)
        with KopfRunner(operator_args(NS), timeout=150) as runner:
            sender.start()
            scaled = wait_for(
                "status.autoscaling.replicas = 1",
                lambda: autoscaling().get("replicas") == 1 and autoscaling(),
                timeout=60,
            )
            relay.start()  # the new pod is up: the router's probe finds it ready and forwards the held request
            sender.join(timeout=120)
            cold = wait_for(
                "the cold start in status", lambda: autoscaling().get("coldStartSeconds"), timeout=60
            )
        assert runner.exception is None, runner.output
    finally:
        relay.stop()
        stop_process(router)

    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert "scale from zero" in scaled["reason"] and "wait in the router" in scaled["reason"], scaled
    # the wait of the held request: at least the time until the tuner scaled, at most the whole test
    assert 0.0 < cold < 150.0
    events = [r.body for r in fake_kube.requests if r.method == "POST" and r.path.endswith("/events")]
    assert any(
        isinstance(e, dict) and e.get("reason") == "Scaled" and "0 -> 1" in e.get("message", "")
        for e in events
    ), events
    # the spec stays the user's: the count lives in status.autoscaling (GitOps sees no drift)
    assert (fake_kube.get(*ISVC, NS, "smollm2") or {})["spec"]["replicas"] == 0
