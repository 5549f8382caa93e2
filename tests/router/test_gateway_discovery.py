"""The gateway in the cluster: InferenceServices listed from the API double (tests/fake_kube.py, which admits
them through the generated CRD) by namespace and label selector, each one's engines from its EndpointSlices
(written here as the EndpointSlice controller would, pointing at two real engines on loopback), requests
through the gateway with the official openai client. A weight change reaches the split within one
discovery interval; a deleted service leaves the table.

What the double does not model: the operator (no Deployment or Service is rendered; the slices are
written by the test) and watch bookmarks."""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube
from helpers import free_port
from specfleet.operator import resources
from specfleet.operator.inference_service import load_inference_service
from specfleet.router.gateway import SERVICE_HEADER, Gateway, serve_gateway
from specfleet.router.gateway_discovery import (
    ISVC_API,
    ISVC_PLURAL,
    InferenceServiceDiscovery,
    engine_services,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(240)

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "smollm2-cpu.yaml").read_text())
SLICES = "/apis/discovery.k8s.io/v1"
INTERVAL_S = 0.5  # the discovery interval under test: short, so the test is too
ISVCS = f"{ISVC_API}/namespaces/prod/{ISVC_PLURAL}"  # the discovery's list of the watched namespace


def isvc(
    name: str, namespace: str, *, weight: int = 100, aliases: tuple[str, ...] = (), **labels: str
) -> dict:
    doc: dict[str, Any] = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name, "namespace": namespace, "labels": labels}
    doc["spec"]["routing"] = {"weight": weight, "aliases": list(aliases)}
    return doc


def engines_slice(service: str, namespace: str, url: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {
            "name": f"{service}-x1",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
        "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
    }


def test_the_gateways_names_are_the_operators() -> None:
    """The gateway may not import the operator: its API path and engine Service names are checked here."""
    assert ISVC_API == f"/apis/{resources.GROUP}/{resources.VERSION}" and ISVC_PLURAL == resources.PLURAL
    plain, roles = isvc("llm", "ns"), isvc("llm", "ns")
    roles["spec"]["disaggregation"] = {}
    off = isvc("llm", "ns")
    off["spec"]["routing"]["enabled"] = False
    assert engine_services("llm", plain["spec"]) == [(resources.engines_service_name("llm"), None)]
    assert engine_services("llm", roles["spec"]) == [
        (resources.engines_service_name("llm", "decode"), "decode"),
        (resources.engines_service_name("llm", "prefill"), "prefill"),
    ]
    # routing off: the client Service selects the engine pods (operator/render/network.py)
    assert engine_services("llm", off["spec"]) == [(load_inference_service(off).name, None)]


def test_discovers_services_by_namespace_and_selector_and_follows_weight_changes(
    engines: dict[str, str],
) -> None:
    kube = FakeKube().start()
    try:
        for ns in ("prod", "other"):
            kube.add_namespace(ns)
        api = ISVC_API
        kube.put(api, ISVC_PLURAL, "prod", isvc("llm-v1", "prod", weight=300, aliases=("llm",), gateway="on"))
        kube.put(api, ISVC_PLURAL, "prod", isvc("llm-v2", "prod", weight=100, aliases=("llm",), gateway="on"))
        kube.put(api, ISVC_PLURAL, "prod", isvc("private", "prod"))  # not selected
        kube.put(
            api, ISVC_PLURAL, "other", isvc("elsewhere", "other", gateway="on")
        )  # not a watched namespace
        kube.put(
            SLICES, "endpointslices", "prod", engines_slice("llm-v1-engines", "prod", engines["engine-a"])
        )
        kube.put(
            SLICES, "endpointslices", "prod", engines_slice("llm-v2-engines", "prod", engines["engine-b"])
        )

        async def test() -> None:
            gateway = Gateway()
            discovery = InferenceServiceDiscovery(
                gateway, kube.url, ["prod"], "gateway=on", interval_s=INTERVAL_S, retry_s=0.1
            )
            task = asyncio.create_task(discovery.run())
            port = free_port()
            runner = await serve_gateway(gateway, "127.0.0.1", port)
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
            )

            async def until(what: str, check: Any, timeout: float = 10.0) -> float:
                start = time.monotonic()
                while not check():
                    assert time.monotonic() - start < timeout, f"{what} not after {timeout}s"
                    await asyncio.sleep(0.02)
                return time.monotonic() - start

            async def service_of(**extra: Any) -> str:
                raw = await client.completions.with_raw_response.create(
                    model="llm", prompt="canary", max_tokens=1, **extra
                )
                return raw.headers[SERVICE_HEADER]

            try:
                await until(
                    "both services with a ready engine",
                    lambda: (
                        len(gateway.services) == 2
                        and all(s.router.endpoints.routable() for s in gateway.services.values())
                    ),
                )
                settled = time.monotonic()  # both services' routers made: from here on a list is only a list
                assert [m.id for m in (await client.models.list()).data] == ["llm", "llm-v1", "llm-v2"]
                split = Counter([await service_of() for _ in range(8)])
                assert split == {"prod/llm-v1": 6, "prod/llm-v2": 2}

                # the canary's weight goes up to v1's: within one interval the split is even
                await asyncio.to_thread(
                    kube.put,
                    api,
                    ISVC_PLURAL,
                    "prod",
                    isvc("llm-v2", "prod", weight=300, aliases=("llm",), gateway="on"),
                )
                took = await until("the new weight", lambda: gateway.services["prod/llm-v2"].weight == 300)
                # within one interval (the list's cadence is checked below); 2 s for a loaded host's list
                # and late wake-up on top, where 0.5 s was one slow round trip through the API double, which
                # shares this process with the gateway and the test
                assert took <= INTERVAL_S + 2.0, (
                    f"the weight change took {took:.2f}s, the interval is {INTERVAL_S}s"
                )
                assert Counter([await service_of() for _ in range(4)]) == {"prod/llm-v1": 2, "prod/llm-v2": 2}

                # the canary is deleted: it leaves the table and the names it alone served
                await asyncio.to_thread(kube.remove, api, ISVC_PLURAL, "prod", "llm-v2")
                await until("the deletion", lambda: "prod/llm-v2" not in gateway.services, INTERVAL_S + 2)
                assert [m.id for m in (await client.models.list()).data] == ["llm", "llm-v1"]
                assert {await service_of() for _ in range(3)} == {"prod/llm-v1"}
                with pytest.raises(openai.NotFoundError):
                    await client.completions.create(model="llm-v2", prompt="x", max_tokens=1)

                # the discovery lists every INTERVAL_S: a list and the loop's wake-up on top, 2 s at most on
                # a loaded host, where the 5 s default interval would be twice that
                def listed() -> list[float]:
                    return [
                        r.at
                        for r in kube.requests
                        if r.path == ISVCS and "watch" not in r.query and r.at >= settled
                    ]

                await until("three lists since the services settled", lambda: len(listed()) >= 3)
                gaps = [b - a for a, b in zip(listed(), listed()[1:])]
                assert INTERVAL_S <= min(gaps) and max(gaps) <= INTERVAL_S + 2.0, gaps
            finally:
                task.cancel()
                await client.close()
                await runner.cleanup()

        asyncio.run(asyncio.wait_for(test(), timeout=120))
    finally:
        kube.stop()


def test_gateway_flags_are_checked_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from specfleet.router.cli import main

    assert main(["--gateway", "--all-namespaces", "--gateway-namespace", "prod"]) == 2
    assert "--all-namespaces and --gateway-namespace exclude each other" in capsys.readouterr().err
    assert main(["--gateway", "--discovery-interval", "0"]) == 2
    assert "--discovery-interval=0.0 must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--gateway", "--service", "llm-engines"])  # one source of engines at a time


def test_a_removed_services_router_closes_when_the_gateway_stops_even_with_a_request_held() -> None:
    """A service leaves the table while its router holds a request (no engine yet, within its queue
    timeout): its router waits for that request before closing, and the gateway stopping ends that wait and
    closes it, instead of leaving it open behind."""
    kube = FakeKube().start()
    try:
        kube.add_namespace("prod")
        doc = isvc("llm", "prod")
        doc["spec"]["routing"]["queueTimeoutSeconds"] = 60  # the request waits for an engine, none comes
        kube.put(ISVC_API, ISVC_PLURAL, "prod", doc)

        async def test() -> bool:
            gateway = Gateway()
            discovery = InferenceServiceDiscovery(gateway, kube.url, ["prod"], interval_s=0.1, retry_s=0.1)
            task = asyncio.create_task(discovery.run())
            port = free_port()
            runner = await serve_gateway(gateway, "127.0.0.1", port)
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
            )
            held = None
            try:
                while "prod/llm" not in gateway.services:
                    await asyncio.sleep(0.02)
                router = gateway.services["prod/llm"].router
                session = router.client()  # its connections to the engines
                held = asyncio.create_task(client.completions.create(model="llm", prompt="x", max_tokens=1))
                while router.in_flight == 0:
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(kube.remove, ISVC_API, ISVC_PLURAL, "prod", "llm")
                while "prod/llm" in gateway.services:
                    await asyncio.sleep(0.02)
                assert router.in_flight == 1 and not session.closed  # it waits for the held request
                task.cancel()  # the gateway stops
                await asyncio.gather(task, return_exceptions=True)
                return session.closed
            finally:
                task.cancel()
                if held is not None:
                    held.cancel()
                    await asyncio.gather(held, return_exceptions=True)
                await client.close()
                await runner.cleanup()

        assert asyncio.run(asyncio.wait_for(test(), timeout=60))
    finally:
        kube.stop()
