"""The reconcile with the operator's memory of one InferenceService (operator/registry.py), on the API double:
a pass that finds nothing changed sends nothing, a change is applied without a read before it, the
children it cannot watch are re-applied one per pass once the resync period has passed, and status is
written only when the reconcile's share of it changed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest
from fake_kube import FakeKube
from specfleet.operator import handlers
from specfleet.operator.kube import KubeClient
from specfleet.operator.reconcile import Reconciler
from specfleet.operator.registry import Registry, ServiceMemory
from test_op_reconcile import CONFIG, DEPLOY, ISVC, NS, create_isvc, set_deployment_status, update_spec

SERVICE = ("/api/v1", "services")
ISVC_PATH = f"{ISVC[0]}/namespaces/{NS}/{ISVC[1]}/smollm2"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def passes(fake: FakeKube, memory: ServiceMemory, clock: Clock, count: int = 1) -> list[list[Any]]:
    """`count` reconciles with one memory; the API requests each one made."""

    async def run() -> list[list[Any]]:
        client = KubeClient(fake.url)
        made = []
        try:
            for _ in range(count):
                body = await client.get(ISVC_PATH)  # the test's read, not the reconcile's
                assert body is not None
                start = len(fake.requests)
                await Reconciler(client, CONFIG, memory, clock).reconcile(body, now="2026-01-01T00:00:00Z")
                made.append(fake.requests[start:])
        finally:
            await client.close()
        return made

    return asyncio.run(run())


def test_nothing_changed_sends_nothing_and_a_change_is_applied_without_a_read(fake_kube: FakeKube) -> None:
    create_isvc(fake_kube)
    memory, clock = ServiceMemory(), Clock()
    first, second, third = passes(fake_kube, memory, clock, 3)
    assert any(r.method == "GET" for r in first)  # the first pass reads what exists
    assert len(second) == 1 and second[0].path.endswith("/secrets/smollm2-admin")  # the new token's owner
    assert third == []

    update_spec(fake_kube, batching={"maxNumSeqs": 8, "maxNumBatchedTokens": 2048})
    (changed,) = passes(fake_kube, memory, clock)
    deployment = f"{DEPLOY[0]}/namespaces/{NS}/deployments/smollm2"
    assert [r.method for r in changed if r.path == deployment] == ["PATCH"]  # no GET before the apply
    assert not any(r.method == "PATCH" and "/services/" in r.path for r in changed)  # rendered as before
    assert passes(fake_kube, memory, clock) == [[]]


def test_an_unwatched_child_comes_back_within_the_resync_period_one_child_per_pass(
    fake_kube: FakeKube,
) -> None:
    create_isvc(fake_kube)
    memory, clock = ServiceMemory(), Clock()
    passes(fake_kube, memory, clock, 2)
    fake_kube.remove(*SERVICE, NS, "smollm2")  # by hand: the operator does not watch Services
    assert passes(fake_kube, memory, clock) == [[]]  # not seen yet: it trusts its last apply
    clock.now += CONFIG.resync_interval_seconds
    renewals = passes(fake_kube, memory, clock, len(memory.applied) + len(memory.apis) + 1)
    assert fake_kube.get(*SERVICE, NS, "smollm2") is not None
    assert all(len(made) <= 1 for made in renewals), [[(r.method, r.path) for r in m] for m in renewals]
    assert renewals[-1] == []  # every child renewed: quiet again until the next period


def test_status_is_written_only_when_the_reconciles_share_changed(
    fake_kube: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kopf, "info", lambda *a, **k: None)
    create_isvc(fake_kube)
    logger = logging.getLogger("t")

    def status_writes(since: int) -> int:
        return sum(r.path.endswith("/status") for r in fake_kube.requests[since:])

    async def run() -> None:
        memo = kopf.Memo(config=CONFIG, registry=Registry(KubeClient(fake_kube.url)))
        try:
            start = len(fake_kube.requests)
            for _ in range(3):
                await handlers.converge(fake_kube.get(*ISVC, NS, "smollm2"), memo, logger)
            assert status_writes(start) == 1  # the first pass since the start; the same status is not sent

            set_deployment_status(fake_kube, ready=1)  # the pods are ready: the watch delivers both
            start = len(fake_kube.requests)
            for name in ("smollm2", "smollm2-router"):
                deployment = fake_kube.get(*DEPLOY, NS, name)
                await handlers.deployment_changed(body=deployment, memo=memo, logger=logger, type="MODIFIED")
            assert status_writes(start) >= 1
            assert fake_kube.get(*ISVC, NS, "smollm2")["status"]["readyReplicas"] == 1

            start = len(fake_kube.requests)
            for _ in range(3):
                await handlers.converge(fake_kube.get(*ISVC, NS, "smollm2"), memo, logger)
            assert status_writes(start) == 0
        finally:
            await memo.registry.client.close()

    asyncio.run(run())
