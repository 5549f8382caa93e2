"""Endpoint discovery from a watched EndpointSlice in the API double (tests/fake_kube.py): the router's
set follows readiness, termination and deletion, and only this Service's slices count.

What the double does not model: the EndpointSlice controller itself (the test writes the slices as it
would), watch bookmarks and 410 Gone (the watch's relist path is the same as its start)."""

from __future__ import annotations

import asyncio

from fake_kube import FakeKube
from specfleet.router.discovery import EndpointSliceWatch, slice_states
from specfleet.router.endpoints import EndpointSet

PREFIX = "/apis/discovery.k8s.io/v1"


def endpoint_slice(name: str, service: str, endpoints: list[tuple[str, dict[str, bool]]]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": cond} for ip, cond in endpoints],
    }


def test_slice_states_reads_conditions():
    states = slice_states(
        endpoint_slice(
            "s",
            "svc",
            [
                ("10.0.0.1", {"ready": True}),
                ("10.0.0.2", {"ready": False}),
                ("10.0.0.3", {}),
                ("10.0.0.4", {"ready": False, "serving": True, "terminating": True}),
            ],
        ),
        "http",
    )
    assert states == {
        "http://10.0.0.1:8000": (True, False),
        "http://10.0.0.2:8000": (False, False),
        "http://10.0.0.3:8000": (True, False),
        "http://10.0.0.4:8000": (False, True),
    }


def test_watch_follows_the_services_endpointslices():
    kube = FakeKube().start()
    try:
        kube.put(
            PREFIX,
            "endpointslices",
            "ns",
            endpoint_slice(
                "llm-engines-a",
                "llm-engines",
                [("10.0.0.1", {"ready": True}), ("10.0.0.2", {"ready": False})],
            ),
        )
        kube.put(
            PREFIX,
            "endpointslices",
            "ns",
            endpoint_slice("other-x", "other", [("10.9.9.9", {"ready": True})]),
        )

        async def test() -> None:
            endpoints = EndpointSet()

            def routable() -> list[str]:
                return [e.url for e in endpoints.routable()]

            watch = EndpointSliceWatch(kube.url, "ns", "llm-engines", endpoints.replace, retry_s=0.1)
            task = asyncio.create_task(watch.run())

            async def until(expected: list[str]) -> None:
                for _ in range(100):
                    if routable() == expected:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"routable {routable()} never became {expected}")

            await until(["http://10.0.0.1:8000"])  # the listed state: only ready, only this Service
            await asyncio.to_thread(
                kube.put,
                PREFIX,
                "endpointslices",
                "ns",
                endpoint_slice(
                    "llm-engines-a",
                    "llm-engines",
                    [("10.0.0.1", {"ready": True}), ("10.0.0.2", {"ready": True})],
                ),
            )
            await until(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
            await asyncio.to_thread(
                kube.put,
                PREFIX,
                "endpointslices",
                "ns",
                endpoint_slice(
                    "llm-engines-a",
                    "llm-engines",
                    [("10.0.0.1", {"ready": False, "terminating": True}), ("10.0.0.2", {"ready": True})],
                ),
            )
            await until(["http://10.0.0.2:8000"])
            assert endpoints.get("http://10.0.0.1:8000").draining  # terminating: draining, nothing new
            await asyncio.to_thread(
                kube.put,
                PREFIX,
                "endpointslices",
                "ns",
                endpoint_slice("llm-engines-b", "llm-engines", [("10.0.0.3", {"ready": True})]),
            )
            await until(["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
            await asyncio.to_thread(kube.remove, PREFIX, "endpointslices", "ns", "llm-engines-a")
            await until(["http://10.0.0.3:8000"])
            assert endpoints.get("http://10.0.0.1:8000") is None
            task.cancel()

        asyncio.run(asyncio.wait_for(test(), timeout=30))
    finally:
        kube.stop()
