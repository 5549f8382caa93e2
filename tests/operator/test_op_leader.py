"""Leader election (operator/leadership.py) against the API double over HTTP, with the chart's RBAC: the
Lease's semantics in the double, one holder among candidates, hand-over on release, take-over after a
holder vanished, and a holder that cannot renew stepping down before anyone may take its place."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
from fake_kube import FakeKube
from specfleet.operator.cli import main
from specfleet.operator.leadership import (
    LeadershipLost,
    LeaseElector,
    LeaseTimings,
    micro_time,
    run_elected,
)

LEASE_NS = "specfleet-system"  # the release namespace Rbac.from_chart renders, where the chart grants leases
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases"
# Short timings keep each scenario to seconds; their ratios are the defaults' (lease > renew > 1.2 retry).
FAST = LeaseTimings(lease_duration_s=2.0, renew_deadline_s=1.3, retry_period_s=0.5)


@pytest.fixture
def kubeconfig(fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = fake_kube.write_kubeconfig(tmp_path / "kubeconfig", LEASE_NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


def elector(identity: str, timings: LeaseTimings = FAST, name: str = "specfleet-operator") -> LeaseElector:
    def connect() -> Any:
        return kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())

    return LeaseElector(connect, LEASE_NS, name, identity, timings)


def lease(fake: FakeKube, name: str = "specfleet-operator") -> dict[str, Any]:
    return (fake.get("/apis/coordination.k8s.io/v1", "leases", LEASE_NS, name) or {}).get("spec") or {}


def test_the_double_keeps_a_leases_rules(fake_kube: FakeKube) -> None:
    """What a holder relies on: an update must name the resourceVersion it read (a stale one is a 409),
    MicroTime is decoded strictly, the spec's numbers are validated; the chart grants leases in its own
    namespace only."""
    now = micro_time()
    spec = {"holderIdentity": "a", "leaseDurationSeconds": 8, "renewTime": now, "acquireTime": now}
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"}, "spec": spec}
    with httpx.Client(base_url=fake_kube.url) as http:
        created = http.post(LEASES, json=body)
        assert created.status_code == 201, created.text
        assert http.post(LEASES, json=body).status_code == 409
        unconditional = http.put(f"{LEASES}/l", json=body)
        assert unconditional.status_code == 422 and "resourceVersion" in unconditional.json()["message"]
        current = created.json()
        taken = http.put(f"{LEASES}/l", json={**current, "spec": {**spec, "holderIdentity": "b"}})
        assert taken.status_code == 200, taken.text
        stale = http.put(f"{LEASES}/l", json={**current, "spec": {**spec, "holderIdentity": "c"}})
        assert stale.status_code == 409 and "resourceVersion" in stale.json()["message"]
        fresh = taken.json()
        for field, value, code, words in [
            ("renewTime", "2026-01-01T00:00:00Z", 400, "spec.renewTime"),
            ("acquireTime", "2026-01-01T00:00:00.123Z", 400, "spec.acquireTime"),
            ("leaseDurationSeconds", 0, 422, "spec.leaseDurationSeconds: Invalid value: 0"),
            ("leaseTransitions", -1, 422, "spec.leaseTransitions: Invalid value: -1"),
        ]:
            refused = http.put(f"{LEASES}/l", json={**fresh, "spec": {**spec, field: value}})
            assert refused.status_code == code and words in refused.json()["message"], refused.text
        assert lease(fake_kube, "l")["holderIdentity"] == "b"  # nothing refused was stored
        elsewhere = http.post("/apis/coordination.k8s.io/v1/namespaces/team-a/leases", json=body)
        assert elsewhere.status_code == 403, elsewhere.text


def test_timings_and_the_cli_refuse_an_order_that_could_elect_two(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    for kwargs, words in [
        ({"lease_duration_s": 5.0, "renew_deadline_s": 5.0}, "--leader-election-lease-duration=5.0 must be"),
        ({"renew_deadline_s": 2.2, "retry_period_s": 2.0}, "--leader-election-renew-deadline=2.2 must be"),
        ({"retry_period_s": 0.0}, "--leader-election-retry-period=0.0 must be greater than 0"),
    ]:
        with pytest.raises(ValueError, match=words):
            LeaseTimings(**kwargs)
    assert (
        main(
            [
                "-n",
                "a",
                "--leader-elect",
                "--leader-election-namespace",
                "x",
                "--leader-election-renew-deadline",
                "9",
            ]
        )
        == 2
    )
    assert "--leader-election-renew-deadline=9.0" in capsys.readouterr().out
    assert main(["-n", "a", "--leader-elect"]) == 2  # no POD_NAMESPACE here
    assert "--leader-election-namespace" in capsys.readouterr().out


def test_one_candidate_holds_the_lease_and_hands_it_over_on_release(
    fake_kube: FakeKube, kubeconfig: Path
) -> None:
    async def scenario() -> None:
        a, b = elector("a"), elector("b")
        await asyncio.wait_for(a.acquire(), timeout=5)
        holding = asyncio.create_task(a.hold())
        assert not await b.try_acquire_or_renew(time.monotonic())
        # b keeps looking for longer than the lease lasts: a renews, so b never gets it
        deadline = time.monotonic() + 2 * FAST.lease_duration_s
        while time.monotonic() < deadline:
            assert not await b.try_acquire_or_renew(time.monotonic())
            await asyncio.sleep(FAST.retry_period_s)
        assert lease(fake_kube)["holderIdentity"] == "a"
        holding.cancel()
        await a.release()
        assert lease(fake_kube)["holderIdentity"] == ""
        started = time.monotonic()
        await asyncio.wait_for(b.acquire(), timeout=5)
        assert time.monotonic() - started < FAST.lease_duration_s  # at its next look, not after expiry
        assert lease(fake_kube)["holderIdentity"] == "b" and lease(fake_kube)["leaseTransitions"] == 1
        await a.close()
        await b.close()

    asyncio.run(scenario())
    assert not fake_kube.answered(403)


def test_a_vanished_holder_is_replaced_after_the_lease_duration_and_not_before(
    fake_kube: FakeKube, kubeconfig: Path
) -> None:
    async def scenario() -> float:
        a, b = elector("a"), elector("b")
        await a.acquire()
        await a.close()  # a crash: no release, no more renewals
        gone = time.monotonic()
        await asyncio.wait_for(b.acquire(), timeout=10)
        await b.close()
        return time.monotonic() - gone

    took = asyncio.run(scenario())
    assert FAST.lease_duration_s <= took <= FAST.lease_duration_s + 2 * 1.2 * FAST.retry_period_s + 0.5, took
    assert lease(fake_kube)["holderIdentity"] == "b"


def test_a_holder_that_cannot_renew_stops_its_work_before_anyone_may_take_over(
    fake_kube: FakeKube, kubeconfig: Path
) -> None:
    """The API server refuses the holder's renewals (a partition, an overloaded server): within the renew
    deadline it cancels its work and returns 1 (the process exits); a candidate gets the Lease only later."""

    async def scenario() -> tuple[int, float, float]:
        a, b = elector("a"), elector("b")
        stopped: list[float] = []
        started = asyncio.Event()

        async def work() -> None:
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.append(time.monotonic())

        running = asyncio.create_task(run_elected(a, work))
        await asyncio.wait_for(started.wait(), timeout=5)
        last_renewal = time.monotonic()
        # more failures than the holder's tries within its deadline (3 at most); the candidate meets the rest
        for _ in range(6):
            fake_kube.fail_next("PUT", "/leases/", 503)
            fake_kube.fail_next("GET", "/leases/", 503)
        code = await asyncio.wait_for(running, timeout=10)
        await asyncio.wait_for(b.acquire(), timeout=15)
        taken = time.monotonic()
        await b.close()
        return code, stopped[0] - last_renewal, taken - last_renewal

    code, stopped_after, taken_after = asyncio.run(scenario())
    assert code == 1
    assert stopped_after <= FAST.renew_deadline_s + FAST.retry_period_s, stopped_after
    assert taken_after >= FAST.lease_duration_s > stopped_after, (stopped_after, taken_after)


def test_a_lost_lease_is_noticed_at_the_next_renewal(fake_kube: FakeKube, kubeconfig: Path) -> None:
    async def scenario() -> None:
        a = elector("a")
        await a.acquire()
        current = fake_kube.get("/apis/coordination.k8s.io/v1", "leases", LEASE_NS, "specfleet-operator")
        assert current is not None
        current["spec"]["holderIdentity"] = "someone-else"  # e.g. an operator with another lease duration
        fake_kube.put("/apis/coordination.k8s.io/v1", "leases", LEASE_NS, current)
        with pytest.raises(LeadershipLost, match="someone-else holds the Lease"):
            await asyncio.wait_for(a.hold(), timeout=5)
        await a.close()

    asyncio.run(scenario())


def test_a_refused_lease_is_a_warning_naming_the_status(
    fake_kube: FakeKube, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Lease where the chart grants none (a wrong --leader-election-namespace): the replica waits, and says
    why at WARNING, not silently."""

    def connect() -> Any:
        return kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())

    async def scenario() -> bool:
        candidate = LeaseElector(connect, "team-a", "specfleet-operator", "a", FAST)
        try:
            return await candidate.try_acquire_or_renew(time.monotonic())
        finally:
            await candidate.close()

    with caplog.at_level("WARNING", logger="specfleet.operator.leadership"):
        assert not asyncio.run(scenario())
    assert any("status=403" in r.getMessage() and "leases" in r.getMessage() for r in caplog.records)
