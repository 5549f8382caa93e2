"""Endpoint discovery from a watched EndpointSlice in the API double (tests/fake_kube.py): the router's
set follows readiness, termination and deletion, and only this Service's slices count.

What the double does not model: the EndpointSlice controller itself (the test writes the slices as it
would), watch bookmarks and 410 Gone (the watch's relist path is the same as its start)."""

from __future__ import annotations

import asyncio

from fake_kube import FakeKube
from specfleet.router.discovery import EndpointSliceWatch, RoleStates, slice_states
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


class _Router:
    """What RoleStates drives: the router's endpoint set and its change hook."""

    def __init__(self) -> None:
        self.endpoints = EndpointSet()
        self.changes: list[list[str]] = []

    def endpoints_changed(self, removed: list[str] | None = None) -> None:
        self.changes.append(list(removed or []))


def test_two_services_give_the_router_prefill_and_decode_engines():
    """The operator's roles: `--service NAME-decode --prefill-service NAME-prefill`. Each address takes the
    role of the Service whose EndpointSlices list it; prefill engines never become decode targets."""
    kube = FakeKube().start()
    try:
        kube.put(
            PREFIX,
            "endpointslices",
            "ns",
            endpoint_slice("llm-prefill-a", "llm-prefill", [("10.0.1.1", {"ready": True})]),
        )
        kube.put(
            PREFIX,
            "endpointslices",
            "ns",
            endpoint_slice(
                "llm-decode-a", "llm-decode", [("10.0.2.1", {"ready": True}), ("10.0.2.2", {"ready": True})]
            ),
        )

        async def test() -> None:
            router = _Router()
            roles = RoleStates(router)
            tasks = [
                asyncio.create_task(
                    EndpointSliceWatch(kube.url, "ns", service, roles.watcher(role), retry_s=0.1).run()
                )
                for service, role in (("llm-decode", "decode"), ("llm-prefill", "prefill"))
            ]

            def seen() -> tuple[list[str], list[str]]:
                return (
                    [e.url for e in router.endpoints.routable()],
                    [e.url for e in router.endpoints.prefill_routable()],
                )

            async def until(expected: tuple[list[str], list[str]]) -> None:
                for _ in range(100):
                    if seen() == expected:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"{seen()} never became {expected}")

            await until((["http://10.0.2.1:8000", "http://10.0.2.2:8000"], ["http://10.0.1.1:8000"]))
            assert {e.role for e in router.endpoints.all()} == {"prefill", "decode"}
            # a prefill pod going away leaves the decode engines alone, and is reported as removed
            await asyncio.to_thread(kube.remove, PREFIX, "endpointslices", "ns", "llm-prefill-a")
            await until((["http://10.0.2.1:8000", "http://10.0.2.2:8000"], []))
            assert ["http://10.0.1.1:8000"] in router.changes
            for task in tasks:
                task.cancel()

        asyncio.run(asyncio.wait_for(test(), timeout=30))
    finally:
        kube.stop()


def test_a_prefill_service_needs_the_decode_service():
    from specfleet.router.cli import main

    assert main(["--endpoint", "http://127.0.0.1:1", "--prefill-service", "llm-prefill"]) == 2
