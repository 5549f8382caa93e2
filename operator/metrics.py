"""The operator's own Prometheus metrics: what it knows of each InferenceService and of its tuner.

The alerts about an InferenceService's state (deploy/monitoring/prometheus-rules.yaml: not ready, degraded,
not reconciled, tuner failing static) read these series, so they need nothing but a scrape of the operator
(`specfleet operator --metrics-port`, the chart's `monitoring.podMonitor`): no kube-state-metrics
custom-resource config. Every series is labelled `namespace` and `service`, the InferenceService's name: the
engines' `job` label (their `service` is the Service scraped, `NAME-engines` behind the router).

The reconcile sets the generation before it starts and, once it wrote status, the observed generation (the
generation that status describes: the Deployment controller has seen its rollout, docs/operator.md) and the
conditions; so a reconcile that keeps failing (the API server erring, timeouts) or a rollout the Deployment
controller never picks up shows as generation ahead of observed generation while the operator runs. A
child the API server refuses is not that: it is reported as Degraded. The tuner sets its own two series each interval.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

REGISTRY = CollectorRegistry()
_SERVICE = ["namespace", "service"]

CONDITION = Gauge(
    "specfleet_inferenceservice_condition",
    "1 for each status condition of an InferenceService, labelled with its status and reason",
    [*_SERVICE, "type", "status", "reason"],
    registry=REGISTRY,
)
GENERATION = Gauge(
    "specfleet_inferenceservice_generation",
    "metadata.generation the operator last saw (bumped by every spec change)",
    _SERVICE,
    registry=REGISTRY,
)
OBSERVED_GENERATION = Gauge(
    "specfleet_inferenceservice_observed_generation",
    "The generation the operator last reconciled successfully",
    _SERVICE,
    registry=REGISTRY,
)
TUNER_STATIC_INTERVALS = Gauge(
    "specfleet_tuner_static_intervals",
    "Consecutive tuning intervals without metrics (the tuner holds the config: fail "
    "static); 0 while it tunes",
    _SERVICE,
    registry=REGISTRY,
)
TUNER_FROZEN = Gauge(
    "specfleet_tuner_frozen",
    "1 while the tuner is frozen (spec.autotune.freeze or the specfleet.io/tuner-freeze annotation)",
    _SERVICE,
    registry=REGISTRY,
)

_lock = threading.Lock()
_conditions: dict[tuple[str, str], set[tuple[str, str, str]]] = {}  # service -> label sets set now
_gone: set[str] = set()  # uids of deleted services: a reconcile still in flight must not bring them back


def live(uid: str | None) -> bool:
    """False once the service with this uid was deleted (a recreated one has a new uid)."""
    return uid is None or uid not in _gone


def saw_generation(namespace: str, name: str, generation: int, uid: str | None = None) -> None:
    if live(uid):
        GENERATION.labels(namespace, name).set(generation)


def reconciled(namespace: str, name: str, status: Mapping[str, Any], uid: str | None = None) -> None:
    """After a successful reconcile: the observed generation (0 until a status describes any generation,
    so that a service whose first rollout is never observed still shows as behind) and every condition."""
    if not live(uid):
        return
    OBSERVED_GENERATION.labels(namespace, name).set(int(status.get("observedGeneration") or 0))
    set_conditions(namespace, name, status.get("conditions") or [])


def set_conditions(namespace: str, name: str, conditions: Iterable[Mapping[str, Any]]) -> None:
    """One series per condition type, at its current status and reason; a type's previous series go."""
    now = {(str(c.get("type", "")), str(c.get("status", "")), str(c.get("reason", ""))) for c in conditions}
    with _lock:
        before = _conditions.get((namespace, name), set())
        types = {t for t, _, _ in now}
        for labels in before - now:
            if labels[0] in types:
                CONDITION.remove(namespace, name, *labels)
        for labels in now:
            CONDITION.labels(namespace, name, *labels).set(1)
        _conditions[(namespace, name)] = {b for b in before if b[0] not in types} | now


def tuned(namespace: str, name: str, static_intervals: int, frozen: bool, uid: str | None = None) -> None:
    if not live(uid):
        return
    TUNER_STATIC_INTERVALS.labels(namespace, name).set(static_intervals)
    TUNER_FROZEN.labels(namespace, name).set(1 if frozen else 0)


def forget(namespace: str, name: str, uid: str | None = None) -> None:
    """The InferenceService is gone: drop its series (an alert must not fire for a deleted service)."""
    if uid is not None:
        _gone.add(uid)
    with _lock:
        for labels in _conditions.pop((namespace, name), set()):
            CONDITION.remove(namespace, name, *labels)
    for gauge in (GENERATION, OBSERVED_GENERATION, TUNER_STATIC_INTERVALS, TUNER_FROZEN):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on `port` from a background thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
