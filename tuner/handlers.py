"""kopf: one tuning loop per InferenceService with `spec.autotune.enabled`.

A timer fires every few seconds for each such service and runs the service's `ServiceTuner` once its
`autotune.intervalSeconds` have passed. Pods come from the Kubernetes API (ready pods with the service's
selector label), the admin token from the `NAME-admin` Secret the reconcile creates, metrics from
`autotune.prometheusURL` (else the operator's default, else a direct scrape of the pods). It writes only
`status.tuning` and the `Tuned` condition (with autoscaling on, `status.autoscaling`: the replica count the
reconcile renders into the Deployment), plus an Event per change and per transition (frozen, resumed,
failing static, recovered); never `spec`. The config the engines accepted goes into the `NAME-tuned`
ConfigMap the engine pods mount (operator/render/tuned.py), so a pod of a scale-up or a restart starts on
it; the pod template is not touched, so tuning rolls nothing.

Autoscaling reads the routers too (`router_signals.py`): at every timer tick while the service has zero
replicas, so that a request the router holds brings the first pod within one tick (5 s), not one interval;
and at every interval, for the requests held and the cold start the routers measured.

Freeze: `spec.autotune.freeze: true` (in Git) or the annotation `specfleet.io/tuner-freeze: "true"` (a
`kubectl annotate`, no Git change) holds the config from the next interval on; the annotation is read at
every tick, so removing it resumes tuning within one interval too.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any
from urllib.parse import quote

import httpx
import kopf
from specfleet.operator import metrics
from specfleet.operator.conditions import timestamp
from specfleet.operator.handlers import autotune_enabled, kube_client
from specfleet.operator.inference_service import (
    InferenceService,
    InvalidInferenceService,
    parse_inference_service,
)
from specfleet.operator.kube import ApiError, KubeClient, object_path
from specfleet.operator.render.secret import read_admin_token
from specfleet.operator.render.tuned import render_tuned_config
from specfleet.operator.resources import (
    ADMIN_PORT,
    AUTOSCALER_FIELD_MANAGER,
    ENGINE_PORT,
    GROUP,
    LABEL_ISVC,
    LABEL_ROLE,
    PLURAL,
    ROUTER_PORT,
    TUNER_FIELD_MANAGER,
    VERSION,
    admin_secret_name,
    router_selector_labels,
)
from specfleet.operator.spec import FREEZE_ANNOTATION

from .actuator import admin_on_port
from .loop import ServiceTuner, Tick, build_tuner, replica_params, tuner_fingerprint
from .policy.replicas import ReplicaDecision, ReplicaPolicy
from .policy.resume import restore, snapshot
from .report import autoscaling_status, event_for, scale_event, status_patch, transition_events
from .router_signals import RouterSignals, read_router_signals

TIMER_SECONDS = float(os.environ.get("SPECFLEET_TUNER_TICK_SECONDS", "5"))
# The first tick after kopf starts (an operator restarted, or a standby newly elected): 1 s, not a whole
# tick, so the tuner resumes from status.tuning.resume at once (a failover is within 15 s only then); the
# tick is cheap and idempotent, and 1 s lets kopf's first listing deliver the services before it.
FIRST_TICK_SECONDS = min(1.0, TIMER_SECONDS)
# PromQL label matchers for a service's engine series; {namespace} and {name} are filled in. The default
# matches the labels the Prometheus Operator adds when scraping through our ServiceMonitor: its `jobLabel`
# makes job the InferenceService's name whichever Service lists the engines (`service` is `<name>-engines`
# behind the router, `<name>-decode`/`<name>-prefill` with disaggregation, so it cannot be the key).
SELECTOR_TEMPLATE = os.environ.get("SPECFLEET_PROMETHEUS_SELECTOR", 'namespace="{namespace}",job="{name}"')


async def ready_pod_urls(
    client: KubeClient,
    namespace: str,
    name: str,
    role: str | None = None,
    label: str = LABEL_ISVC,
    port: int | None = None,
) -> list[str]:
    """http://POD_IP:PORT of each pod with `label`=name (of one role, with spec.disaggregation) whose Ready
    condition is True (the service's engines on ENGINE_PORT by default)."""
    selector = quote(f"{label}={name}" + (f",{LABEL_ROLE}={role}" if role else ""))
    pods = await client.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}") or {}
    urls = []
    for pod in pods.get("items", []):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            urls.append(f"http://{status['podIP']}:{ENGINE_PORT if port is None else port}")
    return sorted(urls)


async def router_signals(client: KubeClient, namespace: str, name: str) -> RouterSignals:
    """The service's router pods' queue, cold start and replica count (`router_signals.py`)."""
    ((label, value),) = router_selector_labels(name).items()
    urls = await ready_pod_urls(client, namespace, value, label=label, port=ROUTER_PORT)
    async with httpx.AsyncClient(timeout=2.0) as http:
        return await read_router_signals(http, urls)


def prometheus_selector(namespace: str, name: str, role: str | None = None) -> str:
    """The PromQL label matchers of a service's engine series (of one role: the ServiceMonitor copies the
    pod's role label onto its series as specfleet_role)."""
    return SELECTOR_TEMPLATE.format(namespace=namespace, name=name) + (
        f',specfleet_role="{role}"' if role else ""
    )


def frozen_by(body: kopf.Body) -> str | None:
    """Who froze this service's tuner, or None: the spec field, else the annotation ("true", any case)."""
    if ((body.get("spec") or {}).get("autotune") or {}).get("freeze"):
        return "spec.autotune.freeze"
    value = (body["metadata"].get("annotations") or {}).get(FREEZE_ANNOTATION, "")
    return f"annotation {FREEZE_ANNOTATION}=true" if str(value).strip().lower() == "true" else None


def _restore(tuner: ServiceTuner, status: kopf.Status) -> None:
    """A rebuilt loop (spec change, operator restart) continues the transitions status last reported, so
    that lifting a freeze through the spec still posts TuningResumed."""
    tuner.frozen_by = (status.get("tuning") or {}).get("frozenBy") or None
    tuner.static = any(
        c.get("type") == "Tuned" and c.get("reason") == "MetricsUnavailable"
        for c in status.get("conditions") or []
    )


async def _build(client: KubeClient, body: kopf.Body, memo: kopf.Memo) -> ServiceTuner:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    isvc = parse_inference_service(body, f"{namespace}/{name}")
    secret = await client.get(object_path("Secret", namespace, admin_secret_name(name)))
    if secret is None:
        raise kopf.TemporaryError(
            f"Secret {admin_secret_name(name)} (admin token) does not exist yet; the reconcile creates it",
            delay=10,
        )

    # With spec.disaggregation the tuner tunes and scales the decode engines only, as the local fleet does:
    # the knobs it moves (k, batch limits) and the SLO it holds (TPOT) are the decode engines'; prefill
    # engines keep the spec's values (docs/tuner.md). Their series carry specfleet_role (the ServiceMonitor).
    role = "decode" if isvc.spec.disaggregation is not None else None

    async def endpoints() -> list[str]:
        return await ready_pod_urls(client, namespace, name, role)

    return build_tuner(
        f"{namespace}/{name}",
        isvc.spec,
        endpoints,
        read_admin_token(secret),
        admin_url=admin_on_port(ADMIN_PORT),
        prometheus_url=isvc.spec.autotune.prometheus_url or getattr(memo.config, "prometheus_url", "") or "",
        prometheus_selector=prometheus_selector(namespace, name, role),
    )


class StatusScaler:
    """The operator's `Scaler`: the routers' queue from their pods, a decision into `status.autoscaling`
    (under its own field manager; the reconcile renders the count into the Deployment, the operator never
    writes `spec.replicas`) with a `Scaled` Event on a change. Built per timer tick: it
    writes against that tick's body and status. Its write comes before the tuner's own status apply: an
    operator upgraded from one whose tuner manager owned status.autoscaling hands it over here, so that
    apply (which no longer sends it) cannot remove it."""

    def __init__(self, client: KubeClient, body: kopf.Body, status: kopf.Status) -> None:
        self.client, self.body, self.status = client, body, status
        self.signals = RouterSignals()  # as of the last `queued()`: the cold start goes with the decision

    async def queued(self) -> int:
        meta = self.body["metadata"]
        self.signals = await router_signals(self.client, meta["namespace"], meta["name"])
        return self.signals.queued

    async def scale(self, decision: ReplicaDecision) -> None:
        meta = self.body["metadata"]
        update = autoscaling_status(
            decision, dict(self.status).get("autoscaling"), timestamp(), self.signals.cold_start_s
        )
        await self.client.apply_status(
            meta["namespace"], meta["name"], {"autoscaling": update}, AUTOSCALER_FIELD_MANAGER
        )
        scaled = scale_event(decision)
        if scaled is not None:
            kopf.info(self.body, reason=scaled[1], message=scaled[2][:1000])


async def _tuner_of(
    client: KubeClient,
    body: kopf.Body,
    isvc: InferenceService,
    status: kopf.Status,
    memo: kopf.Memo,
    logger: kopf.Logger,
) -> tuple[ServiceTuner, str, float]:
    """This service's tuner, with the fingerprint it was built under and the time of its last interval:
    rebuilt only when a field the tuner depends on changed (bounds, SLO, method, model, ...), since a
    /scale write bumps the generation too and must not make the tuner forget what it learned."""
    # uid -> (tuner, fingerprint of the spec fields it depends on, its clock at its last interval)
    tuners: dict[str, tuple[ServiceTuner, str, float]] = memo.setdefault("tuners", {})
    meta = body["metadata"]
    fingerprint = tuner_fingerprint(isvc.spec)
    entry = tuners.get(meta["uid"])
    if entry is not None and entry[1] == fingerprint:
        return entry
    if entry is not None:
        await entry[0].close()
    try:
        tuner = await _build(client, body, memo)
    except ApiError as error:
        raise kopf.TemporaryError(f"cannot read the admin Secret: {error}", delay=10) from error
    _restore(tuner, status)
    # a restarted operator continues from status.tuning, if it was learned under this same spec
    if entry is None and restore(tuner.policy, dict(status).get("tuning") or {}, tuner.clock(), fingerprint):
        logger.info(
            "event=tuner_resumed config=%s", tuner.policy.current.short() if tuner.policy.current else ""
        )
    entry = tuners[meta["uid"]] = (tuner, fingerprint, -math.inf)
    return entry


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=TIMER_SECONDS,
    initial_delay=FIRST_TICK_SECONDS,
    sharp=False,
    when=autotune_enabled,
)
async def tune(
    body: kopf.Body, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """Every tick: the tuner's interval once `autotune.intervalSeconds` have passed (`ServiceTuner.interval`,
    the sequence every host shares), else the between-interval work (new pods, scale from zero)."""
    client = kube_client(memo)
    try:
        isvc = parse_inference_service(body, f"{meta['namespace']}/{meta['name']}")
    except InvalidInferenceService:
        return  # the reconcile reports it as InvalidSpec
    tuner, fingerprint, last = await _tuner_of(client, body, isvc, status, memo, logger)
    tuner.replicas = _replica_policy(memo, meta["uid"], isvc)
    tuner.scaler = StatusScaler(client, body, status)
    if tuner.clock() - last < tuner.policy.params.interval_s:
        await tuner.sync_new_pods()  # a pod that started before its file was written: tuned within a tick
        await publish_in_force(client, body, tuner, memo, logger)
        await tuner.from_zero()  # scale from zero: the routers' queue, every tick
        return
    memo["tuners"][meta["uid"]] = (tuner, fingerprint, tuner.clock())
    tick = await tuner.interval(frozen_by(body))
    await publish_in_force(client, body, tuner, memo, logger)
    await _report(client, body, status, tuner, tick, fingerprint, logger)


async def _report(
    client: KubeClient,
    body: kopf.Body,
    status: kopf.Status,
    tuner: ServiceTuner,
    tick: Tick,
    fingerprint: str,
    logger: kopf.Logger,
) -> None:
    """The tuner's share of status (status.tuning, the Tuned condition) under its own field manager (the
    reconcile's conditions are another manager's entries of the same list-map, which this cannot touch),
    its metrics, and an Event per change and per transition."""
    meta = body["metadata"]
    update = status_patch(
        tick,
        tuner.policy.current,
        dict(status),
        int(meta.get("generation") or 0),
        timestamp(),
        resume=snapshot(tuner.policy, tuner.clock(), fingerprint),
    )
    await client.apply_status(meta["namespace"], meta["name"], update, TUNER_FIELD_MANAGER)
    uid = meta["uid"]
    metrics.tuned(meta["namespace"], meta["name"], tuner.static_intervals, tick.frozen_by is not None, uid)
    if metrics.live(uid):
        metrics.set_conditions(
            meta["namespace"], meta["name"], [c for c in update["conditions"] if c["type"] == "Tuned"]
        )
    change = event_for(tick.decision)
    for kind, reason, message in [*transition_events(tick), *([change] if change else [])]:
        post = kopf.warn if kind == "Warning" else kopf.info
        post(body, reason=reason, message=event_message(reason, message, meta["namespace"], meta["name"]))
    logger.debug("tuner tick: %s", tick.decision.reason)


# The API server keeps an Event message to 1024 bytes; 1000 leaves room for multi-byte characters.
EVENT_MESSAGE_MAX = 1000
CHANGE_EVENTS = ("Tuned", "TuningReverted")  # the tuner changed what the engines run


def event_message(reason: str, message: str, namespace: str, name: str) -> str:
    """The Event's message: the decision's reason, and on a change the command that stops the tuner (the
    incident switch, docs/sre.md), kept whole however long the reason, so that `kubectl describe isvc`
    says what changed, why, and how to stop it."""
    if reason not in CHANGE_EVENTS:
        return message[:EVENT_MESSAGE_MAX]
    hint = f" [to stop tuning: kubectl annotate isvc -n {namespace} {name} {FREEZE_ANNOTATION}=true]"
    return message[: EVENT_MESSAGE_MAX - len(hint)] + hint


async def publish_in_force(
    client: KubeClient, body: kopf.Body, tuner: ServiceTuner, memo: kopf.Memo, logger: kopf.Logger
) -> None:
    """The config the engines accepted (`ServiceTuner.in_force`) into `NAME-tuned`, under the spec's key,
    when either changed since this operator last wrote it: what the next pod starts on. A refused write
    is logged and tried again at the next tick; the pods it misses are tuned by `sync_new_pods`."""
    if tuner.in_force is None:
        return
    written: dict[str, str] = memo.setdefault("tuned_written", {})
    meta = body["metadata"]
    isvc = parse_inference_service(body, f"{meta['namespace']}/{meta['name']}")
    configmap = render_tuned_config(isvc, tuner.in_force.as_admin())
    content = json.dumps(configmap["data"], sort_keys=True)
    if written.get(meta["uid"]) == content:
        return
    try:
        await client.apply(configmap, TUNER_FIELD_MANAGER)
    except ApiError as error:
        logger.warning(
            "event=tuned_config_refused configmap=%s error=%s", configmap["metadata"]["name"], error
        )
        return
    written[meta["uid"]] = content


def _replica_policy(memo: kopf.Memo, uid: str, isvc: InferenceService) -> ReplicaPolicy | None:
    """One replica policy per service with autoscaling on, started from the count in force. Rebuilt only when
    its settings (`replica_params`: the bounds, windows, cooldown) change: a `/scale` write or any other spec
    change bumps the generation too, and must not restart its cooldown or its stabilization windows."""
    policies: dict[str, ReplicaPolicy] = memo.setdefault("replica_policies", {})
    if not isvc.spec.autoscaling.enabled:
        policies.pop(uid, None)
        return None
    params = replica_params(isvc.spec)
    policy = policies.get(uid)
    if policy is None or policy.params != params:
        policy = policies[uid] = ReplicaPolicy(params, isvc.desired_replicas)
    return policy


@kopf.on.event(GROUP, VERSION, PLURAL)
async def forget(event: kopf.RawEvent, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A deleted service's loop goes with it (an event handler: the timers hold no finalizer)."""
    if event.get("type") != "DELETED":
        return
    memo.setdefault("replica_policies", {}).pop(meta["uid"], None)
    memo.setdefault("tuned_written", {}).pop(meta["uid"], None)
    entry = memo.setdefault("tuners", {}).pop(meta["uid"], None)
    if entry is not None:
        await entry[0].close()
