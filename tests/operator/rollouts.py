"""What the Deployment controller would report, written into the API double (which runs no controllers)."""

from __future__ import annotations

from typing import Any

from fake_kube import FakeKube

DEPLOY = ("/apis/apps/v1", "deployments")


def report_rollout(
    fake: FakeKube,
    namespace: str,
    name: str,
    ready: int | None = None,
    updated: int | None = None,
    replicas: int | None = None,
    synced: bool = True,
    **extra: Any,
) -> None:
    """Deployment `name`'s status (available = ready: no minReadySeconds); by default its rollout is done:
    every one of spec.replicas updated and ready."""
    deployment = fake.get(*DEPLOY, namespace, name)
    assert deployment is not None, name
    desired = deployment["spec"]["replicas"]
    ready = desired if ready is None else ready
    generation = deployment["metadata"]["generation"]
    deployment["status"] = {
        "observedGeneration": generation if synced else generation - 1,
        "replicas": desired if replicas is None else replicas,
        "updatedReplicas": desired if updated is None else updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
        **extra,
    }
    fake.put(*DEPLOY, namespace, deployment)


def report_router_rolled_out(fake: FakeKube, namespace: str, isvc_name: str) -> None:
    """The router Deployment (routing on) has finished its rollout: the engines' state decides Ready."""
    report_rollout(fake, namespace, f"{isvc_name}-router")
