"""One lock and one API client per InferenceService for the operator's lifetime, whatever starts the
reconcile (issue 34, section 3): the real kopf operator against the API double.

kopf gives every object its own memo (a shallow copy of the operator-wide one), so a lock or a client kept
on a Deployment's memo is not the InferenceService's: a reconcile started by a Deployment event ran beside
one started by the timer or a spec change, and every object built its own client session.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import FakeKube
from helpers import wait_for
from isvc_schema_tools import REPO
from kopf.testing import KopfRunner
from rollouts import report_rollout, report_router_rolled_out
from specfleet.operator import handlers
from specfleet.operator.kube import KubeClient
from specfleet.operator.reconcile import Reconciler

NS = "team-a"
ISVC = ("/apis/serving.specfleet.io/v1alpha1", "inferenceservices")
DEPLOY = ("/apis/apps/v1", "deployments")
ARGS = ["run", "--standalone", "--namespace", NS, "-m", "specfleet.operator.handlers"]


class Probe:
    """What the operator did, seen from inside: reconciles by the handler that started them, the most of
    them running at once for one object, the API clients built, the registry the handlers share."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, slow_seconds: float) -> None:
        self.started: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        self.most_at_once = 0
        self.clients = 0
        self.memos: list[Any] = []
        converge, reconcile = handlers.converge, Reconciler.reconcile
        build = KubeClient.from_connection_info

        async def counted_converge(body: Any, memo: Any, logger: Any, *args: Any, **kwargs: Any) -> Any:
            self.started[sys._getframe(1).f_code.co_name] += 1  # the kopf handler that awaits it
            self.memos.append(memo)
            return await converge(body, memo, logger, *args, **kwargs)

        async def slow_reconcile(reconciler: Reconciler, body: Any, now: str) -> Any:
            uid = body["metadata"]["uid"]
            self.running[uid] += 1
            self.most_at_once = max(self.most_at_once, self.running[uid])
            try:
                await asyncio.sleep(slow_seconds)  # a reconcile that takes a while: room to overlap
                return await reconcile(reconciler, body, now)
            finally:
                self.running[uid] -= 1

        def counted_client(info: Any) -> KubeClient:
            self.clients += 1
            return build(info)

        monkeypatch.setattr(handlers, "converge", counted_converge)
        monkeypatch.setattr(Reconciler, "reconcile", slow_reconcile)
        monkeypatch.setattr(KubeClient, "from_connection_info", staticmethod(counted_client))


@pytest.fixture
def kubeconfig(fake_kube: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = fake_kube.write_kubeconfig(tmp_path / "kubeconfig", NS)
    monkeypatch.setenv("KUBECONFIG", str(path))
    fake_kube.add_namespace(NS)
    yield path


def isvc_doc() -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())


def ready(fake: FakeKube) -> str | None:
    conditions = ((fake.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == "Ready"), None)


def ready_replicas(fake: FakeKube) -> int | None:
    return ((fake.get(*ISVC, NS, "smollm2") or {}).get("status") or {}).get("readyReplicas")


def set_max_num_seqs(fake: FakeKube, value: int) -> None:
    isvc = fake.get(*ISVC, NS, "smollm2")
    assert isvc is not None
    isvc["spec"]["batching"]["maxNumSeqs"] = value
    fake.put(*ISVC, NS, isvc)


def test_deployment_events_timer_and_spec_changes_take_one_lock_and_share_one_client(
    fake_kube: FakeKube, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = Probe(monkeypatch, slow_seconds=0.3)
    fake_kube.put(*ISVC, NS, isvc_doc())
    # the timer's interval is bound when kopf registers it (at import): 30 s here, so these reconciles
    # come from create/update and from the Deployments' events
    with KopfRunner(ARGS, timeout=90) as runner:
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, "smollm2-router"))
        # a spec change and a Deployment status change at once, until each kind has run several times
        # (kopf merges a burst of one object's events, so a round may start fewer than one of each)
        for round in range(20):
            if min(probe.started["reconcile"], probe.started["deployment_changed"]) >= 6:
                break
            set_max_num_seqs(fake_kube, 8 + round)
            report_rollout(fake_kube, NS, "smollm2", ready=round % 2)
            report_router_rolled_out(fake_kube, NS, "smollm2")
            time.sleep(1.0)  # the slow reconciles of this round finish
        assert probe.started["reconcile"] >= 6 and probe.started["deployment_changed"] >= 6, probe.started
        assert probe.most_at_once == 1, f"{probe.most_at_once} reconciles of one object ran at once"
        assert probe.clients == 1, f"{probe.clients} API clients built (one per object's memo)"
        registry = probe.memos[-1].get("registry")
        assert registry is not None and len(registry) == 1
        fake_kube.remove(*ISVC, NS, "smollm2")
        wait_for("the deleted service forgotten (its lock, its memory)", lambda: len(registry) == 0)
    assert runner.exception is None, runner.output


def test_a_deployment_event_that_changes_nothing_the_status_reads_starts_no_reconcile(
    fake_kube: FakeKube, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = Probe(monkeypatch, slow_seconds=0.0)
    fake_kube.put(*ISVC, NS, isvc_doc())
    with KopfRunner(ARGS, timeout=90) as runner:
        wait_for("the router Deployment", lambda: fake_kube.get(*DEPLOY, NS, "smollm2-router"))
        report_rollout(fake_kube, NS, "smollm2")
        report_router_rolled_out(fake_kube, NS, "smollm2")
        wait_for("Ready: both rollouts' events handled", lambda: ready(fake_kube) == "True")
        assert ready_replicas(fake_kube) == 1
        settled = probe.started["deployment_changed"]
        for n in range(3):  # someone labels the Deployment: a watch event, nothing the reconcile reads
            deployment = fake_kube.get(*DEPLOY, NS, "smollm2")
            assert deployment is not None
            deployment["metadata"].setdefault("annotations", {})["team"] = f"edit-{n}"
            fake_kube.put(*DEPLOY, NS, deployment)
        report_rollout(fake_kube, NS, "smollm2", ready=0)  # the pods go: this one reconciles
        wait_for("the status change reconciled", lambda: probe.started["deployment_changed"] > settled)
        wait_for("no ready replica", lambda: ready_replicas(fake_kube) == 0)
    assert runner.exception is None, runner.output
    assert probe.started["deployment_changed"] == settled + 1, probe.started
